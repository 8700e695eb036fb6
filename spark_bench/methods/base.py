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
    """

    indices: torch.Tensor
    valid: torch.Tensor | None = None


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
        warning (:func:`spark_bench.checks.budget_warnings`) counts such samples."""
        return resolve_budget(self.budget, length, self.rounding) >= length

    def stored_tokens(self, prompt_length: int, layer_idx: int, num_layers: int, num_kv_heads: int) -> int:
        """The most prompt tokens :meth:`select` leaves in this layer's store for a prompt of ``prompt_length`` (the
        memory planner's count, no data needed): the budget (``budget``, ``rounding``) or the whole prompt."""
        return min(resolve_budget(self.budget, prompt_length, self.rounding), prompt_length)


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
