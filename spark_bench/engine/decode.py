"""Greedy decoding through the model's own forward pass, several compressed caches at once.

Every method config of a sample is one *row*: one model forward per step serves all rows still generating
(:class:`~spark_bench.engine.cache.BatchedCache`), each row attending over its own compressed stores. Rows leave the
batch when they stop (a stop token, their own ``max_new_tokens``). Because a row's arithmetic does not depend on the
other rows, batched decoding gives the tokens of one-row-at-a-time decoding (``decode_batch=1``), which tests check.

A row may first run a *suffix* through its compressed cache (``compress_scope`` ``question`` / ``context``: the
end of turn, the assistant header, the answer prefix, and under ``context`` the question): one forward over the
suffix tokens of every row (rows with equal suffix lengths batch together), whose last logits give the first answer
token, as the official kvpress pipeline's ``generate_answer`` does. Suffix tokens join the dense decoded tail.
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
    """One sequence to continue: its compressed cache, the logits of its next token (or a ``suffix`` of tokens to run
    through the cache first, whose last logits give it), the position of its next token.

    Positions continue from the original prompt length even when eviction shortened the cache, so RoPE phases
    match the uncompressed model (as in kvpress / the official SparK code). Stop tokens are not returned; the first
    ``min_new_tokens`` tokens are never stop tokens.
    """

    cache: CompressedCache
    first_logits: torch.Tensor | None
    position: int
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    min_new_tokens: int = 0
    suffix: tuple[int, ...] = ()
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


def _forward(model: nn.Module, rows: list[DecodeRow], live: list[int], cache: BatchedCache, ids: list[list[int]],
             first_position: list[int]) -> list[int]:
    """One forward of ``ids`` (one list per live row, equal lengths) through the batch; each live row's choice."""
    device = next(model.parameters()).device
    start = time.perf_counter()
    out = model(
        input_ids=torch.tensor(ids, device=device),
        position_ids=torch.tensor([[p + k for k in range(len(ids[0]))] for p in first_position], device=device),
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
    return pending


@torch.inference_mode()
def decode_rows(model: nn.Module, rows: list[DecodeRow]) -> list[DecodeRow]:
    """Greedy-decode every row together (one forward per step over the rows still generating; rows with suffixes
    of different lengths decode in separate batches); fills ``row.tokens`` and ``row.forward_s``. Attention reads
    each row's compressed stores (:mod:`spark_bench.engine.attention`)."""
    by_suffix: dict[int, list[DecodeRow]] = {}
    for row in rows:
        if not row.suffix and row.first_logits is None:
            raise ValueError("a decode row needs first_logits or a suffix to run through its cache")
        by_suffix.setdefault(len(row.suffix), []).append(row)
    for group in by_suffix.values():
        _decode_batch(model, group)
    return rows


def _decode_batch(model: nn.Module, rows: list[DecodeRow]) -> None:
    n = len(rows[0].suffix)
    live = list(range(len(rows)))
    cache = None
    if n:
        cache = BatchedCache([row.cache for row in rows], capacity=n + max(row.max_new_tokens for row in rows))
        with compressed_attention_enabled(model):
            first = _forward(model, rows, live, cache, [list(row.suffix) for row in rows],
                             [row.position for row in rows])
    else:
        first = [row.choose(row.first_logits) for row in rows]
    live = _step_rows(rows, first)
    if not live:
        return
    if cache is None:
        cache = BatchedCache([rows[i].cache for i in live], capacity=max(rows[i].max_new_tokens for i in live))
    elif len(live) < len(rows):
        cache.keep(live)
    with compressed_attention_enabled(model):
        while live:
            pending = _forward(model, rows, live, cache, [[rows[i].tokens[-1]] for i in live],
                               [rows[i].position + n + len(rows[i].tokens) - 1 for i in live])
            going = _step_rows([rows[i] for i in live], pending)
            if len(going) < len(live):
                if going:
                    cache.keep(going)
                live = [live[j] for j in going]


def greedy_decode(model: nn.Module, cache: CompressedCache, first_logits: torch.Tensor, prompt_length: int,
                  max_new_tokens: int, stop_token_ids: frozenset[int] | set[int],
                  min_new_tokens: int = 0) -> list[int]:
    """One row on its own (``decode_batch=1``): generate up to ``max_new_tokens`` tokens, the first from
    ``first_logits``."""
    row = DecodeRow(cache, first_logits, prompt_length, max_new_tokens, frozenset(stop_token_ids), min_new_tokens)
    return decode_rows(model, [row])[0].tokens
