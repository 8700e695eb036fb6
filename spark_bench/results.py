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

TIMING_FIELDS = ("prefill_s", "compress_s", "decode_s", "peak_mem_bytes", "warmup_s")


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


class DamagedFile(ValueError):
    """A JSON-lines file with a line that is not a JSON record: the message is ``<file>:<line>: <what>``."""


def _parse(line: bytes) -> tuple[dict | None, str | None]:
    """One line of a JSON-lines file: ``(record, None)``, or ``(None, what is wrong)``."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 text (byte 0x{line[err.start]:02x} at column {err.start + 1})"
    except ValueError as err:
        return None, f"not a JSON record ({getattr(err, 'msg', err)} at column {getattr(err, 'colno', '?')})"
    return (record, None) if isinstance(record, dict) else (None, f"a JSON {type(record).__name__}, not a record")


def parse_records(path: Path, data: bytes) -> list[dict]:
    """The records of a JSON-lines file's bytes; :class:`DamagedFile` names the first damaged line."""
    out = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        record, problem = _parse(line)
        if problem:
            raise DamagedFile(f"{path}:{number}: {problem}")
        out.append(record)
    return out


def read_manifest(path: Path) -> dict:
    """A run's ``manifest.json``; :class:`DamagedFile` (``<file>:<line>: …``) when it is not a JSON object."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise DamagedFile(f"{path}:1: not UTF-8 text (at byte {err.start}); restore it or remove the directory "
                          f"to start afresh") from None
    except json.JSONDecodeError as err:
        raise DamagedFile(f"{path}:{err.lineno}: not valid JSON ({err.msg}); restore it or remove the directory "
                          f"to start afresh") from None
    if not isinstance(value, dict):
        raise DamagedFile(f"{path}:1: not a JSON object; restore it or remove the directory to start afresh")
    return value


def read_complete_lines(path: Path) -> list[dict]:
    """Records of every complete line; a torn trailing line (crash mid-write) is cut off the file. A damaged
    line before it raises :class:`DamagedFile` (:func:`repair_lines` moves such lines aside)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return parse_records(path, data[:end])


def repair_lines(path: Path) -> list[int]:
    """Move every damaged line of ``path`` to ``<path>.damaged`` (appended) and keep the good ones (rewritten
    atomically, order kept); the numbers of the lines moved. A torn trailing line is cut off as on resume."""
    if not path.exists():
        return []
    data = path.read_bytes()
    data = data[:data.rfind(b"\n") + 1]
    lines = data.split(b"\n")[:-1]
    bad = {n for n, line in enumerate(lines, 1) if line.strip() and _parse(line)[1]}
    if bad:
        with open(path.with_name(path.name + ".damaged"), "ab") as f:
            f.write(b"".join(lines[n - 1] + b"\n" for n in sorted(bad)))
            f.flush()
            os.fsync(f.fileno())
        keep = [line for n, line in enumerate(lines, 1) if n not in bad]
        atomic_write(path, b"".join(line + b"\n" for line in keep).decode("utf-8"))
    return sorted(bad)


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

    def open(self, expected: dict | None = None) -> list[dict]:
        """Create or reopen the directory; the completed prediction records (for resume). ``expected``: what the
        run sets out to compute (``{"samples": [[id, task], …], "configs": [label, …]}``), kept in the manifest
        beside the fingerprint so a report can say what a stopped run is missing."""
        manifest = self.path / "manifest.json"
        if manifest.exists() and not self._holds_predictions():  # nothing computed under it: the new config wins
            manifest.unlink()
            for stale in (self.predictions, self.timings):
                stale.unlink(missing_ok=True)
        if manifest.exists():
            old = read_manifest(manifest)
            if old.get("fingerprint") != self.key:
                changed = sorted(k for k in set(old.get("payload", {})) | set(self.payload)
                                 if json.dumps(old.get("payload", {}).get(k), sort_keys=True, default=str)
                                 != json.dumps(self.payload.get(k), sort_keys=True, default=str))
                raise ResultsMismatch(f"{self.path} holds results of a different configuration (differs in: "
                                      f"{', '.join(changed) or 'fingerprint'}); choose another run= or remove it")
            if expected is not None and old.get("expected") != expected:
                atomic_write(manifest, json.dumps({**old, "expected": expected}, indent=1, sort_keys=True,
                                                  default=str))
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            atomic_write(manifest, json.dumps({"fingerprint": self.key, "payload": self.payload,
                                               **({"expected": expected} if expected is not None else {})},
                                              indent=1, sort_keys=True, default=str))
        read_complete_lines(self.timings)
        return read_complete_lines(self.predictions)

    def check_files(self, repair: bool = False) -> list[str]:
        """Read the predictions and timings through :func:`read_complete_lines` (:class:`DamagedFile` names a
        damaged line and says how to repair it); with ``repair`` first move damaged lines aside (their
        predictions are recomputed). Lines saying what was repaired."""
        said = []
        for path in (self.predictions, self.timings):
            if repair:
                moved = repair_lines(path)
                if moved:
                    said.append(f"repair: moved line(s) {', '.join(map(str, moved))} of {path} to "
                                f"{path.name}.damaged; their predictions are recomputed")
            try:
                read_complete_lines(path)
            except DamagedFile as err:
                raise DamagedFile(f"{err}; rerun with repair=true to move the damaged line(s) aside to "
                                  f"{path.name}.damaged and recompute them (the good lines are kept)") from None
        if said:  # a recomputed prediction gets a new timing line: drop the timings of predictions moved aside
            kept = {(r["id"], r["config"]) for r in read_complete_lines(self.predictions)}
            timings = read_complete_lines(self.timings)
            if any((t["id"], t["config"]) not in kept for t in timings):
                atomic_write(self.timings, "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in timings
                                                   if (t["id"], t["config"]) in kept))
        return said

    def note_fast_paths(self, record: dict) -> None:
        """Keep in the manifest which decode paths produced this session's predictions (``fast_paths``: one record
        per session that computed some, :meth:`~spark_bench.engine.fastpaths.FastPaths.record`); not part of the
        fingerprint."""
        manifest = self.path / "manifest.json"
        old = read_manifest(manifest)
        atomic_write(manifest, json.dumps({**old, "fast_paths": [*old.get("fast_paths", []), record]}, indent=1,
                                          sort_keys=True, default=str))

    def _holds_predictions(self) -> bool:
        return self.predictions.exists() and b"\n" in self.predictions.read_bytes()

    def complete(self, ids: list[str], labels: list[str]) -> bool:
        """Whether every (sample, config) prediction is already here under this configuration (read only;
        :class:`ResultsMismatch` when the directory holds predictions of another configuration)."""
        manifest = self.path / "manifest.json"
        if not manifest.exists() or not self._holds_predictions():
            return False
        if read_manifest(manifest).get("fingerprint") != self.key:
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
    When another run holds it: :class:`RunLocked` naming the holder, or with ``wait`` block until it is free. A block
    that fails before writing anything leaves no lock file (nor the directories it made for it)."""
    made = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
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
        except BaseException:  # refused before anything was written: the lock (and a directory made for it) goes
            if [p.name for p in path.iterdir()] == [".lock"]:
                (path / ".lock").unlink()
                for directory in made:
                    directory.rmdir()
            raise
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class RunLocked(ValueError):
    """Another run holds the results directory."""
