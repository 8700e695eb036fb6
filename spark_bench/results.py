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
* Each session that computes into the directory is recorded in the manifest as it starts (``runs``: the software
  and machine, :mod:`spark_bench.provenance`, ``status: running``) and completed as it ends (``ended``, ``status``):
  a run killed with SIGKILL leaves its record, with no end. The manifest's lists of records (``runs``,
  ``fast_paths``) are read through :func:`manifest_records`: a damaged one is named in one line, and the next
  session's start repairs it (keeping the records that are whole).
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import logging
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from spark_bench.options import Option
from spark_bench.provenance import PROCESS, now

LOG = logging.getLogger(__name__)
TIMING_FIELDS = ("prefill_s", "compress_s", "decode_s", "peak_mem_bytes", "warmup_s", "fidelity_s", "answer_s")


class ResultsMismatch(ValueError):
    """The results directory was created by a different configuration: ``old`` / ``new`` are the two payloads,
    ``changed`` their top-level keys that differ (:func:`spark_bench.upgrade.mismatch_line` says more about a
    changed sweep)."""

    def __init__(self, message: str, old: dict | None = None, new: dict | None = None, changed: tuple = ()):
        super().__init__(message)
        self.old, self.new, self.changed = old or {}, new or {}, tuple(changed)


def _flat(value, prefix: str = "") -> dict:
    """Nested mappings as ``{"a.b": leaf}`` (lists stay leaves)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out = {}
    for key, inner in value.items():
        out.update(_flat(inner, f"{prefix}.{key}" if prefix else str(key)))
    return out


def payload_changes(old: dict, new: dict, keys: list[str], limit: int = 3) -> str:
    """``benchmark.length 4096 → 8192, …``: the first ``limit`` leaf values that differ under ``keys`` (mappings
    only; a list such as ``configs`` is described by its caller), '' when none can be shown."""
    shown = []
    for key in keys:
        a, b = _flat(old.get(key), key), _flat(new.get(key), key)
        if not (isinstance(old.get(key), dict) or isinstance(new.get(key), dict)):
            if not isinstance(old.get(key), list) and not isinstance(new.get(key), list):
                shown.append(f"{key} {old.get(key)!r} → {new.get(key)!r}")
            continue
        for leaf in sorted(set(a) | set(b)):
            if json.dumps(a.get(leaf), sort_keys=True, default=str) != json.dumps(b.get(leaf), sort_keys=True,
                                                                                   default=str):
                shown.append(f"{leaf} {a.get(leaf, '(absent)')!r} → {b.get(leaf, '(absent)')!r}")
    return ", ".join(shown[:limit]) + (f", and {len(shown) - limit} more" if len(shown) > limit else "")


def manifest_records(manifest: dict, key: str, path: Path | None = None) -> tuple[list[dict], str | None]:
    """The records of a manifest list (``runs``, ``fast_paths``): ``(records, None)``, or when the value is not a
    list of JSON objects ``(the whole records in it, what is wrong in one line)``. Absent: ``([], None)``."""
    where = f"{path}: " if path is not None else ""
    if key not in manifest:
        return [], None
    value = manifest[key]
    if not isinstance(value, list):
        shown = json.dumps(value, default=str)
        return [], (f"{where}{key} is {shown[:40]}{'…' if len(shown) > 40 else ''}, not a list of records; a "
                    f"resume of the run repairs it")
    whole = [r for r in value if isinstance(r, dict)]
    if len(whole) < len(value):
        bad = len(value) - len(whole)
        what = "1 entry that is not a record" if bad == 1 else f"{bad} entries that are not records"
        return whole, f"{where}{key} holds {what}; a resume of the run repairs it"
    return whole, None


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


_NAME, _NUMBER = Option("str", nonempty=True), Option("number", nullable=True, null="not measured")
# the fields of a stored record that resume, merge and the reports read, with their types (runner.Prediction writes
# them): a line without one, or with another type (a hand edit, another tool's file), is damaged like a torn line —
# named ``file:line`` in one line, moved aside by ``repair=true`` — not a traceback in the middle of a report
RECORD_FIELDS = {
    "predictions.jsonl": {"config": _NAME, "task": _NAME, "id": _NAME, "method": Option("dict"),
                          "score": Option("number", 0, 100)},
    "timings.jsonl": {"config": _NAME, "id": _NAME},
}
RECORD_TYPES = {  # optional fields (older versions lack some), typed when present
    "predictions.jsonl": {"prediction": Option("str"), "answers": Option("list", items=Option("str")),
                          "kv_bytes": Option("number", 0),
                          "kv_bytes_full": Option("number", 0), "key_ratio": _NUMBER,
                          "length": Option("int", 0, nullable=True), "answer_nll": _NUMBER, "kl_full": _NUMBER,
                          "agree_full": _NUMBER, "kl_tokens": Option("int", 0, nullable=True),
                          "new_tokens": Option("int", 0), "stopped": Option("bool"), "fidelity": Option("bool")},
    "timings.jsonl": {k: _NUMBER for k in TIMING_FIELDS},
}


def record_problem(record: dict, name: str) -> str | None:
    """What makes a record of the run directory's file ``name`` unusable (:data:`RECORD_FIELDS`), or None."""
    required = RECORD_FIELDS.get(name, {})
    missing = [k for k in required if k not in record]
    if missing:
        return f"a record without {', '.join(missing)} (a {name} line holds {', '.join(required)}, …)"
    for key, option in {**required, **RECORD_TYPES.get(name, {})}.items():
        if key in record and not option.accepts(record[key]):
            return f"{key} must be {option.valid()}; got {json.dumps(record[key])[:60]}"
    return None


