"""Bit packing for boolean masks (channel masks, sign bits) stored one bit per entry."""

from __future__ import annotations

import torch

_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor ``(..., n)`` into uint8 ``(..., ceil(n / 8))``, little-endian within a byte."""
    n = bits.shape[-1]
    pad = (-n) % 8
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad), value=False)
    grouped = bits.reshape(*bits.shape[:-1], -1, 8).to(torch.uint8)
    return (grouped * _WEIGHTS.to(bits.device)).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``(..., ceil(n / 8))`` back to bool ``(..., n)``."""
    weights = _WEIGHTS.to(packed.device)
    bits = (packed.unsqueeze(-1) & weights) != 0
    return bits.reshape(*packed.shape[:-1], -1)[..., :n]


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """True storage size of the given tensors in bytes (``None`` entries count zero)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
