"""ThinK (Xu et al., 2024): structured key-channel pruning, one channel subset per head.

Reference behaviour (ThinK official code; the kvpress ``ThinKPress`` used by the SparK fork computes the same
score): per kv-head and channel ``c``, ``score_c = mean_window(q_c²) · mean_tokens(k_c²)`` where the window queries
are averaged over the query heads of the group (GQA). The ``int(λ·D)`` lowest-scoring channels are pruned for
every older token; with ``keep_window`` (ThinK default) the most recent ``window_size`` tokens keep all channels.
Pruned channels read as zero at attention time, which equals pruning the query channels to match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.base import ChannelMethod
from spark_bench.storage.stores import StructuredKeyStore, channel_index_dtype


@dataclass(frozen=True)
class ThinK(ChannelMethod):
    ratio: float
    window_size: int = 32
    keep_window: bool = True
    score_dtype: str = "float32"  # or "model": the arithmetic in the keys' dtype, as the official code

    def channel_scores(self, old_keys: torch.Tensor, layer: LayerPrefill) -> torch.Tensor:
        """``(B, H_kv, D)`` channel importance (float32)."""
        q = layer.window_queries[:, :, -self.window_size:]
        k = old_keys if self.score_dtype == "model" else old_keys.float()
        q = q.to(k.dtype)
        b, hq, _, d = q.shape
        h_kv = layer.num_kv_heads
        q_energy = q.pow(2).mean(dim=2).view(b, h_kv, hq // h_kv, d).mean(dim=2)
        return (q_energy * k.pow(2).mean(dim=2)).float()

    def compress_keys(self, keys: torch.Tensor, layer: LayerPrefill, layer_idx: int = 0) -> StructuredKeyStore:
        s, d = keys.shape[-2], keys.shape[-1]
        n_recent = min(self.window_size, s) if self.keep_window else 0
        old, recent = keys[..., : s - n_recent, :], keys[..., s - n_recent:, :]
        n_keep = d - int(self.ratio * d)
        if old.shape[-2] == 0:
            channels = torch.arange(d, device=keys.device).expand(*keys.shape[:2], d)
        else:
            channels = self.channel_scores(old, layer).topk(n_keep, dim=-1, sorted=False).indices.sort(dim=-1).values
        channels = channels[..., :n_keep]
        index = channels.unsqueeze(-2).expand(*old.shape[:-1], n_keep)
        return StructuredKeyStore(kept=old.gather(-1, index), channels=channels.to(channel_index_dtype(d)),
                                  recent=recent, head_dim=d)
