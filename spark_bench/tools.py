"""The command-line tools beside ``spark-bench``: ``spark-bench-export`` (write a benchmark's samples; with
``--format kvpress``, a run in kvpress' evaluation layout),
``spark-bench-memory`` (the memory planner) and ``spark-bench-merge`` (join shards). They share ``spark-bench``'s
configs and start-up checks (:mod:`spark_bench.cli`)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from spark_bench.checks import CONF_DIR, ConfigError, check_output
from spark_bench.cli import (
    benchmark_tasks, checked, fail, load_samples, memory_prediction, output_dir, quiet_placement, validate,
)
from spark_bench import logs
from spark_bench.models import load_model

LOG = logging.getLogger(__name__)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _hydra_export(cfg: DictConfig) -> None:
    with logs.last_resort("spark-bench-export"):  # inside the task: @hydra.main catches exceptions itself
        _export(cfg)


def _export(cfg: DictConfig) -> None:
    """Generate (or load) the benchmark's samples with the model's tokenizer and write them as JSONL."""
    from spark_bench.benchmarks.export import write_samples

    path = Path(cfg.get("export_path") or output_dir(cfg) / "samples.jsonl")
    try:
        model_cfg, _ = validate(cfg)
        check_output(path.parent, "export_path")  # before the model loads: a place that cannot be written is one line
        lm = load_model(model_cfg, cfg.device)
        samples = load_samples(cfg, lm)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        fail("spark-bench-export", cfg, err)
    try:
        write_samples(samples, path, lm.tokenizer)
    except OSError as err:  # no such place, not writable, the disk fills: one line, as every start-up refusal
        fail("spark-bench-export", cfg, ConfigError(f"export_path: writing {err.filename or path} failed: "
                                                    f"{err.strerror or err}; choose another export_path="))
    LOG.info(f"{len(samples)} samples of {cfg.benchmark.name} → {path}")


EXPORT_FORMATS = ("kvpress",)  # spark-bench-export --format <format> RUN …: a run written in another tool's layout


def export() -> None:
    """``spark-bench-export [key=value …]``: a benchmark's samples (Hydra, as ``spark-bench``). With ``--format
    kvpress`` (``--format=kvpress``) anywhere on the command line, the rest is ``spark-bench-export-kvpress``'s
    (``RUN --out DIR [--data-dir N] [--model ID]``: :func:`spark_bench.report.kvpress_format.main`), taken off
    before Hydra sees it; another format is one line naming the valid ones, exit 2."""
    argv = sys.argv[1:]
    at = next((i for i, a in enumerate(argv) if a == "--format" or a.startswith("--format=")), None)
    if at is None:
        checked("spark-bench-export", _hydra_export)
        return
    given = argv[at].partition("=")[2] if "=" in argv[at] else (argv[at + 1] if at + 1 < len(argv) else "")
    rest = argv[:at] + argv[at + (1 if "=" in argv[at] else 2):]
    if given not in EXPORT_FORMATS:
        print(f"spark-bench-export: error: --format {given!r}: "
              f"{'no such export format' if given else 'needs a value'}; valid: {', '.join(EXPORT_FORMATS)} "
              "(or no --format: the benchmark's samples, from key=value overrides)", file=sys.stderr)
        sys.exit(2)
    from spark_bench.report.kvpress_format import main as kvpress_main

    kvpress_main(rest, prog="spark-bench-export --format kvpress")


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _hydra_memory(cfg: DictConfig) -> None:
    with logs.last_resort("spark-bench-memory"):  # inside the task: @hydra.main catches exceptions itself
        _memory(cfg)


def _memory(cfg: DictConfig) -> None:
    """Per method config: KV bytes per sequence and the largest batch under ``memory.cap_gib``; then the run's
    predicted peak per device, as ``spark-bench`` predicts it before loading the model (no model load)."""
    import dataclasses

    from spark_bench import memory as planner
    from spark_bench.plan import run_bounds

    try:
        model, configs = validate(cfg, sources=False)
        mem = cfg.memory
        tasks = [] if cfg.benchmark.get("data_file") else benchmark_tasks(cfg)
        prompt, _ = run_bounds(cfg, model, tasks, {c.compress_scope for c in configs})
        seq_len = mem.seq_len or prompt
        if mem.get("out"):
            check_output(Path(mem.out).parent, "memory.out")
        with quiet_placement():
            plans = [planner.plan(c, model, seq_len, mem.gen_len, mem.cap_gib, mem.overhead_gib) for c in configs]
        prediction = memory_prediction(cfg, model, configs)
    except (ConfigError, ValueError, OSError) as err:
        fail("spark-bench-memory", cfg, err)
    print(planner.render(plans, model, seq_len, mem.gen_len, mem.cap_gib))
    print("\n" + "\n".join(prediction.lines()))
    if mem.get("out"):
        Path(mem.out).parent.mkdir(parents=True, exist_ok=True)
        Path(mem.out).write_text(json.dumps({"model": model.name, "seq_len": seq_len, "gen_len": mem.gen_len,
                                             "cap_gib": mem.cap_gib, "plans": [dataclasses.asdict(p) for p in plans],
                                             "run": dataclasses.asdict(prediction)}, indent=1), encoding="utf-8")


def memory() -> None:
    checked("spark-bench-memory", _hydra_memory)


@logs.last_resort("spark-bench-merge")
def merge(argv: list[str] | None = None) -> None:
    """``spark-bench-merge DIR``: join ``DIR/shard-*-of-n`` into ``DIR`` (predictions, scores, table)."""
    from spark_bench.shards import merge_shards

    from spark_bench.commandline import ArgumentParser  # a bad flag: one line, exit 2

    parser = ArgumentParser(prog="spark-bench-merge", description=merge.__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--allow-mixed", action="store_true",
                        help="merge shards that different spark-bench versions computed (refused otherwise)")
    logs.add_flags(parser)
    args = parser.parse_args(argv)
    logs.configure(args.verbosity, "spark-bench-merge")
    try:
        n = merge_shards(args.directory, allow_mixed=args.allow_mixed)
    except (ValueError, FileNotFoundError) as err:
        print(f"spark-bench-merge: error: {err}", file=sys.stderr)
        sys.exit(2)
    LOG.info(f"{n} shards → {args.directory}")
    if args.verbosity > logs.QUIET:
        print((args.directory / "table.md").read_text())
