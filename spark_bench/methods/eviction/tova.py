"""TOVA (Oren et al., 2024): keep the tokens the last prompt token attends to most.

Reference behaviour (kvpress ``TOVAPress``, used by the official SparK code): the softmax attention of the last
prompt query over all earlier tokens, averaged over *all* query heads, gives one score per token; every kv-head of
the layer keeps the same top tokens. The last token itself is always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.base import EvictionMethod, TokenSelection, resolve_budget, top_tokens
from spark_bench.methods.eviction.snapkv import window_attention


@dataclass(frozen=True)
class TOVA(EvictionMethod):
    budget: float
    rounding: str = "exact"  # fraction budgets: resolve_budget's rounding (budget_rounding)

    def stored_tokens(self, prompt_length: int, layer_idx: int, num_layers: int, num_kv_heads: int) -> int:
        """The budget, at least the last token, at most the prompt."""
        return min(max(resolve_budget(self.budget, prompt_length, self.rounding), 1), prompt_length)

    def keeps_whole(self, length: int, layer_idx: int, num_layers: int) -> bool:
        """The budget covers the part, or the part is its last token alone."""
        return length <= 1 or super().keeps_whole(length, layer_idx, num_layers)

    def select(self, layer: LayerPrefill, layer_idx: int, num_layers: int) -> TokenSelection | None:
        b, h, s, _ = layer.keys.shape
        if self.keeps_whole(s, layer_idx, num_layers):
            return None
        n_keep = max(resolve_budget(self.budget, s, self.rounding), 1)  # a fraction of a short part: the last token
        scores = window_attention(layer, 1)[..., 0, :-1].mean(dim=1, keepdim=True).expand(b, h, s - 1)
        return top_tokens(scores, n_keep, torch.tensor([s - 1], device=layer.keys.device))
