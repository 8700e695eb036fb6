"""A results directory that survives crashes: durable appends, resume, refusal to mix configs.

* ``manifest.json`` holds the fingerprint of what produced the directory (method configs, model, samples). A rerun
  with a different fingerprint is refused (:class:`ResultsMismatch`) instead of silently mixing rows.
* ``predictions.jsonl`` gets one line per (sample, config), appended and fsync'ed after every sample, so a crash
  or ``kill -9`` loses at most the sample in flight; a torn last line is dropped on the next start. Timings go to
  ``timings.jsonl`` so predictions are byte-identical between runs of the same seed and config.
* At the end, predictions are rewritten in canonical order (samples × configs) and the tables are written, each
  through a temporary file and an atomic rename, so every file is always complete.
* A directory that holds no prediction yet (a run that stopped before its first sample, e.g. a crash after the
  model loaded) never blocks a rerun: its manifest is replaced by the new configuration's.
* :func:`run_lock`: one run at a time per directory (an OS file lock on ``.lock``, released by the kernel when the
  process ends, so a killed run leaves no stale lock).
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path

TIMING_FIELDS = ("prefill_s", "compress_s", "decode_s", "peak_mem_bytes")


class ResultsMismatch(ValueError):
    """The results directory was created by a different configuration."""


def fingerprint(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_complete_lines(path: Path) -> list[dict]:
    """Records of every complete line; a torn trailing line (crash mid-write) is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return [json.loads(line) for line in data[:end].decode("utf-8").splitlines() if line.strip()]


class ResultsDir:
    def __init__(self, path: Path, payload: dict):
        self.path = path
        self.payload = payload
        self.key = fingerprint(payload)

    @property
    def predictions(self) -> Path:
        return self.path / "predictions.jsonl"

    @property
    def timings(self) -> Path:
        return self.path / "timings.jsonl"

    def open(self) -> list[dict]:
        """Create or reopen the directory; the completed prediction records (for resume)."""
        manifest = self.path / "manifest.json"
        if manifest.exists() and not self._holds_predictions():  # nothing computed under it: the new config wins
            manifest.unlink()
            for stale in (self.predictions, self.timings):
                stale.unlink(missing_ok=True)
        if manifest.exists():
            old = json.loads(manifest.read_text(encoding="utf-8"))
            if old.get("fingerprint") != self.key:
                changed = sorted(k for k in set(old.get("payload", {})) | set(self.payload)
                                 if json.dumps(old.get("payload", {}).get(k), sort_keys=True, default=str)
                                 != json.dumps(self.payload.get(k), sort_keys=True, default=str))
                raise ResultsMismatch(f"{self.path} holds results of a different configuration (differs in: "
                                      f"{', '.join(changed) or 'fingerprint'}); choose another run= or remove it")
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            atomic_write(manifest, json.dumps({"fingerprint": self.key, "payload": self.payload}, indent=1,
                                              sort_keys=True, default=str))
        read_complete_lines(self.timings)
        return read_complete_lines(self.predictions)

    def _holds_predictions(self) -> bool:
        return self.predictions.exists() and b"\n" in self.predictions.read_bytes()

    def complete(self, ids: list[str], labels: list[str]) -> bool:
        """Whether every (sample, config) prediction is already here under this configuration (read only;
        :class:`ResultsMismatch` when the directory holds predictions of another configuration)."""
        manifest = self.path / "manifest.json"
        if not manifest.exists() or not self._holds_predictions():
            return False
        if json.loads(manifest.read_text(encoding="utf-8")).get("fingerprint") != self.key:
            self.open()  # raises the mismatch, naming what differs
        done = {(r["id"], r["config"]) for r in read_complete_lines(self.predictions)}
        return all((i, label) in done for i in ids for label in labels)

    def append(self, records: list[dict]) -> None:
        """Durably append one sample's records (predictions, then timings)."""
        for path, rows in ((self.predictions, [{k: v for k, v in r.items() if k not in TIMING_FIELDS}
                                               for r in records]),
                           (self.timings, [{"id": r["id"], "config": r["config"],
                                            **{k: r[k] for k in TIMING_FIELDS}} for r in records])):
            with open(path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
                f.flush()
                os.fsync(f.fileno())

    def finalize(self, records: list[dict], tables: dict[str, str]) -> None:
        """Canonical predictions (given order) and the tables, each replaced atomically."""
        atomic_write(self.predictions, "".join(json.dumps({k: v for k, v in r.items() if k not in TIMING_FIELDS},
                                                          ensure_ascii=False) + "\n" for r in records))
        for name, text in tables.items():
            atomic_write(self.path / name, text)


@contextmanager
def run_lock(path: Path, wait: bool = False):
    """Hold ``path/.lock`` exclusively for the block (``fcntl.flock``: the kernel drops it when the process dies).
    When another run holds it: :class:`RunLocked` naming the holder, or with ``wait`` block until it is free."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / ".lock", "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise RunLocked(f"{path} is being written by {holder}; wait for it (wait_lock=true waits), or choose "
                            f"another run=") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{datetime.datetime.now().isoformat(timespec='seconds')}")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class RunLocked(ValueError):
    """Another run holds the results directory."""
