"""The fused decode's generic member loop (:mod:`.triton_decode`), in Triton: one query head's logits over a block
of compact keys — SparK's kept entries, masks, μ and sign bits (every recovery the kernel serves; the official one at
a decode step is walked instead, :mod:`.triton_walk`), AdaKV's dense rows
with validity bits, ThinK's keys in the work item holding its recent dense tokens — rebuilt per block as a key tile
(kept entries at their channels) and a recovery tile (the pruned entries' signs), scored on the tensor cores with
float32 products (:func:`~.triton_math._dot3`)."""

from __future__ import annotations

import triton
import triton.language as tl

from spark_bench.storage.segments import GRANULE as GRANULE_COLS
from spark_bench.storage.segments import HEAD_COLS, SEG_COLS
from spark_bench.storage.triton_math import DOT_PRECISION, _dot3, _popc, _rows_dot, _sqrt_rn

SEG: tl.constexpr = tl.constexpr(SEG_COLS)  # (the tables' row widths)
HEAD: tl.constexpr = tl.constexpr(HEAD_COLS)
GRANULE: tl.constexpr = tl.constexpr(GRANULE_COLS)  # tokens per entry of a ragged segment's start table


@triton.jit
def _segment(seg_ptr, s):
    """The table row of segment ``s`` as scalars: out_off, t_kept, kept/mask addresses, mask stride, μ/sign
    addresses, sign bit offset, mode, the fill's float32 bits."""
    row = seg_ptr + s * SEG
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4), tl.load(row + 5),
            tl.load(row + 6), tl.load(row + 7), tl.load(row + 8), tl.load(row + 9))


