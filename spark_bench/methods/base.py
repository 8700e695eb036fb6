"""The two small interfaces every compression method implements.

* :class:`EvictionMethod` picks which prompt tokens each kv-head keeps (SnapKV, ...).
* :class:`ChannelMethod` turns the kept keys of one layer into a compact :class:`KeyStore` (ThinK, SparK).

A method configuration composes at most one of each (``snapkv+spark``); eviction runs first, channel pruning
then sees only the surviving tokens, as in kvpress' ``ComposedPress`` used by the official SparK code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.storage.stores import KeyStore


class EvictionMethod(ABC):
    """Token eviction: which prompt positions survive, per layer and kv-head."""

    @abstractmethod
    def keep_indices(self, layer: LayerPrefill, layer_idx: int, num_layers: int) -> torch.Tensor | None:
        """Ascending token indices ``(B, H_kv, n)`` to keep, or ``None`` to keep every token."""


class ChannelMethod(ABC):
    """Key-channel pruning: store the (already evicted) keys of one layer compactly."""

    @abstractmethod
    def compress_keys(self, keys: torch.Tensor, layer: LayerPrefill) -> KeyStore:
        """``keys`` is ``(B, H_kv, S', D)``; ``layer`` carries the observation-window queries."""


def gather_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Select tokens ``(B, H, n)`` from ``x`` ``(B, H, S, D)``."""
    return x.gather(2, indices.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))
