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
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from spark_bench.engine.attention import compressed_attention_enabled
from spark_bench.engine.cache import BatchedCache, CompressedCache


def choose_all(logits: torch.Tensor, rows: list["DecodeRow"], bans: dict | None = None) -> tuple[torch.Tensor,
                                                                                                    list[int]]:
    """Greedy choice of every row at once on the logits' device: ``logits (R, V)`` → the chosen ids ``(R,)`` (left
    on the device, the next step's input) and the same ids on the host, read in one transfer per step. A row still
    short of its ``min_new_tokens`` never picks one of its stop tokens (its stop ids get −inf first). ``bans``: a
    dict kept across the steps of a batch, holding each ban index on the device (it changes only when a row reaches
    its minimum or rows stop, so steps in between send nothing to the device)."""
    banned = tuple((j, t) for j, row in enumerate(rows) if len(row.tokens) < row.min_new_tokens
                   for t in sorted(row.stop_token_ids))
    if banned:
        bans = {} if bans is None else bans
        if banned not in bans:
            bans[banned] = torch.tensor(banned, device=logits.device).T
        index = bans[banned]
        logits = logits.index_put((index[0], index[1]), logits.new_full((), float("-inf")))
    ids = logits.argmax(dim=-1)
    return ids, ids.tolist()


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


def _input_device(model: nn.Module) -> torch.device:
    """Where the model takes its input ids: its input embeddings' device (with a device map, the first layer's)."""
    return model.get_input_embeddings().weight.device


