"""kvpress' evaluation format, both ways: ``spark-bench-export-kvpress RUN --out DIR`` (also ``spark-bench-export
--format kvpress RUN --out DIR``) writes each config of a spark-bench run as kvpress' ``evaluation/evaluate.py``
writes one evaluation, so their tooling reads it (here); ``spark-bench-report`` reads a kvpress evaluation output
directory as a run (:mod:`spark_bench.report.kvpress_read`, which also says what kvpress writes, citing its code,
and holds the names and list-cell codec both directions share).

The export adds what kvpress does not record, where its tooling ignores it: per-sample columns (``id``,
``score``, ``kv_bytes``, ``kv_bytes_full``, ``key_ratio``, ``answer_nll``, ``kl_full``, ``agree_full``) after
kvpress' own, and ``spark_bench.json`` beside the three files (the config's label and method options, the source
run, its sessions' provenance: :mod:`spark_bench.provenance`). ``press_name`` is kvpress' name where kvpress has the
same method (:data:`PRESS_NAMES`), else spark-bench's (``snapkv+spark``: no press of kvpress' registry, so
kvpress' ``evaluate.py`` would not rerun it, but every file reads as theirs). ``compression_ratio`` is
``1 - budget`` for a fraction budget, 0 without eviction; a token budget has no kvpress equivalent: the mean over
samples of ``1 - budget / prompt_length`` (at least 0). ``query_aware`` is true unless ``compress_scope=context``
(kvpress ``query_aware=false`` compresses the context alone). ``question`` and ``answer_prefix`` are empty (a
prediction does not store them) and ``all_classes`` too (LongBench's classification tasks are re-scored from it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

import pandas as pd

from spark_bench.report.kvpress_read import EXTRA_COLUMNS, PRESS_NAMES, SIDECAR, array_text

LOG = logging.getLogger(__name__)
# EvaluationConfig's fields, in their order (evaluation/evaluate.py), with their defaults
CONFIG_FIELDS = {
    "dataset": "ruler", "data_dir": None, "model": "meta-llama/Meta-Llama-3.1-8B-Instruct", "device": None,
    "press_name": "knorm", "compression_ratio": 1.0, "key_channel_compression_ratio": None,
    "head_compression_ratio": None, "threshold": None, "fraction": 1.0, "max_new_tokens": None,
    "max_context_length": None, "query_aware": False, "needle_depth": None, "compression_interval": None,
    "target_size": None, "hidden_states_buffer_size": None, "output_dir": "./results", "log_level": "INFO",
    "model_kwargs": None, "press_init_command": None, "seed": 42, "fp8": False,
}
DATASETS = ("ruler", "longbench")


@dataclasses.dataclass(frozen=True)
class Source:
    """What the export needs of a run beyond its predictions."""

    dataset: str
    data_dir: str | None
    model: str
    max_new_tokens: int | None
    sessions: list
    device: str | None


def results_dir_name(config: dict) -> str:
    """kvpress' directory name of an evaluation (``EvaluationConfig.get_results_dir``, the numbering aside)."""
    components = [config["dataset"], str(config["data_dir"]) if config.get("data_dir") else "",
                  str(config["model"]).replace("/", "--"), config["press_name"], f"{config['compression_ratio']:.2f}"]
    if config.get("threshold") is not None:
        components[-1] = f"{config['threshold']:.2f}"
    elif config.get("head_compression_ratio") is not None:
        components[-1] = f"{config['head_compression_ratio']:.2f}"
    if config.get("fraction", 1.0) < 1.0:
        components.append(f"fraction{config['fraction']:.3f}")
    if config.get("max_context_length") is not None:
        components.append(f"max_context{config['max_context_length']}")
    if config.get("query_aware"):
        components.append("query_aware")
    if config.get("key_channel_compression_ratio") is not None:
        components.append(f"key_channel_cr{config['key_channel_compression_ratio']:.2f}")
    if config.get("needle_depth") is not None and config["dataset"] == "needle_in_haystack":
        components.append(f"needle_depth{config['needle_depth']}")
    return "__".join(filter(None, components))


