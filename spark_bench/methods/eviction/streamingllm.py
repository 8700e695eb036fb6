"""StreamingLLM (Xiao et al., 2024): keep the first ``n_sink`` attention-sink tokens and the most recent ones.

Reference behaviour (kvpress ``StreamingLLMPress``, used by the official SparK code): ``n_sink = 4``, the rest of
the budget goes to the most recent prompt tokens; the selection is the same for every layer and head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.base import EvictionMethod, TokenSelection, resolve_budget


@dataclass(frozen=True)
class StreamingLLM(EvictionMethod):
    budget: float
    rounding: str = "exact"  # fraction budgets: resolve_budget's rounding (budget_rounding)
    n_sink: int = 4

    def stored_tokens(self, prompt_length: int, layer_idx: int, num_layers: int, num_kv_heads: int) -> int:
        """The budget, at least the sinks and one more token, at most the prompt."""
        n = super().stored_tokens(prompt_length, layer_idx, num_layers, num_kv_heads)
        return n if n >= prompt_length else max(n, min(self.n_sink + 1, prompt_length))

    def keeps_whole(self, length: int, layer_idx: int, num_layers: int) -> bool:
        """The budget covers the part, or the part is no longer than the sinks and one recent token."""
        return length <= self.n_sink + 1 or super().keeps_whole(length, layer_idx, num_layers)

    def select(self, layer: LayerPrefill, layer_idx: int, num_layers: int) -> TokenSelection | None:
        b, h, s, _ = layer.keys.shape
        if self.keeps_whole(s, layer_idx, num_layers):
            return None
        n_keep = resolve_budget(self.budget, s, self.rounding)
        if n_keep <= self.n_sink:
            if self.budget >= 1:
                raise ValueError(f"streamingllm budget {n_keep} tokens must exceed n_sink={self.n_sink}")
            n_keep = self.n_sink + 1  # a fraction of a short prompt: the sinks and the last token
        device = layer.keys.device
        idx = torch.cat([torch.arange(self.n_sink, device=device),
                         torch.arange(s - (n_keep - self.n_sink), s, device=device)])
        return TokenSelection(idx.expand(b, h, n_keep))
