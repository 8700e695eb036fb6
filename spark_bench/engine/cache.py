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


class BatchedLayer(CacheLayerMixin):
    """One decoder layer of a decode batch: each row's compact prompt stores (its own :class:`StoredLayer`) plus
    one preallocated tail buffer ``(R, H_kv, capacity, D)`` for the tokens the rows decode together.

    Rows of a batch advance in lockstep (one token per step, or the same suffix length), so their tails always
    have the same length and the tail part of attention is one batched matmul; only the prompt part runs per row,
    over that row's compact stores (never rebuilt into dense keys unless ``mode="materialize"``).
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, rows: list[StoredLayer], capacity: int):
        super().__init__()
        self.rows = rows
        first = rows[0].value_store
        b, h, _, d = first.shape
        device = (first.data if hasattr(first, "data") else first.kept).device  # DenseStore / UnstructuredStore
        self.tail_keys = torch.empty(len(rows) * b, h, capacity, d, dtype=first.dtype, device=device)
        self.tail_values = torch.empty_like(self.tail_keys)
        self.length = 0
        self.is_initialized = True
        self._group_rows()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: a batched layer is built initialised."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if self.length + n > self.tail_keys.shape[-2]:
            raise RuntimeError(f"decode tail capacity {self.tail_keys.shape[-2]} exceeded")
        self.tail_keys[:, :, self.length:self.length + n] = key_states
        self.tail_values[:, :, self.length:self.length + n] = value_states
        self.length += n
        return self.tail_keys[:, :, :self.length], self.tail_values[:, :, :self.length]

    def _group_rows(self) -> None:
        """Rows whose value store is the same dense tensor (configs sharing an eviction selection) form a group:
        their prompt scores are stacked and the softmax and the ``weights @ values`` product run once per group."""
        groups: dict = {}
        for i, row in enumerate(self.rows):
            store = row.value_store
            groups.setdefault(id(store.data) if isinstance(store, DenseStore) else ("row", i), []).append(i)
        self.groups = list(groups.values())
        flat = [i for g in self.groups for i in g]
        self.order = None if flat == sorted(flat) else torch.tensor(flat, device=self.tail_keys.device).argsort()

    def keep(self, rows: list[int]) -> None:
        """Drop the rows not in ``rows`` (they stopped generating)."""
        index = torch.tensor(rows, device=self.tail_keys.device)
        self.rows = [self.rows[i] for i in rows]
        self.tail_keys, self.tail_values = self.tail_keys[index], self.tail_values[index]
        self._group_rows()

    def attend(self, query: torch.Tensor, scaling: float, mode: str = "compact") -> torch.Tensor:
        """``query (R, H_q, q, D)``, row ``r`` over row ``r``'s stores and tail → ``(R, q, H_q, D)``."""
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
        if self.order is not None:
            prompt = Partial(prompt.out[self.order], prompt.norm[self.order], prompt.peak[self.order])
        tail = tail_attention(grouped, self.tail_keys[:, :, :self.length], self.tail_values[:, :, :self.length],
                              q_len)
        return merge([prompt, tail], query.dtype).reshape(r, hq, q_len, d).transpose(1, 2)

    def get_seq_length(self) -> int:
        return max(row.key_store.length for row in self.rows) + self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class BatchedCache(Cache):
    """The rows of one decode batch (each a :class:`CompressedCache`, e.g. every method config of a sample), seen
    by the model as one batch-``R`` cache. ``capacity``: most tokens any row will run through it."""

    def __init__(self, caches: list[CompressedCache], capacity: int):
        modes = {c.attention for c in caches}
        if len(modes) != 1:
            raise ValueError(f"one decode batch cannot mix attention modes {sorted(modes)}")
        layers = [BatchedLayer([c.layers[i] for c in caches], capacity) for i in range(len(caches[0].layers))]
        super().__init__(layers=layers)
        self.attention = modes.pop()

    def keep(self, rows: list[int]) -> None:
        for layer in self.layers:
            layer.keep(rows)
