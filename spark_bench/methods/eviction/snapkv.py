"""SnapKV (Li et al., 2024): keep the prompt tokens the observation window attends to most.

Reference behaviour (SnapKV / kvpress, settings of the SparK paper Appendix C): the last ``window_size`` (32)
prompt queries attend to all prompt keys (causal inside the window); their softmax weights on the pre-window
tokens are averaged over the window, smoothed with a 1-D pooling of ``kernel_size`` (7, max pooling), averaged
over the query heads of each kv-head group (GQA), and the top ``budget - window_size`` tokens are kept per
kv-head together with the whole window, which is always kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.base import EvictionMethod


def resolve_budget(budget: float, prompt_length: int) -> int:
    """KV budget in tokens: an integer ≥ 1 is a token count, a value in (0, 1) a fraction of the prompt."""
    if budget <= 0:
        raise ValueError(f"budget must be > 0 (tokens, or a fraction in (0, 1)), got {budget}")
    n = int(prompt_length * budget) if budget < 1 else int(budget)
    return min(n, prompt_length)


def window_attention(layer: LayerPrefill, window_size: int) -> torch.Tensor:
    """Softmax attention of the last ``window_size`` queries over all prompt keys: ``(B, H_q, W, S)``."""
    q = layer.window_queries[:, :, -window_size:].float()
    keys = layer.keys.float()
    b, hq, w, d = q.shape
    s = keys.shape[-2]
    k = keys.repeat_interleave(hq // keys.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    # causal mask inside the window: window query i sits at position s - w + i
    future = torch.ones(w, w, dtype=torch.bool, device=q.device).triu(1)
    logits[..., s - w:] = logits[..., s - w:].masked_fill(future, float("-inf"))
    return logits.softmax(dim=-1)


@dataclass(frozen=True)
class SnapKV(EvictionMethod):
    budget: float
    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"

    def __post_init__(self):
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"snapkv pooling must be 'max' or 'avg', got {self.pooling!r}")

    def token_scores(self, layer: LayerPrefill) -> torch.Tensor:
        """Importance of each pre-window token per kv-head: ``(B, H_kv, S - W)``."""
        w = min(self.window_size, layer.keys.shape[-2])
        attn = window_attention(layer, w)[..., :-w].mean(dim=-2)  # (B, H_q, S - W)
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        b, hq, n = attn.shape
        attn = pool(attn.reshape(b * hq, 1, n), kernel_size=self.kernel_size, stride=1,
                    padding=self.kernel_size // 2).reshape(b, hq, n)
        h_kv = layer.num_kv_heads
        return attn.view(b, h_kv, hq // h_kv, n).mean(dim=2)

    def keep_indices(self, layer: LayerPrefill, layer_idx: int, num_layers: int) -> torch.Tensor | None:
        s = layer.keys.shape[-2]
        n_keep = resolve_budget(self.budget, s)
        w = min(self.window_size, s)
        if n_keep >= s:
            return None
        if n_keep < w:
            raise ValueError(f"snapkv budget {n_keep} tokens is smaller than the observation window {w}")
        scores = self.token_scores(layer)
        top = scores.topk(n_keep - w, dim=-1).indices
        b, h, _ = top.shape
        window = torch.arange(s - w, s, device=top.device).expand(b, h, w)
        return torch.cat([top, window], dim=-1).sort(dim=-1).values
