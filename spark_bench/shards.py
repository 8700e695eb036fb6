"""``shard=i/n`` splits one run's samples across jobs (sample k goes to shard k mod n); :func:`merge_shards` joins
the shard directories back into the run directory in the original sample order, refusing shards that came from
different configurations or an incomplete set."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from spark_bench.results import TIMING_FIELDS, atomic_write, read_complete_lines, read_manifest
from spark_bench.tables import render_markdown, summarize

SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)$")


def merge_shards(directory: Path) -> int:
    shards = sorted((int(m.group(1)), int(m.group(2)), p) for p in directory.iterdir()
                    if p.is_dir() and (m := SHARD_DIR.match(p.name)))
    if not shards:
        raise FileNotFoundError(f"{directory}: no shard-<i>-of-<n> directories")
    counts = {n for _, n, _ in shards}
    if len(counts) != 1 or [i for i, _, _ in shards] != list(range(next(iter(counts)))):
        raise ValueError(f"{directory}: incomplete or mixed shard set {[p.name for *_, p in shards]}")
    payloads = []
    for _, _, path in shards:
        if not (path / "table.md").exists():
            raise ValueError(f"{path}: shard not finished (no table.md); rerun it to resume")
        payload = read_manifest(path / "manifest.json")["payload"]
        payloads.append({k: v for k, v in payload.items() if k not in ("samples", "shard")})
    if any(p != payloads[0] for p in payloads):
        raise ValueError(f"{directory}: shards were produced by different configurations")
    per_shard = [read_complete_lines(path / "predictions.jsonl") for *_, path in shards]
    timings = {(r["id"], r["config"]): r for *_, path in shards for r in read_complete_lines(path / "timings.jsonl")}
    labels = [c for c in dict.fromkeys(r["config"] for r in per_shard[0])]
    # shard i holds samples i, i+n, i+2n, …: interleave back, one sample (all its configs) at a time
    blocks = [[rows[j:j + len(labels)] for j in range(0, len(rows), len(labels))] for rows in per_shard]
    ordered = [r for k in range(max(map(len, blocks))) for b in blocks if k < len(b) for r in b[k]]
    frame = pd.DataFrame([{**r, **{k: timings.get((r["id"], r["config"]), {}).get(k) for k in TIMING_FIELDS}}
                          for r in ordered])
    tasks = list(dict.fromkeys(frame.task))
    scores = summarize(frame, labels, tasks)
    atomic_write(directory / "predictions.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered))
    atomic_write(directory / "scores.csv", scores.to_csv(index=False))
    atomic_write(directory / "table.md", render_markdown(scores, labels, tasks, frame))
    return len(shards)
