"""Fast decode logits over a compact SparK key store (``kernels/spark_logits.cpp``), never rebuilding keys.

The C++ kernel is compiled with ``torch.utils.cpp_extension`` when the project is installed (``make``; else on first
use; needs a C++ compiler and ninja) and later imported without a build lock (:func:`load_kernel`). It runs on CPU
tensors and supports fixed-T stores (every token keeps T channels) with the recoveries whose term folds into
per-token work (:meth:`FastTerms`): ``zero``/``none``/``constant``, ``degenerate`` in both saliency modes. Anything
else — CUDA tensors, SparK-p/-g (ragged T), ``gaussian``/``exponential`` (per-entry random draws), no compiler — runs
the reference path (rebuild the layer's keys, then matmul), with one warning per reason (:func:`kernel_blocker`
decides; :func:`fallback_reasons` lists what was seen).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
import threading
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


KERNEL_WAIT_S = 300.0  # longest wait for a build (or another process's build lock) before the reference path


def kernel_name() -> str:
    """Extension name: a digest of the source, the machine and the torch version (a change means a new build)."""
    digest = hashlib.sha1(KERNEL_SOURCE.read_bytes() + platform.machine().encode()
                          + torch.__version__.encode()).hexdigest()[:10]
    return f"spark_bench_logits_{digest}"


def build_directory() -> Path:
    """``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``)``/spark_bench/<name>``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / "spark_bench" / kernel_name()


def _import_built(directory: Path, name: str):
    """Import an already built extension directly: no build, no lock file."""
    for path in sorted(directory.glob(f"{name}*.so")) + sorted(directory.glob(f"{name}*.pyd")):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return None


def _build(directory: Path, name: str):
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(KERNEL_SOURCE)], build_directory=str(directory),
                extra_cflags=["-O3", "-march=native"], verbose=False)


@lru_cache(maxsize=1)
def load_kernel(wait_s: float | None = None):
    """The compiled extension, or the reason it is unavailable (a string; the reference path runs instead).

    A build made earlier (``make`` builds it at install) is imported directly, without torch's build lock. Otherwise
    the build runs with a bound of ``wait_s`` seconds (``SPARK_BENCH_KERNEL_WAIT_S``, default 300): torch's
    ``cpp_extension`` waits forever on a ``lock`` file that a killed build leaves behind, so a stale lock is named
    on stderr and, after the bound, the run goes on without the kernel.
    """
    wait_s = float(os.environ.get("SPARK_BENCH_KERNEL_WAIT_S", KERNEL_WAIT_S)) if wait_s is None else wait_s
    name, directory = kernel_name(), build_directory()
    try:
        built = _import_built(directory, name)
        if built is not None:
            return built
    except Exception as err:  # a broken earlier build: rebuild below
        warnings.warn(f"spark-bench: could not import the built kernel in {directory} ({err}); rebuilding")
    lock = directory / "lock"
    if lock.exists():
        print(f"spark-bench: {lock} exists: another process is building the SparK kernel, or a killed build left "
              f"it behind (then delete it); waiting up to {wait_s:g} s before running without the kernel",
              file=sys.stderr, flush=True)
    outcome: list = []

    def build():
        try:
            outcome.append(_build(directory, name))
        except Exception as err:  # no compiler / ninja: the reference path still works
            first = str(err).splitlines()[0][:120] if str(err) else ""
            outcome.append(f"kernel unavailable ({type(err).__name__}: {first})")

    worker = threading.Thread(target=build, daemon=True)
    worker.start()
    worker.join(wait_s)
    if not outcome:
        return (f"kernel build did not finish within {wait_s:g} s (lock file {lock}: delete it if no build is "
                f"running)")
    return outcome[0]


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


def kernel_blocker(store, device: torch.device, group: int) -> str | None:
    """Why the C++ kernel cannot serve this store and these queries (None: it can, as far as the store and the
    device go; the recovery and the build are checked after). The kernel only takes CPU tensors: on CUDA (or any
    other device) the reference path rebuilds the layer's keys transiently for each step — the stored bytes are
    unchanged — since a torch-native gather of ragged kept channels would build an S×D temporary as well."""
    if device.type != "cpu" or store.kept.device.type != "cpu":
        return (f"{device.type} tensors: the C++ kernel runs on the CPU only (keys are rebuilt per step on "
                f"{device.type}, transiently)")
    if store.row_kept is None:
        return "tokens keep different numbers of channels (SparK-p / SparK-g)"
    if store.head_dim % 8:
        return f"head_dim {store.head_dim} is not a multiple of 8"
    if group < 1:
        return f"{group} query rows per kv-head"
    return None


KERNEL_ROWS = 8  # query rows per kv-head one kernel call takes; more (a suffix run through the cache) go in chunks


def compact_logits(store, queries: torch.Tensor, reference) -> torch.Tensor:
    """Kernel when the device, the store and its recovery support it, else ``reference(queries)`` (one warning per
    reason). More than :data:`KERNEL_ROWS` query rows per kv-head are served in chunks of that many."""
    reason = kernel_blocker(store, queries.device, queries.shape[2])
    if reason is None:
        chunks = queries.split(KERNEL_ROWS, dim=2)
        terms = [store.recovery.fast_terms(chunk) for chunk in chunks]
        reason = next((t for t in terms if isinstance(t, str)), None)
        if reason is None:
            kernel = load_kernel()
            if isinstance(kernel, str):
                reason = kernel
            else:
                return torch.cat([fast_logits(store, c, t) for c, t in zip(chunks, terms)], dim=2)
    fallback(reason)
    return reference(queries)


if __name__ == "__main__":  # `python -m spark_bench.storage.fast_logits`: build now (make does this at install)
    result = load_kernel()
    print(f"spark-bench kernel: {result if isinstance(result, str) else 'built in ' + str(build_directory())}")
