"""The small interfaces every compression method implements.

* :class:`EvictionMethod` picks which prompt tokens each kv-head keeps (SnapKV, PyramidKV, ...).
* :class:`ChannelMethod` turns the kept keys of one layer into a compact key store (ThinK, SparK).
* value pruning (:mod:`spark_bench.methods.channel.value_norm`) turns the kept values into a compact value store.

A method configuration composes at most one of each (``snapkv+spark``); eviction runs first, channel pruning
then sees only the surviving tokens, as in kvpress' ``ComposedPress`` used by the official SparK code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.storage.stores import Store


@dataclass(frozen=True)
class TokenSelection:
    """Tokens kept by one layer: ascending ``indices (B, H_kv, n)``.

    Methods that keep a different number of tokens per head (AdaKV) pad every head to the longest one;
    ``valid (B, H_kv, n)`` is then False on the padding, which attention masks out.

    Valid means (:func:`selection_problem`): ``indices`` a ``torch.long`` tensor of shape ``(B, H_kv, n)`` with the
    layer's ``B`` and ``H_kv`` and ``1 <= n <= S``, every position in ``[0, S)``, strictly ascending along the last
    axis (so no position twice); ``valid``, if given, a bool tensor of the same shape, True somewhere in every head,
    and the ascending rule applies to its True entries (padding may hold any position in range).
    """

    indices: torch.Tensor
    valid: torch.Tensor | None = None


def selection_problem(selection, batch: int, heads: int, length: int, device=None) -> str | None:
    """What makes ``selection`` (what a ``select`` returned) not a valid :class:`TokenSelection` of a layer of
    ``length`` tokens, ``batch`` rows and ``heads`` kv-heads (on ``device``, the keys' device, when given), in
    words; None when it is valid (or None: every token kept). A few reductions over the small index tensor (the
    runner checks methods of one's own with it)."""
    if selection is None:
        return None
    if not isinstance(selection, TokenSelection):
        return f"returned {type(selection).__name__}, not a TokenSelection (or None to keep every token)"
    idx, valid = selection.indices, selection.valid
    if not isinstance(idx, torch.Tensor):
        return f"returned indices of type {type(idx).__name__}, not a torch tensor"
    if idx.dtype != torch.long:
        return f"returned indices of dtype {idx.dtype}, not torch.long (what gathering the tokens takes)"
    for what, tensor in (("indices", idx), ("valid mask", valid)):
        if device is not None and isinstance(tensor, torch.Tensor) and tensor.device != torch.device(device):
            return f"returned {what} on device {tensor.device}, not the keys' device {torch.device(device)}"
    if idx.dim() != 3 or tuple(idx.shape[:2]) != (batch, heads):
        return (f"returned indices of shape {tuple(idx.shape)}, not (batch, kv-heads, n) = ({batch}, {heads}, n) "
                f"for keys of {length} tokens")
    n = idx.shape[2]
    if not 1 <= n <= length:
        return f"returned {n} positions per head, not 1 to {length} (the layer's tokens)"
    if valid is not None:
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.shape != idx.shape:
            what = f"{valid.dtype} {tuple(valid.shape)}" if isinstance(valid, torch.Tensor) else type(valid).__name__
            return f"returned a valid mask of {what}, not a bool tensor of the indices' shape {tuple(idx.shape)}"
        if not bool(valid.any(dim=-1).all()):
            return "returned a valid mask with no True entry in some head (a head keeps at least one token)"
    low, high = int(idx.min()), int(idx.max())
    if low < 0 or high >= length:
        bad = low if low < 0 else high
        return f"returned position {bad}, out of range for a layer of {length} tokens (positions 0 to {length - 1})"
    if n > 1:
        if valid is None:
            order = idx[..., 1:] > idx[..., :-1]
        else:  # each kept position above every kept position before it
            kept = torch.where(valid, idx, torch.full_like(idx, -1))
            order = ~valid[..., 1:] | (idx[..., 1:] > kept.cummax(dim=-1).values[..., :-1])
        if not bool(order.all()):
            where = (~order).nonzero()[0].tolist()
            b, h, j = where
            a, c = int(idx[b, h, j]), int(idx[b, h, j + 1])
            what = "twice" if a == c else "not ascending"
            return (f"returned positions {what} (row {b}, kv-head {h}: {a} then {c} at {j} and {j + 1}); "
                    "indices are ascending, each position once")
    return None


BUDGET_ROUNDINGS = ("exact", "official")


def resolve_budget(budget: float, prompt_length: int, rounding: str = "exact") -> int:
    """KV budget in tokens: an integer ≥ 1 is a token count, a value in (0, 1) a fraction of the prompt.

    ``rounding`` of a fraction ``b`` (``budget_rounding``): ``exact`` keeps ``int(S·b)``; ``official`` keeps what
    the official SparK code keeps, ``int(S·(1 − compression_ratio))`` with ``compression_ratio = 1 − b``
    (kvpress ``ScorerPress.compress``, ``AdaKVPress``), evaluated in floating point: at ``b = 0.2`` (and 0.1)
    ``1 − (1 − b)`` is a hair below ``b`` (0.19999999999999996), so every ``S`` divisible by 5 keeps ``S/5 − 1``.
    Token budgets are integers and unaffected."""
    if budget <= 0:
        raise ValueError(f"budget must be > 0 (tokens, or a fraction in (0, 1)), got {budget}")
    if rounding not in BUDGET_ROUNDINGS:
        raise ValueError(f"budget_rounding must be one of {', '.join(BUDGET_ROUNDINGS)}; got {rounding!r}")
    if budget >= 1:
        n = int(budget)
    else:
        n = int(prompt_length * (1 - (1 - budget))) if rounding == "official" else int(prompt_length * budget)
    return min(n, prompt_length)


class EvictionMethod(ABC):
    """Token eviction: which prompt positions survive, per layer and kv-head."""

    needs_query_stats = False  # True if the method needs the prefill's query mean/covariance (ExpectedAttention)

    @abstractmethod
    def select(self, layer: LayerPrefill, layer_idx: int, num_layers: int) -> TokenSelection | None:
        """The kept tokens, or ``None`` to keep every token (exactly when :meth:`keeps_whole`)."""

    def keeps_whole(self, length: int, layer_idx: int, num_layers: int) -> bool:
        """Whether a compressed part of ``length`` tokens is kept whole in this layer (the full cache): its budget
        covers it, or it is no longer than what the method always keeps (the observation window, the sinks and one
        recent token, the last token). :meth:`select` returns ``None`` exactly then, and the run's budget-coverage
        warning (:func:`spark_bench.checks.budget_warnings`) counts such samples. A method without a ``budget``
        attribute is not known to keep anything whole (False)."""
        budget = self._budget()
        return budget is not None and resolve_budget(budget, length, self._rounding()) >= length

    def stored_tokens(self, prompt_length: int, layer_idx: int, num_layers: int, num_kv_heads: int) -> int:
        """The most prompt tokens :meth:`select` leaves in this layer's store for a prompt of ``prompt_length`` (the
        memory planner's count, no data needed): the budget (``budget``, ``rounding``) or the whole prompt — also
        for a method of one's own that declares no ``budget`` (what it keeps is then its own; at most the prompt)."""
        budget = self._budget()
        if budget is None:
            return prompt_length
        return min(resolve_budget(budget, prompt_length, self._rounding()), prompt_length)

    def _budget(self) -> float | None:
        """The ``budget`` attribute (a method of one's own declares only the options it reads: maybe none)."""
        budget = getattr(self, "budget", None)
        return budget if isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0 else None

    def _rounding(self) -> str:
        """The ``rounding`` attribute; ``exact`` (``budget_rounding``'s default) where the method has none."""
        rounding = getattr(self, "rounding", None)
        return rounding if rounding in BUDGET_ROUNDINGS else "exact"


class ChannelMethod(ABC):
    """Key-channel pruning: store the (already evicted) keys of one layer compactly."""

    @abstractmethod
    def compress_keys(self, keys: torch.Tensor, layer: LayerPrefill, layer_idx: int = 0) -> Store:
        """``keys`` is ``(B, H_kv, S', D)``; ``layer`` carries the observation-window queries."""


def gather_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Select tokens ``(B, H, n)`` from ``x`` ``(B, H, S, D)``."""
    return x.gather(2, indices.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))


def top_tokens(scores: torch.Tensor, n_keep: int, forced: torch.Tensor | None = None,
               offset: int = 0) -> TokenSelection:
    """Keep ``n_keep`` tokens per head: the ``forced`` positions ``(n_f,)`` (window, sinks) and the highest scores.

    ``scores`` is ``(B, H, n)`` over prompt positions ``offset … offset + n − 1``.
    """
    n_forced = 0 if forced is None else forced.numel()
    top = scores.topk(n_keep - n_forced, dim=-1, sorted=False).indices + offset  # the set; sorted below
    if forced is not None:
        top = torch.cat([top, forced.expand(*top.shape[:2], n_forced)], dim=-1)
    return TokenSelection(top.sort(dim=-1).values)
