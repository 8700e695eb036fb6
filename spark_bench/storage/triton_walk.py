"""The fused decode's member loop for SparK's official recovery at a decode step (:mod:`.triton_decode`), by walks:
each token's kept entries are visited where they are stored, never placed in a key tile. It serves members of 1 or
2 query rows, float32 stores and Triton before 3.6; a bfloat16 step of 4 rows a member or more builds tiles instead
(:mod:`.triton_tiles`, :func:`~.walk_layout.tiled`).

Per member (a query head's ``RPM`` rows) and token ``t`` the logit is (``segments.MODES`` 2, the C++ kernel's formula)

    s_r = Σ_{c kept} q_r[c] · k_tc  +  √μ_t · Σ_{c pruned} sign_tc · qa_r[c]        (qa = q ∘ a)
        = Σ_{c kept} (q_r[c] · k_tc + √μ_t · qa_r[c])  +  √μ_t · (2 Σ_{c pruned, sign +} qa_r[c] − Σ_c qa_r[c])

A block of 32 tokens runs on 128 lanes, four per token: lane ``W`` of token ``t`` walks its kept ranks
``W·⌈T/4⌉ …`` (the channel of its first rank found once — its mask word by the words' popcounts, its byte by SWAR
prefix sums, its bit by a (byte, j) → bit table — then each next kept channel by ``ffs`` and, past the word's last,
a jump to the next nonzero word by a table) and recovers mask word ``W``'s pruned channels: their signs, stored in
pruned order, are read as one 32-bit window of the sign bits, and per nibble a 256-byte table turns (pruned nibble,
its next signs) into the nibble of its positive channels, which indexes a per-step table of ``qa`` sums over each
nibble's subsets. Products and sums are float32 FMAs/adds; the four lanes' partial logits are summed at the end.

The per-step tables (per query head: ``q`` and ``qa`` by channel, a zero row for padding slots; the nibble sums;
``Σ_c qa``; :func:`~.walk_layout.head_floats` floats) are written by each program that serves the
head, in its prologue (:func:`_walk_tables`), into a buffer of the launch: every program serving a head writes the
same values, so it reads what it wrote after its own barrier whichever program wrote last. The constant table
(:func:`~.walk_layout.walk_table`, 2,368 bytes) travels with the other tables
(``FusedTables.walk_tab``). A lane's kept ranks are visited ``SLOTS`` per trip of a loop (the last trip's extra ones
masked). On sm_90 at T = 26 (SparK 0.8, head_dim 128): 380 + 155 per trip = 690 SASS instructions per warp per
32-token block, instead of the dense-tile loop's 952 (``scripts/bench/instructions.py``; a standalone walk with T
fixed, ``scripts/bench/member_layouts.py`` layout W, 463).
"""

from __future__ import annotations

import triton
import triton.language as tl

from spark_bench.storage.segments import HEAD_COLS, SEG_COLS
from spark_bench.storage.triton_compact import _visible
from spark_bench.storage.triton_math import _ffs, _popc, _prefetch, _sqrt_rn

SEG: tl.constexpr = tl.constexpr(SEG_COLS)  # (the tables' row widths)
HEAD: tl.constexpr = tl.constexpr(HEAD_COLS)
SLOTS: tl.constexpr = tl.constexpr(4)    # kept ranks a lane visits per trip of its loop (_slots, _kept4: four)
NEXT: tl.constexpr = tl.constexpr(2048)    # offsets in the constant table (walk_layout.walk_table): (byte, j) → bit
EXPAND: tl.constexpr = tl.constexpr(2112)  # of its j-th set bit at 0, (nonzero words, k) → 8 × the next nonzero
#                                            word, (pruned nibble, signs) → the positive channels' nibble


