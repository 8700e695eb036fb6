"""Timing and peak memory that mean something on an asynchronous device.

CUDA kernels run after the Python call that launched them returns, so a wall-clock reading is only the device's time
once the device has drained: :func:`synchronize` before every reading that closes a timed span (prefill,
compression; a decode step ends with its one host read of the chosen tokens). :func:`peak_memory` is what a run
records per decode batch: ``torch.cuda.max_memory_allocated`` since :func:`reset_peak` on CUDA, the process's peak
resident set size so far on the CPU (the operating system keeps no resettable peak).
"""

from __future__ import annotations

import resource
import sys

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait until ``device`` has finished the work queued so far (no-op on the CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device | str | None) -> int:
    """Bytes: peak allocated on a CUDA ``device`` since :func:`reset_peak`, else the process's peak RSS."""
    if device is not None and torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux
