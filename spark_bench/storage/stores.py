"""Key stores: what a channel-pruned layer actually keeps in memory.

A store owns only compact tensors and rebuilds the ``(B, H, S, D)`` key matrix that attention sees on demand
(:meth:`materialize`). :meth:`nbytes` is the true size of everything it holds, metadata included, so the
byte figures in every prediction are measured, not estimated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from spark_bench.storage.bits import pack_bits, tensor_bytes, unpack_bits


class KeyStore(Protocol):
    """Compact prompt keys of one layer."""

    @property
    def length(self) -> int: ...

    def materialize(self) -> torch.Tensor: ...

    def nbytes(self) -> int: ...


class Recovery(Protocol):
    """Refills pruned key entries at attention time from cached statistics (paper §4.3)."""

    def fill(self, kept_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...

    def nbytes(self) -> int: ...


def channel_index_dtype(head_dim: int) -> torch.dtype:
    """Smallest integer type that can hold a channel index."""
    return torch.uint8 if head_dim <= 256 else torch.int16


@dataclass(frozen=True)
class DenseKeyStore:
    """Uncompressed keys (reference / no channel pruning)."""

    keys: torch.Tensor

    @property
    def length(self) -> int:
        return self.keys.shape[-2]

    def materialize(self) -> torch.Tensor:
        return self.keys

    def nbytes(self) -> int:
        return tensor_bytes(self.keys)


@dataclass(frozen=True)
class UnstructuredKeyStore:
    """Per-token channel subsets (SparK): kept entries + a D-bit channel mask per token + recovery metadata.

    ``kept`` is ``(B, H, S, T)`` with the kept entries of every token in ascending channel order, so the mask
    alone says where each value goes (no explicit indices needed).
    """

    kept: torch.Tensor
    mask_bits: torch.Tensor
    head_dim: int
    recovery: Recovery

    @classmethod
    def from_mask(cls, keys: torch.Tensor, kept_mask: torch.Tensor, recovery: Recovery) -> "UnstructuredKeyStore":
        """Build from dense keys and a bool mask with the same number of kept channels in every row."""
        kept_per_row = kept_mask.sum(-1)
        n_kept = int(kept_per_row.flatten()[0]) if kept_per_row.numel() else 0
        if not bool((kept_per_row == n_kept).all()):
            raise ValueError("UnstructuredKeyStore needs the same number of kept channels for every token")
        kept = keys.masked_select(kept_mask).reshape(*keys.shape[:-1], n_kept)
        return cls(kept=kept, mask_bits=pack_bits(kept_mask), head_dim=keys.shape[-1], recovery=recovery)

    @property
    def length(self) -> int:
        return self.kept.shape[-2]

    def kept_mask(self) -> torch.Tensor:
        return unpack_bits(self.mask_bits, self.head_dim)

    def materialize(self) -> torch.Tensor:
        mask = self.kept_mask()
        out = self.recovery.fill(mask, self.kept.dtype)
        return out.masked_scatter(mask, self.kept)

    def nbytes(self) -> int:
        return tensor_bytes(self.kept, self.mask_bits) + self.recovery.nbytes()


@dataclass(frozen=True)
class StructuredKeyStore:
    """One channel subset per head shared by all older tokens (ThinK), plus the recent tokens kept dense.

    ``kept`` is ``(B, H, S_old, T)``, ``channels`` ``(B, H, T)`` ascending channel indices, ``recent``
    ``(B, H, R, D)``. Pruned channels read as zero, which is exactly ThinK's "prune the query channels to
    match" (q·k only sums over kept channels).
    """

    kept: torch.Tensor
    channels: torch.Tensor
    recent: torch.Tensor
    head_dim: int

    @property
    def length(self) -> int:
        return self.kept.shape[-2] + self.recent.shape[-2]

    def materialize(self) -> torch.Tensor:
        b, h, s_old, _ = self.kept.shape
        out = self.kept.new_zeros(b, h, s_old, self.head_dim)
        index = self.channels.long().unsqueeze(-2).expand(b, h, s_old, -1)
        out.scatter_(-1, index, self.kept)
        return torch.cat([out, self.recent], dim=-2)

    def nbytes(self) -> int:
        return tensor_bytes(self.kept, self.channels, self.recent)
