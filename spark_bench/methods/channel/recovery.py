"""SparK recovery functions 𝓕: refill pruned key entries at attention time (paper §4.3, Appendix A.2).

A recovery is a *score sampler* (which saliency ``w̃`` a pruned entry gets) composed with a *key mapping* (which
key entry produces that score). Each object keeps exactly the metadata it needs and reports its byte size.

Score samplers (``recovery=``), statistics cached at prefill:

* ``degenerate`` (default): ``w̃_tc = μ_pruned,t``, the mean saliency of the token's pruned channels (Eq. 12).
* ``gaussian``: ``w̃_tc ~ N(μ_t, σ_t²)``.
* ``exponential``: ``w̃_tc ~ Exp(1/μ_t)`` (mean ``μ_t``).

The paper is ambiguous about ``μ_t, σ_t`` of the two stochastic samplers (``recovery_stats=``): Appendix A.2 says
the statistics are computed "for the saliency scores of all channels within the pruned set", but its Eqs. 13–14
average over all channels ``C_i``. ``pruned`` (default) follows the sentence — and keeps the samples on the scale
of the pruned entries, as the paper's near-equal Normal/Exponential/Degenerate ablation requires; ``all`` follows
the equations.

Samples come from a generator seeded per layer (``seed``), drawn the same way at every decode step, so a token's
recovered key never changes during decoding and runs are reproducible.

Key mappings (``saliency=``):

* ``official`` (:class:`SignedKey`): the official code's saliency is ``k²·‖q_c‖₂``, inverted as
  ``k̃_tc = sign(k_tc)·sqrt(w̃ / ‖q_c‖₂)``; needs ``‖q_c‖₂`` per head and one sign bit per pruned entry.
* ``paper`` (:class:`AlignedKey`): ``k̃_tc = w̃ / q̄_c`` so that ``q̄_c·k̃_tc = w̃`` exactly (§4.3,
  ``⟨q̄ʲ, k̃ʲ⟩ ≈ w̃ʲ``); the sign comes from the mean query, no sign bits. Channels with ``q̄_c = 0`` refill 0.

Observation-2 ablations (:class:`ConstantFill`, nothing cached): ``zero`` and ``constant`` (``constant=0.01``)
fill pruned entries with a constant. ``none`` removes the channels and prunes the query to match (unrecovered);
for a dot product that is the same number as a zero fill, so it is the zero fill, kept as its own name so the
ablation tables read like the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.methods.channel.fork_recovery import FORK_MODES
from spark_bench.storage.bits import masked_entries, pack_bits, tensor_bytes, unpack_bits
from spark_bench.storage.segments import KernelTerms

SAMPLED = ("degenerate", "gaussian", "exponential")
STATS = ("pruned", "all")
CONSTANT = ("zero", "constant", "none")
POOL0 = ("fork_pool0",)  # the official code's pooling_ratio=0.0 refill (pool0_mean_saliency)
RECOVERY_MODES = SAMPLED + CONSTANT + FORK_MODES + POOL0  # FORK_MODES: the official code's own draws (.fork_recovery)


def mean_pruned_saliency(saliency: torch.Tensor, kept_mask: torch.Tensor) -> torch.Tensor:
    """``μ_pruned`` per token: mean saliency over the token's own pruned channels (0 if none is pruned)."""
    pruned = ~kept_mask
    return (saliency * pruned).sum(-1) / pruned.sum(-1).clamp(min=1)


