"""The layout of the fused decode's signed members at a decode step — walked (:mod:`.triton_walk`) or built into
tensor-core tiles a nibble at a time (:mod:`.triton_tiles`): where each applies, their constant table and the size of
the walk's per-step tables. Plain Python, read by the tables (:class:`~.segments.FusedTables`), the launches
(:mod:`.triton_decode`) and the memory planner (``memory.step_work``)."""

from __future__ import annotations

import functools

WALK_TABLE_BYTES = 2368  # the walk's constant table (walk_table)
TILE_TABLE_BYTES = 2176  # the tiles' (tile_table): per mask nibble, its PRMT selectors, placing and zeroing (128 B);
TILE_SIGNS = 128         # from here, per (mask nibble, its pruned channels' next 4 signs) the sign tile's entries
TILE_ROWS = 4            # query rows per member from which the tiles serve a bfloat16 decode step
PROGRAM_ROWS = 16        # query rows of one program of the fused decode (triton_decode.ROWS: the dots' M)


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


@functools.lru_cache(maxsize=1)
def tile_table() -> bytes:
    """The tiles' constant table (uint32, little-endian). Per mask nibble (16 × 2): the ``PRMT`` selectors placing its
    kept entries (channel ``j`` ← bytes ``2s, 2s + 1`` of four entries from the nibble's first kept rank, ``s`` = its
    kept channels below ``j``; channels 0, 1 in the low half, 2, 3 in the high half: each half one permute's four
    byte selectors; the kernel, whose four end at the nibble's last kept entry, adds 2 to each selector per entry
    read before the first), then the selectors that keep those channels' bytes and zero the others' (byte
    ``i`` ← ``i``, or 4: byte 0 of a zero word; same halves). Per (mask nibble, the next four sign bits of its pruned
    channels in pruned order) (256 × 2, from :data:`TILE_SIGNS`): the sign tile's four bfloat16 entries, in pairs:
    0 kept, +1 (0x3F80) pruned positive, −1 (0xBF80) pruned negative — :func:`~.triton_compact._keys`' ``S``."""
    words = []
    for nib in range(16):
        sel, keep = 0, 0x44444444
        for j in (j for j in range(4) if nib >> j & 1):
            src = bin(nib & ((1 << j) - 1)).count("1")
            sel |= (2 * src | (2 * src + 1) << 4) << (8 * j)
            keep ^= (0x44 ^ (2 * (j % 2) | (2 * (j % 2) + 1) << 4)) << (8 * j)
        words += [sel, keep]
    for code in range(256):
        nib, signs = code & 15, code >> 4
        v = [0 if nib >> j & 1 else 0x3F80 if signs >> (j - bin(nib & ((1 << j) - 1)).count("1")) & 1 else 0xBF80
             for j in range(4)]
        words += [v[0] | v[1] << 16, v[2] | v[3] << 16]
    out = b"".join(w.to_bytes(4, "little") for w in words)
    assert len(out) == TILE_TABLE_BYTES and TILE_SIGNS == 16 * 8
    return out


def tiled(members: int, itemsize: int) -> bool:
    """Whether a decode step's signed members are built into key tiles (:mod:`.triton_tiles`) rather than walked, for
    work items of ``members`` query heads (each ``PROGRAM_ROWS // members`` query rows): bfloat16 stores (entries
    placed by byte permutes, scored on the tensor cores) whose members hold at least :data:`TILE_ROWS` query rows. A
    walk's FMAs and gathers grow with the rows, a tile's dot covers the program's 16 rows whatever a member holds
    (sm_90 SASS, ``scripts/bench/instructions.py``). (The tables also ask that every signed segment hold four kept
    entries or more: :attr:`~.segments.FusedTables.tiles`; and a Triton that compiles them without a spill:
    :data:`~.triton_versions.TILES`, none before 3.6.)"""
    return itemsize == 2 and PROGRAM_ROWS // members >= TILE_ROWS and _tiles_compile()


def _tiles_compile() -> bool:
    """Whether this environment's Triton builds the tiles (:data:`~.triton_versions.TILES`); without Triton there
    is no fused decode for them to serve."""
    try:
        from spark_bench.storage.triton_versions import TILES
    except ImportError:
        return False
    return TILES


def head_floats(head_dim: int, rpm: int) -> int:
    """Floats of one query head's per-step tables: ``q`` and ``qa`` by channel (``head_dim + 1`` rows, the last 0),
    the nibble sums (the padded head_dim's nibbles × 16 subsets, 0 past ``head_dim``), ``Σ_c qa`` — ``rpm`` rows
    each."""
    padded = max(32, 1 << (head_dim - 1).bit_length())
    return (head_dim + 1) * 2 * rpm + padded // 4 * 16 * rpm + rpm
