"""The planner's GPU-hour and KV estimate of every paper target → results/bench/plan_hours.json.

For each make target that runs experiments (``$(call experiment,NAME,…)`` in the Makefile), what ``make <target>
DRY_RUN=true`` prints per experiment (:func:`spark_bench.cli.plan_cost`): H100 decode and prefill hours (summed over
the target's experiments, as README.md and docs/tables.md show them), rows, samples and KV GiB per sample.
tests/test_docs.py checks the docs' tables against this file and recomputes its table1 entry.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from spark_bench.cli import plan_cost, validate  # noqa: E402
from spark_bench.commandline import compose  # noqa: E402


def targets(makefile: str) -> dict[str, list[str]]:
    """make target → the experiments its recipe runs."""
    out = {}
    for target, recipe in re.findall(r"^([\w.\-]+):.*\n((?:\t.*\n)+)", makefile, flags=re.M):
        names = re.findall(r"\$\(call experiment,(\w+),", recipe)
        if names:
            out[target] = names
    return out


def experiment(name: str) -> dict:
    cfg = compose([f"+experiment={name}"])
    model, configs = validate(cfg, sources=False)
    cost = plan_cost(cfg, model, configs)[1]
    prefill, decode = cost.hours["h100"]
    return {"rows": cost.configs, "samples": cost.samples, "kv_gib_per_sample": round(cost.kv_gib_per_sample, 4),
            "h100_prefill_h": round(prefill, 4), "h100_decode_h": round(decode, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("results/bench/plan_hours.json"))
    args = parser.parse_args()
    found, cache = {}, {}
    for target, names in targets(Path("Makefile").read_text()).items():
        for name in names:
            cache.setdefault(name, experiment(name))
        found[target] = {"experiments": {n: cache[n] for n in names},
                         "h100_decode_h": round(sum(cache[n]["h100_decode_h"] for n in names), 4),
                         "h100_prefill_h": round(sum(cache[n]["h100_prefill_h"] for n in names), 4)}
        print(f"{target}: {found[target]['h100_decode_h']:.1f} + ≤ {found[target]['h100_prefill_h']:.1f} H100 hours")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
