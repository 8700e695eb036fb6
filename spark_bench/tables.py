"""Per-config × per-task score tables (scores.csv, table.md), with what each config cost beside its scores."""

from __future__ import annotations

import pandas as pd

MIB = 2 ** 20
COST_NOTE = ("Prefill s: the sample's one full-cache prefill, which every config of the sample shares; Compress s: "
             "per sample, what compressing under this config alone takes (a token selection several configs share "
             "is computed once and counted in each); Decode tok/s: new tokens over this config's share of the batched decode forwards, as "
             "run; KV MiB: bytes held after compression; Peak MiB: the peak of the decode batch it ran in "
             "(CUDA: torch's max allocated; CPU: the process's resident set).")


def summarize(predictions: pd.DataFrame, labels: list[str], tasks: list[str]) -> pd.DataFrame:
    """Per (config, task): mean score, sample count, mean KV bytes held and their ratio to the full cache, the
    achieved key ratio, and the cost: mean prefill and compression seconds, new tokens and decode seconds (summed,
    and their ratio ``decode_tok_s``), the largest peak memory (``peak_mem_bytes``). Missing timings stay NaN."""
    df = predictions.assign(kv_ratio=predictions.kv_bytes / predictions.kv_bytes_full,
                            new_tokens=predictions.tokens.map(len))
    for column in ("prefill_s", "compress_s", "decode_s", "peak_mem_bytes"):
        if column not in df:
            df[column] = float("nan")
    out = (df.groupby(["config", "task"], sort=False)
             .agg(score=("score", "mean"), n=("score", "size"), kv_bytes=("kv_bytes", "mean"),
                  kv_bytes_full=("kv_bytes_full", "mean"), kv_ratio=("kv_ratio", "mean"),
                  key_ratio=("key_ratio", "mean"), prefill_s=("prefill_s", "mean"),
                  compress_s=("compress_s", "mean"), new_tokens=("new_tokens", "sum"),
                  decode_s=("decode_s", lambda s: s.sum(min_count=1)), peak_mem_bytes=("peak_mem_bytes", "max"))
             .reset_index())
    out["decode_tok_s"] = out.new_tokens / out.decode_s
    order = {label: i for i, label in enumerate(labels)}
    task_order = {t: i for i, t in enumerate(tasks)}
    return out.sort_values(["config", "task"], key=lambda s: s.map(order if s.name == "config" else task_order),
                           ignore_index=True)


def cost_table(scores: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """One row per config (sweep order): ``KV MiB``, ``Prefill s``, ``Compress s`` (sample-weighted means over its
    tasks), ``Decode tok/s`` (all its new tokens over all its decode seconds) and ``Peak MiB`` (the largest)."""
    g = scores.assign(w_kv=scores.kv_bytes * scores.n, w_prefill=scores.prefill_s * scores.n,
                      w_compress=scores.compress_s * scores.n).groupby("config")
    n = g.n.sum()
    return pd.DataFrame({
        "KV MiB": g.w_kv.sum() / n / MIB,
        "Prefill s": g.w_prefill.sum(min_count=1) / n,
        "Compress s": g.w_compress.sum(min_count=1) / n,
        "Decode tok/s": g.new_tokens.sum() / g.decode_s.sum(min_count=1),
        "Peak MiB": g.peak_mem_bytes.max() / MIB,
    }).reindex(labels)


def score_table(scores: pd.DataFrame, labels: list[str], tasks: list[str]) -> pd.DataFrame:
    """Rows: configs (sweep order); columns: tasks, ``Avg`` (mean over tasks), ``KV %`` of the full cache (measured
    bytes), ``Key ratio`` (achieved key-channel pruning ratio, the paper's "Overall Ratio"), then the cost
    (:func:`cost_table`)."""
    wide = scores.pivot(index="config", columns="task", values="score").reindex(index=labels, columns=tasks)
    wide["Avg"] = wide[tasks].mean(axis=1)
    wide["KV %"] = scores.groupby("config").kv_ratio.mean().reindex(labels) * 100
    wide["Key ratio"] = scores.groupby("config").key_ratio.mean().reindex(labels)
    return wide.join(cost_table(scores, labels))


DIGITS = {"Prefill s": 3, "Compress s": 4, "Decode tok/s": 1, "Peak MiB": 0}


def render_markdown(scores: pd.DataFrame, labels: list[str], tasks: list[str]) -> str:
    return _markdown(score_table(scores, labels, tasks))


def cost_markdown(predictions: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    """The cost table of any predictions (with their timings): Markdown (with :data:`COST_NOTE`) and the frame."""
    labels = list(dict.fromkeys(predictions.config))
    cost = cost_table(summarize(predictions, labels, list(dict.fromkeys(predictions.task))), labels)
    return _markdown(cost), cost


def _markdown(wide: pd.DataFrame) -> str:
    header = ["Method", *wide.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, row in wide.iterrows():
        cells = ["–" if pd.isna(v) else f"{v:.{DIGITS.get(name, 2)}f}" for name, v in row.items()]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines) + f"\n\n{COST_NOTE}\n"
