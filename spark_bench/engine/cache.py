"""Transformers :class:`~transformers.Cache` objects whose prompt part lives in compact stores.

A method config's :class:`CompressedCache` holds, per layer (:class:`StoredLayer`), the prompt's keys and values in
:mod:`spark_bench.storage` stores (compressed once, after prefill); its ``nbytes`` are the bytes reported. Decoding
runs a :class:`BatchedCache`: one row per config still generating, each row's prompt attention over its own stores,
and the decoded tokens of all rows in one dense preallocated tail, as the official implementations keep decoded
tokens dense. The two parts are merged exactly (:class:`Partial`, :func:`merge`). Attention is computed here, called
by :mod:`spark_bench.engine.attention`, so the key matrix of a channel-pruned store is never rebuilt unless a store
has no faster way (``attention="materialize"`` forces the dense reference: rebuild the keys, then a plain matmul).

Three rooms beside this one: the softmax-in-parts arithmetic (:mod:`.partial`), how a batched layer's stacked rows
reach the kernels — the fused CUDA launches and the C++ stacked path (:mod:`.launch`, mixed into
:class:`BatchedLayer`) — and what a decode step needs to be captured in a CUDA graph (:mod:`.graphs`, mixed into
:class:`BatchedCache`). This module holds the caches: the rows, their stores and tails, the order and tables a step
reads, the per-row and reference paths and the run-time check of the kernels against them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from spark_bench.engine.fastpaths import FastPaths
from spark_bench.engine.graphs import GraphSteps
from spark_bench.engine.launch import StackedLaunch
from spark_bench.engine.partial import Partial, exact_keys, merge, scaled_queries, tail_attention  # noqa: F401
from spark_bench.storage.bits import pack_bits, tensor_bytes, unpack_bits
from spark_bench.storage.dispatch import (
    compact_backend, compact_logits, fallback, kernel_blocker, reference_logits, value_blocker,
)
from spark_bench.storage.segments import FusedTables, SegmentStack, ValueStack, store_blocker
from spark_bench.storage.stores import DenseStore, Store

ATTENTION_MODES = ("compact", "materialize")


def _query_length(query) -> int:
    """The new tokens' count a layer's ``get_mask_sizes`` is given: an int (transformers >= 5.3) or the step's
    ``cache_position`` tensor (transformers 5.0 … 5.2, whose ``DynamicLayer`` takes ``cache_position.shape[0]``)."""
    return query if isinstance(query, int) else int(query.shape[0])


class StoredLayer(CacheLayerMixin):
    """One layer: prompt keys/values in stores (+ a per-head validity mask for ragged heads), decoded tokens dense."""

    is_sliding = False
    is_compileable = False

    def __init__(self, keys: Store, values: Store, valid: torch.Tensor | None = None):
        super().__init__()
        if keys.length != values.length:
            raise ValueError(f"key store holds {keys.length} tokens but the value store holds {values.length}")
        self.key_store, self.value_store = keys, values
        self.valid_bits = None if valid is None else pack_bits(valid)
        self.tail_keys = self.tail_values = None
        self.dtype = values.dtype
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: a stored layer is built initialised."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.tail_keys is None:
            self.tail_keys, self.tail_values = key_states, value_states
        else:
            self.tail_keys = torch.cat([self.tail_keys, key_states], dim=-2)
            self.tail_values = torch.cat([self.tail_values, value_states], dim=-2)
        return self.tail_keys, self.tail_values

    @property
    def tail_length(self) -> int:
        return 0 if self.tail_keys is None else self.tail_keys.shape[-2]

    def valid(self) -> torch.Tensor | None:
        """``(B, H_kv, S)`` bool, False on padding of heads that keep fewer tokens (AdaKV), or None."""
        return None if self.valid_bits is None else unpack_bits(self.valid_bits, self.key_store.length)

    def materialized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys and values (prompt then decoded tokens): the reference path, for tests and benchmarks."""
        keys, values = self.key_store.materialize(), self.value_store.materialize()
        if self.tail_keys is not None:
            keys = torch.cat([keys, self.tail_keys], dim=-2)
            values = torch.cat([values, self.tail_values], dim=-2)
        return keys, values

    def prompt_scores(self, grouped: torch.Tensor, mode: str = "compact") -> torch.Tensor:
        """``grouped (B, H_kv, G·q, D)`` (already scaled, float32) queries · this layer's prompt keys → float32
        scores, −inf on padding (AdaKV). ``compact``: the C++ kernel where it serves the store, else the rebuilt keys
        (:func:`~spark_bench.storage.dispatch.compact_logits`); ``materialize``: always the rebuilt keys."""
        if mode == "materialize":
            scores = reference_logits(self.key_store, grouped)
        else:
            scores = compact_logits(self.key_store, grouped)
        valid = self.valid()
        return scores if valid is None else scores.masked_fill(~valid.unsqueeze(2), float("-inf"))

    def attend(self, query: torch.Tensor, scaling: float, mode: str = "compact") -> torch.Tensor:
        """Attention of ``query (B, H_q, q, D)`` (the newest ``q`` tokens, already in the tail) over this layer.

        Returns ``(B, q, H_q, D)`` like transformers' attention functions. Same arithmetic as
        :meth:`BatchedLayer.attend` (prompt part, tail part, :func:`merge`).
        """
        b, hq, q_len, d = query.shape
        h = self.value_store.shape[1]
        grouped = query.float().reshape(b, h, hq // h * q_len, d) * scaling  # query head i uses kv-head i // group
        parts = [Partial.of(self.prompt_scores(grouped, mode), self.value_store.materialize())]
        if self.tail_length:
            parts.append(tail_attention(grouped, self.tail_keys, self.tail_values, q_len))
        return merge(parts, query.dtype).reshape(b, hq, q_len, d).transpose(1, 2)

    def get_seq_length(self) -> int:
        return self.key_store.length + self.tail_length

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        return self.get_seq_length() + _query_length(query_length), 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers < 5.3's name of get_max_length (abstract there)
        return -1

    def nbytes(self) -> int:
        """Bytes actually held: compact prompt keys and values (+ validity bits) + decoded keys and values."""
        return (self.key_store.nbytes() + self.value_store.nbytes()
                + tensor_bytes(self.valid_bits, self.tail_keys, self.tail_values))


class CompressedCache(Cache):
    """A cache built from per-layer :class:`StoredLayer` objects (one per decoder layer).

    ``attention`` picks how decode attention reads the stores: ``compact`` (default) or ``materialize``.
    """

    def __init__(self, layers: list[StoredLayer], attention: str = "compact"):
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        super().__init__(layers=layers)
        self.attention = attention

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Refused: a context's stores are not a generation cache (as a model's ``past_key_values`` its positions
        would restart at the kept length and another attention would read the new tokens only)."""
        raise ValueError("past_key_values: context.cache holds a context's compressed stores, not a generation "
                         "cache; pass context.as_cache() (on the spark_bench attention), or use spark_bench.generate "
                         "/ spark_bench.press")

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def kept_key_fraction(self) -> float:
        """Fraction of key entries actually stored (1 − the achieved "Overall Ratio" of paper Table 5)."""
        total = sum(layer.key_store.length for layer in self.layers)
        kept = sum(layer.key_store.kept_fraction() * layer.key_store.length for layer in self.layers)
        return kept / max(total, 1)

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Decode attention of layer ``layer_idx`` (called by :mod:`spark_bench.engine.attention`)."""
        return self.layers[layer_idx].attend(query, scaling, self.attention)


