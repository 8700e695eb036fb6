"""Figures of the paper's Fig. 5 from measured runs (matplotlib, PNG).

* (a) score vs key pruning ratio λ for SparK, ThinK, unrecovered SparK (``recovery=none``), Mustafar (its key
  sparsity) and LeanK (its mask's pruned fraction), one eviction method and budget;
* (c) score vs measured KV-cache bytes, one line per method family across its ratios or budgets
  (:func:`~spark_bench.report.at_bytes.families`: ``snapkv+spark`` at λ 0.5 / 0.8 one line, ``snapkv+think``
  another, ``spark`` alone another), each point labelled with its ratio or budget and drawn with its 95% interval;
* and beside them, score vs measured decode throughput (tokens/s, batched as run) for every config, and the mean
  ``kl_full`` (how far each cache moves the model, :mod:`spark_bench.engine.fidelity`) vs KV bytes, drawn as (c).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from spark_bench.results import TIMING_FIELDS, parse_records


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Lay out, write as PNG (120 dpi) and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def load_predictions(directories) -> pd.DataFrame:
    """The runs' predictions, each with its timings (``timings.jsonl``: NaN where a run has none) and ``run`` (the
    index of its directory); a config label two runs share is told apart by what differs
    (:func:`~spark_bench.report.frame.run_tags`), so per-config tables keep both."""
    frames = []
    from spark_bench.report.kvpress_read import is_kvpress, read_kvpress

    for i, directory in enumerate(directories):
        if is_kvpress(directory):  # a kvpress evaluation output: no timings
            preds = read_kvpress(directory)
            frames.append(preds.reindex(columns=[*preds.columns, *TIMING_FIELDS]).assign(run=i))
            continue
        path = Path(directory) / "predictions.jsonl"
        preds = pd.DataFrame(parse_records(path, path.read_bytes()))
        timings = Path(directory) / "timings.jsonl"
        times = pd.DataFrame(parse_records(timings, timings.read_bytes())) if timings.exists() else pd.DataFrame()
        if not times.empty:
            times = times.drop_duplicates(["id", "config"], keep="last")  # one line per prediction (the latest)
            kept = [f for f in TIMING_FIELDS if f in times]  # runs before a field was timed lack it (warmup_s)
            preds = preds.merge(times[["id", "config", *kept]], on=["id", "config"], how="left")
        preds = preds.reindex(columns=[*preds.columns, *(f for f in TIMING_FIELDS if f not in preds)])
        frames.append(preds.assign(run=i))  # the index of the run in ``directories``
    preds = pd.concat(frames, ignore_index=True)
    from spark_bench.report.frame import run_tags, with_tags

    firsts = preds.drop_duplicates(["run", "config"])
    entries = [(run, (config,), method) for run, config, method in zip(firsts.run, firsts.config, firsts.method)]
    renamed = {(run, key[0]): with_tags(key[0], tag) for (run, key, _), tag in zip(entries, run_tags(
        entries, list(directories)))}
    preds["config"] = [renamed[run, config] for run, config in zip(preds.run, preds.config)]
    method = pd.DataFrame(list(preds.method))
    return preds.assign(name=method.name, ratio=method.ratio, recovery=method.recovery, budget=method.budget)


def _per_config(preds: pd.DataFrame) -> pd.DataFrame:
    from spark_bench.report.at_bytes import knob_ratio

    preds = preds.assign(kl_full=pd.to_numeric(preds.kl_full, errors="coerce") if "kl_full" in preds
                         else float("nan"),
                         ratio=[r if isinstance(r := knob_ratio(m), (int, float)) else float("nan")
                                for m in preds.method])  # LeanK: the pruned fraction of its mask file
    task_means = preds.groupby(["config", "task"], sort=False).agg(
        score=("score", "mean"), kl_full=("kl_full", "mean"), name=("name", "first"), ratio=("ratio", "first"),
        recovery=("recovery", "first"),
        budget=("budget", "first"), kv_bytes=("kv_bytes", "mean"), new_tokens=("tokens", lambda t: t.map(len).sum()),
        decode_s=("decode_s", "sum"))
    return task_means.groupby("config", sort=False).agg(
        score=("score", "mean"), kl_full=("kl_full", "mean"), name=("name", "first"), ratio=("ratio", "first"), recovery=("recovery", "first"),
        budget=("budget", "first"), kv_mib=("kv_bytes", lambda b: b.mean() / 2 ** 20),
        new_tokens=("new_tokens", "sum"), decode_s=("decode_s", "sum")).reset_index().assign(
            tok_s=lambda f: f.new_tokens / f.decode_s)


def figure_ratio(preds: pd.DataFrame, path: Path, eviction: str = "snapkv") -> Path:
    plt = pyplot()
    rows = _per_config(preds)
    pruned = rows[rows.name.str.startswith(f"{eviction}+")]
    budget = pruned.budget.mode().iloc[0] if len(pruned) else rows.budget.iloc[0]  # the budget of the λ sweep
    rows = rows[rows.budget == budget]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    base = rows[rows.name == eviction]
    series = {"SparK": (rows.name == f"{eviction}+spark") & (rows.recovery == "degenerate"),
              "ThinK": rows.name == f"{eviction}+think",
              "unrecovered": (rows.name == f"{eviction}+spark") & (rows.recovery == "none"),
              "Mustafar": rows.name == f"{eviction}+mustafar", "LeanK": rows.name == f"{eviction}+leank"}
    for label, mask in series.items():
        part = pd.concat([base.assign(ratio=0.0), rows[mask]]).sort_values("ratio")
        if len(part) > 1:
            ax.plot(part.ratio, part.score, marker="o", label=label)
    ax.set_xlabel("key pruning ratio λ")
    ax.set_ylabel("average score")
    ax.set_title(f"Score vs pruning ratio ({eviction}, budget {budget:g})")
    ax.legend()
    return save(fig, path)


FAMILIES = ("full / eviction only", "ThinK", "SparK", "SparK, no recovery", "Mustafar", "LeanK")


def family(name: str, recovery) -> str:
    """The scatter family of a method config: its channel method (``snapkv+spark``, ``spark`` → SparK; SparK with
    ``recovery=none`` apart), or none (the full cache and eviction alone)."""
    channel = name.rpartition("+")[2]
    if channel == "think":
        return "ThinK"
    if channel == "spark":
        return "SparK, no recovery" if recovery == "none" else "SparK"
    return {"mustafar": "Mustafar", "leank": "LeanK"}.get(channel, "full / eviction only")


def _scatter(preds: pd.DataFrame, path: Path, x: str, xlabel: str, title: str, y: str = "score",
             ylabel: str = "average score") -> Path:
    """``y`` (the average score) against ``x`` per config, every config, one colour per :func:`family`."""
    plt = pyplot()
    rows = _per_config(preds)
    families = [family(n, r) for n, r in zip(rows.name, rows.recovery)]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label in FAMILIES:
        part = rows[[f == label for f in families]]
        if len(part):
            ax.scatter(part[x], part[y], label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return save(fig, path)


def _family_lines(preds: pd.DataFrame, path: Path, metric: str, ylabel: str, title: str) -> Path:
    """``metric`` (mean over tasks, 95% interval as error bars) against the measured byte fraction, one line per
    method family (:func:`~spark_bench.report.at_bytes.points`), each point labelled with its ratio or budget;
    configs without measured bytes or without the metric are left out."""
    from spark_bench.report.at_bytes import points

    plt = pyplot()
    pts = points(preds).dropna(subset=["fraction", metric])
    fig, ax = plt.subplots(figsize=(6, 4))
    for family_, curve in pts.groupby("family", sort=False):
        curve = curve.sort_values("fraction")
        x = 100 * curve.fraction.to_numpy(float)
        y = curve[metric].to_numpy(float)
        err = [y - curve[f"{metric}_low"].to_numpy(float), curve[f"{metric}_high"].to_numpy(float) - y]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=family_)
        for xi, yi, text in zip(x, y, curve.point):
            ax.annotate(text, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("KV cache held after compression (% of the full cache's bytes, measured)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(pts):
        ax.legend(fontsize=7)
    return save(fig, path)


def figure_bytes(preds: pd.DataFrame, path: Path) -> Path:
    """Fig. 5c: the average score against the bytes held, one line per method family, points labelled, 95%
    intervals."""
    return _family_lines(preds, path, "score", "average score (95% interval)", "Score vs KV-cache bytes")


def figure_throughput(preds: pd.DataFrame, path: Path) -> Path:
    return _scatter(preds, path, "tok_s", "decode throughput (tokens/s per config, batched as run)",
                    "Score vs decode throughput")


def figure_kl_bytes(preds: pd.DataFrame, path: Path) -> Path:
    """How far each cache moves the model against what it holds: mean ``kl_full`` (over tasks, 95% interval) vs
    the bytes held, one line per method family (the full cache at KL 0)."""
    return _family_lines(preds, path, "kl_full", "mean KL(full ‖ config), nats / token (95% interval)",
                         "KL to the full cache vs KV-cache bytes")
