"""Value-sparse stores: their compact and dense parts, which both stacked kernels read, and their arithmetic in torch.

A value-sparse store is what ``value_ratio > 0`` makes (Mustafar's values, SparK's Appendix D values with
``value_fill=zero``): an :class:`~.stores.UnstructuredStore` with a zero fill — per token and kv-head a D-bit mask
(``mask_bits``, ``D/8`` bytes, little-endian within a byte: :mod:`.bits`) and the kept entries flat in row-major
order (ascending channel inside a token) — alone or as the compact part of a :class:`~.windowed.WindowedStore`
(Mustafar's last ``R`` tokens dense). Its bytes are ``kept + mask bits`` (+ the dense window), counted by the store
itself. Mustafar's own format (its ``kernel/compression.py``) is a 64-bit bitmap per 64-entry tile (keys: 64 tokens
of one channel; values: 64 channels of one token) with the tile's non-zeros padded to a multiple of 8; this one
has no tiles and no padding, so it is never larger.

Such a row stacks (:class:`~.segments.ValueStack`, :func:`value_parts`; Mustafar's window a dense segment after the
compact tokens): the C++ ``pv_segments`` walks each token's kept entries in place; the fused CUDA decode gives such
a head work items of its own, whose blocks of values it rebuilds from masks, kept entries and granule starts
(``VSPARSE``, :mod:`.triton_decode`). This module also holds the reference they match (:class:`ValueSegments`:
per query head where its kept entries, masks and 32-token blocks start; :func:`block_values`,
:func:`sparse_weighted_sum`: ``weights · values`` rebuilt block by block, never an ``S × D`` matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.storage.bits import unpack_bits
from spark_bench.storage.stores import DenseStore, UnstructuredStore
from spark_bench.storage.windowed import WindowedStore

BLOCK = 32  # tokens per block of the fused kernel's loops (triton_decode.py's BLOCK_N)


def value_parts(store) -> tuple[UnstructuredStore | None, torch.Tensor | None]:
    """``(compact part, dense part)`` of a value store: a value-sparse store alone, or Mustafar's window of dense
    tokens after it; ``ValueError`` for a store whose pruned entries are not zeros (a ``mean`` refill)."""
    if isinstance(store, DenseStore):
        return None, store.data
    if isinstance(store, WindowedStore):
        old, _ = value_parts(store.old)
        return old, store.recent
    if isinstance(store, UnstructuredStore):
        terms = store.recovery.kernel_terms()
        if isinstance(terms, str) or terms.mode != "constant" or terms.fill != 0.0:
            raise ValueError("a value-sparse member reads stores whose pruned entries are zeros (value_fill=zero)")
        return store, None
    raise TypeError(f"{type(store).__name__} is not a value store")


def block_values(kept: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One block's values ``(n, D)`` from its mask ``(n, D)`` bool and its kept entries (flat, row-major): what the
    member loop rebuilds in registers (pruned entries 0)."""
    out = torch.zeros(mask.shape, dtype=kept.dtype, device=kept.device)
    return out.masked_scatter(mask, kept)


@dataclass(frozen=True)
class ValueSegments:
    """Per query head (row × kv-head, in the stores' order) of value-sparse stores, what the fused kernel's
    value-sparse member reads in place:

    * ``kept_off`` / ``mask_off``: the head's first kept entry in its store's ``kept`` and first mask byte in its
      ``mask_bits`` (element offsets; the kernel adds the tensors' addresses, as ``FusedTables`` does);
    * ``block_start (heads, ceil(S_old / 32) + 1)``: the kept-entry offset, relative to the head, at which each
      32-token block starts (the last column: the head's count), so a program reads block ``j`` from
      ``kept_off + block_start[j]`` and walks the mask bits to place them — tokens keep different counts where
      magnitudes tie, so ``t · T`` is not enough;
    * ``n_old`` / ``n_recent``: the compact tokens and the dense window's tokens (``WindowedStore``), the window
      read as a dense value run after the compact ones.

    The kernels read the same layout through ``segments.ValueStack`` and ``FusedTables`` (per 16-token granule
    starts, :func:`~.segments.granule_starts`, rather than these 32-token blocks); :func:`sparse_weighted_sum` is
    the reference they match.
    """

    kept_off: torch.Tensor     # (heads,) int64
    mask_off: torch.Tensor     # (heads,) int64
    block_start: torch.Tensor  # (heads, n_blocks + 1) int64
    n_old: int
    n_recent: int

    @classmethod
    def of(cls, store) -> "ValueSegments":
        compact, dense = value_parts(store)
        if compact is None:
            raise ValueError("a dense value store needs no value-sparse segments")
        b, h, s, d = compact.shape
        counts = compact.kept_mask().sum(-1).reshape(b * h, s)  # kept entries per token
        head_counts = counts.sum(-1)
        kept_off = torch.cat([head_counts.new_zeros(1), head_counts.cumsum(0)[:-1]])
        n_blocks = -(-s // BLOCK)
        padded = torch.nn.functional.pad(counts, (0, n_blocks * BLOCK - s)).reshape(b * h, n_blocks, BLOCK).sum(-1)
        block_start = torch.cat([padded.new_zeros(b * h, 1), padded.cumsum(-1)], dim=-1)
        mask_off = torch.arange(b * h, device=counts.device) * s * (d // 8)
        return cls(kept_off, mask_off, block_start, s, 0 if dense is None else dense.shape[-2])


def sparse_weighted_sum(weights: torch.Tensor, store) -> torch.Tensor:
    """``weights (B, H, G, S)`` float32 · the values of ``store`` → ``(B, H, G, D)`` float32, rebuilding 32 tokens
    at a time from the compact store as the fused kernel's member would (:class:`ValueSegments`), the dense window
    as plain rows: the reference for a value-sparse member kind (equal to ``weights @ store.materialize()``)."""
    compact, dense = value_parts(store)
    b, h, g, s = weights.shape
    d = store.shape[-1]
    out = torch.zeros(b, h, g, d, dtype=torch.float32, device=weights.device)
    n_old = 0
    if compact is not None:
        seg = ValueSegments.of(compact)
        n_old = seg.n_old
        mask = unpack_bits(compact.mask_bits, d).reshape(b * h, n_old, d)
        w = weights[..., :n_old].reshape(b * h, g, n_old)
        flat = out.view(b * h, g, d)
        for i in range(b * h):
            base = int(seg.kept_off[i])
            for j in range(seg.block_start.shape[1] - 1):
                lo, hi = int(seg.block_start[i, j]), int(seg.block_start[i, j + 1])
                t0, t1 = j * BLOCK, min((j + 1) * BLOCK, n_old)
                block = block_values(compact.kept[base + lo:base + hi], mask[i, t0:t1])
                flat[i] += w[i, :, t0:t1] @ block.float()
    if dense is not None and dense.shape[-2]:
        out += weights[..., n_old:] @ dense.float()
    return out