@triton.jit
def _walk_tables(walk_ptr, q, qa, qh_r, own, r, c, D: tl.constexpr, D_PAD: tl.constexpr, RPM: tl.constexpr):
    """A program's prologue: the per-step tables of its query heads whose rows ``own`` (signed members) from their
    scaled queries ``q`` and ``qa = q ∘ a`` ``(rows, D_PAD)``, then a barrier."""
    HS: tl.constexpr = (D + 1) * 2 * RPM + D_PAD // 4 * 16 * RPM + RPM
    rr = r % RPM
    hb = walk_ptr + qh_r * HS
    at = hb[:, None] + c[None, :] * (2 * RPM) + rr[:, None]
    ok = own[:, None] & (c < D)[None, :]
    tl.store(at, q, mask=ok)
    tl.store(at + RPM, qa, mask=ok)
    tl.store(hb + D * (2 * RPM) + rr, tl.zeros_like(rr).to(tl.float32), mask=own)  # the padding slots' row
    tl.store(hb + D * (2 * RPM) + RPM + rr, tl.zeros_like(rr).to(tl.float32), mask=own)
    # nibble sums: entry e of nibble G = Σ_{i: bit i of e} qa[4G + i]
    lo, hi = tl.split(tl.reshape(qa, (q.shape[0], D_PAD // 4, 2, 2)))  # channels 4G + (0, 2) and 4G + (1, 3)
    c0, c2 = tl.split(lo)
    c1, c3 = tl.split(hi)
    grp = tl.arange(0, D_PAD // 4)[None, :]
    at = hb[:, None] + (D + 1) * 2 * RPM + grp * (16 * RPM) + rr[:, None]
    ok = own[:, None] & (grp >= 0)  # (every nibble: 0 past D)
    for e in tl.static_range(16):  # (an entry at a time: a few registers)
        lut = tl.zeros_like(c0)
        if e & 1:
            lut += c0
        if e & 2:
            lut += c1
        if e & 4:
            lut += c2
        if e & 8:
            lut += c3
        tl.store(at + e * RPM, lut, mask=ok)
    tl.store(hb + (D + 1) * 2 * RPM + D_PAD // 4 * 16 * RPM + rr, tl.sum(qa, axis=1), mask=own)
    tl.debug_barrier()


@triton.jit
def _kept4(kept, i, lim):
    """A lane's kept entries ``i … i + 3`` (those before ``lim``; 0 past them: nothing read)."""
    return (tl.load(kept + i, mask=i < lim, other=0.0), tl.load(kept + i + 1, mask=i + 1 < lim, other=0.0),
            tl.load(kept + i + 2, mask=i + 2 < lim, other=0.0), tl.load(kept + i + 3, mask=i + 3 < lim, other=0.0))


@triton.jit
def _slots(k0, k1, k2, k3, i0, lim, rem, s8, nxt, x1, x2, x3, acc, kqa, q_b, r, D: tl.constexpr, RPM: tl.constexpr):
    """One trip: a lane's kept ranks ``i0 … i0 + 3`` (those before ``lim``; the others read the per-step tables' zero
    row), entries ``k0 … k3``: each kept channel's ``q`` times its entry into ``acc``, its ``q ∘ a`` into ``kqa``;
    the walk (``rem``, ``s8``) moved on to the next kept channel at each."""
    for u in tl.static_range(SLOTS):
        ok = i0 + u < lim
        idx = tl.where(ok, s8 * 4 + _ffs(rem).to(tl.uint32) - 1, D)  # (a padding slot: the zero row)
        if u == 0:  # (u is a constant: one entry's register, no select)
            k = k0.to(tl.float32)
        elif u == 1:
            k = k1.to(tl.float32)
        elif u == 2:
            k = k2.to(tl.float32)
        else:
            k = k3.to(tl.float32)
        rem = rem & (rem - 1)  # the next kept channel: this word's next, or the next nonzero word's first
        n8 = (nxt >> s8) & 0xFF
        empty = rem == 0
        rem = tl.where(empty, tl.where(n8 == 8, x1, tl.where(n8 == 16, x2, x3)), rem)
        s8 = tl.where(empty, n8, s8)
        at = q_b + (idx * (2 * RPM))[:, :, :, None] + r
        acc += k[:, :, :, None] * tl.load(at)
        kqa += tl.load(at + RPM)
    return rem, s8, acc, kqa


@triton.jit
def _walk_start(x0, x1, x2, x3, c1, c2, c3, p0, tab):
    """Where a lane's walk starts: kept rank ``p0`` (uint32) of a token's mask words ``x0 … x3`` (``c1, c2, c3``:
    the kept channels before words 1, 2, 3) — its word by those counts, its byte by SWAR prefix sums of the byte
    counts, its bit by the constant table's (byte, j) → bit — as (the word's kept channels from that rank on,
    8 × the word's index, the table's next-nonzero-word entry for the token: byte k = 8 × the word after k)."""
    g1, g2, g3 = p0 >= c1, p0 >= c2, p0 >= c3
    xw = tl.where(g3, x3, tl.where(g2, x2, tl.where(g1, x1, x0)))
    rr = p0 - tl.where(g3, c3, tl.where(g2, c2, tl.where(g1, c1, 0)))
    s8 = tl.where(g3, 24, tl.where(g2, 16, tl.where(g1, 8, 0))).to(tl.uint32)
    bc = xw - ((xw >> 1) & 0x55555555)
    bc = (bc & 0x33333333) + ((bc >> 2) & 0x33333333)
    bc = (bc + (bc >> 4)) & 0x0F0F0F0F  # set bits per byte
    pb = bc * 0x01010101  # their inclusive prefix sums
    shb = _popc(((rr * 0x01010101 + 0x80808080) - pb) & 0x80808080).to(tl.uint32) * 8
    eb = ((pb - bc) >> shb) & 0xFF
    c0 = shb + tl.load(tab + ((xw >> shb) & 0xFF) * 8 + ((rr - eb) & 7)).to(tl.uint32)
    nzw = (tl.where(x1 != 0, 2, 0) | tl.where(x2 != 0, 4, 0) | tl.where(x3 != 0, 8, 0)).to(tl.uint32)
    nxt = tl.load((tab + NEXT + nzw * 4).to(tl.pointer_type(tl.uint32), bitcast=True))
    return xw & (0xFFFFFFFF << (c0 & 31)), s8, nxt


@triton.jit
def _signed_ahead(row, l1, n1, t_kept, bits, sign_addr, D: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK_: tl.constexpr, ELEM: tl.constexpr, ESIZE: tl.constexpr):
    """Ask L2 (:func:`~.triton_math._prefetch`) for the next block's bytes of a signed segment (table row ``row``;
    ``bits``: its sign bits' first bit from the 4-byte aligned word below ``sign_addr``): its mask words, μ, sign
    bits and kept entries of its ``n1`` tokens from the segment's token ``l1`` (none past the chunk's end: ``n1``
    ≤ 0)."""
    NW: tl.constexpr = D // 32
    stride = tl.load(row + 4).to(tl.int32) * NW
    # (lines: powers of two, each at least the array's lines in a block plus one, its start unaligned)
    _prefetch(tl.load(row + 3).to(tl.pointer_type(tl.uint32), bitcast=True) + l1 * stride, n1 * stride * 4,
              BLOCK_ * D_PAD // 32 * 4 // 64)
    _prefetch(tl.load(row + 5).to(tl.pointer_type(ELEM), bitcast=True) + l1, n1 * ESIZE, 2)
    f1 = bits + l1.to(tl.int64) * (D - t_kept)
    _prefetch((sign_addr - (sign_addr & 3)).to(tl.pointer_type(tl.int8), bitcast=True) + (f1 >> 3),
              (n1 * (D - t_kept) + 15) // 8, BLOCK_ * D_PAD // 8 // 64)
    _prefetch(tl.load(row + 2).to(tl.pointer_type(ELEM), bitcast=True) + l1 * t_kept, n1 * t_kept * ESIZE,
              BLOCK_ * D_PAD * ESIZE // 64)


@triton.jit
def _walk_scores(s, member, m, heads, head_ptr, seg_ptr, walk_ptr, tab_ptr, t0, t_end, D: tl.constexpr,
                 D_PAD: tl.constexpr, BLOCK_: tl.constexpr, RPM: tl.constexpr, ROWS_: tl.constexpr,
                 ELEM: tl.constexpr, ESIZE: tl.constexpr = 2, AHEAD: tl.constexpr = False):
    """Member ``m``'s logits over the ``BLOCK_`` tokens from ``t0`` (those before ``t_end``; AdaKV validity applied)
    into its rows of ``s``. ``AHEAD``: the next block's mask words, μ, sign bits and kept entries are requested from
    L2 (:func:`~.triton_math._prefetch`) once this block's loads are issued."""
    HS: tl.constexpr = (D + 1) * 2 * RPM + D_PAD // 4 * 16 * RPM + RPM
    NW: tl.constexpr = D // 32
    qh = tl.load(heads + m)
    hrow = head_ptr + qh * HEAD
    row = seg_ptr + tl.load(hrow) * SEG
    t_kept = tl.load(row + 1).to(tl.int32)
    sign_addr = tl.load(row + 6)
    q_b = walk_ptr + qh * HS
    lut_b = q_b + (D + 1) * 2 * RPM
    tab = tab_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    TW = tl.arange(0, BLOCK_ // 8)[:, None, None]
    W = tl.arange(0, 4)[None, :, None]
    TL = tl.arange(0, 8)[None, None, :]
    r = tl.arange(0, RPM)[None, None, None, :]
    t = t0 + (TW * 8 + TL + W * 0)  # (every lane of a token holds its words: one layout, each word loaded once)
    live = t < t_end
    local = (t - tl.load(row)).to(tl.int32)  # (offsets in a segment: 32-bit)
    words = tl.load(row + 3).to(tl.pointer_type(tl.uint32), bitcast=True) + local * (
        tl.load(row + 4).to(tl.int32) * NW)
    x0 = tl.load(words, mask=live, other=0)
    x1, x2, x3 = tl.zeros_like(x0), tl.zeros_like(x0), tl.zeros_like(x0)  # (words past the head_dim: 0)
    if NW > 1:
        x1 = tl.load(words + 1, mask=live, other=0)
    if NW > 2:
        x2 = tl.load(words + 2, mask=live, other=0)
    if NW > 3:
        x3 = tl.load(words + 3, mask=live, other=0)
    # the member block's loads are issued here, before any is used (one round trip, none dependent; the kept entries,
    # whose address needs no loaded data, in the slot loop below):
    # the mask words above; μ; the token's sign bits (pruned order), the words that hold them whatever its mask —
    # their address is the token's, each lane's window chosen from them below
    mu = tl.load(tl.load(row + 5).to(tl.pointer_type(ELEM), bitcast=True) + local, mask=live, other=0.0)
    bits = tl.load(row + 7) + (sign_addr & 3) * 8  # (from the 4-byte aligned word below the array's start)
    first = bits + local.to(tl.int64) * (D - t_kept)  # the token's first sign bit
    signs = (sign_addr - (sign_addr & 3)).to(tl.pointer_type(tl.uint32), bitcast=True) + (first >> 5)
    span = (first & 31).to(tl.int32) + (D - t_kept)  # bits from the first word's start to the token's last sign
    in_w = live & (W < NW)
    w0 = tl.load(signs, mask=in_w & (span > 0), other=0)
    w1 = tl.load(signs + 1, mask=in_w & (span > 32), other=0)
    w2 = tl.load(signs + 2, mask=in_w & (span > 64), other=0)
    w3 = tl.load(signs + 3, mask=in_w & (span > 96), other=0)
    w4 = tl.load(signs + 4, mask=in_w & (span > 128), other=0)
    spt = (t_kept + 3) // 4  # kept ranks per lane
    lim = tl.where(live, tl.minimum(spt, t_kept - W * spt), 0)  # the lane's kept ranks (its slots past them: none)
    kept = tl.load(row + 2).to(tl.pointer_type(ELEM), bitcast=True) + local * t_kept + W * spt
    if AHEAD:
        _signed_ahead(row, (t0 + BLOCK_ - tl.load(row)).to(tl.int32), tl.minimum(t_end - t0 - BLOCK_, BLOCK_).to(
            tl.int32), t_kept, bits, sign_addr, D, D_PAD, BLOCK_, ELEM, ESIZE)
    c1 = _popc(x0).to(tl.uint32)  # kept channels before words 1, 2, 3
    c2 = c1 + _popc(x1).to(tl.uint32)
    c3 = c2 + _popc(x2).to(tl.uint32)
    rem, s8, nxt = _walk_start(x0, x1, x2, x3, c1, c2, c3, (W * spt).to(tl.uint32), tab)  # (rank W·spt on)
    acc = tl.zeros((BLOCK_ // 8, 4, 8, RPM), tl.float32)
    kqa = tl.zeros((BLOCK_ // 8, 4, 8, RPM), tl.float32)
    # the lane's kept entries, SLOTS a trip, loaded in the trip (asked of L2 the block before: see AHEAD)
    for j in range(0, (spt + SLOTS - 1) // SLOTS):
        k0, k1, k2, k3 = _kept4(kept, j * SLOTS, lim)
        rem, s8, acc, kqa = _slots(k0, k1, k2, k3, j * SLOTS, lim, rem, s8, nxt, x1, x2, x3, acc, kqa, q_b, r, D,
                                   RPM)
    # mask word W's pruned channels: their signs from bit `start` of the token's (pruned order), chosen from the
    # words loaded above
    notm = tl.where(W < NW, ~tl.where(W == 0, x0, tl.where(W == 1, x1, tl.where(W == 2, x2, x3))), 0)
    before = tl.where(W == 0, 0, tl.where(W == 1, c1, tl.where(W == 2, c2, c3))).to(tl.int32)
    start = (first & 31).to(tl.int32) + 32 * W - before  # (0 ≤ start < 128: the word it falls in, 0 … 3)
    kw = start >> 5
    lo = tl.where(kw == 0, w0, tl.where(kw == 1, w1, tl.where(kw == 2, w2, w3)))
    hi = tl.where(kw == 0, w1, tl.where(kw == 1, w2, tl.where(kw == 2, w3, w4)))
    shift = (start & 31).to(tl.uint64)
    window = ((lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)) >> shift).to(tl.uint32)
    rec = tl.zeros((BLOCK_ // 8, 4, 8, RPM), tl.float32)
    lut_w = lut_b + tl.where(W < NW, W, 0) * (8 * 16 * RPM)  # (word W's nibbles: groups 8W …; past D: none)
    expand = tab + EXPAND
    for g in tl.static_range(8):  # nibble g: (pruned channels, their next 4 signs) → the positive channels
        pm = (notm >> (4 * g)) & 0xF
        ex = tl.load(expand + (pm * 16 + (window & 0xF))).to(tl.int32)
        rec += tl.load((lut_w + ex * RPM)[:, :, :, None] + (g * 16 * RPM + r))  # (no pruned channel: entry 0, 0)
        window = window >> _popc(pm).to(tl.uint32)
    smu = _sqrt_rn(tl.maximum(mu.to(tl.float32), 0.0))
    qat = tl.load(q_b + (D + 1) * 2 * RPM + D_PAD // 4 * 16 * RPM + r)  # Σ_c qa, taken once (by lane 0)
    acc += smu[:, :, :, None] * (kqa + 2.0 * rec - tl.where(W[:, :, :, None] == 0, qat, 0.0))
    sm = tl.trans(tl.reshape(tl.sum(acc, axis=1), (BLOCK_, RPM)))
    sm = tl.reshape(tl.broadcast_to(sm[None, :, :], (ROWS_ // RPM, RPM, BLOCK_)), (ROWS_, BLOCK_))
    t1 = t0 + tl.arange(0, BLOCK_)
    return tl.where((member == m)[:, None] & _visible(hrow, t1, t1 < t_end)[None, :], sm, s)
