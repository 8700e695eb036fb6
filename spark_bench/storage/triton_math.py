"""The arithmetic the fused decode kernels share (:mod:`.triton_decode`, :mod:`.triton_merge`), in Triton.

Float32 products on the tensor cores from bfloat16 operands: a float32 operand is split into three bfloat16 terms
(:func:`_split3`, ``a = a₁ + a₂ + a₃`` to float32's 24 bits), each product with a bfloat16 is exact in float32, and
:func:`_dot3` accumulates the three dots in float32. The online softmax (:func:`_online`) folds a block of logits
and values into a running max, sum and ``Σ weight · value``. Helpers for the C++ kernel's exact arithmetic:
:func:`_sqrt_rn` (correctly rounded ``sqrt``); bit instructions: :func:`_popc` (``POPC``), :func:`_ffs`,
:func:`_prmt` (``PRMT``). Under Triton's CPU interpreter (``TRITON_INTERPRET=1`` set before this module is
imported) the GPU-only instructions fall back to equivalents, and the interpreter's bfloat16 ``tl.dot`` is made to
widen its operands (:func:`_interpreter_bf16_dot`); two faults of the interpreter up to Triton 3.2 are put right
(:func:`_interpreter_older_triton`).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice


def _interpreter_bf16_dot() -> None:
    """Triton's CPU interpreter (3.9) multiplies ``tl.dot``'s bfloat16 operands as their raw 16-bit patterns (numpy
    has no bfloat16; it stores them as uint16): widen them to float32 first, which is exact, as the tensor cores'
    products are. Installed only under ``TRITON_INTERPRET=1``."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    if getattr(original, "widens_bf16", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot.widens_bf16 = True
    interpreter.InterpreterBuilder.create_dot = create_dot


def _interpreter_older_triton() -> None:
    """Faults of Triton's CPU interpreter up to 3.2 (torch 2.6's; its ``ReduceScanOpIneterface``, renamed with the
    fixes) under numpy 2, put right where they occur: a reduction or scan keeps numpy's accumulator type (uint32
    words summed into uint64 data under a uint32 tensor, which a bitcast then reads as twice as many int32s); a scalar
    (a one-element array there) used as an index or a loop bound is converted by ``int(array)``, which numpy 2.4
    refuses; ``~`` of a boolean or an unsigned tensor asks for an all-ones value it has no type for (booleans) or
    makes as ``-1``, which numpy 2 refuses for unsigned types; a store through a scalar pointer whose mask is false
    stores all the same (``if not mask`` reads the mask's value where a newer Triton asks ``mask is None``; the
    partials kernel's tail-length update, one program's, would run in every program). Installed only under
    ``TRITON_INTERPRET=1``; nothing is changed in a newer interpreter. The kernels' source is the same for every
    Triton."""
    import numpy as np
    from triton.language import semantic
    from triton.runtime import interpreter

    base = getattr(interpreter, "ReduceScanOpIneterface", None)
    if base is None or getattr(base.to_tensor, "keeps_dtype", False):
        return
    to_tensor, patch, builder = base.to_tensor, interpreter._patch_lang_tensor, interpreter.InterpreterBuilder
    store = semantic._store_legacy

    def typed_to_tensor(self, ret, dtype):
        if getattr(ret, "shape", ()):
            ret = ret.astype(interpreter._get_np_dtype(dtype), copy=False)
        return to_tensor(self, ret, dtype)

    def patch_lang_tensor(tensor, *args):
        patch(tensor, *args)
        tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])

    def get_all_ones_value(self, type):
        np_type = interpreter._get_np_dtype(type)
        ones = True if np_type == np.bool_ else np.iinfo(np_type).max if np_type.kind == "u" else -1
        return interpreter.TensorHandle(np.full(1, ones, dtype=np_type), type.scalar)

    def store_legacy(ptr, val, mask, *args):
        if mask is not None and not mask.type.is_block() and not np.asarray(mask.handle.data).reshape(-1)[0]:
            return tl.tensor(None, tl.void)  # (its mask is off: nothing stored)
        return store(ptr, val, mask, *args)

    typed_to_tensor.keeps_dtype = True
    base.to_tensor = typed_to_tensor
    interpreter._patch_lang_tensor = patch_lang_tensor
    builder.get_int1_ty = lambda self: tl.int1
    builder.get_all_ones_value = get_all_ones_value
    semantic._store_legacy = store_legacy


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_bf16_dot()
    _interpreter_older_triton()


