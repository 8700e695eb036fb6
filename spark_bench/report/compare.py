"""Tables with intervals and paired comparisons, from per-sample scores (:func:`~.frame.read_sample_scores`).

* :func:`interval_frame`: every cell's mean, sample count and bootstrap interval, in the long format the renderers
  read (extra columns ``n``, ``low``, ``high``), ``Avg.`` included.
* :func:`paired_frame`: every row against its base row — the same eviction method at the same budget for a
  ``+ThinK`` / ``+SparK`` row, the full cache (``Vanilla``) for an eviction row or a channel method on the full
  cache — every SparK (λ) row against ThinK (λ), and every row compressed without the question in view
  (``compress_scope=context``) against itself with it (``question`` / ``prompt``), as Δ (paired bootstrap interval)
  and wins / ties / losses over the shared samples, on the score and on each fidelity number (``answer_nll``,
  ``kl_full``, ``agree_full``).
* :func:`position_markdown`: with several questions per context, each config's score by the question's position.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from spark_bench.report import stats
from spark_bench.report.layouts import LENGTH_BUCKETS, Layout, length_bucket
from spark_bench.tables import FIDELITY_COLUMNS

Row = tuple[str, str, str]
VANILLA: Row = ("", "Vanilla", "Vanilla")


def rows_of(samples: pd.DataFrame) -> list[Row]:
    return list(dict.fromkeys(zip(samples.block, samples.group, samples.method)))


def columns_of(samples: pd.DataFrame, layout: Layout) -> list[str]:
    present = list(dict.fromkeys(samples.column))
    return [c for c in layout.columns if c in present] + [c for c in present if c not in layout.columns]


def per_task(samples: pd.DataFrame, row: Row, columns: list[str], value: str = "score") -> dict[str, pd.Series]:
    """The row's values per column, indexed by sample id (sorted, so two rows align by id)."""
    if value not in samples:  # a fidelity number of a frame that does not carry it
        return {}
    mine = samples[(samples.block == row[0]) & (samples.group == row[1]) & (samples.method == row[2])]
    return {c: mine[mine.column == c].set_index("id")[value].sort_index().astype(float)
            for c in columns if (mine.column == c).any()}


def interval_frame(samples: pd.DataFrame, layout: Layout, resamples: int = stats.RESAMPLES,
                   seed: int = stats.SEED, value: str = "score") -> pd.DataFrame:
    """Long format (``block, group, method, column, value, n, low, high``): each task cell of ``value`` (``score``
    or a fidelity number: ``answer_nll``, ``kl_full``, ``agree_full``), ``Avg.`` (mean over the row's tasks,
    stratified bootstrap), the fidelity columns (``NLL``, ``KL full``, ``Agree``: means over tasks with their
    stratified intervals, where measured), ``KV %`` (mean bytes held over the full cache) and ``Key ratio``."""
    columns, out = columns_of(samples, layout), []
    for row in rows_of(samples):
        tasks = measured(per_task(samples, row, columns, value))
        if tasks:
            cells, average = stats.mean_intervals([s.to_numpy() for s in tasks.values()], resamples, seed)
            for column, cell in zip(tasks, cells):
                out.append((*row, column, cell.estimate, cell.n, cell.low, cell.high))
            if layout.average:
                out.append((*row, "Avg.", average.estimate, average.n, average.low, average.high))
        for field, name in FIDELITY_COLUMNS.items():
            found = measured(per_task(samples, row, columns, field))
            if found:
                _, mean = stats.mean_intervals([s.to_numpy() for s in found.values()], resamples, seed)
                out.append((*row, name, mean.estimate, mean.n, mean.low, mean.high))
        mine = samples[(samples.block == row[0]) & (samples.group == row[1]) & (samples.method == row[2])]
        out.append((*row, "KV %", 100 * float((mine.kv_bytes / mine.kv_bytes_full).mean()), len(mine),
                    float("nan"), float("nan")))
        out.append((*row, "Key ratio", float(mine.key_ratio.mean()), len(mine), float("nan"), float("nan")))
    return pd.DataFrame(out, columns=["block", "group", "method", "column", "value", "n", "low", "high"])


def measured(tasks: dict[str, pd.Series]) -> dict[str, pd.Series]:
    """The tasks whose values were all measured (a fidelity number is NaN in runs made before it, and ``kl_full``
    / ``agree_full`` in runs without a full config)."""
    return {c: v for c, v in tasks.items() if len(v) and v.notna().all()}


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


def think_of(row: Row, present: set[Row]) -> Row | None:
    """A ``SparK (λ)`` row's ``ThinK (λ)`` at the same eviction method, budget and options (the paper's equal-λ
    comparison), or None."""
    block, group, method = row
    bare = _bare(method)
    if not bare.lstrip("+").startswith("SparK (") or "[" in bare:
        return None
    other = method.replace("SparK (", "ThinK (", 1)
    return (block, group, other) if (block, group, other) in present else None


AGNOSTIC, AWARE = "compress_scope=context", ("compress_scope=question", "compress_scope=prompt")