def _parse(line: bytes, name: str = "") -> tuple[dict | None, str | None]:
    """One line of a JSON-lines file (``name``: the file's name, whose :data:`RECORD_FIELDS` it must have):
    ``(record, None)``, or ``(None, what is wrong)``."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 text (byte 0x{line[err.start]:02x} at column {err.start + 1})"
    except ValueError as err:
        return None, f"not a JSON record ({getattr(err, 'msg', err)} at column {getattr(err, 'colno', '?')})"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not a record"
    problem = record_problem(record, name)
    return (None, problem) if problem else (record, None)


def parse_records(path: Path, data: bytes) -> list[dict]:
    """The records of a JSON-lines file's bytes (a run's ``predictions.jsonl`` / ``timings.jsonl``: each with its
    :data:`RECORD_FIELDS`); :class:`DamagedFile` names the first damaged line."""
    out = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        record, problem = _parse(line, Path(path).name)
        if problem:
            raise DamagedFile(f"{path}:{number}: {problem}")
        out.append(record)
    return out


def read_manifest(path: Path) -> dict:
    """A run's ``manifest.json``; :class:`DamagedFile` (``<file>:<line>: …``) when it is missing or not a JSON
    object."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise DamagedFile(f"{path}: missing (it records what computed the directory); restore it, or rerun to "
                          f"write it (a run resumes from its predictions)") from None
    except IsADirectoryError:
        raise DamagedFile(f"{path}: a directory, not the run's manifest file") from None
    try:
        value = json.loads(data.decode("utf-8"))
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
    bad = {n for n, line in enumerate(lines, 1) if line.strip() and _parse(line, path.name)[1]}
    if bad:
        with open(path.with_name(path.name + ".damaged"), "ab") as f:
            f.write(b"".join(lines[n - 1] + b"\n" for n in sorted(bad)))
            f.flush()
            os.fsync(f.fileno())
        keep = [line for n, line in enumerate(lines, 1) if n not in bad]
        atomic_write(path, b"".join(line + b"\n" for line in keep).decode("utf-8"))
    return sorted(bad)


