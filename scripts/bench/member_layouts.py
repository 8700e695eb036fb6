"""Key layouts for the SparK member loop of the fused decode, measured in sm_90 machine code →
results/bench/member_layouts.json.

**What it measures.** The fused decode's partials kernel (:mod:`spark_bench.storage.triton_decode`) runs, inside its
token loop (``BLOCK_`` = 32 tokens per trip, 4 warps), one *member loop* trip per query head sharing the program's
value reads. For a SparK row that loop is the *signed* one: kept entries placed at their channels by a 128-bit
channel mask, the pruned channels recovered as ``√μ · Σ sign_c · qa_c`` (``qa = q · a``, the query times the
channel's recovery scale). Here other storage layouts of the same score, per member and token

    s_r = Σ_j k_j · q_r[idx_j]  +  √μ · Σ_{c pruned} sign_c · qa_r[c]        (r: the member's 4 query rows)

are written as one small Triton kernel (a member loop in a token loop, 4 warps, 32 tokens per block: a warp owns 8
tokens, lane ``(W, TL)`` owns token ``TL``'s slots ``7W .. 7W + 6`` and groups ``8W .. 8W + 7``, the 4 rows in
registers), compiled for sm_90 on this CPU (triton's compiler and bundled ptxas / nvdisasm, as
:mod:`spark_bench.storage.gpu_compile` compiles the real kernel), and the member loop's own SASS instructions counted
(the loops found by their back edges, :func:`~spark_bench.storage.gpu_compile.parse_sass`). The baseline is the real
kernel as launched at the production shape for SparK rows with the official recovery alone
(``Launch("partials", 128, 4, kinds=16)``: the signed member loop only): its token loop is the first top-level loop
holding inner loops, its signed member loop that loop's last inner loop. Each layout's scores are also checked
under Triton's interpreter (``TRITON_INTERPRET=1``, a child process) against a float64 torch reference: D = 128,
26 kept channels, 3 members, 40 tokens (one full block and a partial one), every 10th token's mask (from the 4th)
with empty words (all 26 kept in one word, or in 30 consecutive channels).

**Layouts**, key bytes per token and member at D = 128 with T = 26 kept channels:

* today: 52 B kept values (bf16) + 16 B channel mask + 2 B μ + 12.75 B signs (102 pruned channels × 1 bit) ≈ 83 B,
  read by the real kernel's signed loop: at 4 and 8 rows a member, tiles like Q's
  (:mod:`spark_bench.storage.triton_tiles`; until this round a walk like W's, :mod:`spark_bench.storage.triton_walk`,
  which still serves 1 or 2 rows a member and float32 stores);
* A: one index byte per kept channel (26 B) + the kept values (52 B), the member loop computing the kept part only —
  the floor of any layout storing the kept part this way; charged B's 96 B, since the signs must be stored somewhere;
* B: A + 4 sign words (16 B, bit ``c`` set: channel ``c`` pruned and positive) + μ (2 B) = 96 B; the recovery is
  ``√μ · (2 Σ_{bit set} qa + Σ_j qa[idx_j] − Σ_c qa_c)``, the first sum from per-member nibble tables
  (32 groups × 16 entries × 4 rows, 8 KiB a member, built once per step outside the loop);
* C: A + one base-3 code byte per 4 channels (32 B; digit 0 kept, 1 pruned +, 2 pruned −) + μ (2 B) = 112 B; the
  recovery is ``√μ · Σ_G LUT3[G][code_G]`` (32 groups × 81 entries × 4 rows, 41.5 KiB a member, built once per step);
* W: today's layout, restructured (no byte changes, 82.75 B): lane ``(W, TL)`` finds the channel of kept rank 7W once
  (mask word by popc prefix counts, byte by SWAR, bit by a 2 KiB (byte, j) → bit table), then steps six times to the
  next kept channel (ffs; an emptied word jumps to the next nonzero one by a 64 B table); the recovery of mask word
  W's pruned channels reads their pruned-order sign bits as one 32-bit window of the bit array and, per nibble, maps
  (pruned nibble, next 4 signs) to the positive channels (a 256 B table) to index B's nibble tables (8 KiB a member),
  B's recovery formula after (the kept channels' qa gathered with their q). Shared tables 2,368 B;
* M: the mask (16 B) + the kept values (52 B) + μ (2 B) + B's 4 sign words in channel positions (16 B) = 86 B, the
  other layout under the issue's 0.36 × 256 = 92.16 B cap: W's walk for the kept part, B's recovery (lane ``W``'s
  positive word ``W``, 8 nibbles into B's nibble tables: no sign window, no expansion table: :func:`_member_w`
  with ``CHANNEL_SIGNS``);
* T: M's bytes, placed in key tiles for the tensor cores instead of walked (:func:`_member_t`): every entry of a
  (32 tokens, 128 channels) tile finds its kept value by the rank of its mask bit (a popcount each, then a gather),
  a second tile of 0 / 1 / 2 (pruned −, kept, pruned +) from the mask and sign words, and the score is
  ``q · Kᵀ + √μ · ((q ∘ a) · T2ᵀ − Σ_c qa)`` on the tensor cores (bfloat16 queries in one term, ``q ∘ a`` in three)
  — the "tile from mask ranks" of the third round's open question, written in plain Triton;
* P: T's tiles built a nibble at a time (:func:`_member_p`): per (token, mask word, nibble) one popcount gives the
  nibble's first kept rank, its four kept values from there are loaded and placed at its kept channels by two byte
  permutes (``PRMT``, inline PTX; an interpreter twin) whose selectors and zero masks come from a 16-entry table, and
  the 0 / 1 / 2 tile's four entries from a 256-entry table (:func:`permute_table`);
* Q: P on today's bytes (82.75 B): a word's pruned-order sign bits read as one 32-bit window as W reads them, a
  nibble's next 4 signs and its mask nibble indexing a 256-entry table of its 0 / 1 / 2 entries.

**GQA 8.** W, M, T, P and Q are also written for 8 query rows a member (``R``; the real kernel's signed launch at
``group`` 8): the walks' FMAs and gathers grow with the rows, a tile's dot covers 16 rows whatever a member holds.

**Reading the result.** ``member_instructions`` are per warp per 32-token block (×4 warps per block). The estimate
``instr_per_byte`` = (L + n·M) · warps / (BLOCK · (V + n·K)) charges the real kernel's steady token loop (L, the
instructions a block of SparK members runs, measured here) plus n member loops (M) against the bytes the block
reads: V = 256 B of bf16 values per token, K key bytes per member; ``one_row``: n = 1, ``four_members``: n = 4
(``gqa8``: L and M at group 8, ``two_members``: n = 2). At the bandwidth limit an H100 issues about 0.14
warp-instructions per byte (``scripts/bench/instructions.py``'s budget): below it the loop is bandwidth-bound.
``max_abs_err`` is the interpreter check's largest error (``max_abs_score`` its scale). ``real_kernel.source``: the
commit the baseline was compiled from (the working tree; marked if it had edits).

    python scripts/bench/member_layouts.py [out.json]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spark_bench.storage.gpu_compile import Launch, _target, _tool, compile_launch, guarded, parse_sass  # noqa: E402
from spark_bench.storage.segments import KINDS  # noqa: E402
from spark_bench.storage.triton_math import _ffs, _popc, _prmt  # noqa: E402
from spark_bench.storage.triton_tiles import _pairs_to_tile  # noqa: E402
from spark_bench.storage.triton_walk import SLOTS, _walk_start  # noqa: E402
from spark_bench.storage.walk_layout import walk_table  # noqa: E402

D, T, BLOCK, WARPS = 128, 26, 32, 4
SIGNED = 1 << KINDS.index("signed")  # the partials kernel's KINDS for official-recovery SparK rows alone
SPT = -(-T // 4)                      # kept slots per lane (7: a token's 26 entries over 4 lanes, 28 slots)
LAYOUTS = {"A": 0, "B": 1, "C": 2, "W": 3, "M": 4, "T": 5, "P": 6, "Q": 7}
KEY_BYTES = {"today": 52 + 16 + 2 + 102 / 8, "A": 96, "B": 96, "C": 26 + 52 + 32 + 2, "W": 52 + 16 + 2 + 102 / 8,
             "M": 52 + 16 + 16 + 2, "T": 52 + 16 + 16 + 2,
             "P": 52 + 16 + 16 + 2, "Q": 52 + 16 + 2 + 102 / 8}
VALUE_BYTES = 2 * D
BUDGET = 0.14
CHECK = dict(n_tok=40, count=3)       # the interpreter check: one full block and an 8-token partial one, 3 members
PAD = 4096                            # elements after every store: dead tokens and padding slots read unmasked
SIGN_OFF = tl.constexpr(13)           # W: a member's token t's sign bits from bit 13 + 102 t (not word-aligned)


@triton.jit
def _sqrt_rn(x):
    r = tl.math.rsqrt(x)
    y = x * r
    y = tl.fma(tl.fma(-y, y, x), 0.5 * r, y)
    return tl.where(x < 1.1754944e-38, 0.0, y)


@triton.jit
def _member(q_b, idx_b, kept_b, mu_b, sgn_b, code_b, lut_b, qat_b, t0, D: tl.constexpr, T: tl.constexpr,
            LAYOUT: tl.constexpr, SPT: tl.constexpr):
    """(32 tokens, 4 rows) scores of one member at tokens ``t0 ..`` (pointers: its token 0 / its tables). Tiles are
    (4 warps TW, 4 lanes W, 8 lanes TL[, 4 rows]); the slot and group sums are FFMA/FADD chains in registers, one
    2-level shuffle reduction over W at the end. Padding slots (p >= T) read the next token's index (< D) with k = 0;
    in B, whose Σ qa[idx] needs them at the zero row D, they are masked."""
    TW = tl.arange(0, 4)[:, None, None]
    W = tl.arange(0, 4)[None, :, None]
    TL = tl.arange(0, 8)[None, None, :]
    r = tl.arange(0, 4)[None, None, None, :].to(tl.uint32)
    tt = t0 + TW * 8 + TL
    QW: tl.constexpr = 8 if LAYOUT == 1 else 4   # q table rows: (q_0..3) or, in B, (q_0..3, qa_0..3)
    acc = tl.zeros((4, 4, 8, 4), tl.float32)
    kqa = tl.zeros((4, 4, 8, 4), tl.float32)
    for i in tl.static_range(SPT):
        p = W * SPT + i
        if i >= T - 3 * SPT and LAYOUT == 1:      # (only then can the last lane's slot be past T)
            idx = tl.load(idx_b + tt * T + p, mask=p < T, other=D).to(tl.uint32)
        else:
            idx = tl.load(idx_b + tt * T + p).to(tl.uint32)
        if i >= T - 3 * SPT:
            k = tl.load(kept_b + tt * T + p, mask=p < T, other=0.0).to(tl.float32)
        else:
            k = tl.load(kept_b + tt * T + p).to(tl.float32)
        ga = q_b + (idx * QW)[:, :, :, None] + r
        acc = acc + k[:, :, :, None] * tl.load(ga)
        if LAYOUT == 1:
            kqa = kqa + tl.load(ga + 4)
    if LAYOUT == 0:
        return tl.reshape(tl.sum(acc, axis=1), (32, 4))
    rec = tl.zeros((4, 4, 8, 4), tl.float32)
    if LAYOUT == 1:  # lane W reads sign word W ^ 1 (the xor keeps it a 4-byte load), its groups are that word's nibbles
        wi = W ^ 1
        w = tl.load(sgn_b + tt * 4 + wi)
        for i in tl.static_range(8):
            nib = ((w >> (4 * i)) & 15).to(tl.uint32)
            rec = rec + tl.load((lut_b + (wi * 8 + i) * 64 + nib * 4)[:, :, :, None] + r)
        smu = _sqrt_rn(tl.maximum(tl.load(mu_b + tt).to(tl.float32), 0.0))
        acc = acc + smu[:, :, :, None] * (kqa + 2.0 * rec)
        qat = tl.load(qat_b + tl.arange(0, 4))
        out = tl.sum(acc, axis=1) - tl.reshape(smu, (4, 8))[:, :, None] * qat[None, None, :]
        return tl.reshape(out, (32, 4))
    for i in tl.static_range(8):  # C: lane W owns code bytes (groups) 8W + i
        G = W * 8 + i
        code = tl.load(code_b + tt * 32 + G).to(tl.uint32)
        rec = rec + tl.load((lut_b + G * 324 + code * 4)[:, :, :, None] + r)
    smu = _sqrt_rn(tl.maximum(tl.load(mu_b + tt).to(tl.float32), 0.0))
    acc = acc + smu[:, :, :, None] * rec
    return tl.reshape(tl.sum(acc, axis=1), (32, 4))


@triton.jit
def _member_w(q_b, kept_b, mu_b, mask_b, sgn_b, lut_b, qat_b, tab_b, t0, D: tl.constexpr, T: tl.constexpr,
              SPT: tl.constexpr, CHANNEL_SIGNS: tl.constexpr, R: tl.constexpr = 4):
    """W's (32 tokens, ``R`` rows) scores (tiles as :func:`_member`; ``tab_b``: the 2 KiB select, 64 B next-word and
    256 B expansion tables, in that order). ``CHANNEL_SIGNS``: M's, the same walk with B's recovery from sign words
    in channel positions (lane ``W``: positive word ``W``'s nibbles index B's nibble tables; no window, no expansion
    table)."""
    TW = tl.arange(0, 4)[:, None, None]
    W = tl.arange(0, 4)[None, :, None]
    TL = tl.arange(0, 8)[None, None, :]
    r = tl.arange(0, R)[None, None, None, :].to(tl.uint32)
    tt = t0 + TW * 8 + TL
    x0, x1 = tl.load(mask_b + tt * 4), tl.load(mask_b + tt * 4 + 1)
    x2, x3 = tl.load(mask_b + tt * 4 + 2), tl.load(mask_b + tt * 4 + 3)
    if CHANNEL_SIGNS:
        pos = tl.load(sgn_b + tt * 4 + W)             # word W's positive pruned channels (issued with the mask)
    C1 = _popc(x0).to(tl.uint32)                      # kept channels before words 1, 2, 3
    C2 = C1 + _popc(x1).to(tl.uint32)
    C3 = C2 + _popc(x2).to(tl.uint32)
    rem, s8, nxt = _walk_start(x0, x1, x2, x3, C1, C2, C3, (W * SPT).to(tl.uint32), tab_b)  # (the real kernel's)
    acc = tl.zeros((4, 4, 8, R), tl.float32)
    kqa = tl.zeros((4, 4, 8, R), tl.float32)
    for i in tl.static_range(SPT):
        p = W * SPT + i
        idx = s8 * 4 + _ffs(rem).to(tl.uint32) - 1
        if i >= T - 3 * SPT:
            idx = tl.where(p < T, idx, D)
            k = tl.load(kept_b + tt * T + p, mask=p < T, other=0.0).to(tl.float32)
        else:
            k = tl.load(kept_b + tt * T + p).to(tl.float32)
        if i < SPT - 1:                               # next kept channel
            rem = rem & (rem - 1)
            n8 = (nxt >> s8) & 0xFF
            ez = rem == 0
            rem = tl.where(ez, tl.where(n8 == 8, x1, tl.where(n8 == 16, x2, x3)), rem)
            s8 = tl.where(ez, n8, s8)
        ga = q_b + (idx * (2 * R))[:, :, :, None] + r
        acc = acc + k[:, :, :, None] * tl.load(ga)
        kqa = kqa + tl.load(ga + R)
    rec = tl.zeros((4, 4, 8, R), tl.float32)
    if CHANNEL_SIGNS:
        for g in tl.static_range(8):
            nib = ((pos >> (4 * g)) & 15).to(tl.uint32)
            rec = rec + tl.load((lut_b + (W * 8 + g) * (16 * R) + nib * R)[:, :, :, None] + r)
    else:
        xw = tl.where(W == 0, x0, tl.where(W == 1, x1, tl.where(W == 2, x2, x3)))
        cw = tl.where(W == 0, 0, tl.where(W == 1, C1, tl.where(W == 2, C2, C3))).to(tl.int32)
        notm = ~xw                                    # word W's pruned channels, their signs from bit `start` on
        start = tt * (D - T) + 32 * W - cw + SIGN_OFF
        lo = tl.load(sgn_b + (start >> 5))
        hi = tl.load(sgn_b + (start >> 5) + 1)
        window = ((lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)) >> (start & 31).to(tl.uint64)).to(tl.uint32)
        for g in tl.static_range(8):                  # nibble g: (pruned nibble, next 4 signs) → positive nibble
            if g == 0:
                ix = ((notm << 4) & 0xF0) | (window & 0xF)
            else:
                ix = ((notm >> (4 * g - 4)) & 0xF0) | (window & 0xF)
            ex = tl.load(tab_b + 2112 + ix).to(tl.uint32)
            rec = rec + tl.load((lut_b + (W * 8 + g) * (16 * R) + ex * R)[:, :, :, None] + r)
            if g < 7:
                window = window >> _popc(notm & (15 << (4 * g))).to(tl.uint32)
    smu = _sqrt_rn(tl.maximum(tl.load(mu_b + tt).to(tl.float32), 0.0))
    acc = acc + smu[:, :, :, None] * (kqa + 2.0 * rec)
    qat = tl.load(qat_b + tl.arange(0, R))
    out = tl.sum(acc, axis=1) - tl.reshape(smu, (4, 8))[:, :, None] * qat[None, None, :]
    return tl.reshape(out, (32, R))


@triton.jit
def _tile_logits(qk, qa1, qa2, qa3, K, T2, mu_b, qat_b, t):
    """A tile layout's (16 rows, 32 tokens) logits from its key tile ``K`` and its 0 / 1 / 2 tile ``T2``:
    ``qk · Kᵀ + √μ · ((q ∘ a) · T2ᵀ − Σ_c qa)`` (``q ∘ a`` in three bfloat16 terms)."""
    sk = tl.dot(qk, tl.trans(K))
    sr = tl.dot(qa1, tl.trans(T2)) + tl.dot(qa2, tl.trans(T2), tl.dot(qa3, tl.trans(T2)))
    smu = _sqrt_rn(tl.maximum(tl.load(mu_b + t).to(tl.float32), 0.0))
    qat = tl.load(qat_b + tl.arange(0, 16))
    return sk + smu[None, :] * (sr - qat[:, None])


@triton.jit
def _member_t(qk, qa1, qa2, qa3, kept_b, mu_b, mask_b, sgn_b, qat_b, t0, D: tl.constexpr, T: tl.constexpr):
    """T's scores (16 rows, 32 tokens) of one member, M's bytes rebuilt as key tiles for the tensor cores: each entry
    of a (32 tokens, 128 channels) tile placed by the rank of its mask bit (a popcount per entry) and read from the
    kept values, a second tile of 0 / 1 / 2 (pruned −, kept, pruned +: exact in bfloat16) from the mask and the sign
    words; ``qk · Kᵀ + √μ · ((q ∘ a) · T2ᵀ − Σ_c qa)`` (the recovery's ``q ∘ a`` as three bfloat16 terms, the queries
    bfloat16). ``qk``, ``qa1..3``: the (16, D) query tiles, this member's rows among them."""
    t = t0 + tl.arange(0, 32)
    wi = tl.arange(0, 4)
    x = tl.load(mask_b + t[:, None] * 4 + wi[None, :])                      # (32, 4) mask words
    pos = tl.load(sgn_b + t[:, None] * 4 + wi[None, :])                     # (32, 4) positive pruned channels
    cnt = _popc(x).to(tl.uint32)
    before = tl.cumsum(cnt, axis=1) - cnt                                   # kept channels before each word
    j = tl.arange(0, 32).to(tl.uint32)[None, None, :]
    X = x[:, :, None]
    bit = (X >> j) & 1
    rank = before[:, :, None] + _popc(X & ((1 << j) - 1)).to(tl.uint32)
    kv = tl.load(kept_b + t[:, None, None] * T + rank, mask=bit != 0, other=0.0)
    two = (bit + 2 * ((pos[:, :, None] >> j) & 1)).to(tl.float32).to(tl.bfloat16)
    return _tile_logits(qk, qa1, qa2, qa3, tl.reshape(kv, (32, D)), tl.reshape(two, (32, D)), mu_b, qat_b, t)


