"""The second kernel of the fused decode (:mod:`.triton_decode`): per query head, merge the partial softmaxes of its
chunks, attend over its decoded tail and the step's own tokens (causal among a suffix's tokens), normalise."""

from __future__ import annotations

import triton
import triton.language as tl

from spark_bench.storage.segments import HEAD_COLS
from spark_bench.storage.triton_math import _dot3, _online, _scores, _split3

HEAD: tl.constexpr = tl.constexpr(HEAD_COLS)  # (the head table's row width)


@triton.jit
def _merge_kernel(q_ptr, head_ptr, acc_ptr, ml_ptr, tail_k_ptr, tail_v_ptr, new_k_ptr, new_v_ptr, len_ptr, out_ptr,
                  n_rows, q_stride, tail_cap, q_len, g0, scale, new_k_sh, new_k_st, new_v_sh, new_v_st,
                  D: tl.constexpr, D_PAD: tl.constexpr, RM: tl.constexpr, BLOCK_: tl.constexpr,
                  RS: tl.constexpr = 0):
    """Query head ``qh``'s rows ``gb·RM …``: merge its prompt partials, attend over its decoded tail (the ``old``
    tokens in the tail buffer, then the step's ``q_len`` new ones read from ``new_k``/``new_v``, causal among
    themselves), normalise. Programs ``(qh, 0)`` also write the new tokens into the tail buffer at ``old …``.
    bfloat16 tails score and sum on the tensor cores (:func:`_dot3`, float32 products) over ``RM = 16`` rows: a
    decode step's few rows (``RS`` of them) merge their partials alone, then are padded to 16 (the padding masked);
    float32 tails use FMA products over the rows there are."""
    qh = tl.program_id(0).to(tl.int64)
    gb = tl.program_id(1).to(tl.int64)
    c = tl.arange(0, D_PAD)
    cm = c < D
    R: tl.constexpr = RM if RS == 0 else RS  # the partials' rows: the program's real ones (RS of RM), else RM
    g = gb * RM + tl.arange(0, R)
    ok = g < n_rows
    both = ok[:, None] & cm[None, :]
    slot_base = tl.load(head_ptr + qh * HEAD + 4)
    n_slots = tl.load(head_ptr + qh * HEAD + 5)
    m_i = tl.full((R,), float("-inf"), tl.float32)
    l_i = tl.zeros((R,), tl.float32)
    acc = tl.zeros((R, D_PAD), tl.float32)
    for k in range(0, n_slots):
        at = (slot_base + k) * n_rows + g
        pm = tl.load(ml_ptr + at * 2, mask=ok, other=float("-inf"))
        pl = tl.load(ml_ptr + at * 2 + 1, mask=ok, other=0.0)
        pa = tl.load(acc_ptr + at[:, None] * D + c[None, :], mask=both, other=0.0)
        m_new = tl.maximum(m_i, pm)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a_old = tl.exp(m_i - m_safe)
        a_new = tl.exp(pm - m_safe)
        l_i = l_i * a_old + pl * a_new
        acc = acc * a_old[:, None] + pa * a_new[:, None]
        m_i = m_new
    if R != RM:  # the RS rows repeated up to RM (row r holds row r mod RS), the repeats masked
        rep_: tl.constexpr = RM // R
        g = gb * RM + tl.arange(0, RM)
        ok = g < n_rows
        both = ok[:, None] & cm[None, :]
        real = tl.arange(0, RM) < R
        m_i = tl.where(real, tl.reshape(tl.broadcast_to(m_i[None, :], (rep_, R)), (RM,)), float("-inf"))
        l_i = tl.where(real, tl.reshape(tl.broadcast_to(l_i[None, :], (rep_, R)), (RM,)), 0.0)
        acc = tl.where(real[:, None], tl.reshape(tl.broadcast_to(acc[None, :, :], (rep_, R, D_PAD)), (RM, D_PAD)),
                       0.0)
    old = tl.load(len_ptr) - q_len  # the partials launch already advanced the length past this step's tokens
    q = tl.load(q_ptr + (qh * q_stride + g * D)[:, None] + c[None, :], mask=both, other=0.0).to(tl.float32) * scale
    TC: tl.constexpr = tail_k_ptr.dtype.element_ty == tl.bfloat16  # (RM = 16: tensor-core dots, exact products)
    if TC:
        q1, q2, q3 = _split3(q)
    else:
        q1, q2, q3 = q, q, q
    for t0 in range(0, old, BLOCK_):
        t = t0 + tl.arange(0, BLOCK_).to(tl.int64)
        live = t < old
        at = (qh * tail_cap + t)[:, None] * D + c[None, :]
        tk = tl.load(tail_k_ptr + at, mask=live[:, None] & cm[None, :], other=0.0)
        tv = tl.load(tail_v_ptr + at, mask=live[:, None] & cm[None, :], other=0.0)
        if TC:
            s = _dot3(q1, q2, q3, tl.trans(tk), tl.zeros((RM, BLOCK_), tl.float32))
        else:
            s = _scores(q, tk.to(tl.float32), RM >= 16)
            tv = tv.to(tl.float32)
        s = tl.where(live[None, :], s, float("-inf"))
        m_i, l_i, acc = _online(m_i, l_i, acc, s, tv, RM >= 16)
    newest = (g0 + g) % q_len  # the newest of the step's tokens each query row sees (causal suffix)
    for j0 in range(0, q_len, BLOCK_):
        j = j0 + tl.arange(0, BLOCK_).to(tl.int64)
        live = (j < q_len)[:, None] & cm[None, :]
        nk = tl.load(new_k_ptr + (qh * new_k_sh + j * new_k_st)[:, None] + c[None, :], mask=live, other=0.0)
        nv = tl.load(new_v_ptr + (qh * new_v_sh + j * new_v_st)[:, None] + c[None, :], mask=live, other=0.0)
        at = (qh * tail_cap + old + j)[:, None] * D + c[None, :]
        writes = live & ((j * 0 + gb) == 0)[:, None]  # the head's first program writes the tail
        tl.store(tail_k_ptr + at, nk, mask=writes)
        tl.store(tail_v_ptr + at, nv, mask=writes)
        if TC:
            s = _dot3(q1, q2, q3, tl.trans(nk), tl.zeros((RM, BLOCK_), tl.float32))
        else:
            s = _scores(q, nk.to(tl.float32), RM >= 16)
            nv = nv.to(tl.float32)
        s = tl.where((j < q_len)[None, :] & (j[None, :] <= newest[:, None]), s, float("-inf"))
        m_i, l_i, acc = _online(m_i, l_i, acc, s, nv, RM >= 16)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (qh * q_stride + g * D)[:, None] + c[None, :], out, mask=both)
