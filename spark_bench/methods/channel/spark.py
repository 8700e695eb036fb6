"""SparK (paper §4): unstructured, query-aware key-channel pruning with recovery.

Per token ``t`` and kv-head, the saliency of channel ``c`` is (``saliency=``):

* ``official`` (default; the official code that produced the paper's tables): ``w_tc = k_tc² · ‖q_c‖₂`` with
  ``‖q_c‖₂`` the L2 norm over the observation window of the group-averaged window queries; the
  ``int(λ·D)`` lowest channels are pruned, i.e. ``T = D − int(λ·D)`` are kept.
* ``paper`` (Eq. 6 and §4.3): ``w_tc = |q̄_c| · |k_tc|`` with ``q̄`` the mean window query;
  ``T = ⌊(1 − λ)·D⌋`` channels are kept.

The top-``T`` channels of each token are stored (Eq. 7); pruned entries are refilled at attention time with the
degenerate distribution (``μ_pruned`` per token, Appendix A.2), see :mod:`.recovery`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.base import ChannelMethod
from spark_bench.methods.channel.recovery import DegenerateQueryAligned, DegenerateSigned
from spark_bench.storage.stores import UnstructuredKeyStore

SALIENCY_MODES = ("official", "paper")
RECOVERY_MODES = ("degenerate",)


@dataclass(frozen=True)
class SparK(ChannelMethod):
    ratio: float
    window_size: int = 32
    saliency: str = "official"
    recovery: str = "degenerate"

    def __post_init__(self):
        if self.saliency not in SALIENCY_MODES:
            raise ValueError(f"saliency must be one of {SALIENCY_MODES}, got {self.saliency!r}")
        if self.recovery not in RECOVERY_MODES:
            raise ValueError(f"recovery must be one of {RECOVERY_MODES}, got {self.recovery!r}")

    def n_keep(self, head_dim: int) -> int:
        if self.saliency == "official":
            return head_dim - int(self.ratio * head_dim)
        return math.floor((1 - self.ratio) * head_dim + 1e-9)

    def query_stat(self, layer: LayerPrefill) -> torch.Tensor:
        """Per-head channel statistic of the window queries, ``(B, H_kv, D)`` float32."""
        q = layer.grouped_window_queries(self.window_size).float()
        return q.norm(dim=-2) if self.saliency == "official" else q.mean(dim=-2)

    def saliency_scores(self, keys: torch.Tensor, query_stat: torch.Tensor) -> torch.Tensor:
        k = keys.float()
        if self.saliency == "official":
            return k.pow(2) * query_stat.unsqueeze(-2)
        return k.abs() * query_stat.abs().unsqueeze(-2)

    def kept_mask(self, saliency: torch.Tensor) -> torch.Tensor:
        top = saliency.topk(self.n_keep(saliency.shape[-1]), dim=-1).indices
        return torch.zeros_like(saliency, dtype=torch.bool).scatter_(-1, top, True)

    def compress_keys(self, keys: torch.Tensor, layer: LayerPrefill) -> UnstructuredKeyStore:
        stat = self.query_stat(layer)
        saliency = self.saliency_scores(keys, stat)
        mask = self.kept_mask(saliency)
        build = DegenerateSigned.build if self.saliency == "official" else DegenerateQueryAligned.build
        recovery = build(keys, mask, saliency, stat, keys.dtype)
        return UnstructuredKeyStore.from_mask(keys, mask, recovery)
