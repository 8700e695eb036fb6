"""Transformers :class:`~transformers.Cache` objects whose prompt part lives in compact stores.

A method config's :class:`CompressedCache` holds, per layer (:class:`StoredLayer`), the prompt's keys and values in
:mod:`spark_bench.storage` stores (compressed once, after prefill); its ``nbytes`` are the bytes reported. Decoding
runs a :class:`BatchedCache`: one row per config still generating, each row's prompt attention over its own stores,
and the decoded tokens of all rows in one dense preallocated tail, as the official implementations keep decoded
tokens dense. The two parts are merged exactly (:class:`Partial`, :func:`merge`). Attention is computed here, called
by :mod:`spark_bench.engine.attention`, so the key matrix of a channel-pruned store is never rebuilt unless a store
has no faster way (``attention="materialize"`` forces the dense reference: rebuild the keys, then a plain matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from spark_bench.storage.bits import pack_bits, tensor_bytes, unpack_bits
from spark_bench.storage.segments import SegmentStack, ValueStack, compact_backend, store_blocker
from spark_bench.storage.stores import DenseStore, Store

ATTENTION_MODES = ("compact", "materialize")


@dataclass(frozen=True)
class Partial:
    """Softmax attention over one block of keys, un-normalised: ``out = Σ_j exp(s_j − m)·v_j``, ``norm = Σ_j
    exp(s_j − m)``, ``m = max_j s_j`` (float32, per query row). Two blocks merge exactly (:func:`merge`): this is
    how a row's compact prompt stores and the decoded tail — batched across rows — make one softmax."""

    out: torch.Tensor   # (..., n_q, D) float32
    norm: torch.Tensor  # (..., n_q, 1)
    peak: torch.Tensor  # (..., n_q, 1)

    @classmethod
    def of(cls, scores: torch.Tensor, values: torch.Tensor) -> "Partial":
        """``scores (..., n_q, S)`` (already scaled, −inf where masked) and ``values (..., S, D)``."""
        peak = scores.amax(dim=-1, keepdim=True)  # finite: every block has a visible key per query row
        weights = (scores - peak).exp_()
        w = weights.to(values.dtype)
        if w.shape[0] > 1 and values.shape[0] == 1:  # rows sharing one value tensor: fold them into the query dim
            r, h, n, s = w.shape                      # (a broadcast matmul would copy the values once per row)
            out = (w.transpose(0, 1).reshape(1, h, r * n, s) @ values).view(h, r, n, -1).transpose(0, 1)
        else:
            out = w @ values
        return cls(out if out.dtype == torch.float32 else out.float(), weights.sum(dim=-1, keepdim=True), peak)


def merge(parts: list[Partial], dtype: torch.dtype) -> torch.Tensor:
    """Normalised attention output over the union of the parts' keys (log-sum-exp merge)."""
    if len(parts) == 1:
        return (parts[0].out / parts[0].norm).to(dtype)
    peak = torch.maximum(parts[0].peak, parts[1].peak)
    for p in parts[2:]:
        peak = torch.maximum(peak, p.peak)
    out = sum(p.out * (p.peak - peak).exp() for p in parts)
    norm = sum(p.norm * (p.peak - peak).exp() for p in parts)
    return (out / norm).to(dtype)