def scope_pairs(row: Row, present: set[Row]) -> list[Row]:
    """A row compressed query-agnostic (``[compress_scope=context, …]``: the question not in view) → the same row
    (method, block, every other option) compressed query-aware (``compress_scope=question`` or ``prompt``), where the
    run holds it; [] for any other row (each pair is listed once, agnostic − aware)."""
    block, group, method = row
    if AGNOSTIC not in _tags(method):
        return []
    head = method[:method.rindex(" [")]
    tags = _ordered(method)
    others = [(block, group, f"{head} [{', '.join(aware if t == AGNOSTIC else t for t in tags)}]") for aware in AWARE]
    return [r for r in others if r in present]


def _ordered(label: str) -> list[str]:
    """The ``key=value`` options of a label in the order it writes them."""
    return [t.strip() for t in label[label.rindex(" [") + 2:-1].split(",")]


METRICS = {"score": "Score", "answer_nll": "NLL", "kl_full": "KL full", "agree_full": "Agree"}


def paired_frame(samples: pd.DataFrame, layout: Layout, resamples: int = stats.RESAMPLES,
                 seed: int = stats.SEED, values: tuple[str, ...] = tuple(METRICS)) -> pd.DataFrame:
    """One line per (row, its base, metric): every row against its base row (:func:`base_of`), every SparK (λ)
    row against ThinK (λ) (:func:`think_of`), and every query-agnostic row against itself query-aware
    (:func:`scope_pairs`), on each of ``values`` measured in both — Δ of the mean over tasks (row − base) with its
    paired interval, and wins / ties / losses (for NLL and KL lower is better: a win is the row's larger value, as
    for the score; read Δ's sign)."""
    columns, rows = columns_of(samples, layout), rows_of(samples)
    out = []
    for value in values:
        for row in rows:
            for base in (base_of(row, set(rows)), think_of(row, set(rows)), *scope_pairs(row, set(rows))):
                if base is None:
                    continue
                xs, ys = aligned(samples, row, base, columns, value)
                keep = [k for k, (x, y) in enumerate(zip(xs, ys)) if not (np.isnan(x).any() or np.isnan(y).any())]
                if not keep:
                    continue
                p = stats.paired([xs[k] for k in keep], [ys[k] for k in keep], resamples, seed)
                out.append({"metric": value, "block": row[0], "group": row[1], "method": row[2], "base": base[2],
                            "n": p.delta.n, "delta": p.delta.estimate, "low": p.delta.low, "high": p.delta.high,
                            "wins": p.wins, "ties": p.ties, "losses": p.losses})
    return pd.DataFrame(out, columns=["metric", "block", "group", "method", "base", "n", "delta", "low", "high",
                                      "wins", "ties", "losses"])


def paired_markdown(paired: pd.DataFrame) -> str:
    """One table per metric (score first); intervals that exclude 0 in bold."""
    parts = []
    for metric, part in paired.groupby("metric", sort=False):
        digits = 2 if metric == "score" else 3
        name = METRICS.get(metric, metric)
        lines = [f"{name} ({'mean over tasks' if metric == 'score' else 'mean over tasks; ' + FIDELITY_SENSE[metric]})"
                 ":", "", f"| Block | Method | vs | n | Δ {name} (95% CI) | row > base / ties / row < base |",
                 "|---|---|---|---|---|---|"]
        for r in part.itertuples(index=False):
            label = r.method if not r.method.startswith("+") else f"{r.group} {r.method}"
            cell = f"{r.delta:+.{digits}f} [{r.low:+.{digits}f}, {r.high:+.{digits}f}]"
            if r.low > 0 or r.high < 0:
                cell = f"**{cell}**"
            lines.append(f"| {r.block or '–'} | {label} | {r.base.lstrip('+')} | {r.n} | {cell} | "
                         f"{r.wins} / {r.ties} / {r.losses} |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


FIDELITY_SENSE = {"answer_nll": "lower keeps the reference answer likelier",
                  "kl_full": "lower stays closer to the full cache",
                  "agree_full": "higher agrees more often with the full cache's next token"}


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


def position_markdown(predictions: pd.DataFrame, resamples: int = stats.RESAMPLES, seed: int = stats.SEED) -> str:
    """With several questions per context (predictions with ``question`` > 1): each config's score by the position
    of the question among its context's questions — the mean over tasks of each task's mean at that position, with
    its 95% bootstrap half-width and the number of answers — so a reader sees whether later questions, answered
    from the same compressed cache, fare differently. '' when no context has a second question."""
    if "question" not in predictions:
        return ""
    position = pd.to_numeric(predictions.question, errors="coerce")
    if not (position > 1).any():
        return ""
    frame = predictions.assign(position=position.fillna(1).astype(int))
    positions = sorted(frame.position.unique())
    lines = ["| Method | " + " | ".join(f"Q{k}" for k in positions) + " |", "|---" * (len(positions) + 1) + "|"]
    for config, mine in frame.groupby("config", sort=False):
        cells = []
        for k in positions:
            at = mine[mine.position == k]
            tasks = [g.score.to_numpy(float) for _, g in at.groupby("task", sort=False)]
            if not tasks:
                cells.append("–")
                continue
            _, mean = stats.mean_intervals(tasks, resamples, seed)
            cells.append(f"{mean.estimate:.2f} ± {mean.half_width:.2f} (n={mean.n})")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return ("Score by question position (several questions per context; under compress_scope=context every "
            "question is answered from the one cache compressed for its context, which no earlier answer changes; "
            "mean over tasks ± 95% bootstrap half-width, n answers):\n\n" + "\n".join(lines) + "\n")
