"""The compiled CPU kernels of compact attention (``kernels/spark_logits.cpp``): building and loading.

The C++ extension is compiled with ``torch.utils.cpp_extension`` when the project is installed (``make``; else on
first use; needs a C++ compiler and ninja) and later imported without a build lock (:func:`load_kernel`). It holds
two CPU kernels over a segment table (:mod:`.segments`): ``spark_segments`` (logits ``q·k̃`` over compact key stores:
SparK fixed-T with ``zero``/``none``/``constant`` and ``degenerate`` in both saliency modes, ThinK, dense keys) and
``pv_segments`` (``weights · values`` over value tensors shared by several rows). :mod:`.dispatch` calls them; on
CUDA tensors the fused Triton decode (:mod:`.triton_decode`) serves instead.
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
MAX_GROUP = 8  # query rows per kv-head one spark_segments call takes (a template parameter); more go in chunks


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


if __name__ == "__main__":  # `python -m spark_bench.storage.fast_logits`: build now (make does this at install)
    result = load_kernel()
    print(f"spark-bench kernel: {result if isinstance(result, str) else 'built in ' + str(build_directory())}")