def pool0_mean_saliency(saliency: torch.Tensor, k: int) -> torch.Tensor:
    """``μ'`` of ``recovery=fork_pool0``: the official code's ``pooling_ratio=0.0`` refill (``run4.sh`` snap_spark /
    pyramid_spark with ``threshold_ratio=0``: ``dynamic_score_selection_norm`` takes the ``pooling_ratio ==
    threshold_ratio`` branch, ``exponential_attn_grouped`` with one group and ``topk_ratios=[λ]``). Per token, the
    mean saliency of the channels *strictly below* the ``k = max(1, int(λ·D))``-th largest saliency — the ``D − k``
    lowest, where the degenerate refill averages the ``int(λ·D)`` pruned (lowest) ones — with the count clamped to
    ≥ 1. At λ = 0.5 the two sets coincide; at λ = 0.8 they differ. The refill is then the official one,
    ``sign(k)·sqrt(μ'/‖q_c‖)`` on the pruned entries: it stores what ``degenerate`` stores (one ``μ'`` per token and
    kv-head in the model dtype, one sign bit per pruned entry, ‖q‖ per head) and decodes through the same kernel
    mode."""
    threshold = saliency.topk(k, dim=-1).values[..., -1:]
    low = saliency < threshold
    count = low.sum(-1)
    return (saliency * low).sum(-1) / (count + (count == 0))


# ---- score samplers ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DegenerateScores:
    mu: torch.Tensor  # (B, H, S) μ_pruned per token, model dtype

    def scores(self, shape: torch.Size) -> torch.Tensor:
        return self.mu.float().unsqueeze(-1).expand(shape)

    def nbytes(self) -> int:
        return tensor_bytes(self.mu)


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class GaussianScores:
    mu: torch.Tensor     # (B, H, S) mean saliency (pruned channels, or all: ``recovery_stats``)
    sigma: torch.Tensor  # (B, H, S) std of the saliency over the same channels
    seed: int

    def scores(self, shape: torch.Size) -> torch.Tensor:
        noise = torch.randn(shape, generator=_generator(self.seed, self.mu.device), device=self.mu.device)
        return self.mu.float().unsqueeze(-1) + self.sigma.float().unsqueeze(-1) * noise

    def nbytes(self) -> int:
        return tensor_bytes(self.mu, self.sigma)


@dataclass(frozen=True)
class ExponentialScores:
    mu: torch.Tensor  # (B, H, S) mean saliency (``recovery_stats``) = the distribution's mean
    seed: int

    def scores(self, shape: torch.Size) -> torch.Tensor:
        unit = torch.empty(shape, device=self.mu.device).exponential_(generator=_generator(self.seed, self.mu.device))
        return self.mu.float().unsqueeze(-1) * unit

    def nbytes(self) -> int:
        return tensor_bytes(self.mu)


