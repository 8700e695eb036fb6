"""What the fused decode's partials kernel launches under the Triton that compiles it: one table by version.

Torch 2.6 pins Triton 3.2, the kernels are tuned on 3.9 (docs/development.md#tested-versions); a Triton between them
gets the launch of the first row of :data:`LAUNCH_SHAPES` it reaches (:func:`triton_launch`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import triton

# the Triton this runs, (major, minor): the launch shape below is tuned for 3.9; torch 2.6 pins 3.2
TRITON = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", triton.__version__).groups())


@dataclass(frozen=True)
class LaunchShape:
    """What the partials kernel launches under a Triton from ``since`` on (the first row of :data:`LAUNCH_SHAPES`
    this Triton reaches): its bfloat16 warps, whether each block asks L2 for the next one (``AHEAD``,
    triton_math._prefetch), whether a bfloat16 decode step builds SparK's signed rows into tiles
    (``tiles``: storage/triton_tiles.py; else they are walked, walk_layout.tiled), and what differs from the tuned
    kernels (``notes``: scripts/gpu/check.py names them; nothing is disabled)."""

    since: tuple[int, int]
    bf16_warps: int
    prefetch: bool
    notes: tuple[str, ...] = ()
    tiles: bool = True


# Warps of the bfloat16 partials kernel (tensor-core dots): 4 at BLOCK 32 (≤ 248 registers at D ≤ 128, 2 CTAs per
# SM, no spill under 3.9; BLOCK 64 at 4 warps spills, at 8 warps issues ~7% more per byte). A Triton before 3.9
# allocates more registers and spills at 4 warps (every member kind: 100 bytes on sm_90 under 3.2, 16 on sm_80 under
# 3.8; a suffix 500 under 3.2), none at 8 (docs/development.md#tested-versions). Measured on an H200 under 3.6
# (results/bench/gpu/): 4 warps, spilling, run the partials kernel 1.4–1.9× faster than 8 (dense 27 rows × 7,950
# tokens 449 vs 848 µs, the SparK(0.8) 127.5K row 147 vs 206 µs): 4 from 3.6 on; 8 before it (3.2 spills the most;
# not measured on a GPU), where the prefetches' registers spill too (4–16 bytes), so there is none.
LAUNCH_SHAPES = (
    LaunchShape((3, 9), 4, True),
    LaunchShape((3, 6), 4, True, ("the bfloat16 partials kernel spills a few bytes at its 4 warps (measured faster "
                                  "than 8 under 3.6)",)),
    LaunchShape((0, 0), 8, False, (
        "the bfloat16 partials kernel launches 8 warps, not 4 (at 4 this Triton's register allocation spills)",
        "no L2 prefetch of the next block (at 8 warps this Triton spills its registers)",
        "a batch holding a ragged store (tokens keeping different counts: RAGGED) beside every other member kind "
        "spills 24 bytes on sm_90 and sm_80, 36 (sm_80: 44) with value-sparse values too (VSPARSE; none under 3.9)",
        "SparK's official-recovery rows are walked at a decode step, not built into tiles (at 8 warps with every "
        "member kind, the tiles spill 24 bytes on sm_90)"), tiles=False),
)


def triton_launch(version: tuple[int, int]) -> LaunchShape:
    """The row of :data:`LAUNCH_SHAPES` for a Triton ``(major, minor)``."""
    return next(shape for shape in LAUNCH_SHAPES if version >= shape.since)


SHAPE = triton_launch(TRITON)
PARTIAL_WARPS = {2: SHAPE.bf16_warps, 4: 8}  # by element size; float32 (FMA dots): 8 warps at BLOCK 16, no spill
TRITON_NOTES = list(SHAPE.notes)
TILES = SHAPE.tiles  # (walk_layout.tiled)
# by element size: the float32 kernel's 8 warps spill the prefetches' registers (64 bytes on sm_80 under 3.9 with
# every member kind, D = 128, GQA 4), so it asks none, as no kernel at 8 warps does
PREFETCH = {2: SHAPE.prefetch and SHAPE.bf16_warps == 4, 4: False}
