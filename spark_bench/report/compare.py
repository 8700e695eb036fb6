"""Tables with intervals and paired comparisons, from per-sample scores (:func:`~.frame.read_sample_scores`).

* :func:`interval_frame`: every cell's mean, sample count and bootstrap interval, in the long format the renderers
  read (extra columns ``n``, ``low``, ``high``), ``Avg.`` included.
* :func:`paired_frame`: every row against its base row — the same eviction method at the same budget for a
  ``+ThinK`` / ``+SparK`` row, the full cache (``Vanilla``) for an eviction row or a channel method on the full
  cache — as Δ (paired bootstrap interval) and wins / ties / losses over the shared samples.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from spark_bench.report import stats
from spark_bench.report.layouts import LENGTH_BUCKETS, Layout, length_bucket

Row = tuple[str, str, str]
VANILLA: Row = ("", "Vanilla", "Vanilla")


def rows_of(samples: pd.DataFrame) -> list[Row]:
    return list(dict.fromkeys(zip(samples.block, samples.group, samples.method)))


def columns_of(samples: pd.DataFrame, layout: Layout) -> list[str]:
    present = list(dict.fromkeys(samples.column))
    return [c for c in layout.columns if c in present] + [c for c in present if c not in layout.columns]


def per_task(samples: pd.DataFrame, row: Row, columns: list[str], value: str = "score") -> dict[str, pd.Series]:
    """The row's values per column, indexed by sample id (sorted, so two rows align by id)."""
    mine = samples[(samples.block == row[0]) & (samples.group == row[1]) & (samples.method == row[2])]
    return {c: mine[mine.column == c].set_index("id")[value].sort_index().astype(float)
            for c in columns if (mine.column == c).any()}


def interval_frame(samples: pd.DataFrame, layout: Layout, resamples: int = stats.RESAMPLES,
                   seed: int = stats.SEED) -> pd.DataFrame:
    """Long format (``block, group, method, column, value, n, low, high``): each task cell, ``Avg.`` (mean over the
    row's tasks, stratified bootstrap), ``KV %`` (mean bytes held over the full cache) and ``Key ratio``."""
    columns, out = columns_of(samples, layout), []
    for row in rows_of(samples):
        tasks = per_task(samples, row, columns)
        cells, average = stats.mean_intervals([s.to_numpy() for s in tasks.values()], resamples, seed)
        for column, cell in zip(tasks, cells):
            out.append((*row, column, cell.estimate, cell.n, cell.low, cell.high))
        if layout.average:
            out.append((*row, "Avg.", average.estimate, average.n, average.low, average.high))
        mine = samples[(samples.block == row[0]) & (samples.group == row[1]) & (samples.method == row[2])]
        out.append((*row, "KV %", 100 * float((mine.kv_bytes / mine.kv_bytes_full).mean()), len(mine),
                    float("nan"), float("nan")))
        out.append((*row, "Key ratio", float(mine.key_ratio.mean()), len(mine), float("nan"), float("nan")))
    return pd.DataFrame(out, columns=["block", "group", "method", "column", "value", "n", "low", "high"])


def _tags(label: str) -> set[str]:
    """The ``key=value`` options a label carries (``SnapKV [compress_scope=question, window_size=64]``)."""
    if not label.endswith("]") or " [" not in label:
        return set()
    return {t.strip() for t in label[label.rindex(" [") + 2:-1].split(",")}


def _bare(label: str) -> str:
    return label[:label.rindex(" [")] if label.endswith("]") and " [" in label and "=" in label else label


def base_of(row: Row, present: set[Row]) -> Row | None:
    """The row a row is compared with: its eviction row for ``+X`` rows, the full cache for the rest. When a run's
    rows differ in options (labels ``[key=value, …]``, e.g. two protocols in one sweep), the base is the candidate
    whose options all agree with the row's (the one sharing most of them)."""
    block, group, method = row
    if _bare(method) == "Vanilla":
        return None
    want = (block, group) if method.startswith("+") else ("", "Vanilla")
    name = group if method.startswith("+") else "Vanilla"
    tags = _tags(method)
    candidates = [r for r in present if (r[0], r[1]) == want and _bare(r[2]) == name and _tags(r[2]) <= tags]
    return max(candidates, key=lambda r: len(_tags(r[2])), default=None)