def saliency_moments(saliency: torch.Tensor, kept_mask: torch.Tensor, stats: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token mean and (population) std of the saliency over the pruned channels or over all channels."""
    if stats not in STATS:
        raise ValueError(f"recovery_stats must be one of {STATS}, got {stats!r}")
    if stats == "all":
        return saliency.mean(-1), saliency.std(-1, unbiased=False)
    pruned = ~kept_mask
    mu = mean_pruned_saliency(saliency, kept_mask)
    var = ((saliency - mu.unsqueeze(-1)).pow(2) * pruned).sum(-1) / pruned.sum(-1).clamp(min=1)
    return mu, var.sqrt()


def build_sampler(mode: str, saliency: torch.Tensor, kept_mask: torch.Tensor, dtype: torch.dtype, seed: int,
                  stats: str = "pruned"):
    if mode == "degenerate":
        return DegenerateScores(mean_pruned_saliency(saliency, kept_mask).to(dtype))
    mu, sigma = saliency_moments(saliency, kept_mask, stats)
    if mode == "gaussian":
        return GaussianScores(mu.to(dtype), sigma.to(dtype), seed)
    if mode == "exponential":
        return ExponentialScores(mu.to(dtype), seed)
    raise ValueError(f"recovery must be one of {SAMPLED} for a sampled recovery, got {mode!r}")


# ---- key mappings -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SignedKey:
    query_norm: torch.Tensor  # (B, H, D) float32 ‖q_c‖₂ over the window (group-averaged queries)
    sign_bits: torch.Tensor   # flat packed bits, 1 = original key entry > 0, one per pruned entry (row-major)
    n_signs: int

    @classmethod
    def build(cls, keys: torch.Tensor, kept_mask: torch.Tensor, query_norm: torch.Tensor) -> "SignedKey":
        signs = masked_entries(keys > 0, ~kept_mask)
        return cls(query_norm=query_norm, sign_bits=pack_bits(signs), n_signs=signs.numel())

    def keys(self, scores: torch.Tensor, kept_mask: torch.Tensor) -> torch.Tensor:
        magnitude = torch.sqrt(scores.clamp(min=0) / self.query_norm.unsqueeze(-2))
        positive = torch.zeros_like(kept_mask).masked_scatter(~kept_mask, unpack_bits(self.sign_bits, self.n_signs))
        return torch.where(positive, magnitude, -magnitude)

    def nbytes(self) -> int:
        return tensor_bytes(self.query_norm, self.sign_bits)


@dataclass(frozen=True)
class AlignedKey:
    mean_query: torch.Tensor  # (B, H, D) float32 mean window query q̄

    def keys(self, scores: torch.Tensor, kept_mask: torch.Tensor) -> torch.Tensor:
        q = self.mean_query.unsqueeze(-2)
        return torch.where(q == 0, torch.zeros_like(scores), scores / torch.where(q == 0, torch.ones_like(q), q))

    def nbytes(self) -> int:
        return tensor_bytes(self.mean_query)


@dataclass(frozen=True)
class SampledRecovery:
    """𝓕(μ, σ) = key entry whose score with the window query is a sample of the cached distribution (Eq. 8)."""

    sampler: DegenerateScores | GaussianScores | ExponentialScores
    mapping: SignedKey | AlignedKey

    def fill(self, kept_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.mapping.keys(self.sampler.scores(kept_mask.shape), kept_mask).to(dtype)

    def kernel_terms(self) -> KernelTerms | str:
        """Degenerate recovery folds into per-token work: ``μ_t·(Σ_c u_c − Σ_{kept} u_c)`` with ``u = q/q̄``
        (paper) or ``sqrt(μ_t)·Σ_{pruned} sign·q_c/sqrt(‖q_c‖)`` (official). Sampled ones draw per entry."""
        if not isinstance(self.sampler, DegenerateScores):
            return f"{type(self.sampler).__name__} draws a random score per pruned entry"
        if isinstance(self.mapping, SignedKey):
            return KernelTerms("signed", aux_scale=self.mapping.query_norm.float().rsqrt(), mu=self.sampler.mu,
                               sign_bits=self.mapping.sign_bits, n_signs=self.mapping.n_signs)
        q_bar = self.mapping.mean_query.float()
        scale = torch.where(q_bar == 0, torch.zeros_like(q_bar), 1 / torch.where(q_bar == 0, torch.ones_like(q_bar),
                                                                                  q_bar))
        return KernelTerms("aligned", aux_scale=scale, mu=self.sampler.mu)

    def nbytes(self) -> int:
        return self.sampler.nbytes() + self.mapping.nbytes()


@dataclass(frozen=True)
class TokenFill:
    """Pruned entries of token ``t`` read as ``values[..., t]`` (one number per token and head: the official fork's
    value refill with the mean of the token's pruned values)."""

    values: torch.Tensor  # (B, H, S)

    def fill(self, kept_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.values.to(dtype).unsqueeze(-1).expand(kept_mask.shape).clone()

    def kernel_terms(self) -> str:
        return "TokenFill refills values (no compact key path)"

    def nbytes(self) -> int:
        return tensor_bytes(self.values)


@dataclass(frozen=True)
class ConstantFill:
    """Pruned entries read as ``value`` (0 for zero-fill / unrecovered, 0.01 for the paper's constant)."""

    value: float = 0.0

    def fill(self, kept_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.full(kept_mask.shape, self.value, dtype=dtype, device=kept_mask.device)

    def kernel_terms(self) -> KernelTerms:
        """``value · (Σ_c q_c − Σ_{kept} q_c)``."""
        return KernelTerms("constant", fill=self.value)

    def nbytes(self) -> int:
        return 0
