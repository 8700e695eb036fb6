"""Mustafar (Joo et al., NeurIPS 2025, arXiv 2505.22913): unstructured per-token magnitude pruning of keys and values.

What its official code does (github dhjoo98/mustafar; the accuracy runs: ``pred_long_bench.py`` imports
``models/llama_mustafar_Kt_Mag_Vt_Mag.py``, run by ``long_test.sh`` with ``group_size = residual_length = 32``):

* **Rule** (``LlamaAttention_MUSTAFAR.dh_prune_key`` / ``dh_prune_value``, identical for keys and values): per token
  and kv-head, over the ``D`` entries of the vector, ``k = max(1, int(s·D))``; the threshold is the ``k``-th smallest
  ``|x|`` (``torch.kthvalue``) and every entry with ``|x| ≥ threshold`` is kept, the others set to zero. So
  ``D − k + 1`` entries are kept (``int(s·D) − 1`` pruned, one fewer than the paper's "sparsity ``s``"), and every
  entry tied with the threshold is kept too. No query, no statistics, nothing refilled: pruned entries read as 0.
* **Keys after RoPE**: ``apply_rotary_pos_emb`` runs before ``dh_prune_key``; the harness's keys are post-RoPE too.
* **Which tokens** (``LlamaFlashAttention_MUSTAFAR.forward``): the prefill's attention is dense (flash attention
  over the unpruned prompt: the first answer token is the full cache's), then every prompt token but the last
  ``residual_length`` is pruned; at each decode step, after attending, the token that leaves the
  ``residual_length`` window is pruned (decoded tokens included). The kernel code (``models/llama_mustafar_kernel.py``)
  prunes and compresses ``((S − residual_length) // 256) · 256`` tokens at prefill and then 256 at a time.

Here (``window`` = ``mustafar_window``, ``block`` = ``mustafar_block``): the prompt's first
``⌊(S − window) / block⌋ · block`` tokens are pruned by the rule above (``block=1``: the accuracy code; ``256``: the
kernel code's prefill), the rest stay dense; decoded tokens stay dense, as every method's here. A prompt token
in the window is therefore never pruned later, as the official accuracy code would prune it once it leaves the
window (the first two answer tokens see exactly the official cache; docs/protocol.md). ``ratio`` is the key
sparsity ``s_k`` (``k_sparsity``), ``value_ratio`` the value sparsity ``s_v`` (``v_sparsity``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.base import ChannelMethod
from spark_bench.methods.channel.recovery import ConstantFill
from spark_bench.storage.stores import DenseStore, UnstructuredStore
from spark_bench.storage.windowed import WindowedStore

WINDOW = 32  # long_test.sh: group_size=32, --residual_length $group_size
BLOCK = 1    # the accuracy code prunes token by token; llama_mustafar_kernel.py compresses 256 at a time


def threshold_rank(sparsity: float, head_dim: int) -> int:
    """The official ``num_to_keep = max(1, int(sparsity · D))``: despite its name, the rank (1-based, smallest
    first) of the magnitude that becomes the threshold."""
    return max(1, int(sparsity * head_dim))


def magnitude_mask(x: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Bool ``(…, D)``: the entries the official ``dh_prune_key`` / ``dh_prune_value`` keep — ``|x| ≥`` the
    ``threshold_rank``-th smallest ``|x|`` of the vector (ties with the threshold kept). The magnitudes are compared
    in float32: ``|x|`` of a bf16/fp16 entry is exact there, so the kept set is the one the model dtype gives."""
    mag = x.abs().float()
    threshold = mag.kthvalue(threshold_rank(sparsity, x.shape[-1]), dim=-1, keepdim=True).values
    return mag >= threshold


def pruned_tokens(length: int, window: int, block: int) -> int:
    """How many of a prompt's first tokens are pruned: ``⌊(S − window) / block⌋ · block`` (0 when ``S ≤ window``)."""
    return max(length - window, 0) // block * block


def prune_store(x: torch.Tensor, sparsity: float, window: int = WINDOW, block: int = BLOCK):
    """``x (B, H, S, D)`` (keys or values) as Mustafar keeps it: the first :func:`pruned_tokens` tokens pruned by
    :func:`magnitude_mask` into an :class:`~spark_bench.storage.stores.UnstructuredStore` with a zero fill (kept
    entries + a D-bit mask, pruned = 0: the fused kernel's ``bare`` kind), the rest dense (a
    :class:`~spark_bench.storage.windowed.WindowedStore` when both parts hold tokens). Nothing is pruned — a
    :class:`~spark_bench.storage.stores.DenseStore`, the base method's store — when the rule keeps every entry
    (``int(s·D) ≤ 1``, e.g. ``s = 0``) or no token is old enough."""
    s, d = x.shape[-2], x.shape[-1]
    n_old = pruned_tokens(s, window, block)
    if n_old == 0 or threshold_rank(sparsity, d) == 1:
        return DenseStore(x)
    old = x[..., :n_old, :]
    pruned = UnstructuredStore.from_mask(old, magnitude_mask(old, sparsity), ConstantFill(0.0))
    if n_old == s:
        return pruned
    return WindowedStore(pruned, x[..., n_old:, :].clone(memory_format=torch.contiguous_format))


@dataclass(frozen=True)
class Mustafar(ChannelMethod):
    """Keys: ``ratio`` = Mustafar's ``k_sparsity``; ``window`` / ``block``: see the module docstring."""

    ratio: float
    window: int = WINDOW
    block: int = BLOCK

    def __post_init__(self):
        if not 0 <= self.ratio < 1:
            raise ValueError(f"ratio (Mustafar's key sparsity) must be in [0, 1), got {self.ratio}")
        if self.window < 0 or self.block < 1:
            raise ValueError(f"mustafar_window must be >= 0 and mustafar_block >= 1, got {self.window}, {self.block}")

    def compress_keys(self, keys: torch.Tensor, layer: LayerPrefill, layer_idx: int = 0):
        return prune_store(keys, self.ratio, self.window, self.block)


@dataclass(frozen=True)
class MustafarValues:
    """Values: ``ratio`` = Mustafar's ``v_sparsity`` (the config's ``value_ratio``), the keys' rule and window."""

    ratio: float
    window: int = WINDOW
    block: int = BLOCK

    def compress_values(self, values: torch.Tensor):
        return prune_store(values, self.ratio, self.window, self.block)
