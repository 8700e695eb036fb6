"""Stores: what a compressed layer actually keeps in memory, for keys and for values.

A store owns only compact tensors. Attention reads it through :meth:`logits` (keys: ``q·kᵀ`` for grouped
queries) or :meth:`materialize` (the dense ``(B, H, S, D)`` matrix, the reference path and the value path).
:meth:`nbytes` is the true size of everything a store holds, metadata included, so the byte figures in every
prediction are measured, not estimated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from spark_bench.storage.bits import masked_entries, pack_bits, tensor_bytes, unpack_bits


class Store(Protocol):
    """Compact prompt keys or values of one layer."""

    @property
    def length(self) -> int: ...

    @property
    def shape(self) -> tuple[int, int, int, int]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def materialize(self) -> torch.Tensor: ...

    def logits(self, queries: torch.Tensor) -> torch.Tensor: ...

    def nbytes(self) -> int: ...


class Recovery(Protocol):
    """Refills pruned entries at attention time from cached statistics (paper §4.3)."""

    def fill(self, kept_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...

    def kernel_terms(self): ...  # segments.KernelTerms for the compact kernel, or why not (a string)

    def nbytes(self) -> int: ...


def channel_index_dtype(head_dim: int) -> torch.dtype:
    """Smallest integer type that can hold a channel index."""
    return torch.uint8 if head_dim <= 256 else torch.int16


def dense_logits(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``queries (B, H, G, D) @ keys (B, H, S, D)ᵀ → (B, H, G, S)`` in the queries' dtype."""
    return queries @ keys.to(queries.dtype).transpose(-1, -2)


@dataclass(frozen=True)
class DenseStore:
    """Uncompressed keys or values (no channel pruning)."""

    data: torch.Tensor

    @property
    def length(self) -> int:
        return self.data.shape[-2]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def materialize(self) -> torch.Tensor:
        return self.data

    def logits(self, queries: torch.Tensor) -> torch.Tensor:
        return dense_logits(queries, self.data)

    def nbytes(self) -> int:
        return tensor_bytes(self.data)

    def kept_fraction(self) -> float:
        return 1.0


@dataclass(frozen=True)
class UnstructuredStore:
    """Per-token channel subsets (SparK keys, norm-pruned values): kept entries + a D-bit mask + recovery.

    ``kept`` is flat: the kept entries of every token in row-major order (ascending channel inside a token), so
    the mask alone says where each value goes and tokens may keep different numbers of channels (SparK-p/-g).
    """

    kept: torch.Tensor
    mask_bits: torch.Tensor
    shape: tuple[int, int, int, int]
    recovery: Recovery
    row_kept: int | None = None  # channels every token keeps, or None when tokens differ (SparK-p / -g)

    @classmethod
    def from_mask(cls, data: torch.Tensor, kept_mask: torch.Tensor, recovery: Recovery) -> "UnstructuredStore":
        per_row = kept_mask.sum(-1)
        fixed = int(per_row.flatten()[0]) if per_row.numel() and bool((per_row == per_row.flatten()[0]).all()) \
            else None
        return cls(kept=masked_entries(data, kept_mask), mask_bits=pack_bits(kept_mask), shape=tuple(data.shape),
                   recovery=recovery, row_kept=fixed)

    @property
    def length(self) -> int:
        return self.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.kept.dtype

    def kept_mask(self) -> torch.Tensor:
        return unpack_bits(self.mask_bits, self.head_dim)

    def materialize(self) -> torch.Tensor:
        mask = self.kept_mask()
        return self.recovery.fill(mask, self.kept.dtype).masked_scatter(mask, self.kept)

    def logits(self, queries: torch.Tensor) -> torch.Tensor:
        """The reference path: rebuild the keys, then multiply (the compact kernels: :mod:`.dispatch`)."""
        return dense_logits(queries, self.materialize())

    def nbytes(self) -> int:
        return tensor_bytes(self.kept, self.mask_bits) + self.recovery.nbytes()

    def kept_fraction(self) -> float:
        total = 1
        for n in self.shape:
            total *= n
        return self.kept.numel() / max(total, 1)


@dataclass(frozen=True)
class StructuredKeyStore:
    """One channel subset per head shared by all older tokens (ThinK), plus the recent tokens kept dense.

    ``kept`` is ``(B, H, S_old, T)``, ``channels`` ``(B, H, T)`` ascending channel indices, ``recent``
    ``(B, H, R, D)``. Pruned channels read as zero, which is exactly ThinK's "prune the query channels to
    match" (q·k only sums over kept channels); :meth:`logits` does that directly, without rebuilding keys.
    """

    kept: torch.Tensor
    channels: torch.Tensor
    recent: torch.Tensor
    head_dim: int

    @property
    def length(self) -> int:
        return self.kept.shape[-2] + self.recent.shape[-2]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (*self.kept.shape[:2], self.length, self.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.kept.dtype

    def materialize(self) -> torch.Tensor:
        b, h, s_old, _ = self.kept.shape
        out = self.kept.new_zeros(b, h, s_old, self.head_dim)
        index = self.channels.long().unsqueeze(-2).expand(b, h, s_old, -1)
        out.scatter_(-1, index, self.kept)
        return torch.cat([out, self.recent], dim=-2)

    def logits(self, queries: torch.Tensor) -> torch.Tensor:
        index = self.channels.long().unsqueeze(-2).expand(*queries.shape[:-1], -1)
        pruned_queries = queries.gather(-1, index)  # (B, H, G, T): ThinK prunes the query channels to match
        return torch.cat([dense_logits(pruned_queries, self.kept), dense_logits(queries, self.recent)], dim=-1)

    def nbytes(self) -> int:
        return tensor_bytes(self.kept, self.channels, self.recent)

    def kept_fraction(self) -> float:
        old, recent = self.kept.shape[-2], self.recent.shape[-2]
        return (old * self.kept.shape[-1] + recent * self.head_dim) / max((old + recent) * self.head_dim, 1)
