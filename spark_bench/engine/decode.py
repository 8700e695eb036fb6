"""Greedy decoding through the model's own forward pass, several compressed caches at once.

Every method config of a sample is one *row*: one model forward per step serves all rows still generating
(:class:`~spark_bench.engine.cache.BatchedCache`), each row attending over its own compressed stores. Rows leave the
batch when they stop (a stop token, their own ``max_new_tokens``). Because a row's arithmetic does not depend on the
other rows, batched decoding gives the tokens of one-row-at-a-time decoding (``decode_batch=1``), which tests check.

A row may first run a *suffix* through its compressed cache (``compress_scope`` ``question`` / ``context``: the
end of turn, the assistant header, the answer prefix, and under ``context`` the question): one forward over the
suffix tokens of every row (rows with equal suffix lengths batch together), whose last logits give the first answer
token, as the official kvpress pipeline's ``generate_answer`` does. Suffix tokens join the dense decoded tail.
:func:`prime_rows` runs the suffixes before the batch instead, in forwards of a fixed shape: each row keeps its
suffix's keys and values and last logits, so a later teacher-forced pass (:mod:`~spark_bench.engine.fidelity`)
continues from them instead of running the suffix again, with numbers that do not depend on which rows were batched
together.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from spark_bench.engine.attention import compressed_attention_enabled
from spark_bench.engine.cache import BatchedCache, CompressedCache
from spark_bench.engine.fastpaths import FastPaths


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
    tail: list | None = None  # per layer, (keys, values) of the suffix already run through the cache (prime_rows)
    tokens: list[int] = field(default_factory=list)
    forward_s: float = 0.0  # this row's share of the batched decode (forwards, batch building, keep, captures: s)
    warmup_s: float = 0.0   # its share of the first uses of fast-path variants (compile, run-time check: s)


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
    length from the device (the fused kernel advances it), so a replay is the next step. Captured on a batch's second
    step (the first built the kernel tables and compiled and checked the kernels, and warmed the allocator), and
    again when the batch shrinks to a smaller width (:func:`_width`). Only for batches
    :meth:`BatchedCache.graph_blocker` clears. ``variant``: what the run's check records (one per width, its first
    replay compared with an eager step, :mod:`~spark_bench.engine.fastpaths`)."""

    def __init__(self, model: nn.Module, cache: BatchedCache, ids: torch.Tensor, positions: torch.Tensor):
        self.ids, self.positions = ids.clone(), positions.clone()
        self.graph = torch.cuda.CUDAGraph()
        self.variant = f"CUDA graph of a {ids.shape[0]}-row step"
        lengths = cache.host_lengths()
        try:
            with torch.cuda.graph(self.graph):
                out = model(input_ids=self.ids, position_ids=self.positions, past_key_values=cache,
                            compressed_cache=cache, use_cache=True, logits_to_keep=1)
                self.dtype = out.logits.dtype
                self.logits = out.logits[:, -1].float()
        finally:
            cache.set_host_lengths(lengths)  # capture ran the Python once and no kernel: replays advance both

    def __call__(self, cache: BatchedCache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.graph.replay()
        cache.advance(self.ids.shape[1])
        return self.logits


def _eager(model: nn.Module, cache: BatchedCache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, position_ids=positions, past_key_values=cache, compressed_cache=cache,
                 use_cache=True, logits_to_keep=1).logits[:, -1].float()


def _checked_replay(model: nn.Module, cache: BatchedCache, ids: torch.Tensor, positions: torch.Tensor,
                    graph: StepGraph) -> torch.Tensor:
    """A graph's first replay in the run, compared with an eager step over the same inputs (the step rewound: the
    eager kernels write the same tail slots again); the eager logits when they differ (graphs then stay off)."""
    checks = cache.fast_paths
    replayed = graph(cache, ids, positions).clone()
    start = checks.seconds
    with checks.timed(replayed):
        cache.rewind(ids.shape[1])
        eager = _eager(model, cache, ids, positions)
    return replayed if checks.judge("graph", graph.variant, replayed, eager, graph.dtype,
                                    checks.seconds - start) else eager


def _charge(rows: list[DecodeRow], paying: list[int], seconds: float, warmup: float = 0.0) -> None:
    """Share ``seconds`` of decode time (and ``warmup`` seconds of first uses) among the rows ``paying``."""
    for i in paying:
        rows[i].forward_s += seconds / len(paying)
        rows[i].warmup_s += warmup / len(paying)


def _forward(model: nn.Module, rows: list[DecodeRow], live: list[int], cache: BatchedCache, ids: torch.Tensor,
             positions: torch.Tensor, bans: dict | None = None, graph: StepGraph | None = None,
             paying: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """One forward of ``ids (R, n)`` at ``positions (R, n)`` (device tensors, one per batch row; ``live[j]``: the
    row of batch row ``j``) through the batch (or a replay of ``graph``); each batch row's choice, on the device and
    on the host. The one host read at the end also makes the timing true on an asynchronous device. The time is
    shared by the rows ``paying`` (default ``live``: rows kept as no-ops pay nothing); the first uses of fast paths
    inside it (compile and check) go to the rows' ``warmup_s`` instead."""
    checks = cache.fast_paths
    start, warm = time.perf_counter(), checks.seconds
    if graph is not None and checks.due(graph.variant):
        logits = _checked_replay(model, cache, ids, positions, graph)
    elif graph is not None:
        logits = graph(cache, ids, positions)
    else:
        logits = _eager(model, cache, ids, positions)
    chosen, host = choose_all(logits, [rows[i] for i in live], bans)
    elapsed, warm = time.perf_counter() - start, checks.seconds - warm
    _charge(rows, live if paying is None else paying, elapsed - warm, warm)
    return chosen, host


def fixed_groups(items: list, size: int) -> list[tuple[list, int]]:
    """``items`` in chunks of exactly ``size`` (the last padded with copies of its first item, whose results are
    dropped): ``(chunk, real items)`` each. A forward of a chunk then has one shape whatever the items, and with it
    (and :class:`BatchedCache`'s ``width`` / ``alone``) every row's arithmetic: each reduction of a matrix product of
    one shape sums the same terms in the same order, whatever its other rows hold (``tests/test_fidelity.py``)."""
    return [(chunk + chunk[:1] * (size - len(chunk)), len(chunk))
            for chunk in (items[k:k + size] for k in range(0, len(items), size))]


FORWARD_TOKENS = 128  # tokens a stacked forward of prime_rows / the fidelity pass aims at (fixed_groups)


def group_size(configs: int, tokens: int, most: int = 8) -> int:
    """Rows per :func:`fixed_groups` chunk for a sweep of ``configs`` method configs whose rows each run ``tokens``
    tokens: enough rows for about :data:`FORWARD_TOKENS` tokens per forward (products of fewer rows run 1.5–2× slower
    per token on a CPU; a long answer is efficient alone, and its rows' tails stay small), at most ``most``, as even as
    the chunks allow (26 configs of 15 tokens: 4 chunks of 7). It depends on the sweep and the sample alone, not on a
    decode batch, a resume or a shard."""
    most = max(1, min(most, FORWARD_TOKENS // max(tokens, 1)))
    return -(-configs // -(-configs // most)) if configs else 1


@torch.inference_mode()
def prime_rows(model: nn.Module, rows: list[DecodeRow], stack: bool = True, checks: FastPaths | None = None,
               configs: int = 1, width: int = 0) -> None:
    """Run the rows' suffixes through their caches, :func:`group_size` ``(configs, suffix)`` rows per forward
    (:func:`fixed_groups`; rows of one suffix length and attention mode; ``configs``: the sweep's), each row's
    arithmetic its own (``width``: the sample's prompt length, see
    :class:`BatchedCache`): a row's ``first_logits`` become the suffix's last logits, its ``tail`` the suffix's keys
    and values per layer, its ``position`` the one after the suffix, and its ``suffix`` empty — so decoding starts
    from its first answer token, and a teacher-forced pass (:mod:`~spark_bench.engine.fidelity`) continues from the
    suffix instead of running it again, with numbers that do not depend on which rows were batched together. The
    forwards are decode time (``forward_s``, shared by a chunk's rows; first uses of fast paths in ``warmup_s``)."""
    checks = FastPaths() if checks is None else checks
    device = _input_device(model)
    kinds: dict[tuple[int, str], list[DecodeRow]] = {}
    for row in rows:
        if row.suffix:
            kinds.setdefault((len(row.suffix), row.cache.attention), []).append(row)
    for (n, _), same in kinds.items():
        for chunk, real in fixed_groups(same, group_size(configs, n)):
            start, warm = time.perf_counter(), checks.seconds
            cache = BatchedCache([row.cache for row in chunk], n, stack, fast_paths=checks, width=width, alone=True)
            ids = torch.tensor([list(row.suffix) for row in chunk], device=device)
            positions = torch.tensor([[row.position + k for k in range(n)] for row in chunk], device=device)
            with compressed_attention_enabled(model):
                logits = _eager(model, cache, ids, positions)
            b = cache.layers[0].batch_rows
            for j, row in enumerate(chunk[:real]):
                row.tail = [(layer.tail_keys[j * b:(j + 1) * b, :, :n].clone(),
                             layer.tail_values[j * b:(j + 1) * b, :, :n].clone()) for layer in cache.layers]
                row.first_logits, row.position, row.suffix = logits[j], row.position + n, ()
            logits.max().item()  # read on the host: the forward is done (a true time on an asynchronous device)
            warm = checks.seconds - warm
            _charge(chunk, list(range(real)), time.perf_counter() - start - warm, warm)


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


def _width(live: int, width: int) -> int:
    """The batch width to keep for ``live`` rows still generating when steps are graphed: the next power of two
    (rows that stopped fill it as no-ops), never wider than now. A batch of R rows is captured at most
    ``log2 R + 1`` times, not once per row that stops."""
    return min(width, 1 << max(live - 1, 0).bit_length())


@torch.inference_mode()
def decode_rows(model: nn.Module, rows: list[DecodeRow], stack: bool = True,
                release: bool = False, graph: bool = True, checks: FastPaths | None = None) -> list[DecodeRow]:
    """Greedy-decode every row together (one forward per step over the rows still generating; rows with suffixes
    of different lengths decode in separate batches); fills ``row.tokens``, ``row.forward_s`` and ``row.warmup_s``.
    Attention reads each row's compressed stores (:mod:`spark_bench.engine.attention`); ``stack`` (``decode_stack``)
    lets rows of kinds a compact kernel serves share one kernel call per layer
    (:class:`~spark_bench.engine.cache.BatchedLayer`). ``release``: the batch consumes each row's own cache layer by
    layer while it is built and the rows drop it (the batch's stacks hold what decoding reads), so decoding never
    holds the compressed caches twice. ``graph`` (``decode_graph``): replay each step from a CUDA graph where the
    batch allows (:class:`StepGraph`); the tokens are the same either way. ``checks``: the run's
    :class:`~spark_bench.engine.fastpaths.FastPaths` (default: a new one, the call a run of its own), each fast path
    checked at its first use in the run.

    ``forward_s`` is the time the rows wait for while decoding: the forwards, building the batch, dropping stopped
    rows (``keep``) and graph captures; ``warmup_s`` the first use of each fast-path variant (its compile, its check
    against the reference)."""
    checks = FastPaths() if checks is None else checks
    by_suffix: dict[tuple[int, int], list[DecodeRow]] = {}
    for row in rows:
        if not row.suffix and row.first_logits is None:
            raise ValueError("a decode row needs first_logits or a suffix to run through its cache")
        by_suffix.setdefault((len(row.suffix), tail_length(row.tail)), []).append(row)
    for group in by_suffix.values():
        order = BatchedCache.order([row.cache for row in group], stack)
        _decode_batch(model, [group[i] for i in order], stack, release, graph, checks)
    return rows


def tail_length(tail: list | None) -> int:
    """Tokens a row's tail starts with (:func:`prime_rows`); rows of one batch advance in lockstep from equal tails."""
    return 0 if tail is None else tail[0][0].shape[-2]


def _tails(rows: list[DecodeRow]) -> list | None:
    return None if rows[0].tail is None else [row.tail for row in rows]


def _decode_batch(model: nn.Module, rows: list[DecodeRow], stack: bool, release: bool, graph: bool,
                  checks: FastPaths) -> None:
    n = len(rows[0].suffix)
    device = _input_device(model)
    cache = None
    if n:
        start = time.perf_counter()
        cache = BatchedCache([row.cache for row in rows], n + max(row.max_new_tokens for row in rows), stack,
                             consume=release, fast_paths=checks, tails=_tails(rows))
        if release:
            for row in rows:
                row.cache = None
        _charge(rows, list(range(len(rows))), time.perf_counter() - start)
        ids = torch.tensor([list(row.suffix) for row in rows], device=device)
        positions = torch.tensor([[row.position + k for k in range(n)] for row in rows], device=device)
        with compressed_attention_enabled(model):
            chosen, first = _forward(model, rows, list(range(len(rows))), cache, ids, positions)
    else:
        logits = torch.stack([row.first_logits.reshape(-1) for row in rows]).float()
        chosen, first = choose_all(logits, rows)
    going = _step_rows(rows, first)
    if not going:
        return
    start = time.perf_counter()
    if cache is None:
        cache = BatchedCache([rows[i].cache for i in going], max(rows[i].max_new_tokens for i in going), stack,
                             consume=release, fast_paths=checks, tails=_tails([rows[i] for i in going]))
        if release:
            for row in rows:
                row.cache = None
    elif len(going) < len(rows):
        cache.keep(going)
    members = going  # batch row j decodes rows[members[j]]; active[j]: still generating (else a no-op row)
    active = [True] * len(members)
    chosen = chosen.to(device)
    index = None if len(going) == len(rows) else torch.tensor(going, device=chosen.device)
    ids = (chosen if index is None else chosen.index_select(0, index)).unsqueeze(-1)
    positions = torch.tensor([[rows[i].position + n + len(rows[i].tokens) - 1] for i in members], device=device)
    _charge(rows, members, time.perf_counter() - start)
    graphed = graph and cache.graph_blocker() is None  # steps will be captured: stopped rows wait as no-ops
    bans: dict = {}
    step, captured = 0, None
    with compressed_attention_enabled(model):
        while True:
            live = [members[j] for j, a in enumerate(active) if a]
            if step == 1 and captured is None and graphed:  # the first step built the tables, compiled the kernels
                start = time.perf_counter()
                captured = graph_step(model, cache, ids, positions, graph)
                _charge(rows, live, time.perf_counter() - start)
            chosen, pending = _forward(model, rows, members, cache, ids, positions, bans, captured, live)
            if checks.off and graphed and (not checks.on("graph") or cache.graph_blocker() is not None):
                graphed, captured = False, None  # a fast path differed from its reference: eager steps from now
            now = [j for j, a in enumerate(active) if a]
            still = [now[k] for k in _step_rows([rows[members[j]] for j in now], [pending[j] for j in now])]
            step += 1
            if not still:
                break
            if len(still) < len(now):
                kept = set(still)
                width = _width(len(still), len(members)) if graphed else len(still)
                if width < len(members):
                    start = time.perf_counter()
                    keep = sorted(still + [j for j in range(len(members)) if j not in kept][:width - len(still)])
                    cache.keep(keep)
                    index = torch.tensor(keep, device=chosen.device)
                    chosen, positions = chosen.index_select(0, index), positions.index_select(0, index)
                    members, active = [members[j] for j in keep], [j in kept for j in keep]
                    _charge(rows, [members[j] for j, a in enumerate(active) if a], time.perf_counter() - start)
                    step, captured = 0, None  # the batch changed width: one eager step, then capture again
                else:
                    active = [j in kept for j in range(len(members))]
            ids = chosen.unsqueeze(-1)
            positions = positions + 1


def greedy_decode(model: nn.Module, cache: CompressedCache, first_logits: torch.Tensor, prompt_length: int,
                  max_new_tokens: int, stop_token_ids: frozenset[int] | set[int],
                  min_new_tokens: int = 0) -> list[int]:
    """One row on its own (``decode_batch=1``): generate up to ``max_new_tokens`` tokens, the first from
    ``first_logits``."""
    row = DecodeRow(cache, first_logits, prompt_length, max_new_tokens, frozenset(stop_token_ids), min_new_tokens)
    return decode_rows(model, [row])[0].tokens
