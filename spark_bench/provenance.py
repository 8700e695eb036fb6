"""Where a run's numbers came from: the software and machine of each session that wrote a results directory.

:func:`session` is the record ``manifest.json`` keeps per session (``runs``: one per start, written as the session
starts and completed as it ends, so a run killed with SIGKILL still says who began it): spark-bench's version and,
where the package runs from a git checkout, its commit and whether the checkout had uncommitted changes; the
versions of torch, transformers, triton, kvpress, datasets and hydra-core; Python; the device's name and count, the
CUDA and driver versions where there is a GPU; the dtype and attention implementation the loaded model actually
used; the host, the command line, and the start and end times. Cheap by design: package versions come from their
metadata (nothing imported), git runs once per process (``git`` absent or failing: no commit), the driver version
is read from ``/proc``.

:func:`differences` names what two or more such records disagree on (:data:`COMPARED`); ``spark-bench-report`` and
``spark-bench-merge`` print it in one line, and the merge refuses shards from different spark-bench versions
(:func:`version`) unless ``--allow-mixed``.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

PROCESS = uuid.uuid4().hex[:12]  # this process's sessions: its records are completed by it, never by another
PACKAGES = ("torch", "transformers", "triton", "kvpress", "datasets", "hydra-core")
# what a comparison of records looks at (dotted paths into a record); host, command and times differ by design
COMPARED = ("spark_bench.version", "spark_bench.commit", "spark_bench.dirty", *(f"packages.{p}" for p in PACKAGES),
            "python", "device.name", "device.count", "device.cuda", "device.driver", "dtype", "attn_implementation")


def now() -> str:
    """The time as the records write it (UTC, ISO 8601, seconds)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def git_state() -> dict | None:
    """``{"commit", "dirty"}`` of the checkout spark-bench runs from (tracked files only: results/ and other
    ignored or untracked files do not make it dirty), or None when it runs from an install, ``git`` is absent, or
    git fails (not a repository to it, a foreign owner, a timeout). One ``git status`` per process."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "status", "--porcelain=v2", "--branch", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    lines = out.stdout.splitlines()
    commit = next((line.split()[-1] for line in lines if line.startswith("# branch.oid ")), None)
    if commit is None or commit == "(initial)":
        return None
    return {"commit": commit, "dirty": any(not line.startswith("#") for line in lines)}


def _driver(path: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    """The NVIDIA kernel driver's version (``/proc/driver/nvidia/version``), None where there is none."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    words = text.split()
    return next((w for w in words if w[:1].isdigit() and w.count(".") >= 1), None)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_info(device: str | None) -> dict:
    """The run's device: for ``cuda[:N]`` the GPU's name, the visible GPU count, CUDA's and the driver's versions;
    for the CPU its model name and core count (no CUDA, no driver)."""
    import torch

    if device and str(device).startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        return {"name": torch.cuda.get_device_name(index), "count": torch.cuda.device_count(),
                "cuda": torch.version.cuda, "driver": _driver()}
    return {"name": _cpu_name(), "count": os.cpu_count(), "cuda": None, "driver": None}


def model_facts(model) -> dict:
    """The dtype and attention implementation a loaded model actually uses (``{}`` without a model)."""
    if model is None:
        return {}
    dtype = getattr(model, "dtype", None)
    config = getattr(model, "config", None)
    return {"dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
            "attn_implementation": getattr(config, "_attn_implementation", None)}


def version() -> dict:
    """spark-bench's version (the installed distribution's, else the package's) and, from a checkout, its commit."""
    import spark_bench

    state = git_state() or {}
    return {"version": _package_version("spark-bench") or spark_bench.__version__,
            "commit": state.get("commit"), "dirty": state.get("dirty")}


def session(device: str | None = None, model=None) -> dict:
    """A new session's record (``status: running``, no end yet); ``model``: the loaded model, when it is."""
    return {"status": "running", "started": now(), "ended": None, "process": PROCESS, "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": list(sys.argv), "spark_bench": version(),
            "packages": {p: _package_version(p) for p in PACKAGES},
            "python": platform.python_version(), "device": device_info(device), **model_facts(model)}


def _value(record: dict, path: str):
    for part in path.split("."):
        record = record.get(part) if isinstance(record, dict) else None
    return record


def version_text(record: dict) -> str:
    """``0.1.0 (git 1a2b3c4d, uncommitted changes)`` / ``0.1.0`` / ``unknown (written before spark-bench recorded
    it)``."""
    if not isinstance(record, dict) or not isinstance(record.get("spark_bench"), dict):
        return "unknown (written before spark-bench recorded its version)"
    own = record["spark_bench"]
    git = f"git {str(own['commit'])[:10]}" + (", uncommitted changes" if own.get("dirty") else "") \
        if own.get("commit") else ""
    return f"{own.get('version')}" + (f" ({git})" if git else "")


def version_key(record: dict) -> tuple:
    """What counts as one spark-bench version: the release and, where known, the commit and dirtiness."""
    own = record.get("spark_bench") if isinstance(record, dict) else None
    if not isinstance(own, dict):
        return (None,)
    return own.get("version"), own.get("commit"), own.get("dirty")


def differences(named: list[tuple[str, dict]]) -> list[str]:
    """``field: value (where, …) vs value (where, …)`` for each :data:`COMPARED` field on which the records
    ``named`` (``(where, record)`` pairs: a run directory and its session) disagree; a record from before provenance
    counts as ``unknown`` in every field. Empty when they agree (or fewer than two records)."""
    if len(named) < 2:
        return []
    out = []
    for field in COMPARED:
        values: dict = {}
        for where, record in named:
            known = isinstance(record, dict) and isinstance(record.get("spark_bench"), dict)
            values.setdefault(repr(_value(record, field)) if known else "unknown", []).append(where)
        if len(values) > 1:
            shown = [f"{v.strip(chr(39))} ({', '.join(dict.fromkeys(w))})" for v, w in values.items()]
            out.append(f"{field} {' vs '.join(shown)}")
    return out


def summary(record: dict) -> str:
    """One line: version, the main packages, the device, dtype / attention and the session's times."""
    if not isinstance(record, dict) or not isinstance(record.get("spark_bench"), dict):
        return version_text(record)
    packages = record.get("packages") or {}
    device = record.get("device") or {}
    where = f"{device.get('name')} ×{device.get('count')}" + (
        f", CUDA {device['cuda']}, driver {device.get('driver')}" if device.get("cuda") else "")
    used = ", ".join(str(record[k]) for k in ("dtype", "attn_implementation") if record.get(k))
    libs = ", ".join(f"{p} {v}" for p, v in packages.items() if v)
    end = record.get("ended") or "no end recorded (still running, or stopped without a word: e.g. SIGKILL)"
    return (f"spark-bench {version_text(record)}; {libs}; Python {record.get('python')}; {where}"
            + (f"; {used}" if used else "") + f"; {record.get('host')}, {record.get('started')} → {end}")
