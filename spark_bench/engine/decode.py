"""Greedy decoding through the model's own forward pass, several compressed caches at once.

Every method config of a sample is one *row*: one model forward per step serves all rows still generating
(:class:`~spark_bench.engine.cache.BatchedCache`), each row attending over its own compressed stores. Rows leave the
batch when they stop (a stop token, their own ``max_new_tokens``). Because a row's arithmetic does not depend on the
other rows, batched decoding gives the tokens of one-row-at-a-time decoding (``decode_batch=1``), which tests check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from spark_bench.engine.attention import compressed_attention_enabled
from spark_bench.engine.cache import BatchedCache, CompressedCache


def pick(logits: torch.Tensor, banned: frozenset[int] | set[int] = frozenset()) -> int:
    """Greedy choice, never one of ``banned`` (used for ``min_new_tokens``, like transformers' min_length)."""
    if banned:
        logits = logits.clone()
        logits[list(banned)] = float("-inf")
    return int(logits.argmax())


@dataclass
class DecodeRow:
    """One sequence to continue: its compressed cache, the logits of its next token, its next position.

    Positions continue from the original prompt length even when eviction shortened the cache, so RoPE phases
    match the uncompressed model (as in kvpress / the official SparK code). Stop tokens are not returned; the first
    ``min_new_tokens`` tokens are never stop tokens.
    """

    cache: CompressedCache
    first_logits: torch.Tensor
    position: int
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    min_new_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    forward_s: float = 0.0  # this row's share of the batched forward passes (seconds)

    def choose(self, logits: torch.Tensor) -> int:
        return pick(logits, self.stop_token_ids if len(self.tokens) < self.min_new_tokens else frozenset())


def _step_rows(rows: list[DecodeRow], pending: list[int]) -> list[int]:
    """Append each pending token; return the indices of rows that need another forward pass."""
    going = []
    for i, (row, token) in enumerate(zip(rows, pending)):
        if token in row.stop_token_ids:
            continue
        row.tokens.append(token)
        if len(row.tokens) < row.max_new_tokens:
            going.append(i)
    return going


@torch.inference_mode()
def decode_rows(model: nn.Module, rows: list[DecodeRow]) -> list[DecodeRow]:
    """Greedy-decode every row together (one forward per step over the rows still generating); fills
    ``row.tokens`` and ``row.forward_s``. Attention reads each row's compressed stores
    (:mod:`spark_bench.engine.attention`)."""
    device = next(model.parameters()).device
    live = _step_rows(rows, [row.choose(row.first_logits) for row in rows])
    if not live:
        return rows
    cache = BatchedCache([rows[i].cache for i in live], capacity=max(rows[i].max_new_tokens for i in live))
    with compressed_attention_enabled(model):
        while live:
            start = time.perf_counter()
            out = model(
                input_ids=torch.tensor([[rows[i].tokens[-1]] for i in live], device=device),
                position_ids=torch.tensor([[rows[i].position + len(rows[i].tokens) - 1] for i in live],
                                          device=device),
                past_key_values=cache,
                compressed_cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1].float()
            pending = [rows[i].choose(logits[j]) for j, i in enumerate(live)]
            elapsed = time.perf_counter() - start
            for i in live:
                rows[i].forward_s += elapsed / len(live)
            going = _step_rows([rows[i] for i in live], pending)
            if len(going) < len(live):
                if going:
                    cache.keep(going)
                live = [live[j] for j in going]
    return rows


def greedy_decode(model: nn.Module, cache: CompressedCache, first_logits: torch.Tensor, prompt_length: int,
                  max_new_tokens: int, stop_token_ids: frozenset[int] | set[int],
                  min_new_tokens: int = 0) -> list[int]:
    """One row on its own (``decode_batch=1``): generate up to ``max_new_tokens`` tokens, the first from
    ``first_logits``."""
    row = DecodeRow(cache, first_logits, prompt_length, max_new_tokens, frozenset(stop_token_ids), min_new_tokens)
    return decode_rows(model, [row])[0].tokens
