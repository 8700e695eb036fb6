"""ExpectedAttention (Devoto et al., kvpress): keep the tokens future queries are expected to attend to.

Reference behaviour (kvpress ``ExpectedAttentionPress``): model the next ``n_future_positions`` (512) queries as a
Gaussian with the mean ``μ`` and covariance ``Σ`` of the prompt's queries (sink tokens excluded), rotated by the
RoPE rotation averaged over those future positions. A key's expected logit is ``μ·k/√d + kᵀΣk/(2d)``; the softmax
over the prompt, averaged over each kv-head's query heads and multiplied by ``‖v‖₂``, is the score. The first
``n_sink`` (4) tokens are always kept. The statistics are captured once at prefill
(:func:`spark_bench.engine.prefill.run_prefill` with ``query_stats``); unlike kvpress, they are computed from the
actual queries (``q_norm`` included), so Qwen3 works too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.base import EvictionMethod, TokenSelection, resolve_budget, top_tokens
from spark_bench.methods.eviction.snapkv import group_mean

N_SINK = 4
N_FUTURE_POSITIONS = 512


@dataclass(frozen=True)
class ExpectedAttention(EvictionMethod):
    budget: float
    rounding: str = "exact"  # fraction budgets: resolve_budget's rounding (budget_rounding)
    n_sink: int = N_SINK
    use_covariance: bool = True
    use_vnorm: bool = True

    needs_query_stats = True

    def token_scores(self, layer: LayerPrefill) -> torch.Tensor:
        """``(B, H_kv, S − n_sink)`` scores of the non-sink tokens."""
        if layer.query_mean is None:
            raise ValueError("expected_attention needs the prefill's query statistics (run_prefill(query_stats=...))")
        keys = layer.keys[:, :, self.n_sink:].float()
        values = layer.values[:, :, self.n_sink:].float()
        b, h, s, d = keys.shape
        k = keys.repeat_interleave(layer.query_mean.shape[1] // h, dim=1)  # (B, H_q, S, D)
        logits = torch.einsum("bhd,bhsd->bhs", layer.query_mean, k) / math.sqrt(d)
        if self.use_covariance:
            logits = logits + torch.einsum("bhsi,bhij,bhsj->bhs", k, layer.query_cov, k) / d / 2
        scores = group_mean(logits.softmax(dim=-1), h)
        return scores * values.norm(dim=-1) if self.use_vnorm else scores

    def stored_tokens(self, prompt_length: int, layer_idx: int, num_layers: int, num_kv_heads: int) -> int:
        """The budget, at least the sinks and one more token, at most the prompt."""
        n = super().stored_tokens(prompt_length, layer_idx, num_layers, num_kv_heads)
        return n if n >= prompt_length else max(n, min(self.n_sink + 1, prompt_length))

    def keeps_whole(self, length: int, layer_idx: int, num_layers: int) -> bool:
        """The budget covers the part, or the part is no longer than the sinks and one more token."""
        return length <= self.n_sink + 1 or super().keeps_whole(length, layer_idx, num_layers)

    def select(self, layer: LayerPrefill, layer_idx: int, num_layers: int) -> TokenSelection | None:
        s = layer.keys.shape[-2]
        if self.keeps_whole(s, layer_idx, num_layers):
            return None
        n_keep = resolve_budget(self.budget, s, self.rounding)
        if n_keep <= self.n_sink:
            if self.budget >= 1:
                raise ValueError(f"expected_attention budget {n_keep} tokens must exceed n_sink={self.n_sink}")
            n_keep = self.n_sink + 1  # a fraction of a short prompt: the sinks and the last token
        sinks = torch.arange(self.n_sink, device=layer.keys.device)
        return top_tokens(self.token_scores(layer), n_keep, forced=sinks, offset=self.n_sink)
