"""``spark-bench-leank``: learn a LeanK mask for any supported model (:mod:`spark_bench.leank.train`).

It takes the command line of ``spark-bench`` — the model, the benchmark whose samples calibrate (RULER's generators
by default, LongBench, or ``benchmark.data_file``) — plus the ``leank_train.*`` keys, e.g.::

    spark-bench-leank model=smollm2-135m benchmark.tasks=[niah_single_1,niah_multikey_1] benchmark.num_samples=4 \\
        benchmark.length=1024 leank_train.ratio=0.7 leank_train.align=16 leank_train.stage1_steps=40 \\
        leank_train.stage2_steps=10 leank_train.recent=256 leank_train.sink=16 leank_train.out=results/leank

Everything is checked before the model loads (the run's keys, the training's against the model's shape, the output
place, a checkpoint there made with other settings), each problem one line, exit 2. It writes ``mask.json`` (run it
with ``method=leank leank.mask=<out>/mask.json``), ``train_log.json`` and ``checkpoint.pt`` into ``leank_train.out``
(null: ``results/<run>/leank``); a rerun with the same command resumes from the checkpoint. Masks at several ratios
share one stage 1 (it reads no ratio): ``leank_train.stage1=<out of a finished run>`` (its directory or its
``checkpoint.pt``) starts stage 2 from that run's stage-1 scales, e.g. ``leank_train.ratio=0.8
leank_train.stage1=results/leank leank_train.out=results/leank_0.8``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from spark_bench import logs
from spark_bench.checks import CONF_DIR, ConfigError, check_output, resolve_device
from spark_bench.cli import checked, fail, load_samples, output_dir, validate
from spark_bench.models import load_model

LOG = logging.getLogger(__name__)
TOOL = "spark-bench-leank"


def settings_of(cfg: DictConfig, model) -> tuple:
    """The ``leank_train.*`` keys checked (types and ranges: :data:`spark_bench.options.LEANK_TRAIN_OPTIONS`; the
    alignment against the model's head_dim) and the output directory; (settings, out, cache_teacher)."""
    from spark_bench.leank.train import Settings
    from spark_bench.memory import Arch
    from spark_bench.options import LEANK_TRAIN_OPTIONS, check_all

    values = OmegaConf.to_container(cfg.get("leank_train") or OmegaConf.create({}), resolve=True)
    unknown = sorted(set(values) - set(LEANK_TRAIN_OPTIONS))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join('leank_train.' + k for k in unknown)}; valid: "
                          f"{', '.join('leank_train.' + k for k in LEANK_TRAIN_OPTIONS)}")
    try:
        check_all(values, LEANK_TRAIN_OPTIONS, "leank_train.")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    settings = Settings.from_mapping(values)
    try:
        d = Arch.of(model).head_dim
    except ValueError:
        d = None
    if d is not None and (settings.align > d or d % settings.align):
        divisors = [a for a in range(1, d + 1) if d % a == 0]
        raise ConfigError(f"leank_train.align={settings.align}: kept channels per head are multiples of it, so it "
                          f"divides model {model.name}'s head_dim {d}: one of {', '.join(map(str, divisors))} "
                          "(LeanK: 32)")
    out = Path(values["out"]) if values.get("out") else output_dir(cfg) / "leank"
    stage1 = values.get("stage1")
    if stage1:
        stage1 = Path(stage1) / "checkpoint.pt" if Path(stage1).is_dir() else Path(stage1)
        if not stage1.is_file():
            raise ConfigError(f"leank_train.stage1: {stage1} is not a file; give the leank_train.out of a run whose "
                              "stage 1 finished (its directory or its checkpoint.pt)")
    return settings, out, bool(values.get("cache_teacher", True)), stage1


def prepare(cfg: DictConfig):
    """Everything checked before the model loads: the run's keys, model and data sources, the training's keys,
    the output place and a checkpoint there, the stage 1 to start from. Returns (model config, device, settings,
    out, cache_teacher, stage1 checkpoint or None)."""
    model_cfg, _ = validate(cfg)
    settings, out, cache_teacher, stage1 = settings_of(cfg, model_cfg)
    check_output(out, "leank_train.out")
    checkpoint = out / "checkpoint.pt"
    if checkpoint.is_file():
        _check_checkpoint(checkpoint, settings)
    if stage1 is not None:
        _check_checkpoint(stage1, settings, stage1=True)
    device = resolve_device(cfg.get("device", "auto"), model_cfg)
    return model_cfg, device, settings, out, cache_teacher, stage1


def _check_checkpoint(path: Path, settings, stage1: bool = False) -> None:
    """A checkpoint in the output place was made with these settings (it is resumed), else one line; with ``stage1``,
    the checkpoint stage 2 starts from has finished a stage 1 made with these stage-1 settings."""
    from dataclasses import asdict

    from spark_bench.leank.train import load_checkpoint, stage1_refusal

    try:
        state = load_checkpoint(path)
        theirs = json.loads(state["fingerprint"])["settings"]
    except Exception as err:  # noqa: BLE001 — a damaged or foreign file
        key = "leank_train.stage1" if stage1 else "leank_train.out"
        raise ConfigError(f"{key}: {path} is not a readable spark-bench-leank checkpoint "
                          f"({type(err).__name__}); remove it or choose another {key}") from None
    if stage1:  # the samples and the model's shape are compared once they are loaded (Trainer.start_from)
        refusal = stage1_refusal(path, state, {"settings": asdict(settings)})
        if refusal:
            raise ConfigError(refusal)
        return
    differ = [f"{k}={theirs.get(k)!r}" for k, v in asdict(settings).items() if theirs.get(k) != v]
    if differ:
        raise ConfigError(f"leank_train.out: {path} was made with {', '.join(differ)}; rerun with those to resume, "
                          "or choose another leank_train.out")


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _hydra_leank(cfg: DictConfig) -> None:
    with logs.last_resort(TOOL):  # inside the task: @hydra.main catches exceptions itself
        _leank(cfg)


def _leank(cfg: DictConfig) -> None:
    from spark_bench.leank.train import Trainer, examples_of

    try:
        model_cfg, device, settings, out, cache_teacher, stage1 = prepare(cfg)
        lm = load_model(model_cfg, device)
        examples = examples_of(load_samples(cfg, lm), lm.tokenizer)
        progress = bool(cfg.get("progress", True)) and sys.stderr.isatty()
        trainer = Trainer(lm.model, examples, settings, out, model_cfg.name, progress, cache_teacher, LOG.info)
        resumed = trainer.resume()
        if stage1 is not None and not resumed:
            trainer.start_from(stage1)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        fail(TOOL, cfg, err)
    LOG.info(f"{model_cfg.name}: {len(examples)} calibration samples of {cfg.benchmark.name}, "
             f"{settings.stage1_steps} + {settings.stage2_steps} steps → {out}"
             + (f" (resumed at stage {trainer.stage}, step {trainer.step})" if resumed else
                f" (stage 2 from the stage 1 of {stage1})" if stage1 is not None else ""))
    mask = trainer.run()
    LOG.info(f"mask: ratio {mask.ratio:.4f} (target {settings.ratio:g}, align {settings.align}) → {out / 'mask.json'}")


def main() -> None:
    checked(TOOL, _hydra_leank)


if __name__ == "__main__":
    main()
