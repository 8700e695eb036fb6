"""Reading kvpress' evaluation format: ``spark-bench-report`` reads a kvpress evaluation output directory as a run
(:func:`read_kvpress`), so a kvpress result and a spark-bench result sit in one table; and the names and the
list-cell codec that both directions share (:mod:`spark_bench.report.kvpress_format` writes a spark-bench run in
this format with them).

What kvpress writes (NVIDIA/kvpress ``evaluation/evaluate.py``; the ``evaluation/`` folder is not in the kvpress
wheel, so this module follows its code, cited per function):

* ``EvaluationConfig.get_results_dir``: one directory per evaluation under ``output_dir``, named by joining with
  ``__`` the dataset, ``data_dir`` (RULER: the context length, ``4096``; LongBench: the task), the model with ``/``
  as ``--``, ``press_name``, ``f"{compression_ratio:.2f}"``, then ``query_aware`` and ``key_channel_cr{:.2f}``
  where they apply; an existing directory gets a numbered sub-directory (``…/1``) rather than being overwritten.
* ``EvaluationRunner._save_results``: ``predictions.csv``, the dataset's columns but ``context``, plus
  ``predicted_answer`` and ``compression_ratio``; list columns (RULER's ``answer``, LongBench's ``answers``,
  ``all_classes``) as pandas writes the numpy arrays ``datasets.to_pandas`` gives: ``['a' 'b']``.
* ``_calculate_and_save_metrics``: ``metrics.json``, the dataset's scorer on the predictions — RULER
  (``benchmarks/ruler/calculate_metrics.py``) ``{task: {"string_match": score}}``, LongBench
  (``benchmarks/longbench/calculate_metrics.py``, one task per ``data_dir``) one number; 0–100, 2 decimals.
* ``EvaluationConfig.save_config``: ``config.yaml``, the config's fields in order (``threshold`` and
  ``head_compression_ratio`` dropped when unset), ``press_init_command`` the press's ``str()``.
* ``run_evaluation``: an evaluation is done when its ``predictions.csv`` and ``metrics.json`` both exist.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
from pathlib import Path

import pandas as pd

LOG = logging.getLogger(__name__)
FILES = ("predictions.csv", "metrics.json", "config.yaml")
SIDECAR = "spark_bench.json"
# spark-bench method → kvpress' PRESS_REGISTRY name (evaluation/evaluate_registry.py), where kvpress has the method
PRESS_NAMES = {"full": "no_press", "snapkv": "snapkv", "streamingllm": "streaming_llm", "pyramidkv": "pyramidkv",
               "adasnapkv": "adakv_snapkv", "tova": "tova", "think": "think", "snapkv+think": "snap_think"}
METHODS = {press: name for name, press in PRESS_NAMES.items()}
EXTRA_COLUMNS = ("id", "score", "kv_bytes", "kv_bytes_full", "key_ratio", "answer_nll", "kl_full", "agree_full")


def array_text(values) -> str:
    """A list as kvpress' CSV holds it: ``str()`` of the numpy array ``datasets.to_pandas`` gives (``['a' 'b']``)."""
    import numpy as np

    return str(np.array(list(values), dtype=object))