def aligned(samples: pd.DataFrame, row: Row, other: Row, columns: list[str],
            value: str = "score") -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Both rows' values per task on the samples they share (paired by id)."""
    a, b = per_task(samples, row, columns, value), per_task(samples, other, columns, value)
    xs, ys = [], []
    for column in a:
        if column in b:
            ids = a[column].index.intersection(b[column].index)
            if len(ids):
                xs.append(a[column].loc[ids].to_numpy())
                ys.append(b[column].loc[ids].to_numpy())
    return xs, ys


def paired_frame(samples: pd.DataFrame, layout: Layout, resamples: int = stats.RESAMPLES,
                 seed: int = stats.SEED) -> pd.DataFrame:
    """One line per row that has a base row: Δ of ``Avg.`` with its paired interval, and wins / ties / losses."""
    columns, rows = columns_of(samples, layout), rows_of(samples)
    out = []
    for row in rows:
        base = base_of(row, set(rows))
        if base is None:
            continue
        xs, ys = aligned(samples, row, base, columns)
        if not xs:
            continue
        p = stats.paired(xs, ys, resamples, seed)
        out.append({"block": row[0], "group": row[1], "method": row[2], "base": base[2], "n": p.delta.n,
                    "delta": p.delta.estimate, "low": p.delta.low, "high": p.delta.high,
                    "wins": p.wins, "ties": p.ties, "losses": p.losses})
    return pd.DataFrame(out, columns=["block", "group", "method", "base", "n", "delta", "low", "high", "wins",
                                      "ties", "losses"])


def paired_markdown(paired: pd.DataFrame) -> str:
    lines = ["| Block | Method | vs | n | Δ Avg. (95% CI) | wins / ties / losses |", "|---|---|---|---|---|---|"]
    for r in paired.itertuples(index=False):
        label = r.method if not r.method.startswith("+") else f"{r.group} {r.method}"
        lines.append(f"| {r.block or '–'} | {label} | {r.base} | {r.n} | {r.delta:+.2f} [{r.low:+.2f}, "
                     f"{r.high:+.2f}] | {r.wins} / {r.ties} / {r.losses} |")
    return "\n".join(lines) + "\n"


def length_frame(samples: pd.DataFrame, resamples: int = stats.RESAMPLES, seed: int = stats.SEED,
                 ci: bool = False) -> pd.DataFrame:
    """LongBench-E layout: per row, the score in each length bucket (the mean over tasks of each task's mean within
    the bucket, as LongBench's ``scorer_e`` then averaging tasks) and over all records (``All``); with ``ci``, the
    stratified bootstrap interval of each."""
    if samples.length.isna().any():
        raise ValueError("LongBench-E layout: some predictions have no record length (not LongBench data, or a run "
                         "made before lengths were recorded)")
    samples = samples.assign(bucket=samples.length.map(length_bucket))
    out = []
    for row in rows_of(samples):
        mine = samples[(samples.block == row[0]) & (samples.group == row[1]) & (samples.method == row[2])]
        for bucket in (*LENGTH_BUCKETS, "All"):
            part = mine if bucket == "All" else mine[mine.bucket == bucket]
            if part.empty:
                continue
            tasks = [g.sort_values("id").score.to_numpy(float) for _, g in part.groupby("column", sort=False)]
            _, average = stats.mean_intervals(tasks, resamples, seed)
            low, high = (average.low, average.high) if ci else (float("nan"), float("nan"))
            out.append((*row, bucket, average.estimate, average.n, low, high))
    return pd.DataFrame(out, columns=["block", "group", "method", "column", "value", "n", "low", "high"])
