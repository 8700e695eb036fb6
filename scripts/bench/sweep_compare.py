"""CPU sweep time of this checkout against an earlier commit, alternating in one run.

The embedded default sweep (``spark-bench run=demo``: SmolLM2-135M, RULER needles, the demo method mix, offline) is
run as a fresh process from each code tree in turn — baseline, current, baseline, current, … — so both see the same
machine load over time; each tree's wall times and their medians are written, with the ratio current / baseline
(< 1: the current code is faster). The baseline tree is the commit's files (``git archive``) in a temporary
directory; both run in this virtual environment, each with its own build of the C++ kernel (the build is named by a
digest of its source). The runs' scores must be equal: the same sweep, the same tokens.

Writes ``results/bench/sweep_compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tree(ref: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _run(tree: Path, out: Path) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-c", "from spark_bench.cli import main; main()", "run=demo", f"output_root={out}",
           "progress=false"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: spark-bench run=demo exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    elapsed = time.perf_counter() - start
    scores = sorted(out.glob("*/scores.csv"))
    return elapsed, scores[0].read_text() if scores else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", default="19a0da7", help="the commit to compare with (default: before issue 33)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/bench/sweep_compare.json"))
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="spark-bench-compare-"))
    try:
        trees = {"baseline": _tree(args.baseline, scratch / "baseline"), "current": ROOT}
        for tree in trees.values():  # build each tree's C++ kernel before any clock starts
            subprocess.run([sys.executable, "-m", "spark_bench.storage.fast_logits"], cwd=tree,
                           env={**os.environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True)
        times: dict[str, list[float]] = {name: [] for name in trees}
        scores: dict[str, set[str]] = {name: set() for name in trees}
        for i in range(args.repeats):
            for name, tree in trees.items():
                elapsed, table = _run(tree, scratch / f"{name}-{i}")
                times[name].append(round(elapsed, 2))
                scores[name].add(table)
                print(f"{name} #{i}: {elapsed:.1f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {"what": "spark-bench run=demo (SmolLM2-135M, RULER, demo mix), wall seconds per fresh process",
              "baseline": args.baseline, "repeats": args.repeats, "order": "alternating, baseline first",
              "seconds": times, "median_s": medians,
              "ratio_current_over_baseline": round(medians["current"] / medians["baseline"], 3),
              "same_scores": len(scores["baseline"] | scores["current"]) == 1}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"median {medians['baseline']:.1f} s ({args.baseline}) → {medians['current']:.1f} s (current): "
          f"{result['ratio_current_over_baseline']}×; same scores: {result['same_scores']}")


if __name__ == "__main__":
    main()
