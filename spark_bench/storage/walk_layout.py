"""The layout of the fused decode's signed walk (:mod:`.triton_walk`): where it applies, its constant table and the
size of its per-step tables. Plain Python, read by the tables (:class:`~.segments.FusedTables`), the launches
(:mod:`.triton_decode`) and the memory planner (``memory.step_work``)."""

from __future__ import annotations

import functools

WALK_TABLE_BYTES = 2368  # the constant table (walk_table)


def walks(head_dim: int) -> bool:
    """Whether the walk serves keys of ``head_dim`` channels: whole 32-bit mask words, at most four (each token's
    four lanes recover one word each)."""
    return head_dim % 32 == 0 and head_dim <= 128


@functools.lru_cache(maxsize=1)
def walk_table() -> bytes:
    """The walk's constant table: 256 × 8 (byte, j) → the bit of the byte's j-th set bit; 16 × 4 (which of words 1-3
    are nonzero, word k) → 8 × the next nonzero word after k (24 if none: word 3); 16 × 16 (pruned channels of a
    nibble, the next four sign bits in pruned order) → the nibble's positive channels."""
    out = bytearray(WALK_TABLE_BYTES)
    for v in range(256):
        for j, b in enumerate(b for b in range(8) if v >> b & 1):
            out[8 * v + j] = b
    for z in range(16):
        for k in range(4):
            out[2048 + 4 * z + k] = 8 * next((j for j in range(k + 1, 4) if z >> j & 1), 3)
    for pm in range(16):
        on = [i for i in range(4) if pm >> i & 1]
        for ch in range(16):
            out[2112 + 16 * pm + ch] = sum(1 << i for j, i in enumerate(on) if ch >> j & 1)
    return bytes(out)


def head_floats(head_dim: int, rpm: int) -> int:
    """Floats of one query head's per-step tables: ``q`` and ``qa`` by channel (``head_dim + 1`` rows, the last 0),
    the nibble sums (the padded head_dim's nibbles × 16 subsets, 0 past ``head_dim``), ``Σ_c qa`` — ``rpm`` rows
    each."""
    padded = max(32, 1 << (head_dim - 1).bit_length())
    return (head_dim + 1) * 2 * rpm + padded // 4 * 16 * rpm + rpm
