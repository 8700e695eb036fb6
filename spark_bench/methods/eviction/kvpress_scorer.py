"""Any kvpress press as the eviction stage: ``method=kvpress:<press>[+spark|+think]`` on the command line,
``spark_bench.press(model, kvpress.KnormPress(0.5), ratio=0.8)`` in the library.

kvpress (NVIDIA/kvpress) runs a press as a forward hook after each attention layer of the prefill
(``BasePress.forward_hook``): the hook gets the layer's input ``hidden_states``, its cached ``keys`` / ``values``
``(B, H_kv, S, D)``, the attention weights (None unless the model returns them) and the forward's keyword
arguments, and replaces the layer's cache by the tokens the press keeps. Here the same hook runs inside the
harness's one prefill (:func:`spark_bench.engine.prefill.capture_window_queries`, ``hooks``), on the same
arguments, and records what the press decides, so SparK / ThinK then prune the channels of exactly those tokens
into the compact stores (true bytes), and every config of a sweep shares the prefill:

* a ``ScorerPress`` whose ``compress`` is ``ScorerPress.compress`` (Knorm, SnapKV, ExpectedAttention, TOVA,
  StreamingLLM, ObservedAttention, QFilter, KeyDiff, …): its ``score(module, hidden_states, keys, values,
  attentions, kwargs)`` ``(B, H_kv, S)`` is recorded once per prefill, and :meth:`KvpressEviction.select` keeps
  the top ``n`` per head as ``ScorerPress.compress`` does (``scores.topk(n)``): ``n`` the harness's ``budget``
  (``budget_rounding``) or, for a press given as an object, kvpress' own ``compute_n_kept(S, compression_ratio)``
  — the tokens kvpress keeps. One score serves every budget of a sweep;
* any other press that prunes by gathering tokens (``PerLayerCompressionPress``, ``ComposedPress`` of such
  presses, ``PyramidKVPress``, …): its ``forward_hook`` runs on the layer (over a one-layer stand-in cache) and the
  kept positions are recovered by matching the keys it leaves to the layer's keys, exactly; a press whose result
  is not such a subset (ThinKPress' zeroed channels, AdaKVPress' attention masking, merging, quantisation) is
  refused in one line.

kvpress is an optional dependency (``pip install 'spark-bench[kvpress]'``); nothing here imports it at module level.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import torch

from spark_bench.engine.prefill import LayerPrefill, attention_modules
from spark_bench.methods.base import EvictionMethod, TokenSelection, resolve_budget

PREFIX = "kvpress:"
INSTALL = "pip install 'spark-bench[kvpress]'"


def _kvpress():
    try:
        return importlib.import_module("kvpress")
    except ImportError as err:
        raise ValueError(f"kvpress is not installed ({err}); {INSTALL}") from None


def _normal(name: str) -> str:
    return re.sub(r"[_\-]", "", name).lower()


def press_classes() -> dict[str, type]:
    """kvpress' presses by their short name: the class name without ``Press``, lower case (``knorm``, ``snapkv``,
    ``expectedattention``; underscores and hyphens are ignored when matching, so ``expected_attention`` works)."""
    kvpress = _kvpress()
    base = kvpress.presses.base_press.BasePress
    return {_normal(name[:-5]): cls for name, cls in vars(kvpress).items()
            if isinstance(cls, type) and issubclass(cls, base) and name.endswith("Press") and name != "BasePress"}


def press_class(name: str) -> type:
    """The press class of ``kvpress:<name>``: a short name (:func:`press_classes`), a class name
    (``KnormPress``), or a dotted path to a press defined elsewhere (``my_package.presses.MyPress``)."""
    if "." in name:
        from spark_bench.usercode import import_object  # the one boundary the user's code enters through

        cls = import_object(name, f"method kvpress:{name}")
        base = _kvpress().presses.base_press.BasePress
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"method kvpress:{name}: {name} is not a kvpress press (a BasePress subclass)")
        return cls
    classes = press_classes()
    key = _normal(name[:-5] if name.endswith("Press") else name)
    if key not in classes:
        raise ValueError(f"method kvpress:{name}: no such kvpress press; valid: {', '.join(sorted(classes))} "
                         "(or a dotted path to a press class)")
    return classes[key]


def display_name(name: str) -> str:
    """Table label of ``kvpress:<name>``: ``kvpress:<class name without Press>`` (``kvpress:Knorm``)."""
    try:
        cls = press_class(name)
    except ValueError:
        return PREFIX + name
    return PREFIX + (cls.__name__[:-5] if cls.__name__.endswith("Press") else cls.__name__)


def build_press(name: str, options: dict, budget: float):
    """The press of ``kvpress:<name>`` with its ``options`` (the command line's ``kvpress={...}``, any field of the
    press' dataclass) and, when the press has a ``compression_ratio`` field, ``1 − budget`` for a fraction budget
    (what kvpress keeps is then ``budget`` of the prompt). One line naming the bad option on an error."""
    cls = press_class(name)
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"kvpress: {cls.__name__} has no option {' or '.join(unknown)}; its options: "
                         f"{', '.join(sorted(names)) or 'none'} (kvpress={{option:value}})")
    args = dict(options)
    if "compression_ratio" in names and "compression_ratio" not in args:
        args["compression_ratio"] = 1 - budget if budget < 1 else 0.0
    try:
        return cls(**args)
    except Exception as err:  # noqa: BLE001 — the press' own checks (asserts, a press of the user's: anything)
        from spark_bench.usercode import describe_exception

        given = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in args.items())
        raise ValueError(f"method kvpress:{name}: {cls.__name__}({given}) failed: "
                         f"{describe_exception(err)}") from None


def _scores_tokens(press) -> bool:
    """A press whose kept tokens are ``ScorerPress.compress``'s top-k of its ``score``."""
    scorer = _kvpress().presses.scorer_press.ScorerPress
    return isinstance(press, scorer) and type(press).compress is scorer.compress


def press_key(press) -> tuple:
    """What identifies a press' decisions: its class and field values (kvpress presses are unhashable dataclasses)."""
    return (type(press).__module__, type(press).__qualname__, repr(press))


class PressHook:
    """The layer hook that runs a press inside the harness's prefill (:mod:`spark_bench.engine.prefill`).

    ``mode="score"``: returns the press' ``score`` ``(B, H_kv, S)``; ``mode="gather"``: runs its ``forward_hook``
    and returns the kept positions ``(B, H_kv, n)`` ascending. Equal presses give equal hooks (one run per prefill)."""

    def __init__(self, press):
        self.press = press
        self.mode = "score" if _scores_tokens(press) else "gather"
        self.key = ("kvpress", self.mode, *press_key(press))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, PressHook) and other.key == self.key

    @contextmanager
    def attached(self, model):
        """What kvpress' ``press(model)`` sets up: ``post_init_from_model`` and each attention module's
        ``rotary_emb`` (ExpectedAttention reads it); the attributes it added are removed on exit."""
        self.press.post_init_from_model(model)
        base = getattr(model, "model", model)
        language = getattr(base, "language_model", base)
        rotary = getattr(language, "rotary_emb", None)
        added = []
        for module in attention_modules(model):
            if rotary is not None and not hasattr(module, "rotary_emb"):
                module.rotary_emb = rotary
                added.append(module)
        try:
            yield
        finally:
            for module in added:
                del module.rotary_emb

    @torch.no_grad()
    def __call__(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.mode == "score":
            return self.press.score(module, hidden_states, keys, values, attentions, kwargs)
        return self._gather(module, hidden_states, keys, values, attentions, kwargs)

    def _gather(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        """Run the press' ``forward_hook`` over a one-layer stand-in cache holding copies of ``keys`` / ``values`` (the
        prefill's own stay untouched) and find where each key it leaves came from."""
        length = keys.shape[2]
        layer = SimpleNamespace(keys=keys.clone(), values=values.clone())  # a press may write in place (ThinK)
        cache = SimpleNamespace(layers={module.layer_idx: layer})
        call = {**kwargs, "hidden_states": hidden_states, "past_key_values": cache,
                "cache_position": torch.arange(length, device=keys.device)}
        if hasattr(module, "masked_key_indices"):
            module.masked_key_indices = None
        self.press.forward_hook(module, (), call, (None, attentions))
        if getattr(module, "masked_key_indices", None) is not None:
            module.masked_key_indices = None
            raise ValueError(f"kvpress: {type(self.press).__name__} masks keys per head inside attention "
                             "(AdaKV-style) instead of keeping tokens; use its scorer press alone, or adasnapkv")
        return kept_positions(keys, layer.keys, type(self.press).__name__)


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """One integer per vector of ``x (..., D)`` from its bits (a wrapping integer sum: exact, whatever the order of
    summation, so a gathered copy gets its original's number; a float dot product may not)."""
    bits = x.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]).to(torch.int64)
    weights = torch.randint(1, 2 ** 62, (x.shape[-1],), generator=torch.Generator().manual_seed(0))
    return (bits * weights.to(x.device)).sum(dim=-1)


