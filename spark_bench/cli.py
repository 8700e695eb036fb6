"""``spark-bench``: the Hydra front end of :mod:`spark_bench.runner`."""

from __future__ import annotations

import sys
import time
from dataclasses import fields
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from spark_bench.benchmarks.export import read_samples, write_samples
from spark_bench.benchmarks.longbench import load_longbench
from spark_bench.benchmarks.ruler import load_ruler
from spark_bench.methods import MethodConfig
from spark_bench.models import ModelConfig, load_model
from spark_bench.runner import run_sweep

METHOD_OPTIONS = tuple(f.name for f in fields(MethodConfig) if f.name != "name")  # top-level config keys


class ConfigError(ValueError):
    """Bad user input: reported as one line, exit code 2."""


def method_configs(cfg: DictConfig) -> list[MethodConfig]:
    """``method=`` selects one config built from the top-level options; otherwise every ``sweep.configs``
    entry, each overriding the top-level options."""
    base = {k: cfg[k] for k in METHOD_OPTIONS}
    entries = [{"name": cfg.method.name}] if cfg.get("method") else OmegaConf.to_container(cfg.sweep.configs)
    out = []
    for i, entry in enumerate(entries):
        try:
            out.append(MethodConfig.from_dict({**base, **entry}))
        except (TypeError, ValueError) as err:
            where = "method" if cfg.get("method") else f"sweep.configs[{i}]"
            raise ConfigError(f"{where}: {err}") from None
    return out


def model_config(cfg: DictConfig) -> ModelConfig:
    try:
        return ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model: {err}") from None


def _ruler(cfg: DictConfig, lm):
    b, src = cfg.benchmark, cfg.ruler
    return load_ruler(list(b.tasks), b.length, b.num_samples, b.seed, lm, b.get("max_new_tokens"),
                      essay_file=src.essay_file, squad_file=src.squad_file, hotpotqa_file=src.hotpotqa_file)


def _longbench(cfg: DictConfig, lm):
    src = cfg.longbench
    return load_longbench(list(cfg.benchmark.tasks), lm, data_dir=src.data_dir, num_samples=cfg.benchmark.num_samples,
                          e=src.e, max_length=src.max_length, hub_path=src.hub_path, rouge_backend=src.rouge_backend)


BENCHMARKS = {"ruler": _ruler, "longbench": _longbench}


def load_samples(cfg: DictConfig, lm):
    if cfg.benchmark.get("data_file"):  # samples exported by spark-bench-export: rerun exactly
        return read_samples(cfg.benchmark.data_file)
    name = cfg.benchmark.name
    if name not in BENCHMARKS:
        raise ConfigError(f"benchmark.name={name!r} is not supported; valid: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name](cfg, lm)


def run(cfg: DictConfig, out_dir: Path) -> None:
    configs = method_configs(cfg)
    start = time.perf_counter()
    lm = load_model(model_config(cfg), cfg.device)
    try:
        samples = load_samples(cfg, lm)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True), encoding="utf-8")
    print(f"spark-bench: {lm.config.name} on {cfg.benchmark.name} ({len(samples)} samples) × "
          f"{len(configs)} method configs → {out_dir}", flush=True)
    run_sweep(lm, samples, configs, out_dir, log=lambda msg: print(msg, flush=True))
    print(f"\n{(out_dir / 'table.md').read_text()}\nwall time {time.perf_counter() - start:.0f}s; "
          f"results in {out_dir}", flush=True)


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # repository-level conf/ (editable install)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except (ConfigError, FileNotFoundError) as err:
        print(f"spark-bench: error: {err}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    _hydra_main()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _hydra_export(cfg: DictConfig) -> None:
    """Generate (or load) the benchmark's samples with the model's tokenizer and write them as JSONL."""
    try:
        lm = load_model(model_config(cfg), cfg.device)
        samples = load_samples(cfg, lm)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"spark-bench-export: error: {err}", file=sys.stderr)
        sys.exit(2)
    path = Path(cfg.get("export_path") or Path(HydraConfig.get().runtime.output_dir) / "samples.jsonl")
    write_samples(samples, path, lm.tokenizer)
    print(f"spark-bench-export: {len(samples)} samples of {cfg.benchmark.name} → {path}")


def export() -> None:
    _hydra_export()


if __name__ == "__main__":
    main()