def _source(run: Path, records: list[dict], data_dir: str | None, model: str | None) -> Source:
    """The dataset, ``data_dir``, model and generation length of a run (its manifest, else its task names)."""
    from spark_bench.benchmarks.longbench import TASKS as LONGBENCH_TASKS
    from spark_bench.benchmarks.ruler import RULER_TASKS
    from spark_bench.report.setup import sessions
    from spark_bench.results import read_manifest

    manifest = read_manifest(run / "manifest.json") if (run / "manifest.json").is_file() else {}
    payload = manifest.get("payload") if isinstance(manifest.get("payload"), dict) else {}
    bench = payload.get("benchmark") if isinstance(payload.get("benchmark"), dict) else {}
    tasks = {r["task"] for r in records}
    dataset = bench.get("name") or ("ruler" if tasks <= set(RULER_TASKS) else
                                    "longbench" if tasks <= set(LONGBENCH_TASKS) else None)
    if dataset not in DATASETS:
        raise ValueError(f"{run}: benchmark {dataset or 'of tasks ' + ', '.join(sorted(tasks))} has no kvpress "
                         f"evaluation layout here; valid: {', '.join(DATASETS)}")
    if dataset == "ruler" and data_dir is None:
        data_dir = str(bench["length"]) if bench.get("length") else None
        if data_dir is None:
            raise ValueError(f"{run}: its manifest does not say the RULER context length (kvpress' data_dir, e.g. "
                             "4096); give --data-dir")
    known = payload.get("model")
    known = known if isinstance(known, dict) else {"name": known}
    model = model or known.get("path") or known.get("name")
    if not model:
        raise ValueError(f"{run}: its manifest does not name the model; give --model (e.g. a hub id)")
    device = next((s.get("device", {}).get("name") for s in sessions(run) if isinstance(s.get("device"), dict)),
                  None)
    return Source(dataset, data_dir, str(model), bench.get("max_new_tokens"), sessions(run), device)


def _compression_ratio(method: dict, records: list[dict]) -> float:
    from spark_bench.methods.config import relevant_options

    budget = method.get("budget")
    if "budget" not in relevant_options(method) or budget is None:
        return 0.0
    if budget < 1:
        return round(1 - float(budget), 6)
    kept = [min(1.0, budget / r["prompt_length"]) for r in records if r.get("prompt_length")]
    return round(1 - sum(kept) / len(kept), 6) if kept else 0.0


def _key_channel_ratio(method: dict) -> float | None:
    """kvpress' ``key_channel_compression_ratio`` of a config: a channel method's key ratio (``ratio``; LeanK's: the
    pruned fraction its mask file holds, None where the file cannot be read), None for the full cache and eviction
    alone."""
    from spark_bench.methods.builtin import CHANNEL_METHODS  # every channel method, from the one list of them
    from spark_bench.methods.channel.leank import label_ratio

    channel = str(method.get("name", "")).rpartition("+")[2]
    if channel not in CHANNEL_METHODS:
        return None
    if channel == "leank":
        text = label_ratio(method.get("leank") or {})
        return None if text == "?" else float(text)
    return float(method.get("ratio") or 0)


def _config(source: Source, method: dict, label: str, records: list[dict], data_dir: str | None,
            out: Path) -> dict:
    """``config.yaml``'s fields for one config (``EvaluationConfig.save_config``: unset threshold and head ratio
    dropped)."""
    config = dict(CONFIG_FIELDS)
    config.update(dataset=source.dataset, data_dir=data_dir, model=source.model, device=source.device,
                  press_name=PRESS_NAMES.get(method["name"], method["name"]),
                  compression_ratio=_compression_ratio(method, records),
                  key_channel_compression_ratio=_key_channel_ratio(method),
                  max_new_tokens=source.max_new_tokens, query_aware=method.get("compress_scope") != "context",
                  output_dir=str(out), model_kwargs={}, seed=int(method.get("seed", 42) or 0),
                  press_init_command=f"spark-bench {label}: " + json.dumps(method, sort_keys=True, default=str))
    for key in ("threshold", "head_compression_ratio"):
        config.pop(key)
    return config


def _predictions(records: list[dict], config: dict, dataset: str) -> pd.DataFrame:
    answer = "answer" if dataset == "ruler" else "answers"
    rows = []
    for r in records:
        row = {"question": "", "answer_prefix": "", answer: array_text(r.get("answers") or []), "task": r["task"],
               "max_new_tokens": config["max_new_tokens"]}
        if dataset == "longbench":
            row.update(all_classes="", length=r.get("length"))
        row.update(predicted_answer=r.get("prediction", ""), compression_ratio=config["compression_ratio"])
        row.update({k: r.get(k) for k in EXTRA_COLUMNS})
        rows.append(row)
    return pd.DataFrame(rows)


