"""Fused compact-attention decode in Triton (flash-decoding over compact stores): the CUDA path of a decode batch.

One launch per layer reads every stored byte once — a SparK row's kept entries, masks, μ and sign bits, a ThinK row's
structured keys, an eviction-only row's dense keys, and the values — scores each block of keys against the queries,
and keeps an online softmax with ``weights · values`` accumulated in float32. No ``(rows, heads, S)`` score tensor
exists. Work is split over the sequence: one program per *work item* (a chunk of ``chunk`` tokens of one value
tensor, for up to ``MEMBERS`` query heads that read it), so the grid is ``Σ ceil(tokens / chunk)`` over the value
tensors, not segments × the longest. Each program writes its partial softmax ``(max, sum, Σ exp·v)`` per query row; a
second small kernel (:mod:`.triton_merge`) merges the partials of each query head, adds its decoded tail (dense,
causal among a suffix's own tokens) and normalises. The arithmetic both share is :mod:`.triton_math`'s; the generic
compact member loop (masks, ranks, recoveries) is :mod:`.triton_compact`'s.

Per stored entry ``c`` of token ``t`` (modes of :data:`~spark_bench.storage.segments.MODES`), the rebuilt key is:
kept → ``k_tc``; pruned, mode 0 → ``f · a_c``; mode 1 (paper degenerate) → ``μ_t · a_c``; mode 2 (official) →
``s_tc · sqrt(μ_t) · a_c``; mode 3 → every channel kept. ``a = aux_scale`` per query head (``1/q̄`` paper,
``1/sqrt(‖q‖)`` official, ones otherwise), so ``q · k̃`` equals the C++ kernel's formula (``engine/kernels``).

bfloat16 stores score on the tensor cores with float32 products: ``q · k̃ = q · K + scale_t · (q ∘ a) · S`` with
``K`` the kept entries at their channels and ``S`` the pruned entries' signs, both exact in bfloat16
(:mod:`.triton_compact`); ``q ∘ a`` is split once per program into three bfloat16 terms
(:func:`~.triton_math._split3`), and so are the scaled queries when they come in float32, while bfloat16 queries (a
bfloat16 model's) are exact in one term: ``q · K`` is then one dot against them, unscaled, times the scale (``ONE``).
float32 stores rebuild the float32 keys and use an FMA dot (``input_precision=DOT_PRECISION``).

Rows sharing a value tensor (configs with the same eviction selection) are stacked into the rows of one program
(``MEMBERS × ROWS_PER_MEMBER ≤ ROWS``): each value block is loaded once for all of them. A program's heads come
sorted by kind (:class:`~spark_bench.storage.segments.FusedTables`, per work item), and each kind has its own member
loop inside the token loop, specialised to it: dense keys (eviction only, a full row: rows of ``D`` channels loaded
like the values); structured keys (ThinK's channel subset, in work items before its recent dense tokens: each token's
``T`` kept entries against the queries gathered at those channels once per program — the channel indices read from
the tables' copy through the item's gather rows —, a ``TK``-deep dot, no mask read);
keys whose pruned entries read as 0 (SparK's zero/none recoveries, AdaKV rows, ThinK's item holding its recent
tokens: no recovery term); compact keys with a recovery without signs (SparK's paper/constant recoveries); with signs
(SparK's official recovery: at a decode step walked over each token's kept entries where they are stored,
:mod:`.triton_walk`; a longer suffix rebuilds the key tile). A launch compiles only the loops of the kinds its tables
hold (``KINDS``). Whole blocks run unmasked, addressed by 32-bit offsets from the block's first row; a chunk's last,
partial block runs masked in a second loop. Softmax weights are ``2^(s·log₂e − m·log₂e)``
(``ex2.approx.ftz``) and their row sums are kept per column until the chunk ends. A member's
table row is read as scalars (L1-resident), never picked out of registers. Values (and dense keys) are addressed
from the typed element pointer plus a 64-bit offset that the tables state is 16-byte aligned (``VALIGN``): 16-byte
loads (instructions per byte: ``scripts/bench/instructions.py``). The kernels read the rows' own tensors in place
through the tables' 64-bit addresses (nothing copied); offsets inside a segment or a block are 32-bit (no segment of
2³¹ entries). ``head_dim`` is padded to a power of two inside the kernels (``D_PAD``, at least 32 in the partials
kernel), so any multiple of 8 works. Logits and softmax are float32.

Tests run it on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported)
and compile every specialisation for sm_80/sm_90 ahead of time (``tests/test_gpu_compile.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from spark_bench.storage.segments import ALL_KINDS, HEAD_COLS, KINDS, SEG_COLS, WORK_COLS
from spark_bench.storage.triton_compact import _keys, _member_scores
from spark_bench.storage.triton_math import _online, _prefetch, _rows_dot, _split3
from spark_bench.storage.triton_merge import _merge_kernel
from spark_bench.storage.triton_versions import PARTIAL_WARPS, PREFETCH
from spark_bench.storage.triton_walk import _walk_scores, _walk_tables
from spark_bench.storage.triton_tiles import _tile_scores
from spark_bench.storage.walk_layout import PROGRAM_ROWS, head_floats

# the tables' row widths (storage/segments.py builds them, its *_COLS say what each column holds)
SEG: tl.constexpr = tl.constexpr(SEG_COLS)
HEAD: tl.constexpr = tl.constexpr(HEAD_COLS)
WORK: tl.constexpr = tl.constexpr(WORK_COLS)
BLOCK = {2: 32, 4: 16}  # tokens per step of the token loop by element size
ROWS = PROGRAM_ROWS  # query rows per program (the dot products' M: 16)
NUM_WARPS = 8   # the merge of a suffix (16 query rows and more)
NUM_STAGES = 1  # the token loop holds the member loops: Triton's pipeliner does not act on it
# ptxas given no register limit caps these kernels at 64/80/128 registers (3-4 or 2 CTAs per SM of 256 threads) and
# spills; stated as 255, it allocates what the code needs and spills nothing (results/bench/compile.json)
MAX_REGISTERS = 255
MERGE_WARPS = 4  # the merge of a decode step (a few query rows per head)
MERGE_BLOCK = 16  # tail tokens per step of the merge
# a decode step's bfloat16 launch (4 warps) whose work items hold no recovering member (dense, structured and bare
# keys alone: full, eviction, ThinK, zero/none recoveries, AdaKV) and no ragged or value-sparse store fits 168
# registers without a spill (sm_80/sm_90, D 64/128; results/bench/compile.json): 3 CTAs per SM, not 2 — half again
# the bytes in flight (sm_90 D=128 GQA 4, modelled: ThinK(0.8) 12 → 21 KB per SM, a dense row 17 → 31 KB); one whose
# members hold dense and structured keys alone (full, eviction, ThinK, AdaKV) fits 128: 4 CTAs per SM (ThinK(0.8) on
# sm_80 at 0.5 µs 14.6 → 25.8 KB, 86 → 90% of the bound; bare keys' loop spills 16–152 bytes there)
LEAN_REGISTERS = 168
DENSE_REGISTERS = 128
RECOVERING = (1 << KINDS.index("plain")) | (1 << KINDS.index("signed"))
BARE = 1 << KINDS.index("bare")


def max_registers(kinds: int, warps: int, step: bool, ragged: bool, vsparse: bool) -> int:
    """The partials launch's register limit (Triton's ``maxnreg``) for a decode step's 4-warp launch without
    recovering members, ragged or value-sparse stores: :data:`DENSE_REGISTERS` without bare members either,
    :data:`LEAN_REGISTERS` with them; else :data:`MAX_REGISTERS`."""
    lean = warps == 4 and step and not kinds & RECOVERING and not ragged and not vsparse
    if not lean:
        return MAX_REGISTERS
    return LEAN_REGISTERS if kinds & BARE else DENSE_REGISTERS


@triton.jit
def _into(s, sm, member, m, live, MASKED: tl.constexpr):
    """Member ``m``'s rows of ``s`` from its logits ``sm`` (the block's live tokens only, when ``MASKED``)."""
    if MASKED:
        return tl.where((member == m)[:, None] & live[None, :], sm, s)
    else:
        return tl.where((member == m)[:, None], sm, s)


@triton.jit
def _step(m_i, l_i, acc, t0, t_end, v, elem_ptr, q, q1, q2, q3, qa1, qa2, qa3, qg1, qg2, qg3, qd, scale, member,
          heads, head_ptr, seg_ptr, aux_ptr, c, n_dense, n_struct, n_bare, n_plain, count, walk_ptr, tab_ptr,
          ELEM: tl.constexpr, ESIZE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, ROWS_: tl.constexpr,
          BLOCK_: tl.constexpr, VALIGN: tl.constexpr, TK: tl.constexpr, PAIRS: tl.constexpr, MASKED: tl.constexpr,
          KINDS: tl.constexpr, RPM: tl.constexpr, WALK: tl.constexpr, AHEAD: tl.constexpr,
          RAGGED: tl.constexpr = False, ONE: tl.constexpr = False, TILE: tl.constexpr = False):
    """One block of ``BLOCK_`` tokens from ``t0``: its values ``v`` (loaded by the caller, a block ahead), every member's logits (one loop per kind, in the
    order :class:`~spark_bench.storage.segments.FusedTables` sorts them; a kind's loop only where ``KINDS`` has its
    bit), the online softmax. Without ``MASKED`` (a whole block) nothing is masked and the values and dense keys are
    addressed from the block's first row by 32-bit offsets. ``q1 … q3``, ``qa1 … qa3``, ``qg1 … qg3``: the
    queries', ``q ∘ a``'s and the gathered queries' bfloat16 splits (each the float32 tensor itself for float32
    stores), passed one by one: Triton 3.2 has no tuples as values."""
    tt = tl.arange(0, BLOCK_)
    t = t0 + tt.to(tl.int64)
    inside = (tt[:, None] * D + c[None, :])  # (32-bit) offsets of a block's rows of D channels
    if MASKED:
        live = t < t_end
    else:
        live = tt < BLOCK_
    both = live[:, None] & (c < D)[None, :]
    s = tl.full((ROWS_, BLOCK_), float("-inf"), tl.float32)
    if KINDS & 1:
        for m in range(0, n_dense):  # dense keys: rows of D channels, like the values
            seg = tl.load(head_ptr + tl.load(heads + m) * HEAD)
            start = (tl.load(seg_ptr + seg * SEG + 2) - elem_ptr.to(tl.int64, bitcast=True)) // ESIZE
            if VALIGN:
                start = tl.multiple_of(start, 16 // ESIZE)
            rows = elem_ptr + start + (t0 - tl.load(seg_ptr + seg * SEG)) * D  # (from the segment's first token)
            if MASKED or D != D_PAD:
                k = tl.load(rows + inside, mask=both, other=0.0)
            else:
                k = tl.load(rows + inside)
            if AHEAD and not MASKED:  # the next block's keys requested from L2 while this one computes
                _prefetch(rows + BLOCK_ * D, tl.minimum(t_end - t0 - BLOCK_, BLOCK_) * D * ESIZE,
                          BLOCK_ * D_PAD * ESIZE // 64)
            s = _into(s, _rows_dot(qd, q2, q3, k, scale, ELEM, ONE), member, m, live, MASKED)
    if TK > 0:
        # structured keys (ThinK): each token's TK-wide row of the segment's kept channels, against the queries
        # gathered at those channels once per program (qg1 … qg3): a TK-deep dot, no mask read
        j = tl.arange(0, TK)
        for m in range(n_dense, n_struct):
            row = seg_ptr + tl.load(head_ptr + tl.load(heads + m) * HEAD) * SEG
            t_kept = tl.load(row + 1).to(tl.int32)
            start = (tl.load(row + 2) - elem_ptr.to(tl.int64, bitcast=True)) // ESIZE
            rows = elem_ptr + start + (t0 - tl.load(row)) * t_kept  # (from the segment's first token)
            at = tt[:, None] * t_kept + j[None, :]
            if (ELEM == tl.bfloat16 and PAIRS) and not MASKED:  # entries read in pairs, as 32-bit words
                jp = tl.arange(0, TK // 2)
                words = tl.load((rows + (tt[:, None] * t_kept + 2 * jp[None, :])).to(tl.pointer_type(tl.int32)),
                                mask=(2 * jp < t_kept)[None, :], other=0)
                lo = (words & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
                hi = (words >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
                k = tl.reshape(tl.join(lo, hi), (BLOCK_, TK))
            elif MASKED:
                k = tl.load(rows + at, mask=live[:, None] & (j < t_kept)[None, :], other=0.0)
            else:
                k = tl.load(rows + at, mask=(j < t_kept)[None, :], other=0.0)
            if AHEAD and not MASKED:
                _prefetch(rows + BLOCK_ * t_kept, tl.minimum(t_end - t0 - BLOCK_, BLOCK_) * t_kept * ESIZE,
                          BLOCK_ * TK * ESIZE // 64)
            s = _into(s, _rows_dot(qg1, qg2, qg3, k, scale, ELEM, ONE), member, m, live, MASKED)
    if KINDS & 4:
        for m in range(n_struct, n_bare):  # compact keys (or AdaKV validity), pruned entries 0
            s = _member_scores(s, q, q1, q2, q3, qa1, qa2, qa3, member, m, heads, head_ptr, seg_ptr, aux_ptr, t, live,
                               c, ELEM, ESIZE, D, D_PAD, BLOCK_, False, False, RAGGED, qd, scale, ONE)
    if KINDS & 8:
        for m in range(n_bare, n_plain):  # compact keys with a recovery, no signs
            s = _member_scores(s, q, q1, q2, q3, qa1, qa2, qa3, member, m, heads, head_ptr, seg_ptr, aux_ptr, t, live,
                               c, ELEM, ESIZE, D, D_PAD, BLOCK_, False, True, RAGGED, qd, scale, ONE)
    if KINDS & 16:
        for m in range(n_plain, count):  # compact keys with signs (official recovery)
            if TILE:  # (a bfloat16 decode step, 4 rows a member or more: tiles built a nibble at a time)
                s = _tile_scores(s, member, m, heads, head_ptr, seg_ptr, tab_ptr, t0, t_end, q1, q2, q3, qa1, qa2,
                                 qa3, qd, scale, D, D_PAD, BLOCK_, MASKED, ONE, AHEAD and not MASKED)
            elif WALK:  # (a decode step: each token's kept entries walked where they are stored)
                s = _walk_scores(s, member, m, heads, head_ptr, seg_ptr, walk_ptr, tab_ptr, t0, t_end, D, D_PAD,
                                 BLOCK_, RPM, ROWS_, ELEM, ESIZE, AHEAD and not MASKED)
            else:
                s = _member_scores(s, q, q1, q2, q3, qa1, qa2, qa3, member, m, heads, head_ptr, seg_ptr, aux_ptr, t,
                                   live, c, ELEM, ESIZE, D, D_PAD, BLOCK_, True, True, RAGGED, qd, scale, ONE)
    return _online(m_i, l_i, acc, s, v)


@triton.jit
def _sparse_values(v_mask, v_kept, v_starts, v_split, window, t, live, c, ELEM: tl.constexpr, ESIZE: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_: tl.constexpr):
    """A block of a value-sparse item's values ``(BLOCK_, D_PAD)``: its compact tokens (``t < v_split``) rebuilt from
    their masks and kept entries (pruned entries 0; a token's first entry from its granule's start, tokens keeping
    different counts), its dense window's rows (at ``window``) after them: :func:`~.triton_compact._keys` without a
    recovery, the window its second segment."""
    zero = v_split * 0
    return _keys(zero, zero - 1, v_kept, v_mask, zero + 1, zero, zero, zero, zero, zero, window, v_split, v_split, t,
                 live, c, ELEM, ESIZE, D, D_PAD, BLOCK_, False, False, True, True, v_starts)[0]


@triton.jit(do_not_specialize=["n_work", "advance"],
            do_not_specialize_on_alignment=["seg_ptr", "head_ptr", "work_ptr", "list_ptr"])
def _partials_kernel(q_ptr, aux_ptr, seg_ptr, head_ptr, work_ptr, list_ptr, acc_ptr, ml_ptr, elem_ptr, len_ptr,
                     walk_ptr, tab_ptr, n_rows, q_stride, scale, n_work, advance, D: tl.constexpr, D_PAD: tl.constexpr,
                     RPM: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_: tl.constexpr, ESIZE: tl.constexpr,
                     VALIGN: tl.constexpr = False, TK: tl.constexpr = 0, PAIRS: tl.constexpr = False,
                     KINDS: tl.constexpr = ALL_KINDS, WALK: tl.constexpr = False, AHEAD: tl.constexpr = False,
                     RAGGED: tl.constexpr = False, VSPARSE: tl.constexpr = False, TILE: tl.constexpr = False,
                     WIDE: tl.constexpr = True):
    """One work item: ``MEMBERS`` query heads (``RPM`` query rows each) over one chunk of one value tensor.
    ``VALIGN``: every value tensor of the tables starts 16-byte aligned (16-byte value loads); ``PAIRS``: every
    structured segment keeps an even number of channels from a 4-byte aligned start (its entries read in pairs);
    ``KINDS``: the member kinds the tables' work items hold (bit k: :data:`~spark_bench.storage.segments.KINDS`
    ``[k]``, the structured one also ``TK > 0``), the others' loops not compiled in (a launch without compact keys:
    ~190 registers, ~70 fewer instructions per block); ``WALK``: the signed members are walked (:mod:`.triton_walk`;
    a decode step, ``n_rows ≤ RPM``), their per-step tables written at ``walk_ptr``, the constant table at ``tab_ptr``;
    ``TILE``: instead built into key and sign tiles a nibble at a time (:mod:`.triton_tiles`; a bfloat16 decode step
    whose members hold :data:`~.walk_layout.TILE_ROWS` rows or more), their constant table
    (:func:`~.walk_layout.tile_table`) at ``tab_ptr``, no per-step tables;
    ``AHEAD``: each whole block asks L2 for the next block's values and keys (:data:`PREFETCH`; not in a launch
    holding value-sparse values, whose registers it would spill: 12–60 bytes on sm_80 with every kind); ``RAGGED``: a
    segment's tokens keep different numbers of channels (:func:`~.triton_compact._keys`; off: not compiled in);
    ``VSPARSE``: some item's values are value-sparse (Mustafar's values, ``value_ratio`` > 0): such an item rebuilds
    each block of values from their masks and kept entries as :func:`~.triton_compact._keys` rebuilds keys without a
    recovery (its granule starts; the dense window's rows after the compact tokens), the others load dense rows.
    ``WIDE``: the partial-softmax buffer holds 2³¹ floats or more, so its row offsets are 64-bit (else 32-bit).
    Program (0, 0) also advances the layer's tail length by ``advance`` (the merge that follows reads it)."""
    w = tl.program_id(0).to(tl.int64)
    gb = tl.program_id(1).to(tl.int64)
    tl.store(len_ptr, tl.load(len_ptr) + advance, mask=(w == 0) & (gb == 0))
    real = w < n_work  # a launch with no work item still runs program (0, 0) for the length
    item = work_ptr + w * WORK
    list_start = tl.load(item + 0, mask=real, other=0)
    count = tl.load(item + 1, mask=real, other=0).to(tl.int32)  # (members and their loops' indices: 32-bit)
    t_start = tl.load(item + 2, mask=real, other=0)
    t_end = tl.load(item + 3, mask=real, other=0)
    val_addr = tl.load(item + 4, mask=real, other=0)
    chunk = tl.load(item + 5, mask=real, other=0)
    # the item's heads come ordered by kind (FusedTables.layout), each kind a run ending at: dense keys with every
    # token valid; structured keys (ThinK, the item's tokens all before the recent ones); keys whose pruned entries
    # read as 0 (no recovery term); compact keys with a recovery, without signs; with signs (to count). Each kind has
    # its own member loop, specialised to it
    n_dense = tl.load(item + 6, mask=real, other=0).to(tl.int32)
    n_struct = tl.load(item + 7, mask=real, other=0).to(tl.int32)
    n_bare = tl.load(item + 8, mask=real, other=0).to(tl.int32)
    n_plain = tl.load(item + 9, mask=real, other=0).to(tl.int32)
    if TK > 0:  # (where the item's structured members' gather rows start)
        g_start = tl.load(item + 14, mask=real, other=0)
    ELEM: tl.constexpr = elem_ptr.dtype.element_ty
    r = tl.arange(0, RPM * MEMBERS)
    member = r // RPM
    g = gb * RPM + (r % RPM)
    row_ok = (member < count) & (g < n_rows)
    qh_r = tl.load(list_ptr + list_start + member, mask=member < count, other=0)
    c = tl.arange(0, D_PAD)
    cm = c < D
    raw = tl.load(q_ptr + (qh_r * q_stride + g * D)[:, None] + c[None, :], mask=row_ok[:, None] & cm[None, :],
                  other=0.0)
    q = raw.to(tl.float32) * scale
    # bfloat16 queries over bfloat16 keys: the dense and structured keys' dots take the unscaled queries, exact in
    # one bfloat16 term, and scale the logits (one tensor-core dot a block, not three, and no split of them here)
    ONE: tl.constexpr = (ELEM == tl.bfloat16) and (q_ptr.dtype.element_ty == tl.bfloat16)
    if ELEM == tl.bfloat16 or WALK:  # the recovery's scale a (q ∘ a: the recovery term)
        aux = tl.load(aux_ptr + qh_r[:, None] * D + c[None, :], mask=row_ok[:, None] & cm[None, :], other=0.0)
    if ELEM == tl.bfloat16:  # the queries' and q ∘ a's bfloat16 splits, once (tensor-core dots, float32 products)
        q1, q2, q3 = _split3(q)
        qa1, qa2, qa3 = _split3(q * aux)
    else:
        q1, q2, q3, qa1, qa2, qa3 = q, q, q, q, q, q
    if ONE:
        qd = raw
    else:
        qd = q1
    if WALK:  # the signed members' per-step tables (q, q ∘ a by channel; q ∘ a's nibble sums), then a barrier
        _walk_tables(walk_ptr, q, q * aux, qh_r, row_ok & (member >= n_plain) & (member < count), r, c, D, D_PAD,
                     RPM)
    if TK > 0:  # the structured members' queries at their kept channels (zero past them and in other rows)
        j = tl.arange(0, TK)
        # (each member's kept count and channel indices from its gather row and the copy of its indices in the
        # tables: one table row and the indices, every member's loads issued together, no chain through the
        # head and segment rows, no store's bytes)
        own = row_ok & (member >= n_dense) & (member < n_struct)
        gather = list_ptr + g_start + 2 * member
        t_r = tl.load(gather, mask=own, other=0)
        chan_r = tl.load(gather + 1, mask=own, other=0)
        gm = own[:, None] & (j[None, :] < t_r[:, None])
        CHAN: tl.constexpr = tl.uint8 if D <= 256 else tl.int16
        chan = tl.load(seg_ptr.to(tl.pointer_type(CHAN), bitcast=True) + chan_r[:, None] + j[None, :], mask=gm,
                       other=0)
        gq = tl.load(q_ptr + (qh_r * q_stride + g * D)[:, None] + chan.to(tl.int64), mask=gm, other=0.0)
        if ONE:
            qg1, qg2, qg3 = gq, gq, gq
        elif ELEM == tl.bfloat16:
            qg1, qg2, qg3 = _split3(gq.to(tl.float32) * scale)
        else:
            qg1 = gq.to(tl.float32) * scale
            qg2, qg3 = qg1, qg1
    else:
        qg1, qg2, qg3 = qd, qd, qd
    m_i = tl.full((RPM * MEMBERS,), float("-inf"), tl.float32)
    l_i = tl.zeros((RPM * MEMBERS, BLOCK_), tl.float32)  # per-column partial sums (one reduction, at the end)
    acc = tl.zeros((RPM * MEMBERS, D_PAD), tl.float32)
    # the values as an offset from a typed, 16-byte aligned base pointer (the element-type argument): its
    # alignment and the offset's (a multiple of 16 bytes, VALIGN) give 16-byte loads
    offset = (val_addr - elem_ptr.to(tl.int64, bitcast=True)) // ESIZE
    if VALIGN:
        offset = tl.multiple_of(offset, 16 // ESIZE)
    values = elem_ptr + offset
    # whole blocks first, with no token masks and block-relative (32-bit) offsets; then the chunk's last, partial
    # block, if any, masked
    full_end = t_start + (t_end - t_start) // BLOCK_ * BLOCK_
    # the next block's values are asked of L2 (``_prefetch``) as soon as this block's are issued, so a block waits for
    # its values at L2's latency, not the DRAM's (carried in registers instead, a block ahead, they leave the kernel
    # with every member kind too few registers: it spills)
    tt = tl.arange(0, BLOCK_)
    inside = tt[:, None] * D + c[None, :]  # (32-bit offsets of a block's rows of D channels)
    if VSPARSE:  # a value-sparse item: its masks' and first kept entry's addresses, its starts, its compact tokens
        v_mask = tl.load(item + 10, mask=real, other=0)
        v_kept = tl.load(item + 11, mask=real, other=0)
        v_starts = tl.load(item + 12, mask=real, other=0)
        v_split = tl.load(item + 13, mask=real, other=0)
    for t0 in range(t_start, full_end, BLOCK_):
        if VSPARSE:
            if v_mask != 0:
                v = _sparse_values(v_mask, v_kept, v_starts, v_split, val_addr, t0 + tt.to(tl.int64), tt < BLOCK_, c,
                                   ELEM, ESIZE, D, D_PAD, BLOCK_)
            elif D == D_PAD:
                v = tl.load(values + t0 * D + inside)
            else:
                v = tl.load(values + t0 * D + inside, mask=cm[None, :], other=0.0)
        elif D == D_PAD:
            v = tl.load(values + t0 * D + inside)
        else:
            v = tl.load(values + t0 * D + inside, mask=cm[None, :], other=0.0)
        if AHEAD and not VSPARSE:
            _prefetch(values + (t0 + BLOCK_) * D, tl.minimum(t_end - t0 - BLOCK_, BLOCK_) * D * ESIZE,
                      BLOCK_ * D_PAD * ESIZE // 64)
        m_i, l_i, acc = _step(m_i, l_i, acc, t0, t_end, v, elem_ptr, q, q1, q2, q3, qa1, qa2, qa3, qg1, qg2,
                              qg3, qd, scale, member, list_ptr + list_start, head_ptr, seg_ptr, aux_ptr, c, n_dense,
                              n_struct, n_bare, n_plain, count, walk_ptr, tab_ptr, ELEM, ESIZE, D, D_PAD, RPM * MEMBERS, BLOCK_,
                              VALIGN, TK, PAIRS, False, KINDS, RPM, WALK, AHEAD, RAGGED, ONE, TILE)
    for t0 in range(full_end, t_end, BLOCK_):
        if VSPARSE:
            if v_mask != 0:
                v = _sparse_values(v_mask, v_kept, v_starts, v_split, val_addr, t0 + tt.to(tl.int64),
                                   tt < t_end - t0, c, ELEM, ESIZE, D, D_PAD, BLOCK_)
            else:
                v = tl.load(values + t0 * D + inside, mask=(tt < t_end - t0)[:, None] & cm[None, :], other=0.0)
        else:
            v = tl.load(values + t0 * D + inside, mask=(tt < t_end - t0)[:, None] & cm[None, :], other=0.0)
        m_i, l_i, acc = _step(m_i, l_i, acc, t0, t_end, v, elem_ptr, q, q1, q2, q3, qa1, qa2, qa3, qg1, qg2,
                              qg3, qd, scale, member, list_ptr + list_start, head_ptr, seg_ptr, aux_ptr, c, n_dense,
                              n_struct, n_bare, n_plain, count, walk_ptr, tab_ptr, ELEM, ESIZE, D, D_PAD, RPM * MEMBERS, BLOCK_,
                              VALIGN, TK, PAIRS, True, KINDS, RPM, WALK, AHEAD, RAGGED, ONE, TILE)
    slot = tl.load(head_ptr + qh_r * HEAD + 4, mask=row_ok, other=0) + chunk
    if WIDE:
        at = slot * n_rows + g
    else:  # (32-bit row offsets: ~30 instructions fewer a program, 5% of a 512-token eviction program's time)
        at = slot.to(tl.int32) * n_rows + g.to(tl.int32)
    tl.store(acc_ptr + at[:, None] * D + c[None, :], acc, mask=row_ok[:, None] & cm[None, :])
    tl.store(ml_ptr + at * 2, m_i, mask=row_ok)
    tl.store(ml_ptr + at * 2 + 1, tl.sum(l_i, axis=1), mask=row_ok)


WIDE_FLOATS = 2 ** 31  # a partial-softmax buffer this large or larger takes 64-bit row offsets (the kernel's WIDE)


def launch_shape(rows_per_head: int) -> tuple[int, int]:
    """``(RPM, MEMBERS)``: query rows per member in one program (a power of two ≤ :data:`ROWS`) and how many query
    heads sharing a value tensor one program serves (``RPM · MEMBERS = ROWS``)."""
    rpm = min(triton.next_power_of_2(max(rows_per_head, 1)), ROWS)
    return rpm, ROWS // rpm


def launches(q, scale: float, aux_scale, tables, elem, new_keys, new_values, tail_keys, tail_values, tail_len,
             q_len: int, g0: int, out, advance: int, acc=None, ml=None) -> list[tuple]:
    """The two launches of :func:`fused_decode` as ``(kernel, grid, args, kwargs)``, exactly as it runs them (the
    ahead-of-time compile, :mod:`.gpu_compile`, binds these arguments to get the specialisation Triton compiles at
    run time). ``acc``/``ml``: the partial-softmax buffers (made here when None)."""
    import torch

    heads, n, d = q.shape
    rpm, members = launch_shape(n)
    d_pad = max(triton.next_power_of_2(d), 32)  # (the partials kernel reads the masks as 32-bit words)
    if acc is None:
        acc = torch.empty(tables.n_slots, n, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(tables.n_slots, n, 2, dtype=torch.float32, device=q.device)
    # the signed walk at a decode step (one block of query rows per head): its per-step tables, one per query head,
    # in a buffer of the launch (memory.step_work counts it); not in a float32 launch holding a ragged store, whose
    # registers it would spill (sm_80, D = 128, every kind: 4–12 bytes) — its signed rows take the compact loop
    kinds, ragged, vsparse = (getattr(tables, "kinds", ALL_KINDS), bool(getattr(tables, "ragged", False)),
                              bool(getattr(tables, "vsparse", False)))
    signed_step = getattr(tables, "walk_tab", None) is not None and n <= rpm and not (
        ragged and elem.element_size() == 4)
    # tables whose signed constant table is the tiles' (walk_layout.tiled: a bfloat16 step whose members hold 4 rows
    # or more) build tiles, no per-step tables, instead of walking
    tile = signed_step and bool(getattr(tables, "tiles", False))
    walk = signed_step and not tile
    warps = PARTIAL_WARPS[elem.element_size()]
    scratch = torch.empty(tables.head.numel() // HEAD_COLS * head_floats(d, rpm), dtype=torch.float32,
                          device=q.device) if walk else acc
    partials = (_partials_kernel, (max(tables.n_work, 1), triton.cdiv(n, rpm)),
                (q, aux_scale, tables.seg, tables.head, tables.work, tables.lists, acc, ml, elem, tail_len, scratch,
                 tables.walk_tab if signed_step else tables.seg, n, q.stride(0), scale, tables.n_work, advance),
                dict(D=d, D_PAD=d_pad, RPM=rpm, MEMBERS=members, BLOCK_=BLOCK[elem.element_size()],
                     ESIZE=elem.element_size(), VALIGN=bool(getattr(tables, "aligned", False)),
                     TK=getattr(tables, "width", 0), PAIRS=bool(getattr(tables, "pairs", False)),
                     KINDS=kinds, WALK=walk, AHEAD=PREFETCH[elem.element_size()] and not vsparse, RAGGED=ragged,
                     VSPARSE=vsparse, TILE=tile, WIDE=acc.numel() >= WIDE_FLOATS,
                     num_warps=warps, num_stages=NUM_STAGES,
                     maxnreg=max_registers(kinds, warps, n <= rpm, ragged, vsparse)))
    # a decode step's few rows: no padding to 16, except for bfloat16 tails (tensor-core dots need 16 rows)
    rm = ROWS if tail_keys.dtype == torch.bfloat16 else min(triton.next_power_of_2(n), ROWS)
    merge = (_merge_kernel, (heads, triton.cdiv(n, rm)),
             (q, tables.head, acc, ml, tail_keys, tail_values, new_keys, new_values, tail_len, out, n, q.stride(0),
              tail_keys.shape[1], q_len, g0, scale, new_keys.stride(0), new_keys.stride(1), new_values.stride(0),
              new_values.stride(1)),
             dict(D=d, D_PAD=triton.next_power_of_2(d), RM=rm, BLOCK_=MERGE_BLOCK,
                  RS=min(triton.next_power_of_2(n), ROWS) if rm == ROWS and n < ROWS else 0,
                  num_warps=MERGE_WARPS if rm <= 4 or tail_keys.dtype == torch.bfloat16 else NUM_WARPS,
                  num_stages=1, maxnreg=MAX_REGISTERS))
    return [partials, merge]


def fused_decode(q, scale: float, aux_scale, tables, elem, new_keys, new_values, tail_keys, tail_values, tail_len,
                 q_len: int, g0: int, out, advance: int):
    """``q (QH, n, D)`` (query rows ``g0 … g0 + n − 1`` of each query head, any float dtype, scaled by ``scale`` in
    float32 inside the kernels) → ``out (QH, n, D)`` (written in ``out``'s dtype).

    ``q`` and ``out`` may be column slices of larger ``(QH, N, D)`` tensors (a suffix's chunk of query rows: read
    and written in place, their head stride passed to the kernels), with the same strides. ``tables``: the
    :class:`~spark_bench.storage.segments.FusedTables` of the batch (its ``members`` must be :func:`launch_shape`'s
    for ``n``); ``elem``: any tensor of the stores' dtype (the element type of the addresses);
    ``tail_keys``/``tail_values`` ``(QH, capacity, D)``: the decoded tail, ``tail_len`` a 1-element int64 device
    tensor (its filled length, so the launch's arguments are the same at every step); ``new_keys``/``new_values``
    ``(QH, q_len, D)`` (channels contiguous): the step's own tokens, attended from there and written into the tail at
    the length. The partials launch advances ``tail_len`` by ``advance`` before the merge reads it: ``q_len`` on a
    layer's first call of a step, 0 on its others (the tail length is then ``old + q_len`` for every merge of the
    step). The caller runs this under the tensors' device (:func:`~spark_bench.storage.dispatch.on_device`)."""
    _, n, d = q.shape
    if q.stride()[1:] != (d, 1) or out.stride() != q.stride():
        raise ValueError("queries and output need rows of D contiguous channels and the same strides")
    if new_keys.stride(-1) != 1 or new_values.stride(-1) != 1:
        raise ValueError("the new keys and values need contiguous channels")
    rpm, members = launch_shape(n)
    if tables.members != members:
        raise ValueError(f"tables built for {tables.members} heads per work item, the launch needs {members}")
    for kernel, grid, args, kwargs in launches(q, scale, aux_scale, tables, elem, new_keys, new_values, tail_keys,
                                               tail_values, tail_len, q_len, g0, out, advance):
        kernel[grid](*args, **kwargs)
    return out
