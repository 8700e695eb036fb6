"""The shift each protocol point causes, from one run that holds the official configs and variants of them
(`make protocols`, conf/sweep/protocols.yaml).

For every config whose protocol options are the official protocol's, each other config of the same method (name,
budget, ratios) is a variant: the table gives the options in which it differs from the official one, both means
with their 95% bootstrap intervals, and the paired Δ (official − variant, same samples) with wins / ties / losses.

    python scripts/protocol_shifts.py results/protocols [--out results/protocols/report/shifts.md]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from spark_bench.cli import CONF_DIR
from spark_bench.methods.pipeline import relevant_options
from spark_bench.report import stats

SAME_METHOD = ("name", "budget", "ratio", "value_ratio", "variant", "recovery", "saliency")


def per_task(records: list[dict]) -> list[np.ndarray]:
    by_task = defaultdict(dict)
    for r in records:
        by_task[r["task"]][r["id"]] = r["score"]
    return [np.array([scores[i] for i in sorted(scores)]) for _, scores in sorted(by_task.items())]


def shifts(run: Path) -> str:
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines() if line.strip()]
    configs: dict[str, dict] = {}
    rows: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        configs.setdefault(r["config"], r["method"])
        rows[r["config"]].append(r)
    official = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "protocol" / "official.yaml"))
    out = ["| Method | official | variant: options that differ | variant | Δ official − variant [95% CI] | "
           "wins / ties / losses |", "|---|---|---|---|---|---|"]
    for label, method in configs.items():
        relevant = relevant_options(method)
        if any(method.get(k, v) != v for k, v in official.items() if k in relevant):
            continue
        mine = per_task(rows[label])
        mean = stats.mean_intervals(mine)[1]
        for other, variant in configs.items():
            if other == label or any(variant.get(k) != method.get(k) for k in SAME_METHOD):
                continue
            differ = [f"{k}={variant.get(k)}" for k in official if k in relevant and variant.get(k) != method.get(k)]
            if not differ:
                continue
            theirs = per_task(rows[other])
            vmean = stats.mean_intervals(theirs)[1]
            p = stats.paired(mine, theirs)
            name = label.split(" [")[0]
            out.append(f"| {name} | {mean.estimate:.2f} [{mean.low:.2f}, {mean.high:.2f}] | {', '.join(differ)} | "
                       f"{vmean.estimate:.2f} [{vmean.low:.2f}, {vmean.high:.2f}] | {p.delta.estimate:+.2f} "
                       f"[{p.delta.low:+.2f}, {p.delta.high:+.2f}] | {p.wins} / {p.ties} / {p.losses} |")
    n = len({(r["task"], r["id"]) for r in records})
    return "\n".join(out) + f"\n\n{n} samples; seeded bootstrap ({stats.RESAMPLES} resamples), samples resampled " \
                            "within each task.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = shifts(args.run)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
