"""Per-config × per-task score tables (scores.csv, table.md), with what each config cost beside its scores."""

from __future__ import annotations

import pandas as pd

MIB = 2 ** 20
COST_NOTE = ("Prefill s: the sample's one full-cache prefill, which every config of the sample shares; Compress s: "
             "per sample, what compressing under this config alone takes (a token selection several configs share "
             "is computed once and counted in each); Decode tok/s: new tokens over this config's share of the batched decode forwards, as "
             "run; KV MiB: bytes held after compression; Peak MiB: the peak of the decode batch it ran in "
             "(CUDA: torch's max allocated; CPU: the process's resident set).")


FIDELITY = ("answer_nll", "kl_full", "agree_full")  # per-sample fidelity numbers (spark_bench.engine.fidelity)
FIDELITY_COLUMNS = {"answer_nll": "NLL", "kl_full": "KL full", "agree_full": "Agree"}
FIDELITY_NOTE = ("NLL: mean negative log-likelihood per token of the reference answer through the config's cache "
                 "(lower: the answer stays likely); KL full: mean KL(full ‖ config) of the next-token distributions "
                 "along the full cache's first 16 greedy tokens (0: the cache changes nothing); Agree: the fraction "
                 "of those positions whose most likely token is the full cache's; all teacher-forced, means over "
                 "tasks.")


def with_fidelity(predictions: pd.DataFrame) -> pd.DataFrame:
    """``predictions`` with the fidelity columns as floats (NaN where a run did not measure them)."""
    out = predictions.copy()
    for column in FIDELITY:
        out[column] = pd.to_numeric(out[column], errors="coerce") if column in out else float("nan")
    return out


