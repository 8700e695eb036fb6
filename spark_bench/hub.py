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

When the hub is reachable and the repository not on disk, :func:`check_repo` asks the hub about it (its API,
``/api/<type>s/<id>``, with the user's token) within :func:`timeout_s` seconds, so each answer a user meets is one
line: gated or unauthorized (which token fixes it), not found, an error, or no answer in time. The same bound is
given to huggingface_hub's own metadata and download waits (``HF_HUB_ETAG_TIMEOUT``, ``HF_HUB_DOWNLOAD_TIMEOUT``;
``hub_timeout_s=`` on the command line sets them).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0


class HubUnavailable(ValueError):
    """A hub repository is neither on disk nor reachable (reported as one line, exit code 2)."""


DEFAULT_TIMEOUT_S = 10.0


def timeout_s() -> float:
    """Seconds to wait for the hub's answer (``HF_HUB_ETAG_TIMEOUT``, huggingface_hub's own; default 10)."""
    try:
        return max(float(os.environ.get("HF_HUB_ETAG_TIMEOUT", DEFAULT_TIMEOUT_S)), 0.1)
    except ValueError:
        return DEFAULT_TIMEOUT_S


def set_timeout(seconds: float) -> None:
    """Bound every hub wait of this process: ours and huggingface_hub's metadata and download calls."""
    os.environ["HF_HUB_ETAG_TIMEOUT"] = os.environ["HF_HUB_DOWNLOAD_TIMEOUT"] = f"{seconds:g}"


def _token() -> str | None:
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        return token
    try:
        from huggingface_hub import get_token

        return get_token()
    except ImportError:
        return None


def check_repo(repo_id: str, repo_type: str, what: str) -> None:
    """Ask the hub whether ``repo_id`` can be downloaded with the user's token; :class:`HubUnavailable` (one line)
    when it is gated or needs a token, does not exist, answers with an error or does not answer in time."""
    url = f"{endpoint()}/api/{repo_type}s/{repo_id}"
    request = urllib.request.Request(url, headers={"User-Agent": "spark-bench"})
    token = _token()
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    wait = timeout_s()
    try:
        with urllib.request.urlopen(request, timeout=wait) as response:
            response.read(1)
        return
    except urllib.error.HTTPError as err:
        code, kind = err.code, err.headers.get("X-Error-Code", "")
        page = f"{endpoint()}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
        if code in (401, 403) or kind == "GatedRepo":
            who = "the token in HF_TOKEN" if token else "no token (HF_TOKEN unset, no `hf auth login`)"
            raise HubUnavailable(
                f"{what}: the hub refused {repo_id} (HTTP {code}{', gated' if kind == 'GatedRepo' else ''}) with "
                f"{who}: accept its license on {page} and set HF_TOKEN (or run `hf auth login`), or set "
                f"model.path=/local/copy") from None
        if code == 404 or kind in ("RepoNotFound", "EntryNotFound"):
            raise HubUnavailable(f"{what}: {repo_id} does not exist on {endpoint()} (HTTP 404); check the id, or set "
                                 f"model.path=/local/copy") from None
        raise HubUnavailable(f"{what}: the hub answered HTTP {code} for {repo_id}; retry later, or use a local "
                             f"copy (model.path=)") from None
    except OSError as err:  # URLError (refused, DNS) or a timeout while connecting or reading
        reason = getattr(err, "reason", err)
        if isinstance(err, TimeoutError) or isinstance(reason, TimeoutError):
            raise HubUnavailable(f"{what}: {endpoint()} accepted the connection but sent no answer about {repo_id} "
                                 f"within {wait:g} s (hub_timeout_s=); retry later, or use a local copy "
                                 f"(model.path=)") from None
        raise HubUnavailable(f"{what}: asking {endpoint()} about {repo_id} failed ({reason}); use a local copy "
                             f"(model.path=)") from None


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
        check_repo(repo_id, repo_type, what)
        return repo_id
    raise HubUnavailable(f"{what}: {repo_id} {_missing(reason)}; {fix}")


def _missing(reason: str) -> str:
    return (f"is not on disk (no directory of that name, not in the hub cache {cache_dir()}) and the hub cannot be "
            f"used ({reason})")


def describe(repo_id: str, repo_type: str) -> str:
    """Where :func:`resolve` would take ``repo_id`` from, without raising (for dry runs)."""
    try:
        location = resolve(repo_id, repo_type, repo_id, "")
    except HubUnavailable as err:
        reason = unreachable_reason()
        return f"NOT AVAILABLE: {repo_id} " + (_missing(reason) if reason else str(err))
    return "the hub (downloaded on first use)" if location == repo_id and not Path(repo_id).is_dir() else location