DOT_PRECISION: tl.constexpr = tl.constexpr("ieee")  # float32 products (FMA), as the C++ kernel
INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _sqrt_rn(x):
    """``sqrt(x)`` correctly rounded for ``x ≥ 0`` (0 for subnormal ``x``), the C++ kernel's ``std::sqrt``: CUDA's
    ``sqrt.rn`` fast path (Markstein: ``y = x·rsqrt(x)``, one fused correction) without ``tl.sqrt_rn``'s call to its
    slow path (special and subnormal inputs), whose calling convention made the kernels spill registers."""
    r = tl.math.rsqrt(x)
    y = x * r
    y = tl.fma(tl.fma(-y, y, x), 0.5 * r, y)
    return tl.where(x < 1.1754944e-38, 0.0, y)


@triton.jit
def _popc(x):
    """The set bits of each uint32 ``x``, as int32: the GPU's ``POPC`` (libdevice); under the CPU interpreter, which
    has no libdevice, the same count by SWAR bit sums (``tests/test_fused_decode.py`` checks it)."""
    if INTERPRET:
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return ((x * 0x01010101) >> 24).to(tl.int32)
    else:
        return libdevice.popc(x.to(tl.int32, bitcast=True))


@triton.jit
def _ffs(x):
    """1 + the lowest set bit of uint32 ``x`` (0 for 0), int32: libdevice's ``ffs`` (``FLO`` of ``x & −x``); under
    the CPU interpreter by :func:`_popc`."""
    if INTERPRET:
        return tl.where(x != 0, _popc((x & (~x + 1)) - 1) + 1, 0)
    else:
        return libdevice.ffs(x.to(tl.int32, bitcast=True))


@triton.jit
def _prmt(a, b, sel):
    """PTX ``prmt.b32`` (default mode; selector nibbles < 8): byte ``i`` of the result is byte ``(sel >> 4i) & 7`` of
    ``{b, a}`` (0–3: ``a``'s, 4–7: ``b``'s), uint32 — one byte permute (``PRMT``); under the CPU interpreter the same
    by shifts."""
    if INTERPRET:
        out = tl.zeros_like(a)
        for i in tl.static_range(4):
            n = (sel >> (4 * i)) & 7
            out = out | (((tl.where(n < 4, a, b) >> ((n & 3) * 8)) & 0xFF) << (8 * i))
        return out
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.uint32,
                                         is_pure=True, pack=1)


