"""A transformers :class:`~transformers.Cache` whose prompt part lives in compact key stores.

Decoding goes through the model's own forward with this cache: each attention layer calls ``update`` with the new
token's key/value, and gets back the keys attention should see, i.e. the store's keys (rebuilt with recovery for
SparK, zero-filled pruned channels for ThinK) followed by the decoded tokens' keys, which are stored densely as in
the official implementations (compression happens once, after prefill).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from spark_bench.storage.bits import tensor_bytes
from spark_bench.storage.stores import KeyStore


class StoredLayer(CacheLayerMixin):
    """One layer: prompt keys in a :class:`KeyStore`, values dense, decoded tokens appended densely."""

    is_sliding = False
    is_compileable = False

    def __init__(self, store: KeyStore, values: torch.Tensor):
        super().__init__()
        if store.length != values.shape[-2]:
            raise ValueError(f"key store holds {store.length} tokens but values hold {values.shape[-2]}")
        self.store = store
        self.values = values
        self.tail_keys = values[..., :0, :]
        self.dtype, self.device = values.dtype, values.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: a stored layer is built initialised."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.tail_keys = torch.cat([self.tail_keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        keys = torch.cat([self.store.materialize(), self.tail_keys], dim=-2)
        return keys, self.values

    def get_seq_length(self) -> int:
        return self.store.length + self.tail_keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes actually held: compact prompt keys + decoded keys + all values."""
        return self.store.nbytes() + tensor_bytes(self.tail_keys, self.values)


class CompressedCache(Cache):
    """A cache built from per-layer :class:`StoredLayer` objects (one per decoder layer)."""

    def __init__(self, layers: list[StoredLayer]):
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
