"""SparK (paper §4): unstructured, query-aware key-channel pruning with recovery.

Per token ``t`` and kv-head, the saliency of channel ``c`` is (``saliency=``):

* ``official`` (default; the official code that produced the paper's tables): ``w_tc = k_tc² · ‖q_c‖₂`` with
  ``‖q_c‖₂`` the L2 norm over the observation window of the group-averaged window queries; the
  ``int(λ·D)`` lowest channels are pruned, i.e. ``T = D − int(λ·D)`` are kept.
* ``paper`` (Eq. 6 and §4.3): ``w_tc = |q̄_c| · |k_tc|`` with ``q̄`` the mean window query;
  ``T = ⌊(1 − λ)·D⌋`` channels are kept.

Which channels each token keeps (``variant=``, §5.5):

* ``fixed``: the top-``T`` channels (Eq. 7).
* ``top_p`` (SparK-p): the fewest channels whose saliency covers a fraction ``top_p`` (0.99) of the token's total.
* ``group`` (SparK-g): the token's channels sorted by saliency are cut into ``groups`` equal segments; the least
  salient segment gets the largest pruning ratio (g=4: 1.0/0.75/0.5/0.25, g=5: 0.9/0.7/0.5/0.3/0.1 from least to
  most salient) and each segment drops its own least salient channels (the paper's text).
* ``group_fork`` (SparK-g as the official code runs it, ``threshold_ratio=0.99`` → ``dynamic_group``): per token,
  ``n*`` is the 0-based rank at which the saliency sorted high to low first passes ``top_p`` (0.99) of the token's
  total; the token falls in bucket 0…4 by ``n* ≤ int(0.2·D) / ≤ int(0.4·D) / ≤ int(0.6·D) / ≤ int(0.8·D) / above``
  and keeps its top ``int(0.1·D) / int(0.3·D) / int(0.5·D) / int(0.7·D) / int(0.9·D)`` channels; the grouped
  recovery (``exponential_attn_grouped`` with averaging) is the degenerate one with μ over the token's pruned
  channels, i.e. ``recovery=degenerate``. ``groups`` is not used. But the official ``eval.py`` never sets
  ``pooling_ratio`` for SparK-g (an ``elif`` after ``threshold_ratio``), so what its runs — the paper's SparK-g row
  — computed is ``keys * mask``: pruned entries read as zeros. ``group_fork_fill`` (set by the protocol) picks:
  ``zero`` (``protocol=official``, the default of the runs) or ``recovery`` (``protocol=paper``: the ``recovery``
  option, degenerate by default).

Pruned entries are refilled at attention time by the recovery function (``recovery=``, see :mod:`.recovery`, and
:mod:`.fork_recovery` for the official code's own distribution draws).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.base import ChannelMethod
from spark_bench.methods.channel.fork_recovery import FORK_MODES, build_fork_recovery
from spark_bench.methods.channel.recovery import (
    RECOVERY_MODES, STATS, AlignedKey, ConstantFill, DegenerateScores, SampledRecovery, SignedKey, build_sampler,
    pool0_mean_saliency,
)
from spark_bench.storage.bits import pack_bits, unpack_bits
from spark_bench.storage.stores import UnstructuredStore

SALIENCY_MODES = ("official", "paper")
SALIENCY_DTYPES = ("float32", "model")  # saliency arithmetic: float32, or the keys' dtype as the official code
VARIANTS = ("fixed", "top_p", "group", "group_fork")
GROUP_FORK_FILLS = ("recovery", "zero")  # group_fork's refill: the recovery option (paper) or zeros (official runs)
GROUP_RATIOS = {4: (0.25, 0.5, 0.75, 1.0), 5: (0.1, 0.3, 0.5, 0.7, 0.9)}  # paper §5.5, most → least salient
FORK_BUCKETS = (0.2, 0.4, 0.6, 0.8)       # dynamic_group: n* bounds, fractions of D (inclusive)
FORK_KEEP = (0.1, 0.3, 0.5, 0.7, 0.9)     # … and the fraction of D each bucket keeps


def fork_group_keep(sorted_saliency: torch.Tensor, threshold: float = 0.99) -> torch.Tensor:
    """Channels each token keeps under ``variant=group_fork`` (``(…, 1)`` long), from its saliency sorted high to
    low: the bucket of ``n*`` (first rank whose cumulative share passes ``threshold``) picks the keep count."""
    d = sorted_saliency.shape[-1]
    cumulative = sorted_saliency.cumsum(-1)
    n_star = (cumulative > threshold * cumulative[..., -1:]).float().argmax(-1, keepdim=True)
    bucket = sum((n_star > int(f * d)).long() for f in FORK_BUCKETS)
    keep = torch.tensor([int(f * d) for f in FORK_KEEP], device=sorted_saliency.device)
    return keep[bucket]


def group_keep_by_rank(head_dim: int, groups: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``(D,)`` over saliency ranks (0 = most salient): which ranks SparK-g keeps, made on ``device``."""
    ratios = GROUP_RATIOS[groups]
    keep = torch.zeros(head_dim, dtype=torch.bool, device=device)
    bounds = [round(i * head_dim / groups) for i in range(groups + 1)]
    for ratio, start, end in zip(ratios, bounds[:-1], bounds[1:]):
        n = end - start
        keep[start:start + n - int(ratio * n)] = True  # the segment's most salient channels survive
    return keep


@dataclass(frozen=True)
class SparK(ChannelMethod):
    ratio: float
    window_size: int = 32
    saliency: str = "official"
    recovery: str = "degenerate"
    variant: str = "fixed"
    top_p: float = 0.99
    groups: int = 4
    constant: float = 0.01
    seed: int = 0
    recovery_stats: str = "pruned"
    saliency_dtype: str = "float32"

    def __post_init__(self):
        if self.saliency not in SALIENCY_MODES:
            raise ValueError(f"saliency must be one of {SALIENCY_MODES}, got {self.saliency!r}")
        if self.recovery not in RECOVERY_MODES:
            raise ValueError(f"recovery must be one of {RECOVERY_MODES}, got {self.recovery!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.groups not in GROUP_RATIOS:
            raise ValueError(f"groups must be one of {sorted(GROUP_RATIOS)}, got {self.groups}")
        if self.recovery_stats not in STATS:
            raise ValueError(f"recovery_stats must be one of {STATS}, got {self.recovery_stats!r}")
        if self.saliency_dtype not in SALIENCY_DTYPES:
            raise ValueError(f"saliency_dtype must be one of {SALIENCY_DTYPES}, got {self.saliency_dtype!r}")
        if (self.recovery in FORK_MODES or self.recovery == "fork_pool0") and self.saliency != "official":
            raise ValueError(f"recovery={self.recovery} is the official code's and inverts its saliency k²·‖q‖; "
                             "it needs saliency=official")

    def n_keep(self, head_dim: int) -> int:
        if self.saliency == "official":
            return head_dim - int(self.ratio * head_dim)
        return math.floor((1 - self.ratio) * head_dim + 1e-9)

    def query_stat(self, layer: LayerPrefill) -> torch.Tensor:
        """Per-head channel statistic of the window queries, ``(B, H_kv, D)`` float32 (computed in the model dtype
        under ``saliency_dtype=model``, as the official code does, then widened)."""
        q = layer.grouped_window_queries(self.window_size)
        q = q if self.saliency_dtype == "model" else q.float()
        return (q.norm(dim=-2) if self.saliency == "official" else q.mean(dim=-2)).float()

    def saliency_scores(self, keys: torch.Tensor, query_stat: torch.Tensor) -> torch.Tensor:
        """``(B, H, S, D)`` float32 saliency; ``saliency_dtype=model`` rounds the arithmetic to the keys' dtype (the
        official code scores bf16 keys in bf16, which reorders near-equal channels)."""
        k = keys if self.saliency_dtype == "model" else keys.float()
        stat = query_stat.to(k.dtype).unsqueeze(-2)
        if self.saliency == "official":
            return (k.pow(2) * stat).float()
        return (k.abs() * stat.abs()).float()

    def kept_mask(self, saliency: torch.Tensor) -> torch.Tensor:
        d = saliency.shape[-1]
        if self.variant == "fixed":
            top = saliency.topk(self.n_keep(d), dim=-1, sorted=False).indices  # only the set is used
            return torch.zeros_like(saliency, dtype=torch.bool).scatter_(-1, top, True)
        order = saliency.argsort(dim=-1, descending=True)
        if self.variant == "top_p":
            sorted_sal = saliency.gather(-1, order)
            share = sorted_sal.cumsum(-1) / sorted_sal.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
            n_keep = ((share < self.top_p).sum(-1, keepdim=True) + 1).clamp(max=d)  # fewest covering top_p
            keep_sorted = torch.arange(d, device=saliency.device) < n_keep
        elif self.variant == "group_fork":
            n_keep = fork_group_keep(saliency.gather(-1, order), self.top_p)
            keep_sorted = torch.arange(d, device=saliency.device) < n_keep
        else:
            keep_sorted = group_keep_by_rank(d, self.groups, saliency.device).expand_as(saliency)
        return torch.zeros_like(saliency, dtype=torch.bool).scatter_(-1, order, keep_sorted)

    def build_recovery(self, keys, mask, saliency, stat, seed: int):
        if self.recovery in ("zero", "none"):
            return ConstantFill(0.0)
        if self.recovery == "constant":
            return ConstantFill(self.constant)
        if self.recovery in FORK_MODES:
            return build_fork_recovery(self.recovery, keys, mask, saliency, stat, seed)
        if self.recovery == "fork_pool0":
            mu = pool0_mean_saliency(saliency, max(1, int(self.ratio * keys.shape[-1])))
            return SampledRecovery(DegenerateScores(mu.to(keys.dtype)), SignedKey.build(keys, mask, stat))
        sampler = build_sampler(self.recovery, saliency, mask, keys.dtype, seed, self.recovery_stats)
        mapping = SignedKey.build(keys, mask, stat) if self.saliency == "official" else AlignedKey(stat)
        return SampledRecovery(sampler, mapping)

    def shared_mask(self, keys: torch.Tensor, saliency: torch.Tensor, layer: LayerPrefill) -> torch.Tensor:
        """:meth:`kept_mask`, computed once per sample for the configs that prune the same evicted keys with the
        same saliency and keep rule (e.g. one ratio under several recoveries): kept in ``layer.memo`` as packed
        bits next to the keys it was computed from (a hit needs those very keys)."""
        key = ("spark_mask", id(keys), self.saliency, self.saliency_dtype, self.window_size, self.variant,
               self.n_keep(keys.shape[-1]) if self.variant == "fixed" else (self.ratio, self.top_p, self.groups))
        hit = layer.memo.get(key)
        if hit is not None and hit[0] is keys:
            return unpack_bits(hit[1], keys.shape[-1])
        mask = self.kept_mask(saliency)
        layer.memo[key] = (keys, pack_bits(mask))
        return mask

    def compress_keys(self, keys: torch.Tensor, layer: LayerPrefill, layer_idx: int = 0) -> UnstructuredStore:
        stat = self.query_stat(layer)
        saliency = self.saliency_scores(keys, stat)
        mask = self.shared_mask(keys, saliency, layer)
        recovery = self.build_recovery(keys, mask, saliency, stat, seed=self.seed * 100_003 + layer_idx)
        return UnstructuredStore.from_mask(keys, mask, recovery)