class StepGraph:
    """One decode step of a fixed batch captured in a CUDA graph (``decode_graph``) and replayed: static input
    buffers (ids, positions), the model's forward up to the last logits. Every kernel of the step reads the tail
    length from the device (the fused kernel advances it), so a replay is the next step. Captured on the batch's
    second step (the first built the kernel tables and compiled the kernels, and warmed the allocator), again after
    rows stop (the batch changed shape). Only for batches :meth:`BatchedCache.graph_blocker` clears."""

    def __init__(self, model: nn.Module, cache: BatchedCache, ids: torch.Tensor, positions: torch.Tensor):
        self.ids, self.positions = ids.clone(), positions.clone()
        self.graph = torch.cuda.CUDAGraph()
        lengths = cache.host_lengths()
        try:
            with torch.cuda.graph(self.graph):
                out = model(input_ids=self.ids, position_ids=self.positions, past_key_values=cache,
                            compressed_cache=cache, use_cache=True, logits_to_keep=1)
                self.logits = out.logits[:, -1].float()
        finally:
            cache.set_host_lengths(lengths)  # capture ran the Python once and no kernel: replays advance both

    def __call__(self, cache: BatchedCache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.graph.replay()
        cache.advance(self.ids.shape[1])
        return self.logits


def _forward(model: nn.Module, rows: list[DecodeRow], live: list[int], cache: BatchedCache, ids: torch.Tensor,
             positions: torch.Tensor, bans: dict | None = None, graph: StepGraph | None = None) -> tuple[
                 torch.Tensor, list[int]]:
    """One forward of ``ids (R, n)`` at ``positions (R, n)`` (device tensors, one row per live row) through the
    batch (or a replay of ``graph``); each live row's choice, on the device and on the host. The one host read at
    the end also makes the timing true on an asynchronous device."""
    start = time.perf_counter()
    if graph is not None:
        logits = graph(cache, ids, positions)
    else:
        logits = model(input_ids=ids, position_ids=positions, past_key_values=cache, compressed_cache=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1].float()
    chosen, host = choose_all(logits, [rows[i] for i in live], bans)
    elapsed = time.perf_counter() - start
    for i in live:
        rows[i].forward_s += elapsed / len(live)
    return chosen, host


def graph_step(model: nn.Module, cache: BatchedCache, ids: torch.Tensor, positions: torch.Tensor,
               wanted: bool) -> StepGraph | None:
    """The captured step for this batch, or None (``wanted`` false, or :meth:`BatchedCache.graph_blocker` names
    why not; a capture that fails warns once and the batch decodes eagerly)."""
    if not wanted or cache.graph_blocker() is not None:
        return None
    try:
        return StepGraph(model, cache, ids, positions)
    except Exception as exc:  # noqa: BLE001 — any capture failure means: decode without the graph
        warnings.warn(f"spark-bench: decode_graph: CUDA graph capture failed ({type(exc).__name__}: {exc}); "
                      "decoding without it", stacklevel=2)
        return None


@torch.inference_mode()
def decode_rows(model: nn.Module, rows: list[DecodeRow], stack: bool = True,
                release: bool = False, graph: bool = True) -> list[DecodeRow]:
    """Greedy-decode every row together (one forward per step over the rows still generating; rows with suffixes
    of different lengths decode in separate batches); fills ``row.tokens`` and ``row.forward_s``. Attention reads
    each row's compressed stores (:mod:`spark_bench.engine.attention`); ``stack`` (``decode_stack``) lets rows of
    kinds a compact kernel serves share one kernel call per layer (:class:`~spark_bench.engine.cache.BatchedLayer`).
    ``release``: the batch consumes each row's own cache layer by layer while it is built and the rows drop it (the
    batch's stacks hold what decoding reads), so decoding never holds the compressed caches twice. ``graph``
    (``decode_graph``): replay each step from a CUDA graph where the batch allows (:class:`StepGraph`); the
    tokens are the same either way."""
    by_suffix: dict[int, list[DecodeRow]] = {}
    for row in rows:
        if not row.suffix and row.first_logits is None:
            raise ValueError("a decode row needs first_logits or a suffix to run through its cache")
        by_suffix.setdefault(len(row.suffix), []).append(row)
    for group in by_suffix.values():
        order = BatchedCache.order([row.cache for row in group], stack)
        _decode_batch(model, [group[i] for i in order], stack, release, graph)
    return rows


def _decode_batch(model: nn.Module, rows: list[DecodeRow], stack: bool, release: bool, graph: bool) -> None:
    n = len(rows[0].suffix)
    device = _input_device(model)
    live = list(range(len(rows)))
    cache = None
    if n:
        cache = BatchedCache([row.cache for row in rows], n + max(row.max_new_tokens for row in rows), stack,
                             consume=release)
        if release:
            for row in rows:
                row.cache = None
        ids = torch.tensor([list(row.suffix) for row in rows], device=device)
        positions = torch.tensor([[row.position + k for k in range(n)] for row in rows], device=device)
        with compressed_attention_enabled(model):
            chosen, first = _forward(model, rows, live, cache, ids, positions)
    else:
        logits = torch.stack([row.first_logits.reshape(-1) for row in rows]).float()
        chosen, first = choose_all(logits, rows)
    going = _step_rows(rows, first)
    if not going:
        return
    if cache is None:
        cache = BatchedCache([rows[i].cache for i in going], max(rows[i].max_new_tokens for i in going), stack,
                             consume=release)
        if release:
            for row in rows:
                row.cache = None
    elif len(going) < len(rows):
        cache.keep(going)
    live = going
    chosen = chosen.to(device)
    index = None if len(going) == len(rows) else torch.tensor(going, device=chosen.device)
    ids = (chosen if index is None else chosen.index_select(0, index)).unsqueeze(-1)
    positions = torch.tensor([[rows[i].position + n + len(rows[i].tokens) - 1] for i in live], device=device)
    bans: dict = {}
    step, captured = 0, None
    with compressed_attention_enabled(model):
        while live:
            if step == 1 and captured is None:  # the first step built the tables and compiled the kernels
                captured = graph_step(model, cache, ids, positions, graph)
            chosen, pending = _forward(model, rows, live, cache, ids, positions, bans, captured)
            going = _step_rows([rows[i] for i in live], pending)
            step += 1
            if len(going) < len(live):
                if not going:
                    break
                cache.keep(going)
                index = torch.tensor(going, device=chosen.device)
                chosen, positions = chosen.index_select(0, index), positions.index_select(0, index)
                live = [live[j] for j in going]
                step, captured = 0, None  # the batch changed shape: one eager step, then capture again
            ids = chosen.unsqueeze(-1)
            positions = positions + 1


def greedy_decode(model: nn.Module, cache: CompressedCache, first_logits: torch.Tensor, prompt_length: int,
                  max_new_tokens: int, stop_token_ids: frozenset[int] | set[int],
                  min_new_tokens: int = 0) -> list[int]:
    """One row on its own (``decode_batch=1``): generate up to ``max_new_tokens`` tokens, the first from
    ``first_logits``."""
    row = DecodeRow(cache, first_logits, prompt_length, max_new_tokens, frozenset(stop_token_ids), min_new_tokens)
    return decode_rows(model, [row])[0].tokens
