"""Per-config × per-task score tables (scores.csv, table.md), with what each config cost beside its scores."""

from __future__ import annotations

import numpy as np
import pandas as pd

MIB = 2 ** 20
COST_NOTE = ("Prefill s: the sample's one full-cache prefill, which every config of the sample shares; Compress s: "
             "per sample, what compressing under this config alone takes (a token selection several configs share "
             "is computed once and counted in each); Decode tok/s: new tokens over this config's share of the batched decode forwards, as "
             "run; KV MiB: bytes held after compression; Peak MiB: the peak of the decode batch it ran in "
             "(CUDA: torch's max allocated; CPU: the process's resident set). Out tok: tokens generated per answer; "
             "Stop %: the answers that ended on a stop token of their own rather than at max_new_tokens; s/answer: "
             "one answer end to end (its share of the sample's prefill, its compression and its decode); these "
             "three are means over tasks with their 95% bootstrap half-width. Fidelity s: the fidelity pass per "
             "answer (not in s/answer; – where it was skipped, fidelity=false).")


FIDELITY = ("answer_nll", "kl_full", "agree_full")  # per-sample fidelity numbers (spark_bench.engine.fidelity)
FIDELITY_COLUMNS = {"answer_nll": "NLL", "kl_full": "KL full", "agree_full": "Agree"}
FIDELITY_NOTE = ("NLL: mean negative log-likelihood per token of the reference answer through the config's cache "
                 "(lower: the answer stays likely); KL full: mean KL(full ‖ config) of the next-token distributions "
                 "along the full cache's first 16 greedy tokens (0: the cache changes nothing); Agree: the fraction "
                 "of those positions whose most likely token is the full cache's; all teacher-forced, means over "
                 "tasks.")


COST = {"out_tokens": "Out tok", "stop_pct": "Stop %", "answer_s": "s/answer"}  # per answer, with intervals
FIDELITY_SKIPPED = ("NLL / KL full / Agree are empty: the fidelity pass was skipped (fidelity=false); a rerun into "
                    "the same run directory with fidelity=true computes them")


def with_cost(predictions: pd.DataFrame) -> pd.DataFrame:
    """``predictions`` with the per-answer cost as floats: ``out_tokens`` (the stored ``new_tokens``, else the
    tokens counted), ``stop_pct`` (100 where the answer stopped on its own; NaN where a run predates the field),
    ``answer_s`` (the stored end-to-end seconds, else recomputed from the timings an older run stored: its
    prefill shared by the configs of the sample, plus its compression and decode) and ``fidelity_s`` (NaN where not
    measured)."""
    out = predictions.copy()
    counted = (out.tokens.map(lambda t: len(t) if isinstance(t, list) else float("nan")).astype(float)
               if "tokens" in out else pd.Series(float("nan"), index=out.index))
    stored = pd.to_numeric(out["new_tokens"], errors="coerce") if "new_tokens" in out else counted * float("nan")
    out["out_tokens"] = stored.fillna(counted)
    stopped = out["stopped"] if "stopped" in out else pd.Series(None, index=out.index, dtype=object)
    out["stop_pct"] = [100.0 * bool(v) if isinstance(v, (bool, np.bool_)) else float("nan") for v in stopped]
    number = {c: pd.to_numeric(out[c], errors="coerce") if c in out else counted * float("nan")
              for c in ("answer_s", "prefill_s", "compress_s", "decode_s", "fidelity_s")}
    share = number["prefill_s"] / out.groupby(["run", "id"] if "run" in out else "id").config.transform("size")
    out["answer_s"] = number["answer_s"].fillna(share + number["compress_s"] + number["decode_s"])
    out["fidelity_s"] = number["fidelity_s"]
    return out


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
    df = with_cost(with_fidelity(predictions)).assign(kv_ratio=predictions.kv_bytes / predictions.kv_bytes_full,
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
                  decode_s=("decode_s", lambda s: s.sum(min_count=1)), peak_mem_bytes=("peak_mem_bytes", "max"),
                  out_tokens=("out_tokens", "mean"), stop_pct=("stop_pct", _mean_all),
                  answer_s=("answer_s", _mean_all), fidelity_s=("fidelity_s", _mean_all))
             .reset_index())
    out["decode_tok_s"] = out.new_tokens / out.decode_s
    order = {label: i for i, label in enumerate(labels)}
    task_order = {t: i for i, t in enumerate(tasks)}
    return out.sort_values(["config", "task"], key=lambda s: s.map(order if s.name == "config" else task_order),
                           ignore_index=True)


def _mean_all(values: pd.Series) -> float:
    """The mean, NaN when any value is missing (a mean over fewer answers than the cell's ``n`` says is none)."""
    values = pd.to_numeric(values, errors="coerce")
    return float("nan") if values.isna().any() else float(values.mean())


