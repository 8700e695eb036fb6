"""Where hub models and data sets come from, decided before anything runs.

A hub repository (a model id such as ``meta-llama/Meta-Llama-3-8B-Instruct`` or a data set such as
``Xnhyacinth/LongBench``) is looked for, in order:

1. a local directory (``model.path=/dir`` holding ``config.json``, a dataset repository copied to disk);
2. the local hub cache (``HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``; filled once by
   ``hf download <repo>`` or any earlier online run): its snapshot directory is used, so nothing touches the
   network;
3. the hub itself, if a TCP connection to ``HF_ENDPOINT`` opens within :data:`PROBE_TIMEOUT_S` seconds and
   ``HF_HUB_OFFLINE`` is not set.

When none of them has it, :func:`resolve` raises :class:`HubUnavailable` with one line: what is missing, where it
looked and the keys that fix it. That replaces huggingface_hub's retry loop (about a minute, then a traceback)
with an answer in a few seconds.
"""

from __future__ import annotations

import os
import socket
import threading
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0


class HubUnavailable(ValueError):
    """A hub repository is neither on disk nor reachable (reported as one line, exit code 2)."""


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """The hub cache huggingface_hub reads (``HF_HUB_CACHE``, else ``HF_HOME/hub``), from the environment now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


@lru_cache(maxsize=8)
def _probe(url: str, timeout: float) -> str | None:
    parsed = urlparse(url)
    host = parsed.hostname or ""
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect():  # in a thread: getaddrinfo has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(f"{type(err).__name__}: {err}")

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout + 0.5)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


def unreachable_reason(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None if the hub answers, else why not (``HF_HUB_OFFLINE``, DNS failure, refused, timed out)."""
    if offline_requested():
        return "HF_HUB_OFFLINE is set"
    reason = _probe(endpoint(), timeout)
    return None if reason is None else f"{endpoint()} unreachable: {reason}"


def cached_snapshot(repo_id: str, repo_type: str = "model") -> Path | None:
    """The local snapshot directory of ``repo_id`` (its ``main`` revision) in the hub cache, or None.

    The layout is huggingface_hub's: ``<cache>/<type>s--<org>--<name>/refs/main`` holds a commit hash and
    ``snapshots/<hash>/`` the files.
    """
    folder = cache_dir() / f"{repo_type}s--{repo_id.replace('/', '--')}"
    ref = folder / "refs" / "main"
    if ref.is_file():
        snapshot = folder / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir() and any(snapshot.iterdir()):
            return snapshot
    snapshots = sorted((folder / "snapshots").glob("*")) if (folder / "snapshots").is_dir() else []
    snapshots = [s for s in snapshots if s.is_dir() and any(s.iterdir())]
    return snapshots[-1] if len(snapshots) == 1 else None


def looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep == "\\" and "\\" in name


def resolve(repo_id: str, repo_type: str, what: str, fix: str) -> str:
    """A local directory for ``repo_id`` (given directly or from the hub cache), or ``repo_id`` itself when the hub
    is reachable; otherwise :class:`HubUnavailable` naming ``what`` and ``fix``."""
    if Path(repo_id).expanduser().is_dir():
        return str(Path(repo_id).expanduser())
    if looks_like_path(repo_id):
        raise HubUnavailable(f"{what}: {repo_id} is not a directory; {fix}")
    snapshot = cached_snapshot(repo_id, repo_type)
    if snapshot is not None:
        return str(snapshot)
    reason = unreachable_reason()
    if reason is None:
        return repo_id
    raise HubUnavailable(f"{what}: {repo_id} {_missing(reason)}; {fix}")


def _missing(reason: str) -> str:
    return (f"is not on disk (no directory of that name, not in the hub cache {cache_dir()}) and the hub cannot be "
            f"used ({reason})")


def describe(repo_id: str, repo_type: str) -> str:
    """Where :func:`resolve` would take ``repo_id`` from, without raising (for dry runs)."""
    try:
        location = resolve(repo_id, repo_type, repo_id, "")
    except HubUnavailable:
        reason = unreachable_reason()
        return f"NOT AVAILABLE: {repo_id} " + (_missing(reason) if reason else "is not a directory")
    return "the hub (downloaded on first use)" if location == repo_id and not Path(repo_id).is_dir() else location