def store_device(store: Store) -> torch.device:
    """The device of a value store's tensors (a :class:`DenseStore`'s data, an unstructured store's kept entries, a
    windowed store's own ``device``)."""
    if hasattr(store, "device"):
        return store.device
    return (store.data if hasattr(store, "data") else store.kept).device


def stackable(layer: StoredLayer, backend: str, warn: bool = False) -> str | None:
    """Why this row's layer cannot join its batch's stacks (None: it can): a compact kernel must serve the device
    (``backend``, :func:`~spark_bench.storage.segments.compact_backend`), the key store's layout and recovery, and
    the values must be a dense tensor (value-pruned rows rebuild their values per step, on the per-row path:
    :func:`~spark_bench.storage.dispatch.value_blocker`). ``warn``: a decode batch says once per reason why a row
    is not stacked (its keys' layout, its values), so no row leaves the stacks silently."""
    if backend.startswith("no:"):
        return backend[4:]
    reason = store_blocker(layer.key_store)
    if reason is not None and warn:
        fallback(reason)
    values = value_blocker(layer.value_store, backend, warn)
    return reason if reason is not None else values


class BatchedLayer(StackedLaunch, CacheLayerMixin):
    """One decoder layer of a decode batch: each row's compact prompt stores plus one preallocated tail buffer
    ``(R, H_kv, capacity, D)`` for the tokens the rows decode together.

    Rows of a batch advance in lockstep (one token per step, or the same suffix length), so their tails always have
    the same length (``length`` on the host, ``length_t`` on the device for the kernels). Rows whose stores a
    compact kernel serves (dense keys, ThinK, SparK fixed-T with ``zero`` / ``none`` / ``constant`` / ``degenerate``
    / ``fork_pool0``, dense values) are *stacked* when the batch is formed: their key stores go into one
    :class:`~spark_bench.storage.segments.SegmentStack` and their value tensors, each once however many rows share
    it, into one :class:`~spark_bench.storage.segments.ValueStack`. A step then costs a fixed number of kernel
    launches per layer, whatever the number of rows:

    * CPU (``cpp``): the C++ logits over every stacked row's prompt and tail, one float32 softmax, the C++
      ``weights · values``; a suffix's query rows go in chunks sized by ``work_bytes``;
    * CUDA (``triton``): the fused decode (:mod:`spark_bench.storage.triton_decode`), one launch and a merge, no
      score tensor; with ``stack=False`` each row gets its own fused launch (the same arithmetic, row by row). The
      kernels also scale the queries, attend the step's own tokens from :meth:`update`'s arguments and write them
      into the tail at ``length_t``, which the first launch advances: a layer's attention is its two launches.

    Other rows (SparK-p/-g, sampled recoveries, value-pruned stores; every row with ``mode="materialize"``, and on
    the CPU with ``stack=False``) take the per-row path: their own float32 scores, merged with the tail exactly.

    The stacks read the rows' own tensors in place (nothing is copied) and the layer keeps the stores alive, so
    decoding holds the compressed data once. AdaKV's padded heads are read from the rows' validity *bits*. When rows
    stop, the layer's indices and tables are rebuilt and sent in one host→device copy; nothing crosses to the device
    in a step.
    """

    is_sliding = False
    is_compileable = False
    work_bytes = 256 * 2 ** 20  # bound on a suffix's per-call float32 scores / partials (query rows go in chunks)

    def __init__(self, rows: list[StoredLayer], capacity: int, stack: bool = True, mode: str = "compact",
                 fast_paths: FastPaths | None = None, tails: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 width: int = 0, alone: bool = False):
        """``tails``: each row's tokens already run through its cache (keys and values ``(B, H_kv, n, D)``, every
        row the same ``n``: a suffix, :func:`~spark_bench.engine.decode.prime_rows`), the tail's first ``n`` tokens;
        ``capacity`` tokens fit after them. ``width`` (at least the longest row) and ``alone`` (loose rows never
        share one product over shared values) make a row's arithmetic independent of the other rows: every
        reduction of the same length, whatever rows are batched (:func:`~spark_bench.engine.decode.fixed_groups`)."""
        super().__init__()
        self.fast_paths = FastPaths() if fast_paths is None else fast_paths  # the run's checks (None: its own)
        self.reference = False  # True once a kernel differed from its reference: every row on the reference path
        first = rows[0].value_store
        b, h, _, d = first.shape
        device = store_device(first)  # this layer's own device (under a device map, not the model's first one)
        self.batch_rows = b
        primed = tails[0][0].shape[-2] if tails else 0
        self.tail_keys = torch.empty(len(rows) * b, h, primed + capacity, d, dtype=first.dtype, device=device)
        self.tail_values = torch.empty_like(self.tail_keys)
        for i, (keys, values) in enumerate(tails or ()):
            self.tail_keys[i * b:(i + 1) * b, :, :primed] = keys
            self.tail_values[i * b:(i + 1) * b, :, :primed] = values
        self.length = primed
        self.length_t = torch.full((1,), primed, dtype=torch.int64, device=device)
        self.is_initialized = True
        self.lengths = [row.key_store.length for row in rows]
        self.s_max = max(max(self.lengths), width)
        self.alone = alone
        self.backend = compact_backend(device) if mode == "compact" else "no: materialize"
        kernel = [i for i, row in enumerate(rows) if stackable(row, self.backend, warn=True) is None]
        if self.backend == "cpp" and not stack:
            kernel = []  # the CPU per-row path: each row's own scores (the C++ kernel through a one-store table)
        self.rows = rows
        self.valid_bits = None  # AdaKV: (R·B, H, ceil(S_max / 8)) bits, the CPU kernels' mask
        if any(row.valid_bits is not None for row in rows):
            self.valid_bits = torch.full((len(rows) * b, h, -(-self.s_max // 8)), 255, dtype=torch.uint8,
                                         device=device)
            for i, row in enumerate(rows):
                if row.valid_bits is not None:
                    self.valid_bits[i * b:(i + 1) * b, :, :row.valid_bits.shape[-1]] = row.valid_bits
        self.stack = stack
        self._members: set[int] = set()  # fused-kernel table variants in use (query heads per work item)
        self._arrange(kernel)

    def _arrange(self, stacked: list[int], tail_index: list[int] | None = None) -> None:
        """The stacked rows (batch indices, in stack order), their stacks, the per-row groups and every index a step
        reads. All of it, with the fused kernel's tables of the query widths already seen and ``tail_index`` (the
        tail rows to keep when rows stop), goes to the device in one host→device copy."""
        self.stacked = stacked
        self.loose = [i for i in range(len(self.rows)) if i not in set(stacked)]
        self.prefix = stacked == list(range(len(stacked)))  # stacked rows first: no reordering per step
        upload = _Upload()
        tail = upload.add(tail_index)
        order = upload.add(None if self.prefix else _argsort(stacked + self.loose))
        stacked_index = upload.add(None if self.prefix else stacked)
        # units: rows one kernel call serves (all stacked rows; on CUDA with stack=False, one row each)
        units = [stacked] if self.stack or self.backend != "triton" else [[i] for i in stacked]
        self.units, slots = [], []
        for unit in (u for u in units if u):
            keys = SegmentStack([self.rows[i].key_store for i in unit], self.s_max)
            values = ValueStack([self.rows[i].value_store for i in unit], self.s_max)
            self.units.append(dict(rows=unit, keys=keys, values=values, tables={}))
            contiguous = unit == list(range(unit[0], unit[0] + len(unit)))
            slots.append((upload.add(None if contiguous else unit),
                          {m: upload.add(*FusedTables.layout(keys, values, self._valid(unit), m))
                           for m in self._members}))
        served = [i for u in self.units for i in u["rows"]] + self.loose
        out_order = upload.add(None if served == list(range(len(self.rows))) else _argsort(served))
        self.groups = [[i] for i in self.loose] if self.alone else _groups_of(self.rows, self.loose)
        group_slots = [upload.add(group if len(group) > 1 else None) for group in self.groups]
        sent = upload.send(self.tail_keys.device)
        if tail_index is not None:
            self.tail_keys, self.tail_values = self.tail_keys[sent[tail]], self.tail_values[sent[tail]]
            if self.valid_bits is not None:
                self.valid_bits = self.valid_bits[sent[tail]]
        self.order, self.stacked_index, self.out_order = sent[order], sent[stacked_index], sent[out_order]
        for unit, (index, tables) in zip(self.units, slots):
            unit["index"] = sent[index]
            for m, k in tables.items():
                unit["tables"][m] = FusedTables.view(sent[k], upload.layouts[k])
        self.group_index = [sent[k] for k in group_slots]
        # CUDA: the fused kernel writes the step's tokens into the tail itself, where its rows are the tail's own
        # (units in place, no per-row path); otherwise :meth:`update` writes them at the host's length
        self.kernel_writes_tail = (self.backend == "triton" and bool(self.units) and not self.loose
                                   and all(unit["index"] is None for unit in self.units))
        self.pending = None
        self._kernel_rows_now, self._variants = None, {}  # the run-time check's view of these rows (fastpaths.py)

    def _valid(self, rows: list[int]) -> list:
        """Per query head of ``rows``: its AdaKV validity bits and their byte offset, or None (every token valid)."""
        valid = []
        for i in rows:
            bits = self.rows[i].valid_bits
            valid += [None if bits is None else (bits, j * bits.shape[-1])
                      for j in range(self.batch_rows * self.tail_keys.shape[1])]
        return valid

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: a batched layer is built initialised."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if self.length + n > self.tail_keys.shape[-2]:  # ran past its capacity (model.generate's own limits): grow
            grown = max(self.length + n, 2 * self.tail_keys.shape[-2])
            extra = (*self.tail_keys.shape[:2], grown - self.tail_keys.shape[-2], self.tail_keys.shape[-1])
            self.tail_keys = torch.cat([self.tail_keys, self.tail_keys.new_empty(extra)], dim=-2)
            self.tail_values = torch.cat([self.tail_values, self.tail_values.new_empty(extra)], dim=-2)
        if self.units and self.backend == "triton":  # the fused kernel attends them from here and writes them
            self.pending = (key_states, value_states)  # into the tail at the device-held length (graph-safe)
        if not self.kernel_writes_tail:
            self.tail_keys[:, :, self.length:self.length + n] = key_states
            self.tail_values[:, :, self.length:self.length + n] = value_states
        self.length += n
        return key_states, value_states  # attention reads the tail buffers (:meth:`attend`), not these

    def keep(self, rows: list[int]) -> None:
        """Drop the rows not in ``rows`` (they stopped generating): the tails are re-indexed, the tables rebuilt
        (one host→device copy for the layer)."""
        b = self.batch_rows
        position = set(self.stacked)
        self.rows = [self.rows[i] for i in rows]
        self.lengths = [self.lengths[i] for i in rows]
        self._arrange([j for j, i in enumerate(rows) if i in position], [i * b + j for i in rows for j in range(b)])

    def attend(self, query: torch.Tensor, scaling: float, mode: str = "compact") -> torch.Tensor:
        """``query (R, H_q, q, D)``, row ``r`` over row ``r``'s stores and tail → ``(R, q, H_q, D)``, float32
        arithmetic on every path."""
        r, hq, q_len, d = query.shape
        h = self.tail_keys.shape[1]
        grouped = query.reshape(r, h, hq // h * q_len, d)
        if not self.reference and not self.fast_paths.on("kernel"):  # a kernel differed from its reference
            self._to_reference()
        if self.reference:
            out = self._attend_rows(scaled_queries(grouped, scaling), q_len, "materialize")
        else:
            variant = self._variant(grouped, q_len, mode) if self.fast_paths.enabled else None
            if variant is not None and self.fast_paths.due(variant):
                out = self._attend_checked(variant, grouped, scaling, q_len, mode)
            else:
                out = self._attend_fast(grouped, scaling, q_len, mode)
        if out.dtype != query.dtype:
            out = out.to(query.dtype)
        return out.view(r, hq, q_len, d).transpose(1, 2)

    def _attend_fast(self, grouped: torch.Tensor, scaling: float, q_len: int, mode: str) -> torch.Tensor:
        if self.stacked and self.backend == "triton":  # the kernels scale the queries in float32 themselves
            return self._attend_fused(grouped, scaling, q_len)
        if not self.stacked and not (self.alone and self.backend == "cpp"):  # (every row with mode="materialize")
            return self._attend_rows(scaled_queries(grouped, scaling), q_len, mode)  # (rows alone on the CPU: one
        # path for a loose row whether or not a neighbour is stacked, launch.py)
        return self._attend_cpu(scaled_queries(grouped, scaling), q_len)

    def _kernel_rows(self) -> list[int]:
        """The rows whose prompt attention a compiled kernel computes: the fused kernel's stacked rows on CUDA; on
        the CPU every row whose key store the C++ kernel serves (stacked, or through its one-store table). Kept
        until the rows change (:meth:`_arrange`)."""
        if self._kernel_rows_now is None:
            device = self.tail_keys.device
            self._kernel_rows_now = list(self.stacked) if self.backend == "triton" else [
                i for i, row in enumerate(self.rows) if kernel_blocker(row.key_store, device) is None]
        return self._kernel_rows_now

    def _variant(self, grouped: torch.Tensor, q_len: int, mode: str) -> str | None:
        """The kernel specialisation this attention runs (None: no compiled kernel computes any row): backend,
        dtype, head dim, heads per work item (fused kernel), a one-token step or a suffix."""
        key = (mode, grouped.dtype, grouped.shape[2], q_len == 1)
        if key not in self._variants:
            self._variants[key] = self._name_variant(grouped, q_len, mode)
        return self._variants[key]

    def _name_variant(self, grouped: torch.Tensor, q_len: int, mode: str) -> str | None:
        if mode != "compact" or not self._kernel_rows():
            return None
        dtype, d = str(grouped.dtype).removeprefix("torch."), grouped.shape[-1]
        step = "one-token step" if q_len == 1 else "suffix"
        if self.stacked and self.backend == "triton":
            from spark_bench.storage.triton_decode import launch_shape

            return f"fused kernel ({dtype}, D={d}, {launch_shape(grouped.shape[2])[1]} heads per work item, {step})"
        return f"C++ kernels ({'stacked' if self.stacked else 'per row'}, {dtype}, D={d}, {step})"

    def _attend_checked(self, variant: str, grouped: torch.Tensor, scaling: float, q_len: int,
                        mode: str) -> torch.Tensor:
        """The fast path's first use in the run: its output, compared with :meth:`_reference` on the kernel's rows
        (:class:`~spark_bench.engine.fastpaths.FastPaths`); on a mismatch every row of this layer (and, through the
        run's record, of every layer) goes to the reference path, this step included."""
        checks, start = self.fast_paths, self.fast_paths.seconds
        rows, b = self._kernel_rows(), self.batch_rows
        with checks.timed(self.tail_keys):
            out = self._attend_fast(grouped, scaling, q_len, mode)
            reference = self._reference(scaled_queries(grouped, scaling), q_len, rows)
            fast = torch.cat([out[i * b:(i + 1) * b] for i in rows])
        if checks.judge("kernel", variant, fast, reference, out.dtype, checks.seconds - start):
            return out
        self._to_reference()
        return self._attend_rows(scaled_queries(grouped, scaling), q_len, "materialize")

    def _reference(self, grouped: torch.Tensor, q_len: int, rows: list[int]) -> torch.Tensor:
        """float32 attention of ``rows`` (``grouped``: the scaled float32 queries of every row) with each row's keys
        rebuilt as the kernels compute them (:func:`exact_keys`), AdaKV's padding masked, the prompt's softmax
        merged with the decoded tail's (:class:`Partial`, :func:`merge`); the prompt's query rows in chunks bounded by
        :attr:`work_bytes`."""
        b, outs = self.batch_rows, []
        for i in rows:
            row, part = self.rows[i], slice(i * b, (i + 1) * b)
            q = grouped[part]
            keys, values, valid = exact_keys(row.key_store), row.value_store.materialize(), row.valid()
            n, h, g, _ = q.shape
            step = max(1, min(g, self.work_bytes // max(1, n * h * keys.shape[-2] * 4)))
            pieces = []
            for g0 in range(0, g, step):
                scores = q[:, :, g0:g0 + step] @ keys.transpose(-1, -2)
                if valid is not None:
                    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
                pieces.append(Partial.of(scores, values))
            prompt = pieces[0] if len(pieces) == 1 else Partial(*(torch.cat([getattr(p, k) for p in pieces], dim=2)
                                                                  for k in ("out", "norm", "peak")))
            tail = tail_attention(q, self.tail_keys[part, :, :self.length], self.tail_values[part, :, :self.length],
                                  q_len)
            outs.append(merge([prompt, tail], torch.float32))
        return torch.cat(outs)

    def _to_reference(self) -> None:
        """Every row of this layer on the per-row reference path from now on (keys rebuilt, float32 matmuls): the
        step's own tokens, which the fused kernel would have written, go into the tail here."""
        if self.pending is not None and self.kernel_writes_tail:
            new_k, new_v = self.pending
            n = new_k.shape[-2]
            self.tail_keys[:, :, self.length - n:self.length] = new_k
            self.tail_values[:, :, self.length - n:self.length] = new_v
        self.reference = True
        self.backend = "no: the reference path (a kernel differed from it)"
        self._arrange([])

    def _attend_rows(self, grouped: torch.Tensor, q_len: int, mode: str) -> torch.Tensor:
        """The per-row path for the loose rows: each row's prompt scores over its own stores (grouped by shared values),
        its tail, and the exact log-sum-exp merge of the two (:class:`Partial`); float32."""
        out = {}
        for group, index in zip(self.groups, self.group_index):
            scores = [self.rows[i].prompt_scores(grouped[i:i + 1], mode) for i in group]
            prompt = Partial.of(scores[0] if len(scores) == 1 else torch.cat(scores),
                                self.rows[group[0]].value_store.materialize())
            sel = (lambda x: x[group[0]:group[0] + 1]) if index is None else (lambda x: x.index_select(0, index))
            tail = tail_attention(sel(grouped), sel(self.tail_keys)[:, :, :self.length],
                                  sel(self.tail_values)[:, :, :self.length], q_len)
            merged = merge([prompt, tail], torch.float32)
            for k, i in enumerate(group):
                out[i] = merged[k:k + 1]
        return torch.cat([out[i] for i in self.loose])

    def get_seq_length(self) -> int:
        return max(self.lengths) + self.length

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        return self.get_seq_length() + _query_length(query_length), 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers < 5.3's name of get_max_length (abstract there)
        return -1


class _Upload:
    """Host int64 lists sent to a device in one copy: :meth:`add` reserves a slot (``None`` stays ``None``),
    :meth:`send` returns each slot's device view."""

    def __init__(self):
        self.flat: list[int] = []
        self.spans: list[tuple[int, int] | None] = []
        self.layouts: dict[int, tuple] = {}

    def add(self, values: list[int] | None, layout: tuple | None = None) -> int:
        self.spans.append(None if values is None else (len(self.flat), len(values)))
        if values is not None:
            self.flat += values
        if layout is not None:
            self.layouts[len(self.spans) - 1] = layout
        return len(self.spans) - 1

    def send(self, device: torch.device) -> list[torch.Tensor | None]:
        packed = torch.tensor(self.flat, dtype=torch.int64, device="cpu").to(device) if self.flat else None
        return [None if span is None else packed[span[0]:span[0] + span[1]] for span in self.spans]


def _argsort(values: list[int]) -> list[int]:
    return sorted(range(len(values)), key=values.__getitem__)


def _groups_of(rows: list[StoredLayer], which: list[int]) -> list[list[int]]:
    """``which`` grouped by a shared dense value tensor (configs with the same eviction selection)."""
    groups: dict = {}
    for i in which:
        store = rows[i].value_store
        groups.setdefault(id(store.data) if isinstance(store, DenseStore) else ("row", i), []).append(i)
    return list(groups.values())


class BatchedCache(GraphSteps, Cache):
    """The rows of one decode batch (each a :class:`CompressedCache`, e.g. every method config of a sample), seen
    by the model as one batch-``R`` cache. ``capacity``: most tokens any row will run through it."""

    def __init__(self, caches: list[CompressedCache], capacity: int, stack: bool = True, consume: bool = False,
                 fast_paths: FastPaths | None = None, tails: list[list] | None = None, width: int = 0,
                 alone: bool = False):
        """``consume``: hand each row cache's layer over as soon as it is batched (``caches`` are unusable after),
        so building the batch never holds a layer's stores twice. ``fast_paths``: the run's record of its fast paths
        (:mod:`~spark_bench.engine.fastpaths`; default: a new one, this batch a run of its own). ``tails``: per row,
        per layer, the ``(keys, values)`` its tail starts with (:class:`BatchedLayer`), or None; ``width``,
        ``alone``: see :class:`BatchedLayer`."""
        modes = {c.attention for c in caches}
        if len(modes) != 1:
            raise ValueError(f"one decode batch cannot mix attention modes {sorted(modes)}")
        mode = modes.pop()
        self.fast_paths = FastPaths() if fast_paths is None else fast_paths
        layers = []
        for i in range(len(caches[0].layers)):
            layers.append(BatchedLayer([c.layers[i] for c in caches], capacity, stack, mode, self.fast_paths,
                                       None if tails is None else [t[i] for t in tails], width, alone))
            if consume:
                for c in caches:
                    c.layers[i] = None
        super().__init__(layers=layers)
        self.attention = mode

    def keep(self, rows: list[int]) -> None:
        for layer in self.layers:
            layer.keep(rows)

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Decode attention of layer ``layer_idx`` (called by :mod:`spark_bench.engine.attention`)."""
        return self.layers[layer_idx].attend(query, scaling, self.attention)

    @staticmethod
    def order(caches: list[CompressedCache], stack: bool = True) -> list[int]:
        """A row order with the rows that stack (in every layer) first, so a step needs no reordering per layer;
        the order of rows inside each part is kept."""
        if not stack or not caches:
            return list(range(len(caches)))
        backends = [compact_backend(store_device(layer.value_store)) for layer in caches[0].layers]  # per layer:
        ok = [all(stackable(layer, backend) is None  # under a device map, layers live on different devices
                  for layer, backend in zip(c.layers, backends)) for c in caches]
        return [i for i in range(len(caches)) if ok[i]] + [i for i in range(len(caches)) if not ok[i]]
