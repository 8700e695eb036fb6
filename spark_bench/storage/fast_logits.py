"""The compiled kernels of compact attention (``kernels/spark_logits.cpp``): building, loading, dispatch.

The C++ extension is compiled with ``torch.utils.cpp_extension`` when the project is installed (``make``; else on
first use; needs a C++ compiler and ninja) and later imported without a build lock (:func:`load_kernel`). It holds
two CPU kernels over a segment table (:mod:`.segments`): ``spark_segments`` (logits ``q·k̃`` over compact key stores:
SparK fixed-T with ``zero``/``none``/``constant`` and ``degenerate`` in both saliency modes, ThinK, dense keys) and
``pv_segments`` (``weights · values`` over value tensors shared by several rows). On CUDA tensors the same tables go to
the Triton kernels (:mod:`.triton_logits`). A single store outside a decode batch (:func:`compact_logits`) uses the
same kernel through a one-store segment table; anything the kernels do not serve — SparK-p/-g (ragged T),
``gaussian``/``exponential``/``fork_*`` draws (per-entry random scores), no compiler, no Triton on CUDA — runs the
reference path (rebuild the layer's keys, then matmul), with one warning per reason (:func:`kernel_blocker` decides;
:func:`fallback_reasons` lists what was seen).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
import threading
import warnings
from functools import lru_cache
from pathlib import Path

import torch

KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "engine" / "kernels" / "spark_logits.cpp"
MODES = {"constant": 0, "aligned": 1, "signed": 2}
_seen_fallbacks: set[str] = set()


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
                extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)


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


def kernel_blocker(store, device: torch.device) -> str | None:
    """Why no compact kernel can serve this store on ``device`` (None: one can): the store's layout and recovery
    (:func:`~.segments.store_blocker`), then the device (:func:`~.segments.compact_backend`: the C++ kernel takes CPU
    tensors, the Triton kernel CUDA tensors)."""
    from spark_bench.storage.segments import compact_backend, store_blocker

    reason = store_blocker(store)
    if reason is not None:
        return reason
    backend = compact_backend(device)
    return backend[4:] if backend.startswith("no:") else None


def compact_logits(store, queries: torch.Tensor, reference) -> torch.Tensor:
    """``queries (B, H, G, D)`` · keys of one compact ``store`` → ``(B, H, G, S)`` float32 through the kernel of
    ``queries``' device when it serves the store (a one-store segment table, kept on the store: no copy of its
    data), else ``reference(queries)`` with one warning per reason."""
    reason = kernel_blocker(store, queries.device)
    if reason is None:
        return store.segment_stack.logits(queries)
    fallback(reason)
    return reference(queries)


if __name__ == "__main__":  # `python -m spark_bench.storage.fast_logits`: build now (make does this at install)
    result = load_kernel()
    print(f"spark-bench kernel: {result if isinstance(result, str) else 'built in ' + str(build_directory())}")
