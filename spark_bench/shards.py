"""``shard=i/n`` splits one run's samples across jobs (sample k goes to shard k mod n); :func:`merge_shards` joins
the shard directories back into the run directory in the original sample order, refusing shards that came from
different configurations or an incomplete set, and shards that different spark-bench versions computed unless
``allow_mixed`` (``spark-bench-merge --allow-mixed``); any other difference in their provenance (the packages, the
device, the dtype: :mod:`spark_bench.provenance`) is said in one line."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pandas as pd

from spark_bench import provenance
from spark_bench.results import TIMING_FIELDS, atomic_write, manifest_records, read_complete_lines, read_manifest
from spark_bench.tables import render_markdown, summarize

LOG = logging.getLogger(__name__)
SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)$")


def shard_sessions(directory: Path) -> list[tuple[str, dict]]:
    """``(shard name, session record)`` of every session of every shard of ``directory`` (a shard without records
    gives one empty record: written before spark-bench recorded provenance)."""
    out = []
    for path in sorted(p for p in Path(directory).iterdir() if p.is_dir() and SHARD_DIR.match(p.name)):
        try:
            runs, _ = manifest_records(read_manifest(path / "manifest.json"), "runs")
        except (OSError, ValueError):
            runs = []
        out += [(path.name, r) for r in runs] or [(path.name, {})]
    return out


def check_provenance(directory: Path, allow_mixed: bool = False) -> list[str]:
    """Refuse (``ValueError``, one line) shards computed by different spark-bench versions unless ``allow_mixed``;
    the lines saying how their sessions' provenance differs otherwise (empty when it does not)."""
    sessions = shard_sessions(directory)
    versions: dict = {}
    for name, record in sessions:
        versions.setdefault(provenance.version_key(record), (provenance.version_text(record), []))[1].append(name)
    if len(versions) > 1 and not allow_mixed:
        said = "; ".join(f"{text} ({', '.join(dict.fromkeys(names))})" for text, names in versions.values())
        raise ValueError(f"{directory}: shards were computed by different spark-bench versions: {said}; rerun "
                         f"the odd shards with one version, or merge anyway with --allow-mixed")
    differ = provenance.differences(sessions)
    return [f"{directory}: the shards' provenance differs: {'; '.join(differ)}"] if differ else []


def merge_shards(directory: Path, allow_mixed: bool = False) -> int:
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
        payload = read_manifest(path / "manifest.json").get("payload")
        if not isinstance(payload, dict):
            raise ValueError(f"{path / 'manifest.json'}: no payload (the configuration the shard computed); "
                             f"restore the file, or rerun the shard")
        payloads.append({k: v for k, v in payload.items() if k not in ("samples", "shard")})
    if any(p != payloads[0] for p in payloads):
        raise ValueError(f"{directory}: shards were produced by different configurations")
    for line in check_provenance(directory, allow_mixed):
        LOG.warning(f"warning: {line}")
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
