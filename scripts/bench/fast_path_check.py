"""What the run-time fast-path check costs (issue 42 item 4): ``make demo``'s model and sweep on a few of its samples
(one ``spark-bench`` run in a fresh process, this CPU), read back from the run's own records: the first uses of the
kernel variants (``warmup_s`` in timings.jsonl: the first fast call and its float32 reference, each variant once per
run) against the time of a sample (its shared prefill plus every config's compression, decode and warm-up). The
check happens in the run's first sample only; the figure is given for that sample and spread over the demo's 16.

Writes ``results/bench/fast_path_check.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
DEMO_SAMPLES = 16  # make demo: 8 RULER needle tasks x 2 samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("results/bench/fast_path_check.json"))
    parser.add_argument("--tasks", default="[niah_single_1,niah_multikey_3]")
    parser.add_argument("--run", type=Path, help="read a finished run of the demo model instead of running one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        run = args.run or Path(root) / "check"
        if args.run is None:
            subprocess.run([str(BIN / "spark-bench"), f"benchmark.tasks={args.tasks}", "benchmark.num_samples=1",
                            f"output_root={root}", "run=check", "progress=false"], check=True, capture_output=True)
        timings = [json.loads(line) for line in (run / "timings.jsonl").open()]
        (record,) = json.loads((run / "manifest.json").read_text())["fast_paths"]
    samples = {}
    for t in timings:
        s = samples.setdefault(t["id"], {"prefill_s": t["prefill_s"], "configs_s": 0.0, "warmup_s": 0.0})
        s["configs_s"] += t["compress_s"] + t["decode_s"] + t["warmup_s"]
        s["warmup_s"] += t["warmup_s"]
    per_sample = {k: round(v["prefill_s"] + v["configs_s"], 3) for k, v in samples.items()}
    first = max(samples, key=lambda k: samples[k]["warmup_s"])
    check_s = sum(v["warmup_s"] for v in samples.values())
    out = {"device": "cpu (this machine, 2 shared cores)", "model": "smollm2-135m (make demo's sweep: 6 configs)",
           "checks": record["checks"], "numbers_from": record["numbers_from"],
           "check_s": round(check_s, 4), "sample_s": per_sample,
           "check_over_first_sample": round(check_s / per_sample[first], 5),
           "check_over_mean_sample_of_the_demo": round(check_s / (DEMO_SAMPLES * sum(per_sample.values())
                                                                  / len(per_sample)), 5)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in out.items() if k != "checks"}, indent=1))


if __name__ == "__main__":
    main()
