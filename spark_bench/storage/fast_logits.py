"""Fast decode logits over a compact SparK key store (``kernels/spark_logits.cpp``), never rebuilding keys.

The C++ kernel is compiled on first use with ``torch.utils.cpp_extension`` (needs a C++ compiler and ninja, both
installed by ``make``). It supports fixed-T stores (every token keeps T channels) with the recoveries whose
term folds into per-token work (:meth:`FastTerms`): ``zero``/``none``/``constant``, ``degenerate`` in both saliency
modes. Anything else — SparK-p/-g (ragged T), ``gaussian``/``exponential`` (per-entry random draws), no compiler —
falls back to rebuild-then-matmul, with one warning per reason (:func:`fallback_reasons` lists them).
"""

from __future__ import annotations

import hashlib
import platform
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "engine" / "kernels" / "spark_logits.cpp"
MODES = {"constant": 0, "aligned": 1, "signed": 2}
_seen_fallbacks: set[str] = set()


@dataclass(frozen=True)
class FastTerms:
    """What the kernel needs from a recovery for one decode step (see the kernel's header for the formulas)."""

    mode: str                     # constant | aligned | signed
    aux: torch.Tensor             # (B, H, G, D) float32: u (aligned) or v (signed); unused for constant
    totals: torch.Tensor          # (B, H, G) float32: Σ_c of q (constant), u (aligned) or v (signed)
    fill: float = 0.0
    mu: torch.Tensor | None = None
    signs: torch.Tensor | None = None
    n_signs: int = 0


@lru_cache(maxsize=1)
def load_kernel():
    """The compiled extension, or the reason it is unavailable (a string)."""
    try:
        from torch.utils.cpp_extension import load

        digest = hashlib.sha1(KERNEL_SOURCE.read_bytes() + platform.machine().encode()).hexdigest()[:10]
        return load(name=f"spark_bench_logits_{digest}", sources=[str(KERNEL_SOURCE)],
                    extra_cflags=["-O3", "-march=native"], verbose=False)
    except Exception as err:  # no compiler / ninja: the reference path still works
        return f"kernel unavailable ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})"


def fallback(reason: str) -> None:
    if reason not in _seen_fallbacks:
        _seen_fallbacks.add(reason)
        warnings.warn(f"spark-bench: compact SparK attention falls back to rebuild-then-matmul: {reason}",
                      stacklevel=3)


def fallback_reasons() -> set[str]:
    return set(_seen_fallbacks)


def fast_logits(store, queries: torch.Tensor, terms: FastTerms) -> torch.Tensor:
    """``queries (B, H, G, D)`` · keys of ``store`` → ``(B, H, G, S)`` float32."""
    kernel = load_kernel()
    b, h, g, d = queries.shape
    s, t = store.length, store.row_kept
    q = queries.float()

    def heads_dg(x):  # (B, H, G, D) → (B·H, D, G) contiguous: a channel's G query values side by side
        return x.float().permute(0, 1, 3, 2).reshape(b * h, d, g).contiguous()

    empty = torch.empty(0, dtype=store.kept.dtype)
    out = kernel.spark_logits(
        heads_dg(q), heads_dg(terms.aux), terms.totals.float().reshape(b * h, g).contiguous(),
        store.mask_bits.reshape(b * h, s, d // 8).contiguous(), store.kept.contiguous(),
        terms.mu.reshape(-1).contiguous() if terms.mu is not None else empty,
        terms.signs if terms.signs is not None else torch.empty(0, dtype=torch.uint8), terms.n_signs,
        terms.fill, MODES[terms.mode], s, d, t)
    return out.view(b, h, g, s)


def compact_logits(store, queries: torch.Tensor, reference) -> torch.Tensor:
    """Kernel when the store and its recovery support it, else ``reference(queries)`` (with a warning)."""
    if store.row_kept is None:
        reason = "tokens keep different numbers of channels (SparK-p / SparK-g)"
    elif store.head_dim % 8:
        reason = f"head_dim {store.head_dim} is not a multiple of 8"
    elif not 1 <= queries.shape[2] <= 8:
        reason = f"{queries.shape[2]} query rows per kv-head (the kernel handles 1..8)"
    else:
        terms = store.recovery.fast_terms(queries)
        reason = terms if isinstance(terms, str) else None
        if reason is None:
            kernel = load_kernel()
            if isinstance(kernel, str):
                reason = kernel
            else:
                return fast_logits(store, queries, terms)
    fallback(reason)
    return reference(queries)
