"""A transformers :class:`~transformers.Cache` whose prompt part lives in compact stores.

Each layer holds the prompt's keys and values in :mod:`spark_bench.storage` stores (compressed once, after
prefill) and the decoded tokens' keys/values densely, as the official implementations do. Attention over a
layer is computed here (:meth:`StoredLayer.attend`), by :mod:`spark_bench.engine.attention`, so the key matrix of
a channel-pruned store is never rebuilt unless a store has no faster way (``attention="materialize"`` forces the
dense reference path: rebuild keys and values, then run the model's usual SDPA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from spark_bench.storage.bits import pack_bits, tensor_bytes, unpack_bits
from spark_bench.storage.stores import Store

ATTENTION_MODES = ("compact", "materialize")


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

    def attend(self, query: torch.Tensor, scaling: float, mode: str = "compact") -> torch.Tensor:
        """Attention of ``query (B, H_q, q, D)`` (the newest ``q`` tokens, already in the tail) over this layer.

        Returns ``(B, q, H_q, D)`` like transformers' attention functions.
        """
        b, hq, q_len, d = query.shape
        h = self.value_store.shape[1]
        group = hq // h
        s, t = self.key_store.length, self.tail_length
        # causal inside the tail: query i (position t − q_len + i) sees tail keys 0 … t − q_len + i
        causal = torch.ones(q_len, t, dtype=torch.bool, device=query.device).tril(t - q_len)
        valid = self.valid()
        if mode == "materialize":
            keys, values = self.materialized()
            mask = torch.cat([torch.ones(q_len, s, dtype=torch.bool, device=query.device), causal], dim=-1)
            mask = mask.expand(b, hq, q_len, s + t)
            if valid is not None:
                prompt = valid.repeat_interleave(group, dim=1).unsqueeze(2).expand(b, hq, q_len, s)
                mask = torch.cat([prompt, mask[..., s:]], dim=-1)
            out = F.scaled_dot_product_attention(query, keys.repeat_interleave(group, dim=1),
                                                 values.repeat_interleave(group, dim=1), attn_mask=mask,
                                                 scale=scaling)
            return out.transpose(1, 2)
        grouped = query.reshape(b, h, group * q_len, d)  # query head i uses kv-head i // group
        logits = self.key_store.logits(grouped).float()
        if valid is not None:
            logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
        if t:
            tail = (grouped @ self.tail_keys.transpose(-1, -2)).float()
            tail = tail.view(b, h, group, q_len, t).masked_fill(~causal, float("-inf")).view(b, h, group * q_len, t)
            logits = torch.cat([logits, tail], dim=-1)
        weights = (logits * scaling).softmax(dim=-1).to(query.dtype)
        out = weights[..., :s] @ self.value_store.materialize()
        if t:
            out = out + weights[..., s:] @ self.tail_values
        return out.view(b, hq, q_len, d).transpose(1, 2)

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
