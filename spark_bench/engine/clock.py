"""Timing, peak memory and kernel counts that mean something on an asynchronous device.

CUDA kernels run after the Python call that launched them returns, so a wall-clock reading is only the device's time
once the device has drained: :func:`synchronize` before every reading that closes a timed span (prefill,
compression; a decode step ends with its one host read of the chosen tokens). :func:`peak_memory` is what a run
records per decode batch, over every device the model lives on (a device map spreads it): on each CUDA device
``torch.cuda.max_memory_allocated`` since :func:`reset_peak`; on the CPU the process's peak resident set size since
:func:`reset_peak` (Linux resets it through ``/proc/self/clear_refs``; elsewhere it is the peak since the process
started). :class:`OpCounter` counts the aten operations a block dispatches and how many of them run a device kernel
(no GPU needed): a small decode batch on a GPU is bound by its kernel launches.
"""

from __future__ import annotations

import os
import re
import resource
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

Devices = torch.device | str | list | tuple | None  # one device, or every device the model lives on

ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # PyTorch's allocator settings (the second: ≥ 2.8)
EXPANDABLE = "expandable_segments:True"


def use_expandable_segments(environ=os.environ) -> str | None:
    """Let CUDA's caching allocator grow segments in place (``expandable_segments``): blocks freed by one decode
    batch are reused by the next whatever their sizes, so little memory is reserved but unusable (the planner's
    :data:`~spark_bench.memory.FRAGMENTATION` allowance). Set in ``PYTORCH_CUDA_ALLOC_CONF`` when this module is
    imported, before CUDA initialises (the allocator reads it then); a setting the user made is kept as it is.
    Returns the setting in force (None: CUDA was initialised before, the allocator keeps its own)."""
    if any(key in environ for key in ALLOC_CONF):
        return next(environ[key] for key in ALLOC_CONF if key in environ)
    if torch.cuda.is_initialized():
        return None
    environ[ALLOC_CONF[0]] = EXPANDABLE
    return EXPANDABLE


use_expandable_segments()


def _devices(devices) -> list[torch.device]:
    if devices is None:
        return []
    return [torch.device(d) for d in (devices if isinstance(devices, (list, tuple)) else [devices])]


def synchronize(devices: Devices) -> None:
    """Wait until every device in ``devices`` (one device or a list) has finished the work queued so far (no-op on
    the CPU)."""
    for device in dict.fromkeys(_devices(devices)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def reset_peak(devices: Devices) -> None:
    """Start a new peak on every device in ``devices`` (one device or a list)."""
    for device in _devices(devices):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        elif device.type == "cpu":
            return_freed_memory()
            reset_resident_peak()


def peak_memory(devices: Devices) -> int:
    """Bytes: the sum over ``devices`` of each one's peak since :func:`reset_peak` (CUDA: allocated by torch; CPU:
    the process's resident set)."""
    total = 0
    for device in dict.fromkeys(_devices(devices)):
        total += int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else resident_peak()
    return total


_STATUS = Path("/proc/self/status")


def resident_peak() -> int:
    """The process's peak resident set size in bytes (Linux: ``VmHWM``, resettable; elsewhere ``ru_maxrss``)."""
    if _STATUS.is_file():
        match = re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
        if match:
            return int(match.group(1)) * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def resident_now() -> int:
    """The process's resident set size now, in bytes (Linux ``VmRSS``; elsewhere the peak, an upper bound)."""
    if _STATUS.is_file():
        match = re.search(r"^VmRSS:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
        if match:
            return int(match.group(1)) * 1024
    return resident_peak()


def reset_resident_peak() -> bool:
    """Reset the process's peak resident set size to its current size (Linux ≥ 4.0); False where impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def free_memory(device: torch.device | str) -> int:
    """Bytes a run could still allocate on ``device``: CUDA's free memory (``torch.cuda.mem_get_info``), the
    system's available memory on the CPU (``MemAvailable``; elsewhere the physical memory, an upper bound)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        match = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.MULTILINE)
        if match:
            return int(match.group(1)) * 1024
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@contextmanager
def mapped_large_blocks():
    """Within the block, every host allocation of 1 MiB or more is its own mapping, returned to the operating system
    when freed (glibc ``M_MMAP_THRESHOLD``); afterwards blocks up to 32 MiB come from the heap again. For the
    prefill, the compression, the suffixes' forwards and the fidelity pass (``runner.run_samples``), whose large
    temporaries glibc would otherwise keep in its heap after they are freed (its threshold rises after the first
    large frees), with holes that the small blocks allocated between them keep open, so the resident set tracks what
    is live and the planner's prediction can be checked against it: with the two suffix passes on the heap, one
    SmolLM2 2K run's peak moved between 1,333 and 1,596 MiB from process to process, mapped it stays within
    1,303–1,329 MiB. The price is page faults on fresh mappings: a SmolLM2 prefill of 4,096 tokens took 14.32 s
    instead of 13.23 s (1.08×, medians of 4, alternating, this CPU). The decode steps keep the heap: their many
    per-step blocks would each cost a mapping."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(-3, 32 << 20)


def _libc():
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def return_freed_memory() -> bool:
    """Give the heap memory freed tensors left behind back to the operating system (glibc ``malloc_trim``), so a
    CPU peak measured from here on starts from what is live: glibc keeps freed blocks below its mmap threshold (which
    it raises up to 32 MiB after large frees) in its heap, and the resident set would otherwise also hold what the
    previous decode batch freed. Called at the start of every decode batch (:func:`reset_peak`) and before the
    model loads; cheap (once per batch). Returns False where there is no glibc (the resident set is then an upper bound)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


NO_KERNEL = {"empty", "empty_strided", "detach", "alias", "lift_fresh", "_local_scalar_dense", "set_"}


class OpCounter:
    """Counts every aten op dispatched inside the block (``ops``; views included, each a dispatch on a GPU too) and
    those that run a device kernel (``kernels``: not views, allocations, no-op conversions or results aliasing
    their first input)."""

    def __init__(self):
        from collections import Counter

        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.ops = Counter()
        self.kernel_ops = Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                counter.ops[name] += 1
                out = func(*args, **(kwargs or {}))
                first = args[0] if args and isinstance(args[0], torch.Tensor) else None
                aliases = isinstance(out, torch.Tensor) and first is not None \
                    and out.data_ptr() == first.data_ptr() and not name.endswith("_")
                if not (func.is_view or aliases or name in NO_KERNEL):
                    counter.kernel_ops[name] += 1
                return out

        self._mode = Mode()

    def __enter__(self) -> "OpCounter":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def kernels(self) -> int:
        return sum(self.kernel_ops.values())