def summarize(predictions: pd.DataFrame, labels: list[str], tasks: list[str]) -> pd.DataFrame:
    """Per (config, task): mean score, sample count, mean KV bytes held and their ratio to the full cache, the
    achieved key ratio, the mean fidelity numbers (``answer_nll``, ``kl_full``, ``agree_full``; NaN where not
    measured), and the cost: mean prefill and compression seconds, new tokens and decode seconds (summed, and their
    ratio ``decode_tok_s``), the largest peak memory (``peak_mem_bytes``). Missing timings stay NaN."""
    df = with_fidelity(predictions).assign(kv_ratio=predictions.kv_bytes / predictions.kv_bytes_full,
                                           new_tokens=predictions.tokens.map(len))
    for column in ("prefill_s", "compress_s", "decode_s", "peak_mem_bytes"):
        if column not in df:
            df[column] = float("nan")
    out = (df.groupby(["config", "task"], sort=False)
             .agg(score=("score", "mean"), n=("score", "size"), answer_nll=("answer_nll", "mean"),
                  kl_full=("kl_full", "mean"), agree_full=("agree_full", "mean"), kv_bytes=("kv_bytes", "mean"),
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
    """Rows: configs (sweep order); columns: tasks, ``Avg`` (mean over tasks), the fidelity means over tasks
    (:data:`FIDELITY_COLUMNS`), ``KV %`` of the full cache (measured
    bytes), ``Key ratio`` (achieved key-channel pruning ratio, the paper's "Overall Ratio"), then the cost
    (:func:`cost_table`)."""
    wide = scores.pivot(index="config", columns="task", values="score").reindex(index=labels, columns=tasks)
    wide["Avg"] = wide[tasks].mean(axis=1)
    for column, name in FIDELITY_COLUMNS.items():  # means over tasks, as Avg
        wide[name] = scores.pivot(index="config", columns="task", values=column).reindex(
            index=labels, columns=tasks).mean(axis=1)
    wide["KV %"] = scores.groupby("config").kv_ratio.mean().reindex(labels) * 100
    wide["Key ratio"] = scores.groupby("config").key_ratio.mean().reindex(labels)
    return wide.join(cost_table(scores, labels))


DIGITS = {"Prefill s": 3, "Compress s": 4, "Decode tok/s": 1, "Peak MiB": 0, "NLL": 3, "KL full": 3, "Agree": 3}


NO_FULL = ("KL full / Agree are empty: the sweep has no full config (method=full), whose greedy continuation and "
           "distributions they compare with; add {name: full} to the sweep")


def render_markdown(scores: pd.DataFrame, labels: list[str], tasks: list[str],
                    predictions: pd.DataFrame | None = None) -> str:
    """The table, :data:`COST_NOTE`, :data:`FIDELITY_NOTE`, and why a fidelity column is empty where one is. With
    the run's ``predictions``: the fidelity columns carry their 95% intervals and the table is followed by the
    paired comparisons (:func:`paired_markdown`)."""
    why = ""
    if scores.answer_nll.isna().all() and scores.kl_full.isna().all():
        why = "NLL / KL full / Agree are empty: these predictions were made before spark-bench measured them.\n"
    elif scores.kl_full.isna().all():
        why = NO_FULL + ".\n"
    wide = score_table(scores, labels, tasks)
    text = ""
    if predictions is not None:
        predictions = with_fidelity(predictions)
        for column, name in FIDELITY_COLUMNS.items():
            cells = {label: interval(per_task(predictions, label, tasks, column)) for label in labels}
            wide[name] = [_with_half_width(cells[label], DIGITS[name]) for label in labels]
        text = paired_markdown(predictions, labels, tasks)
    return _markdown(wide) + f"\n{FIDELITY_NOTE}\n" + (f"\n{why}" if why else "") + (f"\n{text}" if text else "")


def per_task(predictions: pd.DataFrame, label: str, tasks: list[str], value: str) -> list[pd.Series]:
    """A config's ``value`` per task, indexed by sample id (sorted, so two configs align by id)."""
    mine = predictions[predictions.config == label]
    return [mine[mine.task == t].set_index("id")[value].sort_index().astype(float) for t in tasks
            if (mine.task == t).any()]


def interval(tasks: list[pd.Series]):
    """The mean over tasks with its stratified 95% bootstrap interval (:mod:`spark_bench.report.stats`), or None
    where a value was not measured."""
    from spark_bench.report import stats

    if not tasks or any(t.isna().any() for t in tasks):
        return None
    return stats.mean_intervals([t.to_numpy() for t in tasks])[1]


def _with_half_width(cell, digits: int):
    return float("nan") if cell is None else f"{cell.estimate:.{digits}f} ± {cell.half_width:.{digits}f}"


def base_label(method: dict, others: dict[str, dict]) -> list[str]:
    """The configs a config is paired with: a ``+ThinK`` / ``+SparK`` config with its eviction method alone at the
    same budget (a channel method without eviction: with the full cache), and SparK (λ) with ThinK (λ) (same
    eviction, budget, λ and value ratio); other options equal (``compress_scope``, windows)."""
    eviction, _, channel = method["name"].rpartition("+") if "+" in method["name"] else ("", "", method["name"])
    if channel not in ("think", "spark"):
        return []
    same = {k: v for k, v in method.items() if k in ("compress_scope", "window_size", "budget", "kernel_size",
                                                      "pooling", "budget_rounding")}
    out = []
    for label, other in others.items():
        if eviction and other["name"] == eviction and all(other.get(k) == v for k, v in same.items()):
            out.append(label)
        elif not eviction and other["name"] == "full":
            out.append(label)
    if channel == "spark" and method.get("variant", "fixed") == "fixed" and method.get("recovery") != "none":
        think = (f"{eviction}+think" if eviction else "think")
        out += [label for label, other in others.items() if other["name"] == think
                and other.get("ratio") == method.get("ratio") and other.get("value_ratio") == method.get("value_ratio")
                and all(other.get(k) == v for k, v in same.items())]
    return out


PAIRED_VALUES = {"score": ("Δ Avg", 2), "answer_nll": ("Δ NLL", 3), "kl_full": ("Δ KL full", 3),
                 "agree_full": ("Δ Agree", 3)}


def paired_markdown(predictions: pd.DataFrame, labels: list[str], tasks: list[str]) -> str:
    """Every ``+ThinK`` / ``+SparK`` config against its base and SparK (λ) against ThinK (λ), on the same samples:
    Δ (row − base) of the score's Avg and of each fidelity number, with its paired 95% bootstrap interval
    (:func:`spark_bench.report.stats.paired`); bold where the interval excludes 0. '' when nothing pairs."""
    from spark_bench.report import stats

    methods = {label: predictions[predictions.config == label].iloc[0]["method"] for label in labels}
    lines, fewest = [], None
    for label in labels:
        for base in base_label(methods[label], {k: v for k, v in methods.items() if k != label}):
            cells, n = [], 0
            for value, (_, digits) in PAIRED_VALUES.items():
                xs, ys = per_task(predictions, label, tasks, value), per_task(predictions, base, tasks, value)
                ids = [x.index.intersection(y.index) for x, y in zip(xs, ys)]
                xs, ys = [x.loc[i] for x, i in zip(xs, ids)], [y.loc[i] for y, i in zip(ys, ids)]
                if not xs or any(x.isna().any() for x in xs + ys):
                    cells.append("–")
                    continue
                p = stats.paired([x.to_numpy() for x in xs], [y.to_numpy() for y in ys]).delta
                n, least = p.n, min(len(x) for x in xs)
                fewest = least if fewest is None else min(fewest, least)
                cell = f"{p.estimate:+.{digits}f} [{p.low:+.{digits}f}, {p.high:+.{digits}f}]"
                cells.append(f"**{cell}**" if (p.low > 0 or p.high < 0) and least >= 2 else cell)
            lines.append(f"| {label} | {base} | {n} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    head = ["Method", "vs", "n", *(name for name, _ in PAIRED_VALUES.values())]
    caution = (f" With {fewest} paired sample(s) in the smallest task these intervals are indicative (a percentile "
               f"bootstrap under-covers at few samples; spark-bench-report --claims decides only from 20 per task)"
               + ("; a task with one sample has a zero-width interval, never bold" if fewest < 2 else "") + "."
               if fewest is not None and fewest < 20 else "")
    return ("Paired on the same samples (Δ = row − the config it is compared with; 95% paired bootstrap interval, "
            f"samples resampled within each task; **bold**: the interval excludes 0).{caution}\n\n"
            + "| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|\n" + "\n".join(lines) + "\n")


def cost_markdown(predictions: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    """The cost table of any predictions (with their timings): Markdown (with :data:`COST_NOTE`) and the frame."""
    labels = list(dict.fromkeys(predictions.config))
    cost = cost_table(summarize(predictions, labels, list(dict.fromkeys(predictions.task))), labels)
    return _markdown(cost), cost


def _markdown(wide: pd.DataFrame) -> str:
    header = ["Method", *wide.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, row in wide.iterrows():
        cells = [v if isinstance(v, str) else "–" if pd.isna(v) else f"{v:.{DIGITS.get(name, 2)}f}"
                 for name, v in row.items()]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines) + f"\n\n{COST_NOTE}\n"
