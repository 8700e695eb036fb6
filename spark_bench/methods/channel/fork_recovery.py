"""The official SparK code's distribution recoveries (its ``pooling_ratio`` codes), each under its own name.

The paper's distribution ablation (§5.4, Table "ab_dist") compares Normal / Exponential / Degenerate recovery; the
official code does not draw independent samples of the pruned saliency as :mod:`.recovery` does, but one of:

* ``fork_key_normal`` (code 0.7, ``normal(keys, mask)``) and ``fork_key_exponential`` (code 0.6,
  ``exponential(keys, mask)``): *key values* drawn per pruned entry from the token's key statistics over all its
  channels — ``|N(m_t, s_t)|`` with ``m_t`` the (signed) mean and ``s_t`` the (unbiased) std of the token's key
  entries, both clamped at 1e-5, or ``Exp(1/m_t)`` — given the sign of the original entry.
* ``fork_ranked_normal`` (code 0.755, ``normal_attn(..., is_avg=False)``) and ``fork_ranked_exponential`` (code 0.654,
  ``exponential_attn(..., is_avg=False)``): *saliencies* drawn, D per token, from the statistics of the token's
  saliency over all channels (``|N(mean, std)|``, unbiased std; or ``Exp(1/max(mean, 1e-5))``), sorted high to low
  and handed out by saliency rank (the channel of rank r gets the r-th largest draw); a draw above the token's
  threshold (its smallest kept saliency, the T-th largest) is replaced by ``μ_pruned``; the key entry is
  ``sign(k)·sqrt(w̃ / ‖q_c‖₂)`` as for the official degenerate refill.

Metadata kept: per token the statistics (and for the ranked ones the threshold and ``μ_pruned``), one sign bit per
pruned entry, and for the ranked ones each pruned entry's saliency rank (one byte). Draws come from a generator
seeded per layer, the same at every decode step. These recoveries draw per entry, so attention rebuilds the keys
(the compact kernel does not serve them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.storage.bits import masked_entries, pack_bits, tensor_bytes, unpack_bits

FORK_MODES = ("fork_key_normal", "fork_key_exponential", "fork_ranked_normal", "fork_ranked_exponential")


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _draw(kind: str, mean: torch.Tensor, std: torch.Tensor | None, shape, seed: int) -> torch.Tensor:
    """``shape`` draws per token: ``|N(mean, std)|`` or ``Exp(1/mean)`` (``mean``/``std`` ``(B, H, S)``)."""
    g = _generator(seed, mean.device)
    if kind == "normal":
        noise = torch.randn(shape, generator=g, device=mean.device)
        return (mean.float().unsqueeze(-1) + std.float().unsqueeze(-1) * noise).abs()
    unit = torch.empty(shape, device=mean.device).exponential_(generator=g)
    return mean.float().unsqueeze(-1) * unit


def _signs(keys: torch.Tensor, kept_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    signs = masked_entries(keys > 0, ~kept_mask)
    return pack_bits(signs), signs.numel()


def _signed(magnitude: torch.Tensor, kept_mask: torch.Tensor, sign_bits: torch.Tensor, n_signs: int) -> torch.Tensor:
    positive = torch.zeros_like(kept_mask).masked_scatter(~kept_mask, unpack_bits(sign_bits, n_signs))
    return torch.where(positive, magnitude, -magnitude)


@dataclass(frozen=True)
class ForkKeyRecovery:
    """Codes 0.7 / 0.6: pruned key entries drawn from the token's key statistics, with the entry's own sign."""

    kind: str             # normal | exponential
    mean: torch.Tensor    # (B, H, S) clamped mean of the token's key entries (model dtype)
    std: torch.Tensor | None
    sign_bits: torch.Tensor
    n_signs: int
    seed: int

    @classmethod
    def build(cls, kind: str, keys: torch.Tensor, kept_mask: torch.Tensor, seed: int) -> "ForkKeyRecovery":
        k = keys.float()
        std = k.std(-1).clamp(min=1e-5).to(keys.dtype) if kind == "normal" else None
        return cls(kind, k.mean(-1).clamp(min=1e-5).to(keys.dtype), std, *_signs(keys, kept_mask), seed)

    def fill(self, kept_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        magnitude = _draw(self.kind, self.mean, self.std, kept_mask.shape, self.seed)
        return _signed(magnitude, kept_mask, self.sign_bits, self.n_signs).to(dtype)

    def kernel_terms(self) -> str:
        return f"fork_key_{self.kind} draws a key value per pruned entry"

    def nbytes(self) -> int:
        return tensor_bytes(self.mean, self.std, self.sign_bits)


@dataclass(frozen=True)
class ForkRankedRecovery:
    """Codes 0.755 / 0.654: saliencies drawn from all-channel statistics, handed out by rank, capped at μ_pruned."""

    kind: str
    mean: torch.Tensor        # (B, H, S) mean saliency over all channels (exponential: clamped at 1e-5)
    std: torch.Tensor | None  # (B, H, S) its unbiased std (normal)
    threshold: torch.Tensor   # (B, H, S) the token's smallest kept saliency
    mu_pruned: torch.Tensor   # (B, H, S) mean saliency of its pruned channels
    ranks: torch.Tensor       # uint8, one per pruned entry (row-major): the entry's saliency rank, 0 = most salient
    query_norm: torch.Tensor  # (B, H, D) float32 ‖q_c‖₂ over the window
    sign_bits: torch.Tensor
    n_signs: int
    seed: int

    @classmethod
    def build(cls, kind: str, keys: torch.Tensor, kept_mask: torch.Tensor, saliency: torch.Tensor,
              query_norm: torch.Tensor, seed: int) -> "ForkRankedRecovery":
        if saliency.shape[-1] > 256:
            raise ValueError(f"fork_ranked_{kind} stores ranks in one byte: head_dim {saliency.shape[-1]} > 256")
        dtype = keys.dtype
        mean = saliency.mean(-1)
        std = saliency.std(-1).to(dtype) if kind == "normal" else None
        mean = mean if kind == "normal" else mean.clamp(min=1e-5)
        threshold = saliency.masked_fill(~kept_mask, float("inf")).amin(-1)
        pruned = ~kept_mask
        mu = (saliency * pruned).sum(-1) / pruned.sum(-1).clamp(min=1)
        rank = saliency.argsort(-1, descending=True).argsort(-1)  # channel → its rank
        return cls(kind, mean.to(dtype), std, threshold.to(dtype), mu.to(dtype),
                   masked_entries(rank, pruned).to(torch.uint8), query_norm, *_signs(keys, kept_mask), seed)

    def scores(self, kept_mask: torch.Tensor) -> torch.Tensor:
        draws = _draw(self.kind, self.mean, self.std, kept_mask.shape, self.seed).sort(-1, descending=True).values
        rank = torch.zeros(kept_mask.shape, dtype=torch.long, device=kept_mask.device)
        rank = rank.masked_scatter(~kept_mask, self.ranks.long())
        w = draws.gather(-1, rank)
        return torch.where(w > self.threshold.float().unsqueeze(-1), self.mu_pruned.float().unsqueeze(-1), w)

    def fill(self, kept_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        magnitude = torch.sqrt(self.scores(kept_mask).clamp(min=0) / self.query_norm.unsqueeze(-2))
        return _signed(magnitude, kept_mask, self.sign_bits, self.n_signs).to(dtype)

    def kernel_terms(self) -> str:
        return f"fork_ranked_{self.kind} draws a saliency per pruned entry"

    def nbytes(self) -> int:
        return tensor_bytes(self.mean, self.std, self.threshold, self.mu_pruned, self.ranks, self.query_norm,
                            self.sign_bits)


def build_fork_recovery(mode: str, keys: torch.Tensor, kept_mask: torch.Tensor, saliency: torch.Tensor,
                        query_norm: torch.Tensor, seed: int):
    """The recovery object of ``mode`` (one of :data:`FORK_MODES`); ``saliency`` must be the official one."""
    _, family, kind = mode.split("_")
    if family == "key":
        return ForkKeyRecovery.build(kind, keys, kept_mask, seed)
    return ForkRankedRecovery.build(kind, keys, kept_mask, saliency, query_norm, seed)