def tail_attention(grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_len: int) -> Partial:
    """Attention of ``grouped (R, H, G·q, D)`` (scaled) queries over the decoded tail ``(R, H, t, D)``: the newest
    ``q`` tokens are the tail's last ``q`` entries, causal among themselves."""
    r, h, gq, _ = grouped.shape
    t = keys.shape[-2]
    scores = (grouped @ keys.transpose(-1, -2)).float()
    if q_len > 1:  # query i (tail position t − q + i) sees tail keys 0 … t − q + i
        causal = torch.ones(q_len, t, dtype=torch.bool, device=grouped.device).tril(t - q_len)
        scores = scores.view(r, h, gq // q_len, q_len, t).masked_fill(~causal, float("-inf")).view(r, h, gq, t)
    return Partial.of(scores, values)


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
        """``grouped (B, H_kv, G·q, D)`` (already scaled) queries · this layer's prompt keys → float32 scores,
        −inf on padding (AdaKV). ``materialize``: the dense reference (rebuild the keys, then a plain matmul)."""
        if mode == "materialize":
            scores = (grouped @ self.key_store.materialize().to(grouped.dtype).transpose(-1, -2)).float()
        else:
            scores = self.key_store.logits(grouped).float()
        valid = self.valid()
        return scores if valid is None else scores.masked_fill(~valid.unsqueeze(2), float("-inf"))

    def attend(self, query: torch.Tensor, scaling: float, mode: str = "compact") -> torch.Tensor:
        """Attention of ``query (B, H_q, q, D)`` (the newest ``q`` tokens, already in the tail) over this layer.

        Returns ``(B, q, H_q, D)`` like transformers' attention functions. Same arithmetic as
        :meth:`BatchedLayer.attend` (prompt part, tail part, :func:`merge`).
        """
        b, hq, q_len, d = query.shape
        h = self.value_store.shape[1]
        grouped = query.reshape(b, h, hq // h * q_len, d) * scaling  # query head i uses kv-head i // group
        parts = [Partial.of(self.prompt_scores(grouped, mode), self.value_store.materialize())]
        if self.tail_length:
            parts.append(tail_attention(grouped, self.tail_keys, self.tail_values, q_len))
        return merge(parts, query.dtype).reshape(b, hq, q_len, d).transpose(1, 2)

    def get_seq_length(self) -> int:
        return self.key_store.length + self.tail_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
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
    """The device of a value store's tensors (a :class:`DenseStore`'s data, an unstructured store's kept entries)."""
    return (store.data if hasattr(store, "data") else store.kept).device


def stackable(layer: StoredLayer, backend: str) -> str | None:
    """Why this row's layer cannot join its batch's stacks (None: it can): a compact kernel must serve the device
    (``backend``, :func:`~spark_bench.storage.segments.compact_backend`), the key store's layout and recovery, and
    the values must be a dense tensor (value-pruned rows rebuild their values per step, on the per-row path)."""
    if backend.startswith("no:"):
        return backend[4:]
    reason = store_blocker(layer.key_store)
    if reason is not None:
        return reason
    return None if isinstance(layer.value_store, DenseStore) else "value channels are pruned"


class BatchedLayer(CacheLayerMixin):
    """One decoder layer of a decode batch: each row's compact prompt stores plus one preallocated tail buffer
    ``(R, H_kv, capacity, D)`` for the tokens the rows decode together.

    Rows of a batch advance in lockstep (one token per step, or the same suffix length), so their tails always have
    the same length. Rows whose stores a compact kernel serves (dense keys, ThinK, SparK fixed-T with ``zero`` /
    ``none`` / ``constant`` / ``degenerate`` / ``fork_pool0``, on CPU or CUDA) are *stacked* when the batch is
    formed: their key stores go into one :class:`~spark_bench.storage.segments.SegmentStack` and their value tensors,
    each stored once however many rows share it, into one :class:`~spark_bench.storage.segments.ValueStack`. A step
    then costs a fixed number of operations per layer, whatever the number of rows: one kernel call for the logits
    over every stacked row's prompt and decoded tail, one softmax, one kernel call for weights · values. Other rows
    (SparK-p/-g, sampled recoveries, value-pruned stores) keep the per-row path; with ``stack=False`` or
    ``mode="materialize"`` every row does.

    The stacks are a copy of the stacked rows' compact stores, unpadded (only the ``(R, H, G, S_max)`` scores are
    padded); the layer keeps no reference to those rows' own stores, so once the rows' caches are dropped (the
    runner consumes them while the batch is built) decoding holds the compressed data once. When rows stop, the
    stacks' segment tables are filtered: nothing is copied.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, rows: list[StoredLayer], capacity: int, stack: bool = True, mode: str = "compact"):
        super().__init__()
        first = rows[0].value_store
        b, h, _, d = first.shape
        device = store_device(first)  # this layer's own device (under a device map, not the model's first one)
        self.batch_rows = b
        self.tail_keys = torch.empty(len(rows) * b, h, capacity, d, dtype=first.dtype, device=device)
        self.tail_values = torch.empty_like(self.tail_keys)
        self.length = 0
        self.is_initialized = True
        self.lengths = [row.key_store.length for row in rows]
        self.s_max = max(self.lengths)
        backend = compact_backend(device) if stack and mode == "compact" else "no: stacking off"
        stacked = [i for i, row in enumerate(rows) if stackable(row, backend) is None]
        self.key_stack = self.value_stack = None
        if stacked:
            self.key_stack = SegmentStack([rows[i].key_store for i in stacked], self.s_max)
            self.value_stack = ValueStack([rows[i].value_store for i in stacked], self.s_max)
        self.bias = None  # −inf on AdaKV's padded heads (past a row's length the kernels already give −inf)
        if any(row.valid_bits is not None for row in rows):
            invalid = torch.zeros(len(rows) * b, h, 1, self.s_max, dtype=torch.bool, device=device)
            for i, row in enumerate(rows):
                valid = row.valid()
                if valid is not None:
                    invalid[i * b:(i + 1) * b, :, 0, :row.key_store.length] = ~valid
            self.bias = torch.zeros(invalid.shape, device=device).masked_fill_(invalid, float("-inf"))
        self.rows = [None if i in set(stacked) else row for i, row in enumerate(rows)]  # stacked: in the stacks
        self._arrange(stacked)

    def _arrange(self, stacked: list[int]) -> None:
        """Index bookkeeping for the stacked rows (batch indices, in stack order) and the per-row ones."""
        device = self.tail_keys.device
        self.stacked = stacked
        self.loose = [i for i in range(len(self.rows)) if i not in set(stacked)]
        self.prefix = stacked == list(range(len(stacked)))  # stacked rows first: no reordering per step
        self.order = None if self.prefix else torch.tensor(stacked + self.loose, device=device).argsort()
        self.stacked_index = None if self.prefix else torch.tensor(stacked, device=device)
        self._group_rows()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: a batched layer is built initialised."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if self.length + n > self.tail_keys.shape[-2]:  # ran past its capacity (model.generate's own limits): grow
            grown = max(self.length + n, 2 * self.tail_keys.shape[-2])
            extra = (*self.tail_keys.shape[:2], grown - self.tail_keys.shape[-2], self.tail_keys.shape[-1])
            self.tail_keys = torch.cat([self.tail_keys, self.tail_keys.new_empty(extra)], dim=-2)
            self.tail_values = torch.cat([self.tail_values, self.tail_values.new_empty(extra)], dim=-2)
        self.tail_keys[:, :, self.length:self.length + n] = key_states
        self.tail_values[:, :, self.length:self.length + n] = value_states
        self.length += n
        return key_states, value_states  # attention reads the tail buffers (:meth:`attend`), not these

    def _group_rows(self) -> None:
        """Per-row path (every row loose): rows whose value store is the same dense tensor (configs sharing an
        eviction selection) form a group: their prompt scores are stacked and ``weights @ values`` runs once."""
        groups: dict = {}
        for i in self.loose:
            store = self.rows[i].value_store
            groups.setdefault(id(store.data) if isinstance(store, DenseStore) else ("row", i), []).append(i)
        self.groups = list(groups.values())
        flat = [i for g in self.groups for i in g]
        self.group_order = None if flat == sorted(flat) else torch.tensor(flat, device=self.tail_keys.device).argsort()

    def keep(self, rows: list[int]) -> None:
        """Drop the rows not in ``rows`` (they stopped generating): the tails are re-indexed, the stacks filtered."""
        b = self.batch_rows
        index = torch.tensor([i * b + j for i in rows for j in range(b)], device=self.tail_keys.device)
        self.tail_keys, self.tail_values = self.tail_keys[index], self.tail_values[index]
        if self.bias is not None:
            self.bias = self.bias[index]
        position = {row: k for k, row in enumerate(self.stacked)}
        kept = [position[i] for i in rows if i in position]
        if self.key_stack is not None:
            self.key_stack, self.value_stack = ((self.key_stack.select(kept), self.value_stack.select(kept))
                                                if kept else (None, None))
        self.rows = [self.rows[i] for i in rows]
        self.lengths = [self.lengths[i] for i in rows]
        self._arrange([j for j, i in enumerate(rows) if i in position])

    def attend(self, query: torch.Tensor, scaling: float, mode: str = "compact") -> torch.Tensor:
        """``query (R, H_q, q, D)``, row ``r`` over row ``r``'s stores and tail → ``(R, q, H_q, D)``."""
        if mode == "materialize" or not self.stacked:
            return self._attend_rows(query, scaling, mode)
        r, hq, q_len, d = query.shape
        h = self.tail_keys.shape[1]
        grouped = query.reshape(r, h, hq // h * q_len, d) * scaling
        n = len(self.stacked)
        if n == r:  # every row stacked: prompt and tail in the same two kernel calls
            scores = self.key_stack.logits(grouped, self.tail_keys, self.length, q_len)
            if self.bias is not None:
                scores[..., :self.s_max] += self.bias
            out = self.value_stack.apply(scores.softmax(dim=-1), self.tail_values, self.length)
            if out.dtype != query.dtype:
                out = out.to(query.dtype)
            return out.view(r, hq, q_len, d).transpose(1, 2)
        mine = grouped if n == r else grouped[:n] if self.prefix else grouped.index_select(0, self.stacked_index)
        prompt = self.key_stack.logits(mine)
        if self.loose:
            pad = [torch.nn.functional.pad(self.rows[i].prompt_scores(grouped[i:i + 1]),
                                           (0, self.s_max - self.rows[i].key_store.length), value=float("-inf"))
                   for i in self.loose]
            prompt = torch.cat([prompt, *pad])
            if self.order is not None:
                prompt = prompt.index_select(0, self.order)
        if self.bias is not None:
            prompt = prompt + self.bias
        tail_keys, tail_values = self.tail_keys[:, :, :self.length], self.tail_values[:, :, :self.length]
        tail = grouped @ tail_keys.transpose(-1, -2)
        if tail.dtype != torch.float32:
            tail = tail.float()
        if q_len > 1:  # query i (tail position t − q + i) sees tail keys 0 … t − q + i
            t = self.length
            causal = torch.ones(q_len, t, dtype=torch.bool, device=grouped.device).tril(t - q_len)
            tail = tail.view(r, h, -1, q_len, t).masked_fill(~causal, float("-inf")).view(r, h, -1, t)
        weights = torch.cat([prompt, tail], dim=-1).softmax(dim=-1)
        w_prompt, w_tail = weights[..., :self.s_max], weights[..., self.s_max:]
        if n == r:
            out = self.value_stack.apply(w_prompt)
        else:
            mine = w_prompt[:n] if self.prefix else w_prompt.index_select(0, self.stacked_index)
            parts = [self.value_stack.apply(mine)]
            for i in self.loose:
                store = self.rows[i].value_store
                values = store.materialize()
                parts.append((w_prompt[i:i + 1, ..., :store.length].to(values.dtype) @ values).float())
            out = torch.cat(parts)
            if self.order is not None:
                out = out.index_select(0, self.order)
        if w_tail.dtype != tail_values.dtype:
            w_tail = w_tail.to(tail_values.dtype)
        out_tail = w_tail @ tail_values
        out = out + out_tail if out_tail.dtype == torch.float32 else out + out_tail.float()
        if out.dtype != query.dtype:
            out = out.to(query.dtype)
        return out.view(r, hq, q_len, d).transpose(1, 2)

    def _attend_rows(self, query: torch.Tensor, scaling: float, mode: str) -> torch.Tensor:
        """The per-row path: each row's prompt scores over its own stores (grouped by shared values), the batched
        tail, and the exact log-sum-exp merge of the two (:class:`Partial`)."""
        r, hq, q_len, d = query.shape
        h = self.tail_keys.shape[1]
        grouped = query.reshape(r, h, hq // h * q_len, d) * scaling
        parts = []
        for group in self.groups:
            scores = [self.rows[i].prompt_scores(grouped[i:i + 1], mode) for i in group]
            parts.append(Partial.of(scores[0] if len(scores) == 1 else torch.cat(scores),
                                    self.rows[group[0]].value_store.materialize()))
        prompt = parts[0] if len(parts) == 1 else Partial(*(torch.cat(x) for x in zip(
            *((p.out, p.norm, p.peak) for p in parts))))
        if self.group_order is not None:
            prompt = Partial(prompt.out[self.group_order], prompt.norm[self.group_order],
                             prompt.peak[self.group_order])
        tail = tail_attention(grouped, self.tail_keys[:, :, :self.length], self.tail_values[:, :, :self.length],
                              q_len)
        return merge([prompt, tail], query.dtype).reshape(r, hq, q_len, d).transpose(1, 2)

    def get_seq_length(self) -> int:
        return max(self.lengths) + self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class BatchedCache(Cache):
    """The rows of one decode batch (each a :class:`CompressedCache`, e.g. every method config of a sample), seen
    by the model as one batch-``R`` cache. ``capacity``: most tokens any row will run through it."""

    def __init__(self, caches: list[CompressedCache], capacity: int, stack: bool = True, consume: bool = False):
        """``consume``: hand each row cache's layer over as soon as it is batched (``caches`` are unusable after),
        so building the batch never holds a layer's stores twice."""
        modes = {c.attention for c in caches}
        if len(modes) != 1:
            raise ValueError(f"one decode batch cannot mix attention modes {sorted(modes)}")
        mode = modes.pop()
        layers = []
        for i in range(len(caches[0].layers)):
            layers.append(BatchedLayer([c.layers[i] for c in caches], capacity, stack, mode))
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