@triton.jit
def _split3(a):
    """float32 ``a`` as three bfloat16 terms ``a₁ + a₂ + a₃ = a`` (to float32's 24 bits): each product of one with
    a bfloat16 is exact in float32, so three tensor-core dots accumulated in float32 give float32 products."""
    a1 = a.to(tl.bfloat16)
    r = a - a1.to(tl.float32)
    a2 = r.to(tl.bfloat16)
    return a1, a2, (r - a2.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot3(a1, a2, a3, b, acc):
    """``acc + (a₁ + a₂ + a₃) · b`` on the tensor cores, float32 accumulation (:func:`_split3`): ``a₁ · b`` into
    ``acc`` and ``a₂ · b + a₃ · b`` in a second accumulator, joined once (``d₁ + d₂₃``): two independent chains, so
    ptxas has no dependent HMMAs to pad with no-op instructions on sm_90 as it does for one chain of all three."""
    d1 = tl.dot(a1, b, acc)
    d23 = tl.dot(a2, b, tl.dot(a3, b))
    return d1 + d23


@triton.jit
def _scores(q, k, DOT: tl.constexpr):
    """``q (rows, D) · k (n, D)ᵀ`` in float32: ``tl.dot`` (FMA products at ``ieee``) for 16 rows or more, else a
    broadcast product summed over the channels (a decode step's few rows: no padding to the dot's 16)."""
    if DOT:
        out = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    else:
        out = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    return out


@triton.jit
def _split_dot(a, b, acc):
    """``acc + a · b`` for float32 ``a`` and bfloat16 ``b`` on the tensor cores with float32 products
    (:func:`_split3`), accumulated in float32."""
    a1, a2, a3 = _split3(a)
    return _dot3(a1, a2, a3, b, acc)


@triton.jit
def _rows_dot(a1, a2, a3, k, scale, ELEM: tl.constexpr, ONE: tl.constexpr):
    """``a · kᵀ`` in float32 for keys ``k (n, channels)`` in their rows: bfloat16 keys on the tensor cores against
    ``a``'s three bfloat16 terms (:func:`_dot3`, float32 products) — or, with ``ONE``, against ``a₁`` alone, the
    unscaled bfloat16 queries themselves (exact in one term), the logits scaled after (one dot, not three) —,
    float32 keys by an FMA dot against ``a₁``."""
    if ELEM == tl.bfloat16:
        if ONE:
            return tl.dot(a1, tl.trans(k), tl.zeros((a1.shape[0], k.shape[0]), tl.float32)) * scale
        return _dot3(a1, a2, a3, tl.trans(k), tl.zeros((a1.shape[0], k.shape[0]), tl.float32))
    else:
        return tl.dot(a1, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)


@triton.jit
def _prefetch(ptr, nbytes, LINES: tl.constexpr):
    """Ask L2 for the ``nbytes`` (< (``LINES`` − 1) × 128) from ``ptr`` (any element type), one 128-byte line per
    ``prefetch.global.L2`` from the line holding the first byte (nothing returned, nothing waited for: a later load
    of those lines finds them in L2 — the next block's bytes requested while this block computes). The addresses come
    from ``ptr`` alone (the byte count only masks), as the later loads' do. Nothing under the CPU interpreter."""
    if not INTERPRET:
        base = ptr.to(tl.pointer_type(tl.int8), bitcast=True)
        first = base.to(tl.int64, bitcast=True) & 127  # (lines from the one holding the first byte)
        line = tl.arange(0, LINES)
        at = base + (line * 128 - first)
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [at, (line * 128 < first + nbytes).to(tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _exp2(x):
    """``2ˣ`` by the GPU's ``ex2.approx.ftz`` (what ``tl.exp`` issues, less the subnormal fix-up around it: a
    weight below 2⁻¹²⁶ flushes to 0); ``tl.exp2`` under the CPU interpreter."""
    if INTERPRET:
        return tl.exp2(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _online(m_i, l_i, acc, s, v, DOT: tl.constexpr = True):
    """One online-softmax step: fold logits ``s (rows, n)`` and their values ``v (n, D)`` into the running max
    ``m_i``, sum ``l_i`` and ``acc = Σ exp(s − m) · v`` (rows fully masked so far keep ``m = −inf``, weight 0).
    ``exp(x − m) = 2^(x·log₂e − m·log₂e)``: one FMA and one ``ex2`` per weight. ``l_i`` may be a ``(rows, n)`` tile
    of per-column partial sums (summed once, at the end: no reduction across warps per block) or ``(rows,)``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) * 1.4426950408889634
    alpha = _exp2(m_i * 1.4426950408889634 - m_safe)
    p = _exp2(s * 1.4426950408889634 - m_safe[:, None])
    if len(l_i.shape) == 2:
        l_i = l_i * alpha[:, None] + p
    else:
        l_i = l_i * alpha + tl.sum(p, axis=1)
    if v.dtype == tl.bfloat16:  # bfloat16 values: tensor cores, float32 products and sums
        acc = _split_dot(p, v, acc * alpha[:, None])
    elif DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_i, acc
