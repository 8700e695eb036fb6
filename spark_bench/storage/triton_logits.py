"""The compact key-store logits kernel in Triton: the CUDA path of :class:`~.segments.SegmentStack`.

Same segment table and flat arrays as the C++ kernel (``engine/kernels/spark_logits.cpp``), same result up to
float32 summation order: one program per (segment, block of ``BLOCK_S`` tokens) rebuilds the block's key tile in
registers from the kept entries, the packed mask and the recovery term, and reduces it against each of the ``G``
query rows. Nothing of size S×D is written to memory. Per entry ``c`` of token ``t``:

* kept: ``q_c · k_tc``;
* pruned, mode 0 (constant ``f``): ``f · a_c``; mode 1 (paper degenerate): ``μ_t · a_c`` with ``a = q / q̄``;
  mode 2 (official degenerate): ``s_tc · sqrt(μ_t) · a_c`` with ``a = q / sqrt(‖q‖)`` and ``s`` the stored sign;
* mode 3: every channel is kept (no mask).

A kept entry's place in the flat kept array is its rank among the token's kept channels (an exclusive cumulative
sum over the mask bits); a pruned entry's sign bit is at its rank among the pruned channels.

Tests run it on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_S = 32


@triton.jit
def _tail_logits(q_ptr, tail_ptr, out_ptr, qh, width, s_max, tail_cap, tail_len, q_len, g0, G: tl.constexpr,
                 D: tl.constexpr, BLOCK: tl.constexpr):
    """Query head ``qh`` over its decoded tail (dense ``(QH, cap, D)``, the first ``tail_len`` filled): positions
    ``s_max + t``; query row ``g0 + g`` is the step's query ``(g0 + g) % q_len`` and sees ``t ≤ tail_len − q_len +
    (g0 + g) % q_len``."""
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    c = tl.arange(0, D)
    live = t < tail_len
    k = tl.load(tail_ptr + (qh * tail_cap + t[:, None]) * D + c[None, :], mask=live[:, None] & (c[None, :] >= 0),
                other=0.0).to(tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + (qh * G + g) * D + c)
        visible = live & (t <= tail_len - q_len + (g0 + g) % q_len)
        tl.store(out_ptr + (qh * G + g) * width + s_max + t, tl.sum(qg[None, :] * k, axis=1), mask=visible)


@triton.jit
def _segment_kernel(q_ptr, scale_ptr, table_ptr, fill_ptr, kept_ptr, mask_ptr, mu_ptr, sign_ptr, out_ptr, s_max,
                    n_seg, tail_ptr, tail_cap, tail_len, q_len, g0, G: tl.constexpr, D: tl.constexpr,
                    BLOCK: tl.constexpr):
    seg = tl.program_id(0)
    width = s_max + tail_len
    if seg >= n_seg:  # programs past the table: the tail of query head seg − n_seg
        _tail_logits(q_ptr, tail_ptr, out_ptr, seg - n_seg, width, s_max, tail_cap, tail_len, q_len, g0, G, D, BLOCK)
    else:
        _segment_body(q_ptr, scale_ptr, table_ptr, fill_ptr, kept_ptr, mask_ptr, mu_ptr, sign_ptr, out_ptr, seg, width,
                      G, D, BLOCK)


@triton.jit
def _segment_body(q_ptr, scale_ptr, table_ptr, fill_ptr, kept_ptr, mask_ptr, mu_ptr, sign_ptr, out_ptr, seg, width,
                  G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """One block of one segment's tokens (see the module docstring)."""
    row = table_ptr + seg * 10
    qh = tl.load(row + 0)
    out_off = tl.load(row + 1)
    n_tok = tl.load(row + 2)
    t_kept = tl.load(row + 3)
    kept_off = tl.load(row + 4)
    mask_off = tl.load(row + 5)
    mask_stride = tl.load(row + 6)
    mu_off = tl.load(row + 7)
    sign_off = tl.load(row + 8)
    mode = tl.load(row + 9)
    fill = tl.load(fill_ptr + seg)

    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = t < n_tok
    c = tl.arange(0, D)
    live2 = live[:, None] & (c[None, :] >= 0)
    modes = t[:, None] * 0 + c[None, :] * 0 + mode  # the segment's mode as a (BLOCK, D) tensor (masks need tensors)
    byte = tl.load(mask_ptr + (mask_off + t[:, None] * mask_stride) * (D // 8) + (c[None, :] // 8),
                   mask=live2 & (modes != 3), other=0).to(tl.int32)
    bit = (byte >> (c[None, :] % 8)) & 1
    bit = tl.where(modes == 3, 1, bit)
    rank = tl.cumsum(bit, axis=1) - bit  # kept channels before c
    is_kept = bit != 0
    k = tl.load(kept_ptr + kept_off + t[:, None] * t_kept + rank, mask=live2 & is_kept, other=0.0).to(tl.float32)
    mode1 = t * 0 + mode
    mu = tl.load(mu_ptr + mu_off + t, mask=live & ((mode1 == 1) | (mode1 == 2)), other=0.0).to(tl.float32)
    scale = tl.where(mode == 1, mu, tl.where(mode == 2, tl.sqrt(tl.maximum(mu, 0.0)), fill))
    pruned_rank = c[None, :] - rank
    sign_pos = sign_off + t[:, None] * (D - t_kept) + pruned_rank
    sbyte = tl.load(sign_ptr + (sign_pos >> 3), mask=live2 & (~is_kept) & (modes == 2), other=0).to(tl.int32)
    sign = tl.where(mode == 2, 2.0 * ((sbyte >> (sign_pos & 7)) & 1).to(tl.float32) - 1.0, 1.0)
    recovered = scale[:, None] * sign
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + (qh * G + g) * D + c)
        ag = qg * tl.load(scale_ptr + qh * D + c)
        contrib = tl.where(is_kept, qg[None, :] * k, recovered * ag[None, :])
        tl.store(out_ptr + (qh * G + g) * width + out_off + t, tl.sum(contrib, axis=1), mask=live)


