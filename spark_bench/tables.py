"""Per-config × per-task score tables (scores.csv, table.md)."""

from __future__ import annotations

import pandas as pd


def summarize(predictions: pd.DataFrame, labels: list[str], tasks: list[str]) -> pd.DataFrame:
    """Mean score per (config, task), sample counts and mean KV bytes held relative to the full cache."""
    df = predictions.assign(kv_ratio=predictions.kv_bytes / predictions.kv_bytes_full)
    out = (df.groupby(["config", "task"], sort=False)
             .agg(score=("score", "mean"), n=("score", "size"), kv_bytes=("kv_bytes", "mean"),
                  kv_bytes_full=("kv_bytes_full", "mean"), kv_ratio=("kv_ratio", "mean"),
                  key_ratio=("key_ratio", "mean"))
             .reset_index())
    order = {label: i for i, label in enumerate(labels)}
    task_order = {t: i for i, t in enumerate(tasks)}
    return out.sort_values(["config", "task"], key=lambda s: s.map(order if s.name == "config" else task_order),
                           ignore_index=True)


def score_table(scores: pd.DataFrame, labels: list[str], tasks: list[str]) -> pd.DataFrame:
    """Rows: configs (sweep order); columns: tasks, ``Avg`` (mean over tasks), ``KV %`` of the full cache (measured
    bytes), ``Key ratio`` (achieved key-channel pruning ratio, the paper's "Overall Ratio")."""
    wide = scores.pivot(index="config", columns="task", values="score").reindex(index=labels, columns=tasks)
    wide["Avg"] = wide[tasks].mean(axis=1)
    wide["KV %"] = scores.groupby("config").kv_ratio.mean().reindex(labels) * 100
    wide["Key ratio"] = scores.groupby("config").key_ratio.mean().reindex(labels)
    return wide


def render_markdown(scores: pd.DataFrame, labels: list[str], tasks: list[str]) -> str:
    wide = score_table(scores, labels, tasks)
    header = ["Method", *wide.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, row in wide.iterrows():
        lines.append("| " + " | ".join([label, *(f"{v:.2f}" for v in row)]) + " |")
    return "\n".join(lines) + "\n"