def cost_table(scores: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """One row per config (sweep order): ``KV MiB``, ``Prefill s``, ``Compress s`` (sample-weighted means over its
    tasks), ``Decode tok/s`` (all its new tokens over all its decode seconds), ``Peak MiB`` (the largest), then per
    answer (means over tasks, as ``Avg``): ``Out tok``, ``Stop %``, ``s/answer`` and ``Fidelity s``
    (:func:`with_cost`; NaN where a task's answers lack the number)."""
    g = scores.assign(w_kv=scores.kv_bytes * scores.n, w_prefill=scores.prefill_s * scores.n,
                      w_compress=scores.compress_s * scores.n).groupby("config")
    n = g.n.sum()
    per_answer = {name: g[column].agg(lambda v: v.mean() if v.notna().all() else float("nan"))
                  for column, name in {**COST, "fidelity_s": "Fidelity s"}.items() if column in scores}
    return pd.DataFrame({
        "KV MiB": g.w_kv.sum() / n / MIB,
        "Prefill s": g.w_prefill.sum(min_count=1) / n,
        "Compress s": g.w_compress.sum(min_count=1) / n,
        "Decode tok/s": g.new_tokens.sum() / g.decode_s.sum(min_count=1),
        "Peak MiB": g.peak_mem_bytes.max() / MIB,
        **per_answer,
    }).reindex(labels)


def cost_intervals(wide: pd.DataFrame, predictions: pd.DataFrame, labels: list[str], tasks: list[str]) -> list[str]:
    """``wide``'s per-answer cost columns (:data:`COST`) as ``mean ± 95% half-width`` cells (the same mean over
    tasks, :func:`interval`), in place; the lines that say why a column is empty where one is."""
    costs = with_cost(predictions)
    for column, name in COST.items():
        if name in wide:
            cells = {label: interval(per_task(costs, label, tasks, column)) for label in labels}
            wide[name] = [_with_half_width(cells[label], DIGITS[name]) for label in labels]
    notes = []
    if costs.stop_pct.isna().any():
        notes.append("Stop % is empty where predictions were written before spark-bench recorded whether an answer "
                     "stopped on its own (a resume of the run fills it in from the tokens and max_new_tokens).")
    return notes


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


DIGITS = {"Prefill s": 3, "Compress s": 4, "Decode tok/s": 1, "Peak MiB": 0, "NLL": 3, "KL full": 3, "Agree": 3,
          "Out tok": 1, "Stop %": 1, "s/answer": 3, "Fidelity s": 3}


NO_FULL = ("KL full / Agree are empty: the sweep has no full config (method=full), whose greedy continuation and "
           "distributions they compare with; add {name: full} to the sweep")


def render_markdown(scores: pd.DataFrame, labels: list[str], tasks: list[str],
                    predictions: pd.DataFrame | None = None) -> str:
    """The table, :data:`COST_NOTE`, :data:`FIDELITY_NOTE`, and why a fidelity column is empty where one is. With
    the run's ``predictions``: the fidelity columns carry their 95% intervals and the table is followed by the
    paired comparisons (:func:`paired_markdown`)."""
    why = ""
    skipped = fidelity_skipped(predictions)
    if skipped:
        why = skipped + "\n"
    elif scores.answer_nll.isna().all() and scores.kl_full.isna().all():
        why = "NLL / KL full / Agree are empty: these predictions were made before spark-bench measured them.\n"
    elif scores.kl_full.isna().all():
        why = NO_FULL + ".\n"
    wide = score_table(scores, labels, tasks)
    text, notes = "", []
    if predictions is not None:
        notes = cost_intervals(wide, predictions, labels, tasks)
        predictions = with_fidelity(predictions)
        for column, name in FIDELITY_COLUMNS.items():
            cells = {label: interval(per_task(predictions, label, tasks, column)) for label in labels}
            wide[name] = [_with_half_width(cells[label], DIGITS[name]) for label in labels]
        text = "\n".join(t for t in (paired_markdown(predictions, labels, tasks),
                                     length_markdown(predictions, labels, tasks)) if t)
    why += "".join(f"{line}\n" for line in notes)
    return _markdown(wide) + f"\n{FIDELITY_NOTE}\n" + (f"\n{why}" if why else "") + (f"\n{text}" if text else "")


def fidelity_skipped(predictions: pd.DataFrame | None) -> str:
    """Why the fidelity columns are empty when the pass was skipped (``fidelity=false``) for some predictions
    (their ``fidelity`` field false), '' otherwise."""
    if predictions is None or "fidelity" not in predictions:
        return ""
    off = int((predictions.fidelity == False).sum())  # noqa: E712 — missing (older runs) is not False
    if not off:
        return ""
    if off == len(predictions):
        return FIDELITY_SKIPPED + "."
    return (f"{FIDELITY_SKIPPED.split(':', 1)[0]} where a task holds any of the {off} of {len(predictions)} "
            f"predictions made with the fidelity pass skipped (fidelity=false); a rerun into the same run directory "
            f"with fidelity=true computes them.")


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
    from spark_bench.methods.builtin import CHANNEL_METHODS  # every channel method, from the one list of them

    eviction, _, channel = method["name"].rpartition("+") if "+" in method["name"] else ("", "", method["name"])
    if channel not in CHANNEL_METHODS:
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


LENGTH_VALUES = {"out_tokens": ("Δ Out tok", 1), "stop_pct": ("Δ Stop %", 1)}


def length_markdown(predictions: pd.DataFrame, labels: list[str], tasks: list[str]) -> str:
    """Every config against the full cache on the same samples: Δ (row − full) of the tokens it generated per answer,
    with its paired 95% bootstrap interval, their ratio (``Out tok ×``), and Δ of its stop rate
    (:func:`spark_bench.report.stats.paired`); bold where the interval excludes 0 (the ratio: 1). '' without a
    ``full`` config. A compressed cache that makes the model talk longer or stop later shows here (Rethinking
    Key-Value Cache Compression, MLSys 2025)."""
    from spark_bench.report import stats

    costs = with_cost(predictions)
    methods = {label: costs[costs.config == label].iloc[0]["method"] for label in labels}
    fulls = [label for label in labels if methods[label].get("name") == "full"]
    if not fulls:
        return ""
    lines, fewest = [], None
    for label in labels:
        if label in fulls:
            continue
        scope = methods[label].get("compress_scope")
        base = next((f for f in fulls if methods[f].get("compress_scope") == scope), fulls[0])
        cells, n = [], 0
        for value, (_, digits) in LENGTH_VALUES.items():
            xs, ys = per_task(costs, label, tasks, value), per_task(costs, base, tasks, value)
            ids = [x.index.intersection(y.index) for x, y in zip(xs, ys)]
            xs, ys = [x.loc[i] for x, i in zip(xs, ids)], [y.loc[i] for y, i in zip(ys, ids)]
            if not xs or any(x.isna().any() for x in xs + ys) or not all(len(x) for x in xs):
                cells += ["–", "–"] if value == "out_tokens" else ["–"]
                continue
            p = stats.paired([x.to_numpy() for x in xs], [y.to_numpy() for y in ys])
            n, least = p.delta.n, min(len(x) for x in xs)
            fewest = least if fewest is None else min(fewest, least)
            for interval_, zero, fmt in ((p.delta, 0.0, f"+.{digits}f"), (p.ratio, 1.0, ".2f"))[
                    :2 if value == "out_tokens" else 1]:
                if pd.isna(interval_.estimate):
                    cells.append("–")
                    continue
                cell = f"{interval_.estimate:{fmt}} [{interval_.low:{fmt}}, {interval_.high:{fmt}}]"
                cells.append(f"**{cell}**" if (interval_.low > zero or interval_.high < zero) and least >= 2
                             else cell)
        lines.append(f"| {label} | {base} | {n} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    head = ["Method", "vs", "n", "Δ Out tok", "Out tok ×", "Δ Stop %"]
    caution = (f" With {fewest} paired sample(s) in the smallest task these intervals are indicative."
               if fewest is not None and fewest < 20 else "")
    return ("Output length against the full cache, paired on the same samples (Δ = row − full; Out tok × = the "
            "row's mean tokens per answer over the full cache's; 95% paired bootstrap interval, samples resampled "
            f"within each task; **bold**: the interval excludes 0, or 1 for the ratio).{caution}\n\n"
            + "| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|\n" + "\n".join(lines) + "\n")


def cost_markdown(predictions: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    """The cost table of any predictions (with their timings): Markdown (with :data:`COST_NOTE`; the per-answer
    columns with their intervals, then :func:`length_markdown`) and the frame (the estimates as numbers)."""
    labels = list(dict.fromkeys(predictions.config))
    tasks = list(dict.fromkeys(predictions.task))
    cost = cost_table(summarize(predictions, labels, tasks), labels)
    wide = cost.copy()
    notes = cost_intervals(wide, predictions, labels, tasks)
    if fidelity_skipped(predictions):
        notes.append("Fidelity s is empty where the fidelity pass was skipped (fidelity=false).")
    length = length_markdown(predictions, labels, tasks)
    return _markdown(wide) + "".join(f"\n{line}\n" for line in notes) + (f"\n{length}" if length else ""), cost


def _markdown(wide: pd.DataFrame) -> str:
    header = ["Method", *wide.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, row in wide.iterrows():
        cells = [v if isinstance(v, str) else "–" if pd.isna(v) else f"{v:.{DIGITS.get(name, 2)}f}"
                 for name, v in row.items()]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines) + f"\n\n{COST_NOTE}\n"
