"""AdaSnapKV (Feng et al., 2024, AdaKV over SnapKV scores): head-wise budget allocation inside each layer.

Reference behaviour (kvpress ``AdaKVPress(SnapKVPress)``): the layer's pre-window budget ``H·(B − W)`` is spent on
the highest SnapKV scores across all kv-heads at once, so heads with concentrated attention give tokens to heads
with diffuse attention; a safeguard first reserves each head's top ``int(α·(B − W))`` tokens (``α = 0.2``). The
window is always kept. ``safeguard=spark_fork`` reserves ``max(int(α·B) − W, 0)`` tokens per head instead, as the
official SparK fork computes it (none at all at B=128). Heads end up with different lengths: they are padded to the longest and the padding is
masked at attention time (:class:`~spark_bench.methods.base.TokenSelection`); the padding is real memory and is
counted in the cache bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.base import TokenSelection, resolve_budget
from spark_bench.methods.eviction.snapkv import SnapKV


SAFEGUARDS = ("kvpress", "spark_fork")


def safeguard_tokens(mode: str, alpha: float, budget: int, window: int) -> int:
    """Tokens each head keeps before the cross-head competition (see the module docstring)."""
    if mode == "kvpress":
        return int((budget - window) * alpha)
    if mode == "spark_fork":
        return max(int(alpha * budget) - window, 0)
    raise ValueError(f"ada_safeguard must be one of {', '.join(SAFEGUARDS)}, got {mode!r}")


@dataclass(frozen=True)
class AdaSnapKV(SnapKV):
    alpha_safeguard: float = 0.2
    safeguard: str = "kvpress"

    def __post_init__(self):
        super().__post_init__()
        safeguard_tokens(self.safeguard, self.alpha_safeguard, 1, 0)  # unknown modes fail here, at construction

    def stored_tokens(self, prompt_length: int, layer_idx: int, num_layers: int, num_kv_heads: int) -> int:
        """An upper bound (the heads' split is data-dependent): every head is padded to the longest, which at most
        takes the whole pre-window budget of the layer but every other head's reserve, and never more than the
        prompt."""
        s, w = prompt_length, min(self.window_size, prompt_length)
        n = resolve_budget(self.budget, s, self.rounding)
        if n >= s:
            return s
        n = max(n, w)
        safe = safeguard_tokens(self.safeguard, self.alpha_safeguard, n, w)
        return w + min(s - w, num_kv_heads * (n - w) - (num_kv_heads - 1) * safe)

    def select(self, layer: LayerPrefill, layer_idx: int, num_layers: int) -> TokenSelection | None:
        b, h, s, _ = layer.keys.shape
        if self.keeps_whole(s, layer_idx, num_layers):  # within the budget, or no longer than the window
            return None
        n_keep = resolve_budget(self.budget, s, self.rounding)
        w = self.window_size
        if n_keep < w:
            if self.budget >= 1:
                raise ValueError(f"adasnapkv budget {n_keep} tokens is smaller than the observation window {w}")
            n_keep = w  # a fraction of a short prompt: keep just the window
        scores = self.token_scores(layer)  # (B, H, S − W)
        per_head, n_scored = n_keep - w, s - w
        safe = scores.topk(safeguard_tokens(self.safeguard, self.alpha_safeguard, n_keep, w), dim=-1,
                           sorted=False).indices
        scores = scores.scatter(-1, safe, float("inf"))
        chosen = scores.reshape(b, -1).topk(h * per_head, dim=-1, sorted=False).indices
        selected = torch.zeros(b, h * n_scored, dtype=torch.bool, device=scores.device)
        selected = selected.scatter_(-1, chosen, True).view(b, h, n_scored)
        n_max = int(selected.sum(-1).max())
        # selected positions first (ascending), then padding
        position = torch.arange(n_scored, device=scores.device).expand(b, h, n_scored)
        order = torch.where(selected, position, position + n_scored).sort(dim=-1).values[..., :n_max]
        valid = order < n_scored
        indices = torch.where(valid, order, torch.zeros_like(order))
        window = torch.arange(n_scored, s, device=scores.device).expand(b, h, w)
        return TokenSelection(torch.cat([indices, window], dim=-1),
                              torch.cat([valid, torch.ones_like(window, dtype=torch.bool)], dim=-1))
