"""Fig. 2c / Observation 2 (paper §4.1): the relative loss of each way of pruning channels against the full cache.

A run of ``conf/sweep/figure2c.yaml`` holds, per sample, the full cache and at λ = 0.5 / 0.8: ThinK (structured:
the same channels for every token, the query pruned to match), SparK with ``recovery=none`` (unstructured removal:
each token's top-T, the pruned entries contribute nothing), with ``recovery=constant`` (the pruned entries read as
the constant, 0.01: Observation 2's substitution) and with its recovery. Per task the relative loss is
``100 · (1 − mean(method) / mean(full))`` over the same samples, with a 95% paired bootstrap interval (samples
resampled within the task, the same draws for both rows: :mod:`spark_bench.report.stats`); ``Avg.`` is the mean of
the task losses, on the same draws. A task whose full cache scores 0 has no relative loss and is left out.

The paper's numbers (``paper_tables/figure2c.csv``, LLaMA-3.1-8B on LongBench) come from its text: 4.2% / 1.2% at
50% and 55.7% / 28.3% at 80% for structured / unstructured, and at 80% "removal" → constant 55.7 → 12.2 (SAMSum),
69.4 → 41.3 (HotpotQA), 50.0 → 24.4 (RB-P). The 55.7% appears both as structured pruning at 80% and as removal on
SAMSum, so "removal" is read as the structured row and the three tasks' numbers, SAMSum's, the first ones. The text
does not say which selection its constant fills; here it fills SparK's unstructured selection.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from spark_bench.report import stats
from spark_bench.report.frame import read_paper_csv

METHODS = ("Structured (ThinK)", "Unstructured (removal)", "Unstructured + 0.01", "Unstructured + recovery (SparK)")


def method_name(method: dict) -> str | None:
    """Fig. 2c's name of a run's method config (None: the full cache; a config outside the figure raises)."""
    name = method["name"]
    if name == "full":
        return None
    if name == "think":
        return METHODS[0]
    if name == "spark":
        return {"none": METHODS[1], "zero": METHODS[1], "constant": METHODS[2]}.get(method["recovery"], METHODS[3])
    raise ValueError(f"config {name!r} is not part of Fig. 2c (channel pruning alone: think, spark)")


def read_scores(run_dir: Path) -> pd.DataFrame:
    """Per sample and config: task, id, score, Fig. 2c method name and λ (``predictions.jsonl`` of a run)."""
    lines = (Path(run_dir) / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    if not records:
        raise ValueError(f"{run_dir}: no predictions")
    return pd.DataFrame([{"task": r["task"], "id": r["id"], "score": r["score"], "method": method_name(r["method"]),
                          "ratio": r["method"]["ratio"]} for r in records])


def loss_table(scores: pd.DataFrame, paper: pd.DataFrame | None = None, resamples: int = stats.RESAMPLES,
               seed: int = stats.SEED) -> pd.DataFrame:
    """One row per (method, λ, task) plus ``Avg.``: ``loss``, ``low``, ``high`` (%), ``n`` samples, ``full`` (the
    full cache's mean score) and the paper's ``paper`` loss where it gives one."""
    full = scores[scores.method.isna()]
    if full.empty:
        raise ValueError("Fig. 2c needs the full-cache config in the run")
    tasks = [t for t in dict.fromkeys(full.task) if full[full.task == t].score.mean() > 0]
    base = {t: full[full.task == t].set_index("id").score for t in tasks}
    idx = stats.draws([len(base[t]) for t in tasks], resamples, seed)
    rows = []
    pruned = scores[scores.method.notna()]
    for (method, ratio), group in pruned.groupby(["method", "ratio"], sort=False):
        reps, estimates = [], []
        for t, i in zip(tasks, idx):
            mine = group[group.task == t].set_index("id").score.reindex(base[t].index).to_numpy(dtype=float)
            if np.isnan(mine).any():
                raise ValueError(f"{method} λ={ratio:g}: not every {t} sample of the full cache has a score")
            ref = base[t].to_numpy(dtype=float)
            estimate = 100 * (1 - mine.mean() / ref.mean())
            with np.errstate(divide="ignore", invalid="ignore"):
                rep = 100 * (1 - mine[i].mean(axis=1) / ref[i].mean(axis=1))
            interval = stats.percentile(estimate, rep, len(ref))
            rows.append(dict(method=method, ratio=ratio, task=t, loss=estimate, low=interval.low, high=interval.high,
                             n=len(ref), full=float(ref.mean())))
            reps.append(rep)
            estimates.append(estimate)
        average = stats.percentile(float(np.mean(estimates)), np.nanmean(np.stack(reps), axis=0),
                                   sum(len(base[t]) for t in tasks))
        rows.append(dict(method=method, ratio=ratio, task="Avg.", loss=average.estimate, low=average.low,
                         high=average.high, n=average.n, full=float("nan")))
    table = pd.DataFrame(rows)
    order = {m: k for k, m in enumerate(METHODS)}
    table = table.sort_values(["ratio", "method"], key=lambda s: s.map(order) if s.name == "method" else s,
                              kind="stable").reset_index(drop=True)
    table["paper"] = float("nan")
    if paper is not None:
        for k, row in table.iterrows():
            hit = paper[(paper.block == f"λ {row.ratio:g}") & (paper.method == row.method)
                        & (paper.column == row.task)]
            if not hit.empty:
                table.loc[k, "paper"] = hit.value.iloc[0]
    return table


def paper_frame() -> pd.DataFrame:
    return read_paper_csv("figure2c")


def _count(sizes: pd.Series) -> str:
    low, high = int(sizes.min()), int(sizes.max())
    return str(low) if low == high else f"{low}–{high}"


def to_markdown(table: pd.DataFrame, paper: pd.DataFrame) -> str:
    """Ours (loss % and 95% interval, per task and λ) and then the paper's numbers as its text gives them."""
    tasks = list(dict.fromkeys(table.task))
    lines = ["| λ | Method | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
    for (ratio, method), group in table.groupby(["ratio", "method"], sort=False):
        cells = group.set_index("task").reindex(tasks)
        lines.append(f"| {ratio:g} | {method} | " + " | ".join(
            f"{r.loss:.1f} [{r.low:.1f}, {r.high:.1f}]" for r in cells.itertuples()) + " |")
    full = table[table.task != "Avg."].drop_duplicates("task").set_index("task").full
    lines += ["", "Full cache mean score per task: " + ", ".join(f"{t} {v:.1f}" for t, v in full.items())
              + f"; {_count(table.n[table.task != 'Avg.'])} samples per task. Relative loss in %, 95% paired "
              "bootstrap intervals.", "",
              "The paper (LLaMA-3.1-8B-Instruct, LongBench; §4.1's text):", "",
              "| λ | Method | Task | Loss % |", "|---|---|---|---|"]
    lines += [f"| {b.split()[-1]} | {m} | {c} | {v:g} |" for b, m, c, v in
              paper[["block", "method", "column", "value"]].itertuples(index=False)]
    return "\n".join(lines) + "\n"
