"""Which kernel serves compact attention, and the calls into it, always under the tensors' own device.

The top of :mod:`spark_bench.storage`: stores (:mod:`.stores`, :mod:`.bits`) at the bottom, their layouts for the
kernels (:mod:`.segments`) over them, the kernels (:mod:`.fast_logits`: the C++ CPU kernels; :mod:`.triton_decode`:
the fused CUDA decode) beside each other, and this module on top, the only one that imports both.

* CPU tensors: the C++ kernels — logits over a :class:`~.segments.SegmentStack` (:func:`stack_logits`), a float32
  softmax, ``weights · values`` over a :class:`~.segments.ValueStack` (:func:`stack_apply`).
* CUDA tensors: the fused Triton kernel (:func:`fused_attention`): logits, online softmax and values in one launch
  plus a merge, no score tensor.

Triton launches on the *current* CUDA device and its stream, not on its tensors' device, and Accelerate's hooks never
change the current device: every launch here runs under :func:`on_device` of its tensors, so a layer placed on
``cuda:1`` by a device map launches on ``cuda:1``.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from spark_bench.storage.segments import FusedTables, SegmentStack, ValueStack, store_blocker
from spark_bench.storage.sparse_values import value_parts
from spark_bench.storage.stores import DenseStore, dense_logits
from spark_bench.storage.windowed import WindowedStore

_seen_fallbacks: set[str] = set()
ONE_STORE_ON_CUDA = "scores of one store on CUDA (the fused kernel serves decode batches)"
_EMPTY = torch.empty(0)


def on_device(tensor: torch.Tensor):
    """``torch.cuda.device(tensor.device)`` for a CUDA tensor (the launch's device and current stream), else a
    no-op context."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def _triton_ready() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def compact_backend(device: torch.device, cpp_kernel=None, triton_ready: bool | None = None) -> str:
    """``cpp`` (CPU tensors, the compiled kernel), ``triton`` (CUDA tensors, Triton importable), or the reason
    neither serves ``device`` (a string starting with ``no:``): then the rows are not stacked. ``cpp_kernel``: the
    loaded extension or the reason it is unavailable (default: :func:`~.fast_logits.load_kernel`)."""
    if device.type == "cpu":
        if cpp_kernel is None:
            from spark_bench.storage.fast_logits import load_kernel
            cpp_kernel = load_kernel()
        return f"no: {cpp_kernel}" if isinstance(cpp_kernel, str) else "cpp"
    if device.type == "cuda":
        ready = _triton_ready() if triton_ready is None else triton_ready
        return "triton" if ready else "no: triton is not installed (pip install triton) for the CUDA kernel"
    return f"no: no compact kernel for {device.type} tensors"


def fallback(reason: str) -> None:
    if reason not in _seen_fallbacks:
        _seen_fallbacks.add(reason)
        warnings.warn(f"spark-bench: compact SparK attention falls back to rebuild-then-matmul: {reason}",
                      stacklevel=3)


def fallback_reasons() -> set[str]:
    return set(_seen_fallbacks)


def kernel_blocker(store, device: torch.device) -> str | None:
    """Why the C++ kernel cannot serve this one store's logits on ``device`` (None: it can): the store's layout and
    recovery (:func:`~.segments.store_blocker`), then the device. On CUDA the fused kernel serves whole decode
    batches (:func:`fused_attention`), not one store's scores. A :class:`~.windowed.WindowedStore` (Mustafar's
    dense window) is served where its compact part is (:func:`compact_logits`)."""
    if isinstance(store, WindowedStore):
        return kernel_blocker(store.old, device)
    reason = store_blocker(store)
    if reason is not None:
        return reason
    backend = compact_backend(device)
    if backend == "triton":
        return ONE_STORE_ON_CUDA
    return backend[4:] if backend.startswith("no:") else None


def reference_logits(store, queries: torch.Tensor) -> torch.Tensor:
    """``queries · keys`` with the keys rebuilt, in float32 (the recovered entries rounded to the store's dtype)."""
    return queries.float() @ store.materialize().float().transpose(-1, -2)


def compact_logits(store, queries: torch.Tensor) -> torch.Tensor:
    """``queries (B, H, G, D)`` · keys of one compact ``store`` → ``(B, H, G, S)`` float32: the C++ kernel over a
    one-store segment table where it serves the store (kept on the store: no copy of its data), else the rebuilt
    keys (:func:`reference_logits`, float32), with one warning per reason where a kernel was expected. A
    :class:`~.windowed.WindowedStore`: its compact part so, then its dense recent tokens (float32)."""
    if isinstance(store, WindowedStore):
        return torch.cat([compact_logits(store.old, queries), dense_logits(queries.float(), store.recent)], dim=-1)
    reason = kernel_blocker(store, queries.device)
    if reason is None:
        stack = store.__dict__.get("_segment_stack")
        if stack is None:
            stack = SegmentStack([store])
            object.__setattr__(store, "_segment_stack", stack)
        return stack_logits(stack, queries)
    if reason != ONE_STORE_ON_CUDA:
        fallback(reason)
    return reference_logits(store, queries)


def value_blocker(store, backend: str, warn: bool = False) -> str | None:
    """Which path a row's *value* store takes, said once and explicitly (None: the stacked kernels: the C++
    ``pv_segments`` on the CPU, the fused kernel's value loop on CUDA, each reading dense value tensors and
    value-sparse stores — ``value_ratio > 0``: SparK's Appendix D values, Mustafar's values; kept entries + a D-bit
    mask, pruned = 0, alone or in a :class:`~.windowed.WindowedStore` — in place). A value store whose pruned entries
    are not zeros (a ``mean`` refill) decodes on the per-row path, its values rebuilt per step. ``backend``: the
    layer's :func:`compact_backend` (both stacked kernels read the same layouts). ``warn``: say it once per reason
    (:func:`fallback`), as a decode batch does."""
    if isinstance(store, DenseStore):
        return None
    try:
        value_parts(store)
    except (ValueError, TypeError) as err:
        reason = f"value store not read by the stacked kernels ({err}): per-row path, values rebuilt per step"
    else:
        return None
    if warn:
        fallback(reason)
    return reason


def stack_logits(stack: SegmentStack, queries: torch.Tensor, tail: torch.Tensor | None = None, tail_len: int = 0,
                 q_len: int = 1, g0: int = 0) -> torch.Tensor:
    """C++ kernel: ``queries (ΣB, H, G, D)`` → ``(ΣB, H, G, S_max + tail_len)`` float32, −inf past a row's length.

    ``tail (ΣB, H, capacity, D)``: the rows' decoded tokens (the first ``tail_len`` filled), scored into the
    positions after ``S_max``; the last ``q_len`` of them are this step's own tokens, causal among themselves (query
    row ``r`` of a kv-head, counted from ``g0``, is the step's query ``r % q_len``)."""
    from spark_bench.storage.fast_logits import MAX_GROUP, load_kernel

    n, h, g, d = queries.shape
    q = queries.reshape(n * h, g, d)
    if q.dtype != torch.float32:
        q = q.float()
    tail_flat = tail.reshape(n * h, tail.shape[2], d) if tail_len else _EMPTY
    kernel = load_kernel()
    chunks = [kernel.spark_segments(q[:, k:k + MAX_GROUP].contiguous(), stack.aux_scale, stack.table, stack.fills,
                                    stack.kept_parts, stack.mask_parts, stack.mu_parts, stack.sign_parts,
                                    stack.start_parts, stack.s_max, tail_flat, tail_len, q_len, g0 + k)
              for k in range(0, g, MAX_GROUP)]  # query rows per call: the kernel's bound
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
    return out.view(n, h, g, stack.s_max + tail_len)


def stack_apply(stack: ValueStack, weights: torch.Tensor, tail: torch.Tensor | None = None,
                tail_len: int = 0) -> torch.Tensor:
    """C++ kernel: ``weights (ΣB, H, G, W)`` float32 (the prompt's weights first) → ``(ΣB, H, G, D)`` float32;
    ``tail (ΣB, H, capacity, D)``: the rows' decoded values, weighted by positions ``width …`` of ``weights``."""
    from spark_bench.storage.fast_logits import load_kernel

    n, h, g, w = weights.shape
    flat = weights.reshape(n * h, g, w)
    tail_flat = tail.reshape(n * h, tail.shape[2], stack.head_dim) if tail_len else _EMPTY
    out = load_kernel().pv_segments(flat.contiguous(), stack.table, stack.parts, stack.mask_parts,
                                    stack.head_dim, tail_flat, stack.width, tail_len)
    return out.view(n, h, g, stack.head_dim)


def fused_attention(tables: FusedTables, aux_scale: torch.Tensor, elem: torch.Tensor, queries: torch.Tensor,
                    scale: float, new_keys: torch.Tensor, new_values: torch.Tensor, tail_keys: torch.Tensor,
                    tail_values: torch.Tensor, tail_len: torch.Tensor, q_len: int, g0: int = 0,
                    out: torch.Tensor | None = None, advance: int = 0) -> torch.Tensor:
    """Triton: ``queries (QH, n, D)`` rows ``g0 …`` (scaled by ``scale`` inside the kernel) → attention output
    ``(QH, n, D)`` in the queries' dtype (into ``out`` when given: a slice of the whole suffix's output) over the
    stores of ``tables``, the decoded tail ``(QH, capacity, D)`` and the step's ``new_keys``/``new_values``
    ``(QH, q_len, D)`` (written into the tail at the device length ``tail_len``, which the launch advances by
    ``advance``: see :func:`~.triton_decode.fused_decode`), launched under the queries' device."""
    from spark_bench.storage.triton_decode import fused_decode

    if out is None:
        out = torch.empty(queries.shape, dtype=queries.dtype, device=queries.device)
    with on_device(queries):
        return fused_decode(queries, scale, aux_scale, tables, elem, new_keys, new_values, tail_keys, tail_values,
                            tail_len, q_len, g0, out, advance)