@triton.jit
def _member_p(qk, qa1, qa2, qa3, kept_b, mu_b, mask_b, sgn_b, ptab, qat_b, t0, D: tl.constexpr, T: tl.constexpr,
              WINDOW: tl.constexpr):
    """P's scores (16 rows, 32 tokens): T's tiles built a nibble at a time. Per (token, mask word, nibble): the
    nibble's first kept rank (the word's kept channels before it: one popcount), its four kept values from there
    loaded and paired, and placed at the nibble's kept channels by two byte permutes (``PRMT``) whose selectors and
    zero masks come from a 16-entry table by the mask nibble; the 0 / 1 / 2 tile's four entries from a 256-entry table
    by (mask nibble, sign nibble). Dots as T's. ``WINDOW`` (Q: today's bytes, signs in pruned order): its word's pruned
    signs are read as one 32-bit window (two words), as W reads them; a nibble's are the next 4 past the pruned
    channels before it, and they index Q's own 256-entry table with the mask nibble (no positive-nibble expansion)."""
    t = t0 + tl.arange(0, 32)
    wi = tl.arange(0, 4)
    x = tl.load(mask_b + t[:, None] * 4 + wi[None, :])                      # (32, 4) mask words
    if not WINDOW:
        pos = tl.load(sgn_b + t[:, None] * 4 + wi[None, :])                 # (32, 4) positive pruned channels
    cnt = _popc(x).to(tl.uint32)
    before = tl.cumsum(cnt, axis=1) - cnt
    if WINDOW:  # word w's pruned channels' signs, from bit `start` of the member's sign bits
        start = (t[:, None] * (D - T) + 32 * wi[None, :] - before.to(tl.int32) + SIGN_OFF).to(tl.uint32)
        lo = tl.load(sgn_b + (start >> 5))
        hi = tl.load(sgn_b + (start >> 5) + 1)
        window = ((lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)) >> (start & 31).to(tl.uint64)).to(tl.uint32)
    g4 = (tl.arange(0, 8) * 4).to(tl.uint32)[None, None, :]
    X = x[:, :, None]
    nib = (X >> g4) & 15                                                    # (32, 4, 8)
    below = _popc(X & ((1 << g4) - 1)).to(tl.uint32)                      # kept channels of the word before it
    rk = before[:, :, None] + below                                         # the nibble's first kept rank
    kb = kept_b.to(tl.pointer_type(tl.uint16), bitcast=True) + t[:, None, None] * T + rk
    a01 = tl.load(kb).to(tl.uint32) | (tl.load(kb + 1).to(tl.uint32) << 16)
    a23 = tl.load(kb + 2).to(tl.uint32) | (tl.load(kb + 3).to(tl.uint32) << 16)
    # (selectors, zero masks) of the nibble: one 16-byte row; the 0 / 1 / 2 entries: one 8-byte row
    sel = tl.load((ptab + nib * 4)[:, :, :, None] + tl.arange(0, 4)[None, None, None, :])
    first, second = tl.split(tl.reshape(sel, (32, 4, 8, 2, 2)))            # (sel0, zm0), (sel1, zm1)
    s0, z0 = tl.split(first)
    s1, z1 = tl.split(second)
    k01 = _prmt(a01, a23, s0) & z0
    k23 = _prmt(a01, a23, s1) & z1
    if WINDOW:  # (the pruned channels before nibble g: 4g − the kept ones; their next 4 signs index Q's table)
        two = ptab + 576 + (nib | (((window[:, :, None] >> (g4 - below)) & 15) << 4)) * 2
    else:
        two = ptab + 64 + (nib | (((pos[:, :, None] >> g4) & 15) << 4)) * 2
    u01, u23 = tl.split(tl.load(two[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]))
    return _tile_logits(qk, qa1, qa2, qa3, _pairs_to_tile(k01, k23, 32, D), _pairs_to_tile(u01, u23, 32, D), mu_b,
                        qat_b, t)


