"""SparK recovery functions 𝓕: refill pruned key entries at attention time (paper §4.3, Appendix A.2).

Each recovery object holds exactly the metadata it needs and reports its byte size. Implemented here:

* :class:`DegenerateSigned` (official SparK code, ``saliency=official``): a pruned entry of token ``t``, channel
  ``c`` becomes ``sign(k_tc) · sqrt(μ_t / ‖q_c‖₂)`` where ``μ_t`` is the mean saliency of the token's pruned
  channels and ``‖q_c‖₂`` the L2 norm over the window of the (group-averaged) window queries. Needs ``μ_t`` per
  token, one sign bit per pruned entry and ``‖q_c‖₂`` per head.
* :class:`DegenerateQueryAligned` (paper text, ``saliency=paper``): ``k̃_tc = μ_t / q̄_c`` so that
  ``q̄_c · k̃_tc = μ_t`` exactly as the paper states (``⟨q̄ʲ, k̃ʲ⟩ ≈ w̃ʲ``); the sign comes from the mean window
  query, so no per-entry sign bits are stored. Channels whose mean window query is exactly zero refill with 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.storage.bits import pack_bits, tensor_bytes, unpack_bits


def mean_pruned_saliency(saliency: torch.Tensor, kept_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``μ_pruned`` per token (Appendix A.2: mean saliency over the token's pruned channels) and the number of
    pruned channels per token (the same for every token of a fixed-ratio store)."""
    pruned = ~kept_mask
    n_pruned = int(pruned[(0,) * (pruned.dim() - 1)].sum()) if pruned.numel() else 0
    return (saliency * pruned).sum(-1) / max(n_pruned, 1), n_pruned


@dataclass(frozen=True)
class DegenerateSigned:
    mu: torch.Tensor          # (B, H, S) mean pruned saliency per token, model dtype
    query_norm: torch.Tensor  # (B, H, D) float32, ‖window queries of channel c‖₂
    sign_bits: torch.Tensor   # (B, H, S, ceil(P / 8)) uint8, 1 = original key entry > 0
    n_pruned: int

    @classmethod
    def build(cls, keys, kept_mask, saliency, query_norm, mu_dtype) -> "DegenerateSigned":
        mu, n_pruned = mean_pruned_saliency(saliency, kept_mask)
        signs = (keys > 0).masked_select(~kept_mask).reshape(*keys.shape[:-1], n_pruned)
        return cls(mu=mu.to(mu_dtype), query_norm=query_norm, sign_bits=pack_bits(signs), n_pruned=n_pruned)

    def fill(self, kept_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        magnitude = torch.sqrt(self.mu.float().unsqueeze(-1) / self.query_norm.unsqueeze(-2))
        positive = torch.zeros_like(kept_mask).masked_scatter(~kept_mask, unpack_bits(self.sign_bits, self.n_pruned))
        return torch.where(positive, magnitude, -magnitude).to(dtype)

    def nbytes(self) -> int:
        return tensor_bytes(self.mu, self.query_norm, self.sign_bits)


@dataclass(frozen=True)
class DegenerateQueryAligned:
    mu: torch.Tensor          # (B, H, S) mean pruned saliency per token, model dtype
    mean_query: torch.Tensor  # (B, H, D) float32 mean window query q̄

    @classmethod
    def build(cls, keys, kept_mask, saliency, mean_query, mu_dtype) -> "DegenerateQueryAligned":
        mu, _ = mean_pruned_saliency(saliency, kept_mask)
        return cls(mu=mu.to(mu_dtype), mean_query=mean_query)

    def fill(self, kept_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q = self.mean_query.unsqueeze(-2)
        safe = torch.where(q == 0, torch.ones_like(q), q)
        out = torch.where(q == 0, torch.zeros_like(q), self.mu.float().unsqueeze(-1) / safe)
        return out.expand(*kept_mask.shape).to(dtype)

    def nbytes(self) -> int:
        return tensor_bytes(self.mu, self.mean_query)
