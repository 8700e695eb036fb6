"""The fused decode's member loop for SparK's official recovery at a bfloat16 decode step whose members hold 4 query
rows or more (:func:`~.walk_layout.tiled`; :mod:`.triton_decode`): the stored bytes, the walk's
(:mod:`.triton_walk`), built into a key tile and a sign tile a *nibble* at a time and scored on the tensor cores.

Per token and mask nibble (channels ``4G … 4G + 3``; 32 of them a token at head_dim 128):

* its first kept rank ``ρ`` = the kept channels of the words before its word plus those of its word below it (one
  popcount); four kept entries ending at its last (``ρ + popc(nibble) − 4 …``, from the segment's first entry at
  most) are loaded as 16-bit words and paired into two 32-bit registers, then placed at its kept channels by two
  byte permutes (``PRMT``, :func:`~.triton_math._prmt`) whose selectors (moved by the entries read before ``ρ``)
  and zero masks are the constant table's row for the mask nibble (:func:`~.walk_layout.tile_table`);
* its pruned channels' signs are the next bits of its word's pruned-order sign window (the walk's window: the
  token's sign bits from bit ``32w − before_w`` of them, two aligned words), past the ``4G − kept below`` pruned
  channels before it; the mask nibble and those four bits index the sign tile's four bfloat16 entries (0 kept,
  ±1 pruned; :data:`~.walk_layout.TILE_SIGNS`).

The tiles equal :func:`~.triton_compact._keys`' key tile ``K`` (kept entries at their channels) and sign tile ``S``
entry for entry, and the logits are the compact loop's own (:func:`~.triton_compact._compact_logits`):
``q · k̃ = q · K + √μ_t · (q ∘ a) · S`` (§4's recovery 𝓕 as the official code computes it, ``sign · sqrt(μ) / ‖q̄‖``:
:class:`~spark_bench.methods.channel.recovery.SignedKey`; the C++ kernel's formula), on the tensor cores with float32
products — so a member's logits here are bit for bit the compact loop's. Every load that needs the mask words (the
kept entries, the sign words, the table rows) is issued before any of their data is used: one round trip after the
mask's; the next block's mask words, μ, sign bits and kept entries are asked of L2 the block before
(:func:`~.triton_walk._signed_ahead`). No per-step tables: the dots take the program's query tiles.

Why tiles from 4 rows: a walk's FMAs and gathers grow with a member's rows, a tile's dot covers the program's 16
rows whatever a member holds. sm_90, head_dim 128, T = 26, instructions per warp and 32-token block: the walk's
member loop 741 at 4 rows, 1,111 at 8; the tiles' 665 at either (``scripts/bench/instructions.py``); modelled,
SparK(0.8) rows reach 39% of the HBM bound at GQA 4 and 8, the walk's 34% and 25% (``make bench``, docs/gpu.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from spark_bench.storage.segments import HEAD_COLS, SEG_COLS
from spark_bench.storage.triton_compact import _compact_logits, _visible
from spark_bench.storage.triton_math import _popc, _prmt, _sqrt_rn
from spark_bench.storage.triton_walk import _signed_ahead
from spark_bench.storage.walk_layout import TILE_SIGNS

SEG: tl.constexpr = tl.constexpr(SEG_COLS)  # (the tables' row widths)
HEAD: tl.constexpr = tl.constexpr(HEAD_COLS)
SIGNS: tl.constexpr = tl.constexpr(TILE_SIGNS // 4)  # (the constant table's sign part, in uint32 words)


@triton.jit
def _pairs_to_tile(lo, hi, BLOCK_: tl.constexpr, D_PAD: tl.constexpr):
    """(tokens, words, 8 nibbles) pairs of bfloat16 bit patterns (a nibble's channels 0, 1 in ``lo``, 2, 3 in
    ``hi``) → the ``(BLOCK_, D_PAD)`` bfloat16 tile, channel ``32w + 4g + j``."""
    c0 = (lo & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    c1 = (lo >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    c2 = (hi & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    c3 = (hi >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (BLOCK_, D_PAD))


@triton.jit
def _tile_keys(row, tab_ptr, local0, live, ahead, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_: tl.constexpr,
               MASKED: tl.constexpr, AHEAD: tl.constexpr):
    """The key tile ``K`` ``(BLOCK_, D_PAD)``, ``√μ`` ``(BLOCK_,)`` and the sign tile ``S`` (bfloat16) of a signed
    segment (its table row ``row``) at its ``BLOCK_`` tokens from ``local0`` (int32, in the segment), built a nibble
    at a time (module docstring). A nibble's four entries are read up to its last kept one (or the segment's first
    four: :attr:`~.segments.FusedTables.tiles`), never past the token's row; a dead token (``live`` false, with
    ``MASKED``) reads no mask, μ or sign and its tiles hold no kept entry (its logits are masked by the caller).
    ``AHEAD``: the next block's ``ahead`` tokens' bytes are asked of L2 (:func:`~.triton_walk._signed_ahead`) once
    the mask, μ and the table row are loaded, before the tiles are built (their addresses' registers free by then:
    later, an every-kind launch spills)."""
    NW: tl.constexpr = D // 32    # the mask's 32-bit words (walks: whole words)
    WP: tl.constexpr = D_PAD // 32
    t_kept = tl.load(row + 1).to(tl.int32)
    local = local0 + tl.arange(0, BLOCK_)
    wi = tl.arange(0, WP)
    inw = live[:, None] & (wi < NW)[None, :]  # (a whole block at head_dim D_PAD: every token's every word)
    words = tl.load(row + 3).to(tl.pointer_type(tl.uint32), bitcast=True) + local * (tl.load(row + 4).to(tl.int32)
                                                                                      * NW)
    if MASKED or NW != WP:
        x = tl.load(words[:, None] + wi[None, :], mask=inw, other=0)  # (tokens, words): the mask
    else:
        x = tl.load(words[:, None] + wi[None, :])
    mus = tl.load(row + 5).to(tl.pointer_type(tl.bfloat16), bitcast=True) + local
    if MASKED:
        mu = tl.load(mus, mask=live, other=0.0)
    else:
        mu = tl.load(mus)
    sign_addr = tl.load(row + 6)
    bits = tl.load(row + 7) + (sign_addr & 3) * 8  # (from the 4-byte aligned word below the array's start)
    if AHEAD:
        _signed_ahead(row, local0 + BLOCK_, ahead, t_kept, bits, sign_addr, D, D_PAD, BLOCK_, tl.bfloat16, 2)
    # the stores' loads that need the mask (sign words, kept entries) are issued before either's data is used: one
    # round trip after the mask's (the constant table's rows, L1-resident, after)
    cnt = _popc(x)
    before = tl.cumsum(cnt, axis=1) - cnt  # kept channels in the words before each
    # each word's pruned channels' signs, in pruned order from bit `first` of the token's: one 32-bit window a word
    # (the two aligned words holding it, each loaded only where it holds one of them)
    first = bits + local.to(tl.int64) * (D - t_kept)  # the token's first sign bit
    base = (sign_addr - (sign_addr & 3)).to(tl.pointer_type(tl.uint32), bitcast=True) + (first >> 5)
    off = (first & 31).to(tl.int32)[:, None] + 32 * wi[None, :] - before  # (0 ≤ off < 32 + D)
    n = 32 - cnt  # pruned channels of each word
    shift = off & 31
    if MASKED or NW != WP:
        ok = inw & (n > 0)
    else:
        ok = n > 0
    lo = tl.load(base[:, None] + (off >> 5), mask=ok, other=0)
    hi = tl.load(base[:, None] + (off >> 5) + 1, mask=ok & (shift + n > 32), other=0)
    # per nibble: its first kept rank, the four kept entries ending at its last, placed by two byte permutes
    g4 = (tl.arange(0, 8) * 4).to(tl.uint32)[None, None, :]
    X = x[:, :, None]
    nib = (X >> g4) & 15  # (tokens, words, 8)
    below = _popc(X & ((1 << g4) - 1)).to(tl.uint32)  # the word's kept channels below the nibble
    # the nibble's first kept entry (its token's row, then its first kept rank), and where its four are read: the
    # four that end at its last kept entry (so no read passes the token's row; the segment's first four for its first
    # nibbles: FusedTables.tiles, every signed segment holds four entries or more), the selectors moved by the
    # entries read before its first (each used byte selector ≤ 7, no carry: the nibble's kept entries are inside
    # the four). A dead token (a masked block's) reads the segment's first four.
    if MASKED:
        local = tl.where(live, local, 0)
    at = (local * t_kept)[:, None, None] + before[:, :, None] + below.to(tl.int32)
    back = at - tl.maximum(at + _popc(nib) - 4, 0)
    kept = tl.load(row + 2).to(tl.pointer_type(tl.uint16), bitcast=True) + (at - back)
    e0, e1, e2, e3 = tl.load(kept), tl.load(kept + 1), tl.load(kept + 2), tl.load(kept + 3)
    tab = tab_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    sel, keep = tl.split(tl.load((tab + nib * 2)[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]))
    sel = sel + back.to(tl.uint32) * 0x22222222  # (two bytes an entry, in each of the eight byte selectors)
    a01 = e0.to(tl.uint32) | (e1.to(tl.uint32) << 16)
    a23 = e2.to(tl.uint32) | (e3.to(tl.uint32) << 16)
    zero = tl.zeros_like(a01)  # (placed, then the pruned channels' bytes from a zero word)
    k01 = _prmt(_prmt(a01, a23, sel), zero, keep)
    k23 = _prmt(_prmt(a01, a23, sel >> 16), zero, keep >> 16)
    # the sign tile: (mask nibble, the next 4 signs of its pruned channels — past the 4G − below pruned before it)
    window = ((lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)) >> shift.to(tl.uint64)).to(tl.uint32)
    code = nib | (((window[:, :, None] >> (g4 - below)) & 15) << 4)
    u01, u23 = tl.split(tl.load((tab + SIGNS + code * 2)[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]))
    return (_pairs_to_tile(k01, k23, BLOCK_, D_PAD), _sqrt_rn(tl.maximum(mu.to(tl.float32), 0.0)),
            _pairs_to_tile(u01, u23, BLOCK_, D_PAD))


@triton.jit
def _tile_scores(s, member, m, heads, head_ptr, seg_ptr, tab_ptr, t0, t_end, q1, q2, q3, qa1, qa2, qa3, qd, q_scale,
                 D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_: tl.constexpr, MASKED: tl.constexpr,
                 ONE: tl.constexpr, AHEAD: tl.constexpr = False):
    """Member ``m``'s logits over the ``BLOCK_`` tokens from ``t0`` (those before ``t_end``; AdaKV validity applied)
    into its rows of ``s``: :func:`_tile_keys`' tiles scored as the compact loop scores its own
    (:func:`~.triton_compact._compact_logits`). ``AHEAD``: the next block's bytes are asked of L2 once this block's
    mask and μ loads are issued (:func:`_tile_keys`)."""
    hrow = head_ptr + tl.load(heads + m) * HEAD
    row = seg_ptr + tl.load(hrow) * SEG
    t = t0 + tl.arange(0, BLOCK_).to(tl.int64)
    live = t < t_end
    k, smu, sign = _tile_keys(row, tab_ptr, (t0 - tl.load(row)).to(tl.int32), live,
                              tl.minimum(t_end - t0 - BLOCK_, BLOCK_).to(tl.int32), D, D_PAD, BLOCK_, MASKED, AHEAD)
    sm = _compact_logits(k, smu, sign, q1, q2, q3, qa1, qa2, qa3, qd, q_scale, True, ONE)
    return tl.where((member == m)[:, None] & _visible(hrow, t, live)[None, :], sm, s)