class ResultsDir:
    """A run directory. ``same_study(old payload, payload)``: the keys a newer version added to the payload when the
    directory's older payload is this one's but for them (:func:`spark_bench.upgrade.same_study`), else None; such
    a directory is resumed and its manifest upgraded (``upgraded``: what was added, when). None: fingerprints only."""

    def __init__(self, path: Path, payload: dict, same_study=None):
        self.path = path
        self.payload = payload
        self.key = fingerprint(payload)
        self.same_study = same_study

    def _added(self, old: dict) -> list[str] | None:
        """What this version's payload adds to ``old``'s (the same study), or None (another configuration)."""
        if old.get("fingerprint") == self.key:
            return []
        if self.same_study is None or not isinstance(old.get("payload"), dict):
            return None
        return self.same_study(old["payload"], self.payload)

    @property
    def predictions(self) -> Path:
        return self.path / "predictions.jsonl"

    @property
    def timings(self) -> Path:
        return self.path / "timings.jsonl"

    @property
    def manifest(self) -> Path:
        return self.path / "manifest.json"

    def _write_manifest(self, value: dict) -> None:
        atomic_write(self.manifest, json.dumps(value, indent=1, sort_keys=True, default=str))

    def mismatch(self, old: dict) -> ResultsMismatch:
        """The refusal of a directory whose manifest ``old`` has another fingerprint: what differs, in one line."""
        before = old.get("payload") if isinstance(old.get("payload"), dict) else {}
        changed = sorted(k for k in set(before) | set(self.payload)
                         if json.dumps(before.get(k), sort_keys=True, default=str)
                         != json.dumps(self.payload.get(k), sort_keys=True, default=str))
        shown = payload_changes(before, self.payload, [k for k in changed if k not in ("configs", "samples")])
        return ResultsMismatch(f"{self.path} holds results of a different configuration (differs in: "
                               f"{', '.join(changed) or 'fingerprint'}){f': {shown}' if shown else ''}; choose "
                               f"another run= or remove it", before, self.payload, changed)

    def open(self, expected: dict | None = None, session: dict | None = None) -> list[dict]:
        """Create or reopen the directory; the completed prediction records (for resume). ``expected``: what the
        run sets out to compute (``{"samples": [[id, task], …], "configs": [label, …]}``), kept in the manifest
        beside the fingerprint so a report can say what a stopped run is missing. ``session``: this session's
        record (:func:`spark_bench.provenance.session`), appended to the manifest's ``runs`` (:meth:`start`)."""
        old = None
        if self.manifest.exists():
            try:
                old = read_manifest(self.manifest)
            except DamagedFile:
                if self._holds_predictions():
                    raise
            if old is not None and old.get("fingerprint") != self.key and self._holds_predictions():
                added = self._added(old)
                if added is None:
                    raise self.mismatch(old)
                upgraded, _ = manifest_records(old, "upgraded")
                old = {**old, "fingerprint": self.key, "payload": self.payload, "upgraded": [
                    *upgraded, {"at": now(), "added": added, "fingerprint": old.get("fingerprint")}]}
                self._write_manifest(old)
                LOG.warning(f"resume: {self.path} was begun by an older spark-bench without {', '.join(added)} "
                            f"(added since, here at its default): the same study, resumed")
            if old is None or old.get("fingerprint") != self.key:  # nothing computed under it: the new config wins
                old = None
                for stale in (self.predictions, self.timings):
                    stale.unlink(missing_ok=True)
        if old is None:
            self.path.mkdir(parents=True, exist_ok=True)
            self._write_manifest({"fingerprint": self.key, "payload": self.payload,
                                  **({"expected": expected} if expected is not None else {})})
        elif expected is not None and old.get("expected") != expected:
            self._write_manifest({**old, "expected": expected})
        if session is not None:
            self.start(session)
        read_complete_lines(self.timings)
        return read_complete_lines(self.predictions)

    def start(self, session: dict) -> list[str]:
        """Record this session in the manifest's ``runs`` as it starts (a session already recorded by this process —
        the command line's, before the model loaded — is completed with ``session``'s fields instead). A damaged
        ``runs`` or ``fast_paths`` is repaired here (its whole records kept); lines saying what was repaired."""
        manifest = read_manifest(self.manifest)
        said = []
        lists = {}
        for key in ("runs", "fast_paths"):
            lists[key], problem = manifest_records(manifest, key, self.manifest)
            if problem:
                said.append(f"repair: {problem.split('; ')[0]}: kept its {len(lists[key])} whole record(s)")
        runs = lists["runs"]
        mine = next((i for i in range(len(runs) - 1, -1, -1) if runs[i].get("process") == session.get("process")
                     and runs[i].get("status") == "running"), None)
        if mine is None:
            runs.append(session)
        else:
            runs[mine] = {**session, **{k: v for k, v in runs[mine].items() if v is not None}}  # what it said wins
        repaired = {k: v for k, v in lists.items() if k in manifest or v}
        self._write_manifest({**manifest, **repaired})
        return said

    def update_session(self, **fields) -> None:
        """Set ``fields`` on this process's running session record (e.g. the dtype once the model has loaded)."""
        manifest = read_manifest(self.manifest)
        runs, _ = manifest_records(manifest, "runs")
        for record in reversed(runs):
            if record.get("process") == PROCESS and record.get("status") == "running":
                record.update(fields)
                self._write_manifest({**manifest, "runs": runs})
                return

    def end_session(self, status: str, strict: bool = True) -> None:
        """Complete this process's running session record: its end time and ``status`` (``finished`` or
        ``stopped: …``). ``strict=False`` (while another error propagates): a manifest that cannot be read or
        written leaves the record as it was instead of hiding that error."""
        try:
            self.update_session(ended=now(), status=status)
        except (OSError, ValueError):
            if strict:
                raise

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
            self.drop_timings({(t["id"], t["config"]) for t in read_complete_lines(self.timings)} - kept)
        return said

    def drop_timings(self, keys: set) -> None:
        """Remove the timing lines of the ``(id, config)`` pairs ``keys`` (predictions about to be computed again,
        whose new lines replace them), rewritten atomically."""
        timings = read_complete_lines(self.timings)
        if any((t["id"], t["config"]) in keys for t in timings):
            atomic_write(self.timings, "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in timings
                                               if (t["id"], t["config"]) not in keys))

    def note_fast_paths(self, record: dict) -> None:
        """Keep in the manifest which decode paths produced this session's predictions (``fast_paths``: one record
        per session that computed some, :meth:`~spark_bench.engine.fastpaths.FastPaths.record`); not part of the
        fingerprint."""
        old = read_manifest(self.manifest)
        kept, _ = manifest_records(old, "fast_paths")  # a damaged list: its whole records (start() said so)
        self._write_manifest({**old, "fast_paths": [*kept, record]})

    def _holds_predictions(self) -> bool:
        return self.predictions.exists() and b"\n" in self.predictions.read_bytes()

    def complete(self, ids: list[str], labels: list[str], fields: tuple = ()) -> bool:
        """Whether every (sample, config) prediction is already here under this configuration, each with every one
        of ``fields`` (a record an older version wrote without them is computed again: the model is needed) — read
        only; :class:`ResultsMismatch` when the directory holds predictions of another configuration."""
        if not self.manifest.exists() or not self._holds_predictions():
            return False
        old = read_manifest(self.manifest)
        if self._added(old) is None:
            raise self.mismatch(old)
        done = {(r["id"], r["config"]) for r in read_complete_lines(self.predictions) if all(f in r for f in fields)}
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