def parse_array_text(text) -> list[str]:
    """The strings of a list column as kvpress' ``predictions.csv`` holds it (numpy's ``['a' 'b']``, wrapped onto
    several lines for long ones, or a Python list's ``['a', 'b']``); ``[]`` for an empty cell."""
    if not isinstance(text, str) or not text.strip():
        return []
    literals = re.findall(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", text)
    return [str(ast.literal_eval(s)) for s in literals]


def evaluations(directory) -> list[Path]:
    """The finished kvpress evaluations under ``directory`` (itself or below): the directories holding both
    ``predictions.csv`` and ``metrics.json`` (``run_evaluation``'s rule), in name order."""
    directory = Path(directory)
    return sorted(p.parent for p in directory.rglob("metrics.json") if (p.parent / "predictions.csv").is_file())


def is_kvpress(directory) -> bool:
    """Whether ``directory`` is a kvpress evaluation output (and not a spark-bench run)."""
    directory = Path(directory)
    return directory.is_dir() and not (directory / "predictions.jsonl").exists() and bool(evaluations(directory))


def _method(config: dict) -> dict:
    """A kvpress evaluation's press as a spark-bench method config (:data:`PRESS_NAMES` backwards; another press
    as ``kvpress:<press_name>``): ``budget`` ``1 - compression_ratio``, ``ratio`` the key-channel ratio."""
    from spark_bench.methods.config import MethodConfig

    press = str(config.get("press_name"))
    ratio = float(config.get("compression_ratio") or 0)
    method = {**MethodConfig().to_dict(), "name": METHODS.get(press, f"kvpress:{press}"),
              "budget": max(1 - ratio, 1e-6), "compress_scope": "question" if config.get("query_aware") else "context"}
    if config.get("key_channel_compression_ratio") is not None:
        method["ratio"] = float(config["key_channel_compression_ratio"])
    return method


def _score(dataset: str, task: str, prediction: str, answers: list[str], all_classes: list[str]) -> float:
    """One prediction scored by spark-bench's official metric of the task (the per-sample scores kvpress' scorer
    averages)."""
    from spark_bench.benchmarks.metrics import score

    if dataset.startswith("longbench"):
        from spark_bench.benchmarks.longbench import TASKS

        spec = TASKS[task.removesuffix("-e")]
        return score(spec.metric, prediction, answers, first_line=spec.first_line, all_classes=all_classes)
    return score("string_match_part" if task.startswith("qa") else "string_match_all", prediction, answers)


def read_evaluation(place: Path) -> pd.DataFrame:
    """One kvpress evaluation as spark-bench predictions (the columns :func:`spark_bench.report.frame.read_runs`
    reads): the sidecar's config label and method where spark-bench exported it, else the press's; per-sample
    scores re-scored by the task's metric (kvpress stores only the means); bytes and fidelity numbers where the
    export wrote them, else NaN (kvpress measures neither)."""
    import yaml

    for name in FILES:
        if not (place / name).is_file():
            raise ValueError(f"{place / name}: missing (a kvpress evaluation holds {', '.join(FILES)})")
    try:
        config = yaml.safe_load((place / "config.yaml").read_text(encoding="utf-8")) or {}
        metrics = json.loads((place / "metrics.json").read_text(encoding="utf-8"))
        df = pd.read_csv(place / "predictions.csv", keep_default_na=False, na_values=[""])
    except (yaml.YAMLError, json.JSONDecodeError, pd.errors.ParserError, UnicodeDecodeError) as err:
        raise ValueError(f"{place}: not a readable kvpress evaluation ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{place / 'config.yaml'}: not a mapping of EvaluationConfig's fields")
    dataset = str(config.get("dataset", ""))
    answer = "answer" if dataset == "ruler" else "answers"
    missing = [c for c in ("task", "predicted_answer", answer) if c not in df]
    if dataset not in ("ruler", "longbench", "longbench-e") or missing:
        raise ValueError(f"{place}: dataset {dataset!r}, columns missing: {', '.join(missing) or 'none'}; "
                         f"spark-bench reads kvpress' ruler and longbench evaluations")
    side = json.loads((place / SIDECAR).read_text(encoding="utf-8")) if (place / SIDECAR).is_file() else {}
    method = side.get("method") or _method(config)
    ratio = float(config.get("compression_ratio") or 0)
    label = side.get("config") or f"kvpress {config.get('press_name')} @{ratio:.2f}"
    rows = []
    for i, r in enumerate(df.to_dict("records")):
        task = str(r["task"])
        prediction = "" if pd.isna(r["predicted_answer"]) else str(r["predicted_answer"])
        answers = parse_array_text(r[answer])
        record = {"config": label, "method": method, "task": task, "prediction": prediction, "answers": answers,
                  "tokens": [], "length": r.get("length"), "kl_tokens": None,
                  "id": str(r["id"]) if "id" in r and not pd.isna(r.get("id")) else f"{task}-{i}",
                  "score": _score(dataset, task, prediction, answers, parse_array_text(r.get("all_classes")))}
        for key in EXTRA_COLUMNS[2:]:
            record[key] = float(r[key]) if key in r and not pd.isna(r[key]) else math.nan
        if math.isnan(record["key_ratio"]):
            record["key_ratio"] = float(config.get("key_channel_compression_ratio") or 0)
        rows.append(record)
    frame = pd.DataFrame(rows)
    _check_means(place, frame, metrics, dataset)
    return frame


def _check_means(place: Path, frame: pd.DataFrame, metrics, dataset: str) -> None:
    """Warn (one line) where a task's mean re-scored here differs from the evaluation's ``metrics.json``."""
    if dataset == "ruler" and isinstance(metrics, dict):
        theirs = {t: v.get("string_match") for t, v in metrics.items() if isinstance(v, dict)}
    elif isinstance(metrics, (int, float)) and frame.task.nunique() == 1:
        theirs = {frame.task.iloc[0]: metrics}
    else:
        return
    ours = frame.groupby("task").score.mean()
    differ = [f"{t} {ours[t]:.2f} (metrics.json {v})" for t, v in theirs.items()
              if t in ours and v is not None and abs(round(ours[t], 2) - float(v)) > 0.011]
    if differ:
        LOG.warning(f"warning: {place}: re-scored per sample, tasks differ from its metrics.json: {', '.join(differ)}")


def read_kvpress(directory) -> pd.DataFrame:
    """Every finished evaluation under a kvpress output directory, as one run's predictions."""
    places = evaluations(directory)
    if not places:
        raise FileNotFoundError(f"{directory}: no kvpress evaluation (predictions.csv and metrics.json) in it")
    return pd.concat([read_evaluation(p) for p in places], ignore_index=True)


def sessions(directory) -> list[dict]:
    """The provenance a kvpress output directory carries: the spark-bench sessions of an export (its sidecars),
    else none (kvpress records no software versions)."""
    found = []
    for place in evaluations(directory):
        if (place / SIDECAR).is_file():
            side = json.loads((place / SIDECAR).read_text(encoding="utf-8"))
            found += [s for s in side.get("sessions") or [] if isinstance(s, dict) and s not in found]
    return found


def describe(directory) -> str:
    """``<dir>: a kvpress evaluation output (model …; presses …; seed …)``: what its ``config.yaml`` files say."""
    import yaml

    configs = [yaml.safe_load((p / "config.yaml").read_text(encoding="utf-8")) or {}
               for p in evaluations(directory) if (p / "config.yaml").is_file()]
    values = {k: sorted({str(c.get(k)) for c in configs}) for k in ("model", "dataset", "data_dir", "press_name",
                                                                    "seed", "fp8", "device")}
    said = "; ".join(f"{k} {', '.join(v)}" for k, v in values.items() if v)
    return (f"{directory}: a kvpress evaluation output (kvpress evaluate.py's config.yaml: {said}; kvpress records no "
            "software versions, KV bytes or fidelity numbers)")


def run_setup(directory) -> dict:
    """A kvpress output's setup as :func:`spark_bench.report.setup.run_setup` gives a run's."""
    import yaml

    configs = [yaml.safe_load((p / "config.yaml").read_text(encoding="utf-8")) or {}
               for p in evaluations(directory) if (p / "config.yaml").is_file()]
    first = configs[0] if configs else {}
    dataset = first.get("dataset")
    context = int(first["data_dir"]) if dataset == "ruler" and str(first.get("data_dir", "")).isdigit() else None
    return {"model": first.get("model"), "benchmark": dataset, "context": context, "budgets": (),
            "protocol": "kvpress"}