@triton.jit
def _keys(out_off, t_kept, kept_addr, mask_addr, mask_stride, mu_addr, sign_addr, sign_bitoff, mode, fill, b_kept,
          b_off, split, t, live, c, ELEM: tl.constexpr, ESIZE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
          BLOCK_T: tl.constexpr, SIGNS: tl.constexpr = True, RECOVER: tl.constexpr = True,
          SECOND: tl.constexpr = False, RAGGED: tl.constexpr = False, starts_addr=0):
    """The keys ``(BLOCK, D_PAD)`` of one query head at tokens ``t`` as two parts: the kept entries at their channels
    (0 elsewhere, the stores' dtype) and, per token, the recovery scale (``f``, ``μ_t`` or ``sqrt(μ_t)``) with the
    pruned entries' signs ``S`` (±1 with signs, 1 without, 0 at kept entries; bfloat16, exact): the rebuilt key is
    ``k + scale · S ∘ a``. ``out_off … fill``: its segment's table row (:func:`_segment`, scalars, one argument each:
    Triton 3.2 has no tuples as values); from token ``split`` on, a second segment of dense keys (ThinK's recent
    tokens: every channel kept) at ``b_kept`` (its first token ``b_off``), read only with ``SECOND`` (the generic
    loop's heads: ThinK's, AdaKV's dense rows; a SparK head has one compact segment). Without ``RECOVER`` (a layout
    whose pruned entries read as 0) only the kept entries are read. Offsets inside a segment are 32-bit
    (:meth:`~spark_bench.storage.segments.FusedTables.layout` refuses a segment of 2³¹ entries or more).

    A channel's rank among the token's kept entries comes from the mask read as 32-bit words: ``x = word << (31 − c
    mod 32)`` holds the word's bits up to ``c`` (its top bit: ``c`` kept), so ``rank + kept = popc(x) +`` the kept
    channels of the words before (``POPC``, no scan over the channels).

    ``RAGGED`` (a launch holding a segment whose tokens keep different numbers of channels, ``t_kept`` −1: Mustafar's
    ties, SparK-p/-g): such a token's kept row starts at its block's granule start (one int32 at ``starts_addr``,
    :func:`~spark_bench.storage.segments.granule_starts`) plus the kept counts of the block's tokens before it (a
    cumulative sum of the mask words' popcounts, already in registers): no load waits on another."""
    fill = fill.to(tl.int32).to(tl.float32, bitcast=True)
    t_kept = t_kept.to(tl.int32)
    local = (t - out_off).to(tl.int32)  # the token's index inside its (first) segment (offsets in it: 32-bit)
    cm = c < D
    both = live[:, None] & cm[None, :]
    if SECOND:
        first = t < split
        compact = first & ((t * 0 + mode) != 3)  # a token with a mask (else every channel kept)
    else:  # (a compact segment alone: every token has a mask)
        first = live
        compact = live
    # the mask: D/8 bytes per token (little-endian bits), read as NW 32-bit words (bytes past D/8 read as 0); a
    # dense token's words have every channel's bit set
    NW: tl.constexpr = D_PAD // 32
    wi = tl.arange(0, NW)
    bi = tl.arange(0, 4)
    at = wi[:, None] * 4 + bi[None, :]
    masks = mask_addr.to(tl.pointer_type(tl.uint8), bitcast=True) + local * (mask_stride.to(tl.int32) * (D // 8))
    byte = tl.load(masks[:, None, None] + at[None, :, :], mask=(live & compact)[:, None, None] & (at < D // 8)[None],
                   other=0).to(tl.uint32)
    words = tl.sum(byte << (8 * bi).to(tl.uint32)[None, None, :], axis=2)  # disjoint bits: the sum is their OR
    full = tl.where(wi * 32 + 32 <= D, 0xFFFFFFFF, (1 << (D % 32)) - 1).to(tl.uint32)  # channels < D of each word
    words = tl.where(compact[:, None], words, full[None, :])
    counts = _popc(words)
    before = tl.cumsum(counts, axis=1) - counts  # kept channels in the words before each
    word = tl.reshape(tl.broadcast_to(words[:, :, None], (BLOCK_T, NW, 32)), (BLOCK_T, D_PAD))
    below = tl.reshape(tl.broadcast_to(before[:, :, None], (BLOCK_T, NW, 32)), (BLOCK_T, D_PAD))
    x = word << (31 - (c & 31)).to(tl.uint32)[None, :]
    keep = x.to(tl.int32, bitcast=True) >> 31  # −1 where c is kept, 0 where pruned
    kept = keep != 0
    inword = _popc(x)  # kept channels of c's word up to c
    upto = below + inword  # kept channels up to c: rank + kept
    if RAGGED:  # each token's first kept entry: its granule's start + the block's tokens before it
        total = tl.sum(counts, axis=1)
        ragged = t_kept < 0
        at_start = tl.load(starts_addr.to(tl.pointer_type(tl.int32), bitcast=True) + tl.min(local, axis=0) // GRANULE,
                           mask=ragged, other=0)
        entry = tl.where(ragged, at_start + tl.cumsum(total, axis=0) - total, local * t_kept)
    # the token's kept row, one entry before it (indexed by rank + 1 where kept)
    if SECOND:
        if RAGGED:
            rows = tl.where(first, kept_addr + (entry - 1).to(tl.int64) * ESIZE,
                            b_kept + (t.to(tl.int64) - b_off) * (D * ESIZE) - ESIZE)
        else:
            rows = tl.where(first, kept_addr + (local - 1).to(tl.int64) * t_kept * ESIZE + (t_kept - 1) * ESIZE,
                            b_kept + (t.to(tl.int64) - b_off) * (D * ESIZE) - ESIZE)
        k = tl.load(rows.to(tl.pointer_type(ELEM), bitcast=True)[:, None] + upto, mask=both & kept, other=0.0)
    elif RAGGED:
        rows = kept_addr.to(tl.pointer_type(ELEM), bitcast=True) + (entry - 1)
        k = tl.load(rows[:, None] + upto, mask=both & kept, other=0.0)
    else:
        rows = kept_addr.to(tl.pointer_type(ELEM), bitcast=True) + (local * t_kept - 1)
        k = tl.load(rows[:, None] + upto, mask=both & kept, other=0.0)
    pruned = both & ~kept
    if not RECOVER:
        return k, tl.zeros((BLOCK_T,), tl.float32), tl.zeros((BLOCK_T, D_PAD), tl.bfloat16)
    if (mode == 1) | (mode == 2):
        mu = tl.load(mu_addr.to(tl.pointer_type(ELEM), bitcast=True) + local, mask=live & first,
                     other=0.0).to(tl.float32)
        scale = tl.where(mode == 1, mu, _sqrt_rn(tl.maximum(mu, 0.0)))
    else:
        scale = tl.zeros((BLOCK_T,), tl.float32) + fill
    if SIGNS:
        # the token's pruned signs are consecutive bits from ``bits`` (pruned-rank order); word w's pruned channels'
        # from ``bits + 32w − before_w``: read as one 32-bit window per word (two aligned words, each loaded only
        # where it holds one of them), so a channel's sign is bit ``c mod 32 − popc(x)`` of its word's window
        if RAGGED:  # the pruned entries of the tokens before
            bits = sign_bitoff + (local * D - entry).to(tl.int64) + (sign_addr & 3) * 8
        else:
            bits = sign_bitoff + (local * (D - t_kept)).to(tl.int64) + (sign_addr & 3) * 8  # (4-byte aligned base)
        base = sign_addr - (sign_addr & 3)
        start = bits[:, None] + (wi * 32)[None, :] - before
        n = tl.minimum(tl.maximum(D - wi * 32, 0), 32)[None, :] - counts  # pruned channels of word w
        at = base + (start >> 5) * 4
        shift = start & 31
        wm = (live & ((t * 0 + mode) == 2))[:, None] & (n > 0)
        lo = tl.load(at.to(tl.pointer_type(tl.uint32), bitcast=True), mask=wm, other=0xFFFFFFFF)
        hi = tl.load((at + 4).to(tl.pointer_type(tl.uint32), bitcast=True), mask=wm & (shift + n > 32),
                     other=0xFFFFFFFF)
        window = ((lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)) >> shift.to(tl.uint64)).to(tl.uint32)
        window = tl.reshape(tl.broadcast_to(window[:, :, None], (BLOCK_T, NW, 32)), (BLOCK_T, D_PAD))
        at_c = ((c & 31)[None, :] - inword) & 31  # (pruned c: popc(x) = kept channels below it in its word)
        bit = ((window >> at_c.to(tl.uint32)) & 1).to(tl.int32)
        # bfloat16 bits: 1 → +1 (0x3F80), 0 → −1 (0xBF80)
        sign = tl.where(pruned, 0xBF80 ^ (bit << 15), 0)
    else:
        sign = 0x3F80 * (keep + 1)  # (a dead token's or padding channel's S meets a masked logit or q = 0)
    return k, scale, sign.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _compact_logits(k, scale, sign, q1, q2, q3, qa1, qa2, qa3, qd, q_scale, RECOVER: tl.constexpr,
                    ONE: tl.constexpr):
    """Logits ``(rows, n)`` of bfloat16 compact keys given as a key tile ``k`` (kept entries at their channels) and,
    with ``RECOVER``, the per-token recovery scale with the sign tile ``S`` (:func:`_keys`): ``q · k̃ = q · k +
    scale · (q ∘ a) · S`` on the tensor cores, float32 products (``q1 … q3``, ``qa1 … qa3``: the scaled queries' and
    ``q ∘ a``'s bfloat16 splits, :func:`~.triton_math._split3`); with ``ONE`` (bfloat16 queries) ``q · k`` is one
    dot against ``qd``, the unscaled queries, times ``q_scale``. The recovery's dots first, into the kept part's
    accumulator."""
    init = tl.zeros((q1.shape[0], k.shape[0]), tl.float32)
    if RECOVER:
        init = scale[None, :] * _dot3(qa1, qa2, qa3, tl.trans(sign), init)
    if ONE:
        return init + _rows_dot(qd, qd, qd, k, q_scale, tl.bfloat16, ONE)
    return _dot3(q1, q2, q3, tl.trans(k), init)


@triton.jit
def _visible(hrow, t, live):
    """Which tokens ``t`` of a query head (its head-table row ``hrow``) are attended: the live ones whose AdaKV
    validity bit is set (every live one where the head has no validity bits: address 0, nothing read)."""
    valid_addr = tl.load(hrow + 3)
    vbyte = tl.load((valid_addr + (t >> 3)).to(tl.pointer_type(tl.uint8), bitcast=True),
                    mask=live & ((t * 0 + valid_addr) != 0), other=255).to(tl.int32)
    return live & (((vbyte >> (t & 7).to(tl.int32)) & 1) != 0)


@triton.jit
def _member_scores(s, q, q1, q2, q3, qa1, qa2, qa3, member, m, heads, head_ptr, seg_ptr, aux_ptr, t, live, c,
                   ELEM: tl.constexpr, ESIZE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, SIGNS: tl.constexpr, RECOVER: tl.constexpr, RAGGED: tl.constexpr, qd,
                   q_scale, ONE: tl.constexpr):
    """Member ``m``'s logits from its compact keys (AdaKV validity applied) into its rows of ``s``. bfloat16 stores
    (``q1 … q3``, ``qa1 … qa3``: the queries' and ``q ∘ a``'s bfloat16 splits, :func:`_split3`; unused for float32
    stores): ``q · k̃ = q · k + scale · (q ∘ a) · S`` on the tensor cores (the kept entries and ``S`` are exact in
    bfloat16; float32 products and sums), no float32 key rebuilt; else the float32 keys and an FMA dot. Without
    ``RECOVER`` (pruned entries read as 0: ThinK, the zero/none recoveries, AdaKV's dense rows) only ``q · k``. With
    ``ONE`` (bfloat16 queries) ``q · k`` is one dot against ``qd``, the unscaled queries (exact in one bfloat16
    term), times ``q_scale``, not three against the scaled queries' splits."""
    qh = tl.load(heads + m)
    hrow = head_ptr + qh * HEAD
    b = seg_ptr + tl.load(hrow + 1) * SEG  # (a second segment is a run of dense keys: FusedTables.layout)
    out_off, t_kept, kept_addr, mask_addr, mask_stride, mu_addr, sign_addr, sign_bitoff, mode, fill = _segment(
        seg_ptr, tl.load(hrow))
    starts_addr = 0
    if RAGGED:  # (a ragged segment's granule starts)
        starts_addr = tl.load(seg_ptr + tl.load(hrow) * SEG + 10)
    k, scale, sign = _keys(out_off, t_kept, kept_addr, mask_addr, mask_stride, mu_addr, sign_addr, sign_bitoff, mode,
                           fill, tl.load(b + 2), tl.load(b), tl.load(hrow + 2), t, live, c, ELEM, ESIZE, D, D_PAD,
                           BLOCK_T, SIGNS, RECOVER, not RECOVER, RAGGED, starts_addr)
    if ELEM == tl.bfloat16:
        sm = _compact_logits(k, scale, sign, q1, q2, q3, qa1, qa2, qa3, qd, q_scale, RECOVER, ONE)
    elif not RECOVER:
        sm = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
    else:
        aux = tl.load(aux_ptr + qh * D + c, mask=c < D, other=0.0)
        keys = k.to(tl.float32) + (scale[:, None] * sign.to(tl.float32)) * aux[None, :]  # (k = 0 / S = 0 apart)
        sm = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION)
    return tl.where((member == m)[:, None] & _visible(hrow, t, live)[None, :], sm, s)
