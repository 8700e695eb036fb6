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
from spark_bench.methods.base import EvictionMethod, TokenSelection, resolve_budget, top_tokens


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


def group_mean(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Average ``(B, H_q, ...)`` over the query heads of each kv-head group (GQA) → ``(B, H_kv, ...)``."""
    b, hq = x.shape[:2]
    return x.view(b, num_kv_heads, hq // num_kv_heads, *x.shape[2:]).mean(dim=2)


@dataclass(frozen=True)
class SnapKV(EvictionMethod):
    budget: float
    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    rounding: str = "exact"  # fraction budgets: resolve_budget's rounding (PyramidKV keeps its own rule)

    def __post_init__(self):
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"snapkv pooling must be 'max' or 'avg', got {self.pooling!r}")

    def token_scores(self, layer: LayerPrefill) -> torch.Tensor:
        """Importance of each pre-window token per kv-head: ``(B, H_kv, S - W)``. They do not depend on the budget,
        so SnapKV / PyramidKV / AdaSnapKV configs of a sweep with the same window and pooling compute them once per
        layer and sample (``layer.memo``)."""
        w = min(self.window_size, layer.keys.shape[-2])
        key = ("snapkv_scores", w, self.kernel_size, self.pooling)
        if key not in layer.memo:
            layer.memo[key] = self._token_scores(layer, w)
        return layer.memo[key]

    def _token_scores(self, layer: LayerPrefill, w: int) -> torch.Tensor:
        attn = window_attention(layer, w)[..., :-w].mean(dim=-2)  # (B, H_q, S - W)
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        b, hq, n = attn.shape
        attn = pool(attn.reshape(b * hq, 1, n), kernel_size=self.kernel_size, stride=1,
                    padding=self.kernel_size // 2).reshape(b, hq, n)
        return group_mean(attn, layer.num_kv_heads)

    def layer_budget(self, prompt_length: int, layer_idx: int, num_layers: int) -> int:
        """Tokens this layer keeps (the same for every layer; PyramidKV overrides this)."""
        return resolve_budget(self.budget, prompt_length, self.rounding)

    def stored_tokens(self, prompt_length: int, layer_idx: int, num_layers: int, num_kv_heads: int) -> int:
        """This layer's budget (PyramidKV: its ramp or fallback), at least the window, at most the prompt."""
        n = self.layer_budget(prompt_length, layer_idx, num_layers)
        return prompt_length if n >= prompt_length else max(n, min(self.window_size, prompt_length))

    def keeps_whole(self, length: int, layer_idx: int, num_layers: int) -> bool:
        """The layer's budget covers the part, or the part is no longer than the observation window (which is
        always kept: no token before it to score)."""
        return length <= self.window_size or self.layer_budget(length, layer_idx, num_layers) >= length

    def select(self, layer: LayerPrefill, layer_idx: int, num_layers: int) -> TokenSelection | None:
        s = layer.keys.shape[-2]
        if self.keeps_whole(s, layer_idx, num_layers):
            return None
        n_keep = self.layer_budget(s, layer_idx, num_layers)
        w = self.window_size
        if n_keep < w:
            if self.budget >= 1:  # a token budget below the window is a config error (also caught at start-up)
                raise ValueError(f"{type(self).__name__.lower()} budget {n_keep} tokens is smaller than the "
                                 f"observation window {w}")
            n_keep = w  # a fraction of a short prompt: keep just the window
        return top_tokens(self.token_scores(layer), n_keep, torch.arange(s - w, s, device=layer.keys.device))
