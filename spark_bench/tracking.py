"""Experiment tracking: ``tracking=wandb`` or ``tracking=mlflow`` logs each finished run (``none``, the default,
logs nothing). Optional extras: ``pip install 'spark-bench[wandb]'`` / ``'spark-bench[mlflow]'``.

A run logs its resolved config (parameters), per config its per-task and average scores, KV bytes and ratio, the
prefill / compression seconds, decode tokens/s, peak memory and the fidelity numbers (``answer_nll``, ``kl_full``,
``agree_full``) (metrics, ``<metric>/<config label>``), the
planner's predicted peak, and ``table.md`` / ``scores.csv`` as artifacts. Every job of a Hydra multirun is one
tracked run, grouped by the run name (W&B: ``group``; MLflow: the experiment), named by its output directory.

Where they go: W&B's own settings (``WANDB_PROJECT``, ``WANDB_MODE=offline``, ``WANDB_DIR``; project
``spark-bench`` by default); MLflow's tracking URI (``MLFLOW_TRACKING_URI``, e.g. a server or ``sqlite:///…``, else
MLflow's local file store under ``<output_root>/mlruns``). The library is checked before the model loads
(:func:`check`).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
from pathlib import Path

import pandas as pd

LOG = logging.getLogger(__name__)


def check(kind: str) -> str | None:
    """Why ``tracking=kind`` (one of the values :data:`spark_bench.options.RUN_OPTIONS` declares, each tracker's
    package named as the tracker) cannot run here (None: it can): its library is not installed."""
    if kind == "none" or importlib.util.find_spec(kind) is not None:
        return None
    return f"tracking={kind}: the {kind} package is not installed (pip install 'spark-bench[{kind}]')"


def _name(text: str) -> str:
    """A metric-name-safe config label (MLflow allows letters, digits, ``_ - . / :`` and spaces)."""
    return re.sub(r"[^\w\-. /:]", "_", text)


def metrics(scores: pd.DataFrame, predicted_peak: int | None = None) -> dict[str, float]:
    """The numbers a run logs, from its ``scores.csv``: ``score/<config>/<task>``, ``avg/<config>`` and the cost
    per config (``kv_bytes``, ``kv_ratio``, ``prefill_s``, ``compress_s``, ``decode_tok_s``, ``peak_mem_bytes``), the
    fidelity numbers per config (``answer_nll``, ``kl_full``, ``agree_full``: means over tasks);
    ``predicted_peak_bytes`` of the plan. NaN (no timing) is left out."""
    from spark_bench.tables import FIDELITY, cost_table

    out: dict[str, float] = {}
    labels = list(dict.fromkeys(scores.config))
    for row in scores.itertuples():
        out[f"score/{_name(row.config)}/{row.task}"] = float(row.score)
    cost = cost_table(scores, labels)
    for config, part in scores.groupby("config", sort=False):
        c = _name(config)
        out[f"avg/{c}"] = float(part.score.mean())
        out[f"kv_ratio/{c}"] = float(part.kv_ratio.mean())
        out[f"kv_bytes/{c}"] = float(cost.loc[config, "KV MiB"] * 2 ** 20)
        out[f"prefill_s/{c}"] = float(cost.loc[config, "Prefill s"])
        out[f"compress_s/{c}"] = float(cost.loc[config, "Compress s"])
        out[f"decode_tok_s/{c}"] = float(cost.loc[config, "Decode tok/s"])
        out[f"peak_mem_bytes/{c}"] = float(cost.loc[config, "Peak MiB"] * 2 ** 20)
        for field in FIDELITY:  # means over tasks, as avg (runs before they were measured have no column)
            if field in part:
                out[f"{field}/{c}"] = float(part[field].mean())
    if predicted_peak:
        out["predicted_peak_bytes"] = float(predicted_peak)
    return {k: v for k, v in out.items() if not math.isnan(v)}


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def log_run(kind: str, config: dict, out_dir: Path, root: Path, group: str, predicted_peak: int | None = None) -> None:
    """Log the finished run in ``out_dir`` (its ``scores.csv``, ``table.md``) to ``kind``'s tracker, as
    ``<out_dir relative to root>`` in group ``group``."""
    if kind == "none":
        return
    out_dir, root = Path(out_dir), Path(root)
    values = metrics(pd.read_csv(out_dir / "scores.csv"), predicted_peak)
    artifacts = [out_dir / "table.md", out_dir / "scores.csv"]
    name = out_dir.resolve().relative_to(root.resolve()).as_posix()
    if kind == "mlflow":
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # MLflow's local file store (its maintenance-mode backend, which MLflow 3 asks to allow)
            uri = (root.resolve() / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(group)
        with mlflow.start_run(run_name=name):
            mlflow.log_params(_flat(config))
            mlflow.log_metrics(values)
            for path in artifacts:
                mlflow.log_artifact(str(path))
    else:
        import wandb

        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "spark-bench"), group=group, name=name,
                         config=config, dir=str(out_dir))
        run.log(values)
        run.summary.update(values)
        artifact = wandb.Artifact(re.sub(r"[^\w\-.]", "_", name), type="report")
        for path in artifacts:
            artifact.add_file(str(path))
        run.log_artifact(artifact)
        run.finish()
    LOG.info(f"tracking: {kind} logged {len(values)} metrics for {name}")