def kept_positions(keys: torch.Tensor, kept: torch.Tensor, who: str = "the press") -> torch.Tensor:
    """Positions ``(B, H, n)`` (ascending) of ``kept (B, H, n, D)`` among ``keys (B, H, S, D)``: every kept key must
    be one of the layer's keys, exactly (a press that gathers tokens); else ``ValueError``."""
    b, h, s, d = keys.shape
    if kept.shape[:2] != (b, h) or kept.shape[-1] != d or kept.shape[2] > s:
        raise ValueError(f"kvpress: {who} left keys of shape {tuple(kept.shape)} from {tuple(keys.shape)}: not a "
                         "selection of tokens")
    if kept.shape[2] == s and torch.equal(kept, keys):
        return torch.arange(s, device=keys.device).expand(b, h, s)
    fingerprint = _fingerprint(keys)                                       # (B, H, S): one number per key
    order = fingerprint.argsort(dim=-1)
    position = torch.searchsorted(fingerprint.gather(-1, order).contiguous(), _fingerprint(kept))
    position = order.gather(-1, position.clamp(max=s - 1))
    found = keys.gather(2, position.unsqueeze(-1).expand(-1, -1, -1, d))
    if not torch.equal(found, kept):
        raise ValueError(f"kvpress: {who} changes the keys it keeps (channels, merging or quantisation), so no "
                         "token selection matches it; only presses that keep whole tokens can be the eviction stage")
    return position.sort(dim=-1).values