@triton.jit
def member_kernel(q_ptr, idx_ptr, kept_ptr, mu_ptr, sgn_ptr, code_ptr, lut_ptr, qat_ptr, mask_ptr, tab_ptr, out_ptr,
                  count, t_start, t_end, n_tok, D: tl.constexpr, T: tl.constexpr, BLOCK: tl.constexpr,
                  LAYOUT: tl.constexpr, SPT: tl.constexpr, R: tl.constexpr = 4):
    """Scores (16, n_tok), rows ``R·m … R·m + R − 1`` for member m < count (-inf for the others), tokens t_start ..
    t_end; ``R``: a member's query rows (4, or 8 for W, M, T, P and Q)."""
    QW: tl.constexpr = 2 * R if LAYOUT == 1 or LAYOUT >= 3 else R
    LUTN: tl.constexpr = 32 * 81 * 4 if LAYOUT == 2 else 32 * 16 * R
    r16 = tl.arange(0, 16)
    if LAYOUT >= 5:  # T, P, Q: the (16, D) query tiles, member m's R rows at R·m … (bfloat16 q, q ∘ a's 3 terms)
        at = r16[:, None] * D + tl.arange(0, D)[None, :]
        qk = tl.load(q_ptr + at).to(tl.bfloat16)
        qa1 = tl.load(q_ptr + 16 * D + at).to(tl.bfloat16)
        qa2 = tl.load(q_ptr + 32 * D + at).to(tl.bfloat16)
        qa3 = tl.load(q_ptr + 48 * D + at).to(tl.bfloat16)
    for t0 in range(t_start, t_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        live = t < t_end
        s = tl.full((16, BLOCK), float("-inf"), tl.float32)
        q_b, idx_b, kept_b, mu_b, sgn_b, code_b, lut_b, qat_b = (q_ptr, idx_ptr, kept_ptr, mu_ptr, sgn_ptr, code_ptr,
                                                                   lut_ptr, qat_ptr)
        mask_b = mask_ptr
        for m in range(0, count):
            if LAYOUT == 5:  # (its rows: the member's among the 16 the tiles give)
                sm16 = _member_t(qk, qa1, qa2, qa3, kept_b, mu_b, mask_b, sgn_b, qat_ptr, t0, D, T)
            elif LAYOUT >= 6:  # (Q: P on today's bytes)
                sm16 = _member_p(qk, qa1, qa2, qa3, kept_b, mu_b, mask_b, sgn_b, lut_ptr, qat_ptr, t0, D, T,
                                 LAYOUT == 7)
            else:
                if LAYOUT == 3 or LAYOUT == 4:  # (M: W's walk, signs in channel positions)
                    sm = tl.trans(_member_w(q_b, kept_b, mu_b, mask_b, sgn_b, lut_b, qat_b, tab_ptr, t0, D, T, SPT,
                                            LAYOUT == 4, R))
                else:
                    sm = tl.trans(_member(q_b, idx_b, kept_b, mu_b, sgn_b, code_b, lut_b, qat_b, t0, D, T, LAYOUT,
                                          SPT))
                sm16 = tl.reshape(tl.broadcast_to(sm[None, :, :], (16 // R, R, BLOCK)), (16, BLOCK))
            s = tl.where((r16 // R == m)[:, None] & live[None, :], sm16, s)
            q_b += (D + 1) * QW
            idx_b += n_tok * T
            kept_b += n_tok * T
            mu_b += n_tok
            sgn_b += n_tok * 4                        # (W: its sign bit array, padded to the same stride)
            mask_b += n_tok * 4
            code_b += n_tok * 32
            lut_b += LUTN
            qat_b += R
        tl.store(out_ptr + r16[:, None] * n_tok + t[None, :], s, mask=live[None, :])


def stores(n_tok: int, count: int, seed: int = 0, rows: int = 4) -> dict:
    """Random members in every layout's storage (each padded by PAD zeros), the per-step tables, and the float64
    reference scores (16, n_tok): ``ref`` (kept + recovered), ``ref_kept`` (A's)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(count, rows, D, generator=g) * 0.3).bfloat16().float()  # (bfloat16 queries, as T's dot takes them)
    qa = q * (torch.rand(count, 1, D, generator=g) + 0.5)
    order = torch.stack([torch.randperm(D, generator=g)[:T] for _ in range(count * n_tok)]).view(count, n_tok, T)
    g2 = torch.Generator().manual_seed(seed + 1)  # masks with empty words: 26 kept in one word or in 30 in a row
    for n, (m, t) in enumerate((m, t) for m in range(count) for t in range(3, n_tok, 10)):
        lo, span = (32 * (n // 2 % 4), 32) if n % 2 == 0 else (int(torch.randint(0, D - 29, (1,), generator=g2)), 30)
        order[m, t] = lo + torch.randperm(span, generator=g2)[:T]
    sign = torch.where(torch.rand(count, n_tok, D, generator=g) < 0.5, 1.0, -1.0)
    sign.scatter_(2, order, 0.0)                                              # 0 at kept channels
    kvals = (torch.randn(count, n_tok, T, generator=g) * 2).bfloat16()
    mu = (torch.rand(count, n_tok, generator=g) * 3).bfloat16()
    ref_kept = torch.full((16, n_tok), float("-inf"), dtype=torch.float64)
    ref = ref_kept.clone()
    for m in range(count):
        kept = (q[m].double()[:, order[m]] * kvals[m].double()).sum(-1)      # (rows, n_tok)
        ref_kept[rows * m:rows * m + rows] = kept
        ref[rows * m:rows * m + rows] = kept + mu[m].double().sqrt() * (sign[m].double() @ qa[m].double().T).T

    def padded(x):
        return torch.cat([x.flatten(), torch.zeros(PAD, dtype=x.dtype)])

    def u32(bits):  # (..., 32) bits → uint32 words
        w = (bits.long() << torch.arange(32)).sum(-1)
        return torch.where(w >= 2 ** 31, w - 2 ** 32, w).int().view(torch.uint32)

    # W: the mask; the pruned channels' sign bits (1: +) in channel order, token t's from bit SIGN_OFF + 102 t of the
    # member's n_tok · 128 bits (the others 1); tables: (byte, j) → bit of its j-th set bit, (nonzero words 1..3, k) →
    # 8 × the next nonzero word after k (3 if none), (pruned nibble, next 4 signs) → the positive channels' nibble
    kept_mask = torch.zeros(count, n_tok, D, dtype=torch.bool).scatter_(2, order, True)
    sbits = torch.ones(count, n_tok * 128, dtype=torch.long)
    sbits[:, SIGN_OFF.value:SIGN_OFF.value + n_tok * (D - T)] = (sign[~kept_mask] > 0).long().view(count, -1)
    tab = torch.frombuffer(bytearray(walk_table()), dtype=torch.uint8)  # (the real kernel's constant table)

    def rows16(x):  # (count, rows, n) → (16, n): member m's rows at rows·m …, zero past the members
        return torch.cat([x.reshape(count * rows, -1), torch.zeros(16 - count * rows, x.shape[-1])])

    def split3(x):  # float32 → three bfloat16-exact terms (as float32) summing to it
        a1 = x.bfloat16().float()
        a2 = (x - a1).bfloat16().float()
        return a1, a2, (x - a1 - a2).bfloat16().float()

    def table(x):  # (count, D + 1, rows): channel c's query rows, row D zero (B's masked padding slots)
        return torch.cat([x.transpose(1, 2), torch.zeros(count, 1, rows)], 1)

    bits = ((sign > 0).long().view(count, n_tok, 4, 32) << torch.arange(32)).sum(-1)
    digits = torch.where(sign == 0, 0, torch.where(sign > 0, 1, 2)).view(count, n_tok, 32, 4)
    groups = qa.view(count, rows, 32, 4)                                      # (m, r, G, i): channel 4G + i
    nibble = ((torch.arange(16)[:, None] >> torch.arange(4)) & 1).float()    # (16 entries, 4 bits)
    e = torch.arange(81)[:, None] // 3 ** torch.arange(4) % 3                 # (81 codes, 4 digits)
    trit = torch.where(e == 1, 1.0, torch.where(e == 2, -1.0, 0.0))
    return dict(idx=padded(order.to(torch.uint8)), kept=padded(kvals), mu=padded(mu),
                sgn=padded(torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).int()).view(torch.uint32),
                code=padded((digits * torch.tensor([1, 3, 9, 27])).sum(-1).to(torch.uint8)),
                q4=padded(table(q)), q8=padded(torch.cat([table(q), table(qa)], 2)),
                lut_B=padded(torch.einsum("ei,mrgi->mger", nibble, groups)),
                lut_C=padded(torch.einsum("ei,mrgi->mger", trit, groups)),
                qat=padded(qa.sum(-1)), mask=padded(u32(kept_mask.view(count, n_tok, 4, 32))),
                kept_W=padded(kvals.gather(2, order.argsort(-1))), sgn_W=padded(u32(sbits.view(count, -1, 32))),
                tab=padded(tab), ref=ref, ref_kept=ref_kept, q_T=padded(torch.cat([rows16(q), *split3(rows16(qa))])),
                qat_T=padded(rows16(qa.sum(-1, keepdim=True))), ptab=padded(permute_table()))


def permute_table():
    """P's and Q's tables (uint32): per mask nibble (16 × 4) the two ``PRMT`` selectors placing its kept values (slot
    ``j`` ← bytes ``2s, 2s + 1`` of the four loaded, ``s`` = the kept channels below ``j``) and their zero masks; per
    (mask nibble, sign nibble) (256 × 2) the 0 / 1 / 2 tile's four bfloat16 entries (kept 1.0, pruned + 2.0, pruned −
    0), in pairs — P's sign nibble in channel positions, then Q's (256 × 2, from entry 576): the next 4 signs of the
    nibble's pruned channels in pruned order, so no expansion step."""
    import torch

    rows = []
    for nib in range(16):
        sel, zm = [0, 0], [0, 0]
        for j in range(4):
            if nib >> j & 1:
                src = bin(nib & ((1 << j) - 1)).count("1")
                sel[j // 2] |= (2 * src | (2 * src + 1) << 4) << (8 * (j % 2))
                zm[j // 2] |= 0xFFFF << (16 * (j % 2))
        rows += [*sel, *zm]
    for code in range(256):
        nib, pos = code & 15, code >> 4
        v = [0x3F80 if nib >> j & 1 else 0x4000 if pos >> j & 1 else 0 for j in range(4)]
        rows += [v[0] | v[1] << 16, v[2] | v[3] << 16]
    for code in range(256):  # Q: by (mask nibble, the next 4 signs of its pruned channels, in pruned order)
        nib, signs = code & 15, code >> 4
        v = [0x3F80 if nib >> j & 1 else 0x4000 if signs >> (j - bin(nib & ((1 << j) - 1)).count("1")) & 1 else 0
             for j in range(4)]
        rows += [v[0] | v[1] << 16, v[2] | v[3] << 16]
    return torch.tensor([r - (1 << 32) if r >= 1 << 31 else r for r in rows], dtype=torch.int32).view(torch.uint32)


def _arguments(layout: str, x: dict, n_tok: int, count: int, out, rows: int = 4):
    lut, w = x["lut_C" if layout == "C" else "lut_B"], "_W" if layout in "WQ" else ""
    q = x["q_T"] if layout in "TPQ" else x["q8" if layout in "BWM" else "q4"]
    lut = x["ptab"] if layout in "PQ" else lut
    args = (q, x["idx"], x["kept" + ("_W" if layout in "MTP" else w)], x["mu"], x["sgn" + w], x["code"], lut,
            x["qat_T" if layout in "TPQ" else "qat"], x["mask"], x["tab"], out, count, 0, n_tok, n_tok)
    return args, dict(D=D, T=T, BLOCK=BLOCK, LAYOUT=LAYOUTS[layout], SPT=SPT, R=rows)


def _child(args: list[str], interpret: bool):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def check(layouts=tuple(LAYOUTS), n_tok: int = CHECK["n_tok"], count: int = CHECK["count"], rows: int = 4) -> dict:
    """Each layout's scores under Triton's interpreter vs the float64 reference: {layout: (max abs error, max |score|)}
    (run in a child process with ``TRITON_INTERPRET=1`` unless this one has it)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return _child(["check", ",".join(layouts), str(n_tok), str(count), str(rows)], interpret=True)
    import torch

    x, result = stores(n_tok, count, rows=rows), {}
    for layout in layouts:
        out = torch.zeros(16, n_tok)
        args, kwargs = _arguments(layout, x, n_tok, count, out, rows)
        member_kernel[(1,)](*args, **kwargs)
        ref = x["ref_kept" if layout == "A" else "ref"]
        live = torch.isfinite(ref)
        assert torch.equal(live, torch.isfinite(out.double())), f"{layout}: absent members' rows differ"
        result[layout] = ((out.double() - ref)[live].abs().max().item(), ref[live].abs().max().item())
    return result


def token_and_member(sass: str, trips: int = 0):
    """(token loop's instructions a block of the last member loop's kind runs, that member loop's) — the token loop
    being the first top-level loop holding inner loops: its own instructions less the guarded preambles of the member
    loops that do not run (:func:`~spark_bench.storage.gpu_compile.guarded`, as ``scripts/bench/instructions.py``
    counts them); the member loop's own instructions and, ``trips`` times, the loops nested in it (the real kernel's
    signed walk: its slot loop)."""
    labels: dict = {}
    instructions, loops = parse_sass(sass, labels)
    token = next(loop for loop in loops if loop.inner)
    skipped = sum(len(guarded(instructions, labels, token, x)) for x in token.inner[:-1])
    member = token.inner[-1]
    nested = sum(len(x.own(instructions)) for x in member.inner)
    return len(token.own(instructions)) - skipped, len(member.own(instructions)) + trips * nested


def measure(layout: str, arch: int = 90, rows: int = 4) -> dict:
    """Compile ``layout``'s kernel for ``sm_<arch>`` (4 warps, one stage) as Triton's launcher binds it; registers,
    spill bytes, token- and member-loop instructions (in a child process without the interpreter if this one runs
    it)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _child(["measure", layout, str(arch), str(rows)], interpret=False)
    import torch
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    n_tok, count = 64, 3 if rows == 4 else 2  # (count 1 would be specialised: no member loop)
    args, kwargs = _arguments(layout, stores(n_tok, count, rows=rows), n_tok, count, torch.zeros(16, n_tok), rows)
    kwargs.update(num_warps=WARPS, num_stages=1, maxnreg=255)
    backend = make_backend(_target(arch))
    binder = create_function_from_signature(member_kernel.signature, member_kernel.params, backend)
    bound, specialisation, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = member_kernel._pack_args(backend, options, bound, specialisation, options)
    compiled = triton.compile(ASTSource(member_kernel, signature, constexprs, attrs), target=_target(arch),
                              options=options.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(ptx).write_text(compiled.asm["ptx"])
        Path(cubin).write_bytes(compiled.asm["cubin"])
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        report = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", ptx, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    token, member = token_and_member(sass)
    return dict(registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                spill_bytes=int(re.search(r"(\d+) bytes spill stores", report).group(1)),
                token_loop_instructions=token, member_instructions=member)  # (token loop: this kernel's own)


def instr_per_byte(token: int, member: int, key_bytes: float, members: int, warps: int, block: int) -> float:
    return round((token + members * member) * warps / (block * (VALUE_BYTES + members * key_bytes)), 4)


WIDE = ("W", "M", "T", "P", "Q")  # the layouts written for 8 query rows a member too (GQA 8)


def variants(group: int) -> tuple:
    """The real kernel's signed launch at ``group`` query rows a member (its registers, token loop, signed member
    loop) and every layout's member loop at as many rows (GQA 8: :data:`WIDE`), each with its estimate and check."""
    real = compile_launch(Launch("partials", 128, group, kinds=SIGNED), 90, sass=True)
    token, signed = token_and_member(real.sass, -(-(-(-T // 4)) // SLOTS.value))  # (T kept: ⌈T/4⌉ ranks a lane)
    warps, block = real.num_warps, real.constants["BLOCK_"]
    names = tuple(LAYOUTS) if group == 4 else WIDE
    rows = {"today": dict(registers=real.registers, spill_bytes=real.spill_bytes, member_instructions=signed)}
    rows.update({layout: {k: v for k, v in measure(layout, 90, group).items() if k != "token_loop_instructions"}
                 for layout in names})
    errors = check(names, count=CHECK["count"] if group == 4 else 2, rows=group)
    members = (("one_row", 1), ("four_members", 4) if group == 4 else ("two_members", 2))
    for name, row in rows.items():
        row["key_bytes_per_token"] = KEY_BYTES[name]
        row["instr_per_byte"] = {label: instr_per_byte(token, row["member_instructions"], KEY_BYTES[name], n, warps,
                                                       block) for label, n in members}
        row["max_abs_err"], row["max_abs_score"] = errors.get(name, (None, None))
    return real, token, rows


def main(out: str = "results/bench/member_layouts.json") -> None:
    real, token, rows = variants(4)
    real8, token8, rows8 = variants(8)
    warps, block = real.num_warps, real.constants["BLOCK_"]
    git = ["git", "-C", str(Path(__file__).resolve().parents[2])]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "spark_bench/storage"], capture_output=True,
                           text=True).stdout.strip()
    result = dict(arch=90, real_kernel=dict(source=head + (" + uncommitted spark_bench/storage edits" if dirty else ""),
                                            launch="partials, head_dim 128, group 4, bf16, q_len 1, KINDS 16", warps=warps,
                                            block=block, registers=real.registers, token_loop_instructions=token),
                  value_bytes_per_token=VALUE_BYTES, budget=BUDGET, check=dict(head_dim=D, kept=T, **CHECK),
                  formula="(token_loop + n * member) * warps / (block * (value_bytes + n * key_bytes)), n = 1, 4",
                  variants=rows,
                  gqa8=dict(real_kernel=dict(launch="partials, head_dim 128, group 8, bf16, q_len 1, KINDS 16",
                                             warps=real8.num_warps, registers=real8.registers,
                                             token_loop_instructions=token8),
                            note="8 query rows a member (the check: 2 members); n = 1, 2", variants=rows8))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for group, tok, table in ((4, token, rows), (8, token8, rows8)):
        many = "4 memb" if group == 4 else "2 memb"
        print(f"sm_90, GQA {group}: token loop {tok} instructions/warp, {warps} warps × {block} tokens; budget "
              f"{BUDGET} instr/B")
        print(f"{'layout':7}{'regs':>5}{'spill':>6}{'member':>8}{'key B':>7}{'1 row':>8}{many:>8}{'max err':>10}")
        for name, row in table.items():
            err = "-" if row["max_abs_err"] is None else f"{row['max_abs_err']:.1e}"
            print(f"{name:7}{row['registers']:>5}{row['spill_bytes']:>6}{row['member_instructions']:>8}"
                  f"{row['key_bytes_per_token']:>7.2f}"
                  + "".join(f"{v:>8.3f}" for v in row["instr_per_byte"].values()) + f"{err:>10}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # check / measure in a child process: one JSON line
        what, *rest = sys.argv[2:]
        if what == "check":
            print(json.dumps(check(tuple(rest[0].split(",")), int(rest[1]), int(rest[2]), int(rest[3]))))
        else:
            print(json.dumps(measure(rest[0], int(rest[1]), int(rest[2]))))
    else:
        main(*sys.argv[1:])
