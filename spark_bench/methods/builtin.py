"""The paper's methods by name: each eviction and key-channel method part's builder from a method configuration,
its name in tables and the options it reads. The bottom of the naming layer: :mod:`~spark_bench.methods.registry`
refuses these names for methods of one's own, :mod:`~spark_bench.methods.config` builds from them."""

from __future__ import annotations

import itertools

from spark_bench.methods.channel.leank import LeanK
from spark_bench.methods.channel.mustafar import Mustafar, MustafarValues
from spark_bench.methods.channel.spark import SparK
from spark_bench.methods.channel.think import ThinK
from spark_bench.methods.eviction.adasnapkv import AdaSnapKV
from spark_bench.methods.eviction.expected_attention import ExpectedAttention
from spark_bench.methods.eviction.pyramidkv import PyramidKV
from spark_bench.methods.eviction.snapkv import SnapKV
from spark_bench.methods.eviction.streamingllm import StreamingLLM
from spark_bench.methods.eviction.tova import TOVA


def _snapkv_args(c) -> dict:
    """SnapKV's options (and those PyramidKV / AdaSnapKV share) from a method config ``c``."""
    return dict(budget=c.budget, window_size=c.window_size, kernel_size=c.kernel_size, pooling=c.pooling,
                rounding=c.budget_rounding)


# method name → builder from a MethodConfig (:class:`spark_bench.methods.config.MethodConfig`; one entry per module)
EVICTION_METHODS = {
    "streamingllm": lambda c: StreamingLLM(budget=c.budget, n_sink=c.n_sink, rounding=c.budget_rounding),
    "snapkv": lambda c: SnapKV(**_snapkv_args(c)),
    "pyramidkv": lambda c: PyramidKV(**_snapkv_args(c), beta=c.beta, fallback=c.pyramid_fallback),
    "adasnapkv": lambda c: AdaSnapKV(**_snapkv_args(c), alpha_safeguard=c.alpha_safeguard,
                                     safeguard=c.ada_safeguard),
    "tova": lambda c: TOVA(budget=c.budget, rounding=c.budget_rounding),
    "expected_attention": lambda c: ExpectedAttention(budget=c.budget, n_sink=c.n_sink, rounding=c.budget_rounding),
}
CHANNEL_METHODS = {
    "think": lambda c: ThinK(ratio=c.ratio, window_size=c.channel_window_size, keep_window=c.think_keep_window,
                             score_dtype=c.saliency_dtype),
    "spark": lambda c: SparK(ratio=c.ratio, window_size=c.channel_window_size, saliency=c.saliency,
                             recovery="zero" if c.variant == "group_fork" and c.group_fork_fill == "zero"
                             else c.recovery,
                             variant=c.variant, top_p=c.top_p, groups=c.groups, constant=c.constant, seed=c.seed,
                             recovery_stats=c.recovery_stats, saliency_dtype=c.saliency_dtype),
    "mustafar": lambda c: Mustafar(ratio=c.ratio, window=c.mustafar_window, block=c.mustafar_block),
    "leank": lambda c: LeanK(mask=dict(c.leank)["mask"], recent=dict(c.leank)["recent"]),
}
# channel method → its own value pruning (``value_ratio``), in place of Appendix D's ``ValueNorm`` (value_norm.py)
VALUE_METHODS = {
    "mustafar": lambda c: MustafarValues(ratio=c.value_ratio, window=c.mustafar_window, block=c.mustafar_block),
}
DISPLAY = {"full": "Full", "snapkv": "SnapKV", "streamingllm": "StreamingLLM", "pyramidkv": "PyramidKV",
           "adasnapkv": "AdaSnapKV", "tova": "TOVA", "expected_attention": "ExpectedAttention",
           "think": "ThinK", "spark": "SparK", "mustafar": "Mustafar",
           "leank": "LeanK"}
METHOD_NAMES = ("full", *EVICTION_METHODS, *CHANNEL_METHODS,
                *(f"{e}+{c}" for e, c in itertools.product(EVICTION_METHODS, CHANNEL_METHODS)))

_SNAPKV_OPTIONS = ("window_size", "kernel_size", "pooling", "window_q_norm", "budget_rounding")
# method part → the options that change what it computes (the others are ignored by it)
METHOD_OPTIONS = {
    "snapkv": _SNAPKV_OPTIONS, "pyramidkv": (*_SNAPKV_OPTIONS[:-1], "beta", "pyramid_fallback"),  # own rounding
    "adasnapkv": (*_SNAPKV_OPTIONS, "alpha_safeguard", "ada_safeguard"),
    "streamingllm": ("n_sink", "budget_rounding"), "tova": ("budget_rounding",),
    "expected_attention": ("n_sink", "window_q_norm", "budget_rounding"),
    "think": ("ratio", "window_size", "channel_window", "think_keep_window", "window_q_norm", "saliency_dtype"),
    "spark": ("ratio", "window_size", "channel_window", "saliency", "recovery", "recovery_stats", "variant", "top_p",
              "groups", "constant", "seed", "window_q_norm", "saliency_dtype", "group_fork_fill"),
    "mustafar": ("ratio", "mustafar_window", "mustafar_block"),
    "leank": ("leank",),  # the mask file and the dense recent tokens (a mapping: leank.mask=, leank.recent=)
}