def _kept(press, length: int, layer_idx: int) -> int:
    """Tokens kvpress keeps of ``length`` under ``press`` (its ``compute_n_kept``); ``length`` where it cannot say."""
    kvpress = _kvpress()
    n_kept = kvpress.utils.compute_n_kept
    if isinstance(press, kvpress.PerLayerCompressionPress):
        return n_kept(length, press.compression_ratios[layer_idx]) if press.compression_ratios[layer_idx] else length
    if isinstance(press, kvpress.ComposedPress):
        for inner in press.presses:
            length = _kept(inner, length, layer_idx)
        return length
    if isinstance(press, kvpress.presses.scorer_press.ScorerPress) and not isinstance(press, kvpress.PyramidKVPress):
        return n_kept(length, press.compression_ratio) if press.compression_ratio else length
    return length


@dataclass(frozen=True)
class KvpressEviction(EvictionMethod):
    """A kvpress press as the eviction stage (module docstring). ``budget``: the harness's budget (tokens ≥ 1 or a
    fraction of the prompt, rounded by ``rounding``); None: what the press itself keeps (its
    ``compression_ratio``, kvpress' ``compute_n_kept``). Equal presses and budgets compare equal, so the configs of
    a sweep that share them share one selection."""

    press: Any = field(compare=False, hash=False, repr=False)
    budget: float | None = None
    rounding: str = "exact"
    key: tuple = field(init=False, default=())

    def __post_init__(self):
        object.__setattr__(self, "key", press_key(self.press))
        object.__setattr__(self, "hook", PressHook(self.press))
        if self.budget is not None and self.hook.mode == "gather":
            raise ValueError(f"kvpress: {type(self.press).__name__} keeps what its own compression ratio says; "
                             "give it as a press object, or use a ScorerPress for the harness's budget")

    @property
    def prefill_hooks(self) -> tuple:
        return (self.hook,)

    def _n_keep(self, length: int, layer_idx: int) -> int:
        if self.budget is None:
            return _kept(self.press, length, layer_idx)
        return min(max(resolve_budget(self.budget, length, self.rounding), 1), length)

    def stored_tokens(self, prompt_length: int, layer_idx: int, num_layers: int, num_kv_heads: int) -> int:
        return self._n_keep(prompt_length, layer_idx)

    def keeps_whole(self, length: int, layer_idx: int, num_layers: int) -> bool:
        return self.hook.mode == "score" and self._n_keep(length, layer_idx) >= length

    def select(self, layer: LayerPrefill, layer_idx: int, num_layers: int) -> TokenSelection | None:
        got = layer.hooked.get(self.hook.key)
        if got is None:
            raise ValueError(f"kvpress: the prefill ran without {type(self.press).__name__}'s hook "
                             "(run it through spark_bench.compress / press or the harness)")
        length = layer.keys.shape[2]
        if self.hook.mode == "gather":
            return None if got.shape[-1] >= length else TokenSelection(got)
        n = self._n_keep(length, layer_idx)
        if n >= length:
            return None
        return TokenSelection(got.topk(n, dim=-1).indices.sort(dim=-1).values)


@lru_cache(maxsize=64)
def _built(name: str, options: tuple, budget: float):
    return build_press(name, dict(options), budget)


def from_config(name: str, options: tuple, budget: float, rounding: str) -> KvpressEviction:
    """The eviction of a method part ``kvpress:<name>`` (``options``: the config's ``kvpress`` pairs). A press that
    is not a plain scorer keeps what its ``compression_ratio`` (``1 − budget``) says, so its budget is a fraction."""
    press = _built(name, options, budget)
    if PressHook(press).mode == "gather":
        if budget >= 1:
            raise ValueError(f"method kvpress:{name}: {type(press).__name__} keeps a fraction of the prompt (its "
                             f"compression_ratio); budget={budget:g} must be a fraction < 1")
        return KvpressEviction(press, None, rounding)
    return KvpressEviction(press, budget, rounding)