def _nonempty(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Triton needs a real pointer even where a segment never reads (e.g. no sign bits in the batch)."""
    return x if x.numel() else torch.zeros(1, dtype=dtype, device=x.device)


def segment_logits(q: torch.Tensor, aux_scale: torch.Tensor, table: torch.Tensor, fills: torch.Tensor,
                   kept: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, signs: torch.Tensor, s_max: int,
                   max_tokens: int, tail: torch.Tensor | None = None, tail_len: int = 0, q_len: int = 1,
                   g0: int = 0) -> torch.Tensor:
    """``q (QH, G, D)`` float32 → ``(QH, G, s_max + tail_len)`` float32 (−inf where nothing is visible);
    arguments as the C++ ``spark_segments``."""
    qh, g, d = q.shape
    if d & (d - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim, got {d}")
    out = torch.full((qh, g, s_max + tail_len), float("-inf"), dtype=torch.float32, device=q.device)
    n_seg = table.shape[0]
    grid = (n_seg + (qh if tail_len else 0), triton.cdiv(max(max_tokens, tail_len, 1), BLOCK_S))
    tail_arg = tail if tail_len else _nonempty(kept[:0], kept.dtype)
    _segment_kernel[grid](q, aux_scale, table, fills, _nonempty(kept, kept.dtype), _nonempty(mask, torch.uint8),
                          _nonempty(mu, kept.dtype), _nonempty(signs, torch.uint8), out, s_max, n_seg, tail_arg,
                          tail.shape[1] if tail_len else 0, tail_len, q_len, g0, G=g, D=d, BLOCK=BLOCK_S)
    return out


@triton.jit
def _pv_kernel(w_ptr, table_ptr, v_ptr, out_ptr, W, tail_ptr, tail_cap, tail_start, tail_len, G: tl.constexpr,
               G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    seg = tl.program_id(0)
    row = table_ptr + seg * 4
    qh = tl.load(row + 0)
    w_off = tl.load(row + 1)
    n_tok = tl.load(row + 2)
    val_off = tl.load(row + 3)
    g = tl.arange(0, G_PAD)
    c = tl.arange(0, D)
    acc = tl.zeros((G_PAD, D), dtype=tl.float32)
    for start in range(0, n_tok, BLOCK):
        t = start + tl.arange(0, BLOCK)
        live = t < n_tok
        w = tl.load(w_ptr + (qh * G + g[:, None]) * W + w_off + t[None, :], mask=(g[:, None] < G) & live[None, :],
                    other=0.0)
        v = tl.load(v_ptr + val_off + t[:, None] * D + c[None, :], mask=live[:, None] & (c[None, :] >= 0),
                    other=0.0).to(tl.float32)
        acc += tl.sum(w[:, :, None] * v[None, :, :], axis=1)
    for start in range(0, tail_len, BLOCK):  # the decoded tail of this query head's row
        t = start + tl.arange(0, BLOCK)
        live = t < tail_len
        w = tl.load(w_ptr + (qh * G + g[:, None]) * W + tail_start + t[None, :],
                    mask=(g[:, None] < G) & live[None, :], other=0.0)
        v = tl.load(tail_ptr + (qh * tail_cap + t[:, None]) * D + c[None, :], mask=live[:, None] & (c[None, :] >= 0),
                    other=0.0).to(tl.float32)
        acc += tl.sum(w[:, :, None] * v[None, :, :], axis=1)
    tl.store(out_ptr + (qh * G + g[:, None]) * D + c[None, :], acc, mask=(g[:, None] < G) & (c[None, :] >= 0))


def pv_segments(w: torch.Tensor, table: torch.Tensor, values: torch.Tensor, head_dim: int,
                tail: torch.Tensor | None = None, tail_start: int = 0, tail_len: int = 0) -> torch.Tensor:
    """``w (QH, G, W)`` float32 weights · value segments (+ each query head's decoded tail at ``tail_start``) →
    ``(QH, G, D)`` float32; as the C++ ``pv_segments``."""
    qh, g, width = w.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim, got {head_dim}")
    out = torch.zeros(qh, g, head_dim, dtype=torch.float32, device=w.device)
    tail_arg = tail if tail_len else _nonempty(values[:0], values.dtype)
    _pv_kernel[(table.shape[0],)](w, table, values, out, width, tail_arg, tail.shape[1] if tail_len else 0,
                                  tail_start, tail_len, G=g, G_PAD=triton.next_power_of_2(g), D=head_dim, BLOCK=16)
    return out
