"""Predicted vs measured peak memory of whole runs (issue 23): each case is one ``spark-bench`` run in a fresh
process on this CPU; the run writes ``memory.json`` (the peak :func:`spark_bench.memory.predict_run` predicted
before the model loaded, and the largest peak resident set measured per decode batch). Besides the totals, the
*dynamic* part — the peak above the process's resident memory right after the model loaded — is compared with the
predicted moments (prefill, compression, decode), since on tiny models the process itself dominates the total.

Writes ``results/bench/memory_peak.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
CASES = {
    "tiny-llama demo 4K, 2 tasks x 2": ["model=tiny-llama", "benchmark.length=4096",
                                         "benchmark.tasks=[niah_single_1,niah_multikey_1]"],
    "tiny-llama table1 sweep 4K, decode_samples=2": ["model=tiny-llama", "sweep=table1", "benchmark.length=4096",
                                                     "benchmark.tasks=[niah_single_1]", "decode_samples=2"],
    "smollm2 demo 2K": ["benchmark.length=2048", "benchmark.tasks=[niah_single_1]", "benchmark.num_samples=1"],
    "smollm2 demo 4K": ["benchmark.length=4096", "benchmark.tasks=[niah_single_1]", "benchmark.num_samples=1"],
    "smollm2 demo 4K, decode_batch=2": ["benchmark.length=4096", "benchmark.tasks=[niah_single_1]",
                                        "benchmark.num_samples=1", "decode_batch=2"],
    "smollm2 table1 sweep 4K": ["sweep=table1", "benchmark.length=4096", "benchmark.tasks=[niah_single_1]",
                                "benchmark.num_samples=1"],
}


def run_case(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as root:
        subprocess.run([str(BIN / "spark-bench"), *args, f"output_root={root}", "run=case", "progress=false"],
                       check=True, capture_output=True, text=True)
        return json.loads((Path(root) / "case" / "memory.json").read_text())


def summarize(report: dict) -> dict:
    device = report["prediction"]["devices"][0]
    held = device["prefill_kv"] if device["holds_prefill"] else 0
    moments = {"prefill": device["prefill_kv"] + device["prefill_work"],
               "compression": device["prefill_kv"] + device["memo"] + device["caches"] + device["compress_work"],
               "decode": held + device["caches"] + device["tail"] + max(device["step_work"],
                                                                         device.get("check_work", 0))}
    predicted_dynamic = max(moments.values())
    predicted_dynamic += device.get("overhead", 0)  # the runtime and allocator overhead the planner adds on the CPU
    measured_dynamic = report["measured_peak_bytes"] - report["resident_after_load_bytes"]
    mib = 2 ** 20
    return {"predicted_peak_mib": round(report["predicted_peak_bytes"] / mib, 1),
            "measured_peak_mib": round(report["measured_peak_bytes"] / mib, 1),
            "measured_over_predicted": report["measured_over_predicted"],
            "predicted_baseline_plus_weights_mib": round((device["baseline"] + device["weights"]) / mib, 1),
            "measured_after_load_mib": round(report["resident_after_load_bytes"] / mib, 1),
            "predicted_dynamic_mib": round(predicted_dynamic / mib, 1),
            "measured_dynamic_mib": round(measured_dynamic / mib, 1),
            "dynamic_measured_over_predicted": round(measured_dynamic / predicted_dynamic, 4),
            "predicted_moments_mib": {k: round(v / mib, 1) for k, v in moments.items()},
            "decode_batch": report["prediction"]["decode_batch"], "rows": report["prediction"]["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("results/bench/memory_peak.json"))
    parser.add_argument("--only", help="run only the cases whose name contains this")
    args = parser.parse_args()
    results = {}
    for name, case in CASES.items():
        if args.only and args.only not in name:
            continue
        results[name] = summarize(run_case(case))
        print(name, results[name], flush=True)
    ratios = [r["measured_over_predicted"] for r in results.values()]
    dynamic = [r["dynamic_measured_over_predicted"] for r in results.values()]
    out = {"cases": results, "device": "cpu (this machine: resident set, VmHWM reset per decode batch)",
           "measured_over_predicted": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
           "dynamic_measured_over_predicted": {"median": statistics.median(dynamic), "min": min(dynamic),
                                               "max": max(dynamic)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in out.items() if k != "cases"}, indent=1))


if __name__ == "__main__":
    main()