def _metrics(records: list[dict], dataset: str):
    """``metrics.json``: the scorer's dict (RULER, tasks sorted as its ``groupby``) or number (LongBench)."""
    frame = pd.DataFrame(records)
    if dataset == "ruler":
        return {task: {"string_match": round(float(part.score.mean()), 2)}
                for task, part in frame.groupby("task", sort=True)}
    return round(float(frame.score.mean()), 2)


def _place(out: Path, name: str) -> Path:
    """``get_results_dir``'s place: ``out/name``, or its first free numbered sub-directory when it exists."""
    place = out / name
    if place.exists():
        i = 1
        while (place / str(i)).exists():
            i += 1
        place = place / str(i)
    return place


def export_run(run: Path, out: Path, data_dir: str | None = None, model: str | None = None) -> list[Path]:
    """Write every config of the spark-bench run ``run`` under ``out`` in kvpress' layout (one directory per config,
    per task for LongBench); the directories written. Every check first: ``ValueError`` (one line) and nothing
    written for a run that cannot be exported or a place that cannot be written."""
    import yaml

    from spark_bench.checks import check_output
    from spark_bench.results import parse_records

    run, out = Path(run), Path(out)
    path = run / "predictions.jsonl"
    if not path.is_file():
        raise ValueError(f"{run}: no predictions.jsonl (not a spark-bench results directory)")
    records = parse_records(path, path.read_bytes())
    if not records:
        raise ValueError(f"{path}: no predictions yet; nothing to export")
    source = _source(run, records, data_dir, model)
    check_output(out, "--out")
    plans = []
    for label in dict.fromkeys(r["config"] for r in records):
        mine = [r for r in records if r["config"] == label]
        groups = {source.data_dir: mine} if source.dataset == "ruler" else {
            task: [r for r in mine if r["task"] == task] for task in dict.fromkeys(r["task"] for r in mine)}
        for group_dir, part in groups.items():
            config = _config(source, part[0]["method"], label, part, group_dir, out)
            plans.append((label, part, config))
    written = []
    for label, part, config in plans:
        place = _place(out, results_dir_name(config))
        place.mkdir(parents=True, exist_ok=True)
        _predictions(part, config, source.dataset).to_csv(place / "predictions.csv", index=False)
        (place / "metrics.json").write_text(json.dumps(_metrics(part, source.dataset), indent=4), encoding="utf-8")
        with open(place / "config.yaml", "w", encoding="utf-8") as f:
            yaml.dump(config, f, default_flow_style=False, indent=2, sort_keys=False)
        side = {"config": label, "method": part[0]["method"], "run": str(run), "sessions": source.sessions}
        (place / SIDECAR).write_text(json.dumps(side, indent=1, default=str), encoding="utf-8")
        written.append(place)
    return written


# -------------------------------------------------------------------------------------------------------- command


def main(argv: list[str] | None = None, prog: str = "spark-bench-export-kvpress") -> None:
    """``spark-bench-export-kvpress RUN --out DIR``: every config of a spark-bench run in kvpress' evaluation
    layout (``predictions.csv``, ``metrics.json``, ``config.yaml`` per config), so kvpress' tooling reads it.
    ``prog``: the command in its refusals and usage (``spark-bench-export --format kvpress`` when reached that way;
    its first word names the command in log lines and internal errors)."""
    from spark_bench import logs
    from spark_bench.commandline import ArgumentParser  # a bad flag: one line, exit 2

    tool = prog.split()[0]
    with logs.last_resort(tool):
        parser = ArgumentParser(prog=prog, description=main.__doc__)
        parser.add_argument("run", type=Path, help="a spark-bench results directory")
        parser.add_argument("--out", type=Path, required=True, help="kvpress' output_dir: one directory per config")
        parser.add_argument("--data-dir", help="kvpress' data_dir where the run's manifest does not say it (RULER: "
                                               "the context length, e.g. 4096)")
        parser.add_argument("--model", help="the model as kvpress names it (a hub id); default: the run's model")
        logs.add_flags(parser)
        args = parser.parse_args(argv)
        logs.configure(args.verbosity, tool)
        try:
            written = export_run(args.run, args.out, args.data_dir, args.model)
        except (ValueError, FileNotFoundError) as err:  # ConfigError and DamagedFile are ValueErrors
            print(f"{prog}: error: {str(err).splitlines()[0]}", file=sys.stderr)
            sys.exit(2)
        LOG.info(f"{len(written)} kvpress evaluation director{'y' if len(written) == 1 else 'ies'} → {args.out}")
