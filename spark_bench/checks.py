"""Start-up checks of :mod:`spark_bench.cli`: everything about a run that can be refused before the model or its
tokenizer loads (config names, unknown keys, option types and ranges, the device, the output place, exported
samples' token ids). Each failure is a :class:`ConfigError`: one line naming the key, what it was and what is valid,
reported with exit code 2."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from spark_bench.models import ModelConfig

_PACKAGED_CONF = Path(__file__).resolve().parent / "conf"  # a wheel install: conf/ ships as spark_bench/conf
CONF_DIR = _PACKAGED_CONF if _PACKAGED_CONF.is_dir() else _PACKAGED_CONF.parent.parent / "conf"  # a checkout
CONFIG_GROUPS = ("model", "benchmark", "method", "sweep", "experiment", "protocol")  # conf/<group>/<name>.yaml


class ConfigError(ValueError):
    """Bad user input: reported as one line, exit code 2."""


# group → config names that exist besides conf/<group>/*.yaml: a search path's files and the method names Hydra's
# ConfigStore holds for this command line (spark_bench.methods.registry.prepare_command_line)
EXTRA_CHOICES: dict[str, set[str]] = {}


PROTOCOL_KEYS = ("compress_scope", "window_size", "channel_window", "kernel_size", "pooling", "think_keep_window",
                 "pyramid_fallback", "ada_safeguard", "value_score", "value_fill", "window_q_norm",
                 "saliency_dtype", "budget_rounding", "group_fork_fill")  # what conf/protocol/*.yaml set


def protocol_options(name: str) -> dict:
    """The method options ``conf/protocol/<name>.yaml`` sets (its ``longbench.protocol``, the prompt path, belongs to
    the run's samples, which every entry of a sweep shares, so a sweep entry cannot change it)."""
    path = CONF_DIR / "protocol" / f"{name}.yaml"
    if not path.is_file():
        valid = ", ".join(sorted(p.stem for p in (CONF_DIR / "protocol").glob("*.yaml")))
        raise ValueError(f"protocol {name!r}: no such protocol config (conf/protocol/); valid: {valid}")
    return {k: v for k, v in OmegaConf.to_container(OmegaConf.load(path)).items() if k in PROTOCOL_KEYS}


def parse_shard(shard) -> tuple[int, int] | None:
    if shard in (None, ""):
        return None
    try:
        i, n = (int(x) for x in str(shard).split("/"))
    except ValueError:
        raise ConfigError(f"shard must look like i/n (e.g. shard=0/4), got {shard!r}") from None
    if not 0 <= i < n:
        raise ConfigError(f"shard={shard}: need 0 <= i < n")
    return i, n


def check_file(key: str, path) -> None:
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"{key}: {path} does not exist")


def check_options(cfg: DictConfig) -> None:
    """Every top-level key is known (``+typo=1`` is refused) and every run, benchmark, data and memory option has
    its declared type and range (:mod:`spark_bench.options`)."""
    from spark_bench.options import (
        ANALYSIS_OPTIONS, BENCHMARK_OPTIONS, LONGBENCH_OPTIONS, MEMORY_OPTIONS, MODEL_OPTIONS, RULER_OPTIONS,
        RUN_OPTIONS, check_all,
    )

    known = set(OmegaConf.load(CONF_DIR / "config.yaml")) | {"model", "benchmark", "method", "sweep", "hydra"}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}; valid top-level keys: {', '.join(sorted(known))}")
    plain = OmegaConf.to_container(cfg, resolve=True)
    try:
        check_all(plain, RUN_OPTIONS)
        for prefix, options in (("benchmark.", BENCHMARK_OPTIONS), ("longbench.", LONGBENCH_OPTIONS),
                                ("ruler.", RULER_OPTIONS), ("memory.", MEMORY_OPTIONS), ("model.", MODEL_OPTIONS),
                                ("analysis.", ANALYSIS_OPTIONS)):
            check_all(plain.get(prefix[:-1]) or {}, options, prefix)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_output(out_dir: Path) -> None:
    """The results directory can be made and written: no file in its place or above it, the nearest existing
    directory writable. Nothing is created here."""
    for place in (out_dir, *out_dir.parents):
        if place.exists():
            if not place.is_dir():
                raise ConfigError(f"output_root/run: {place} is a file, not a directory; choose another "
                                  f"output_root= or run=")
            if not os.access(place, os.W_OK | os.X_OK):
                raise ConfigError(f"output_root/run: {place} is not writable; choose another output_root=")
            return


def check_token_ids(samples, model: ModelConfig, key: str) -> None:
    """Every token id of exported samples is inside the model's vocabulary (its ``config.json`` or ``arch:``)."""
    from spark_bench.memory import Arch

    try:
        vocab = Arch.of(model).vocab_size
    except ValueError:
        return  # no shape known: the model's own embedding will say so
    for sample in samples:
        if sample.input_ids and (max(sample.input_ids) >= vocab or min(sample.input_ids) < 0):
            raise ConfigError(f"{key}: sample {sample.id} has token ids outside model {model.name}'s vocabulary "
                              f"(0 … {vocab - 1}; found {min(sample.input_ids)} … {max(sample.input_ids)}): "
                              f"exported with another tokenizer?")


def resolve_device(name, model: ModelConfig) -> str:
    """The run's device: ``auto`` → ``cuda`` when a GPU is visible, else ``cpu``; ``cuda`` / ``cuda:N`` only when
    that GPU exists. A device map (``model.device_map``) places the model itself over the GPUs (then the CPU), so
    it goes with ``device=auto`` or ``cuda``."""
    import torch

    text = str(name)
    valid = "auto, cpu, cuda, cuda:N"
    if text not in ("auto", "cpu", "cuda") and not (text.startswith("cuda:") and text[5:].isdigit()):
        raise ConfigError(f"device must be one of {valid}; got {name!r}")
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(text[5:]) if ":" in text else 0
        if index >= count:
            raise ConfigError(f"device={name}: this machine has {count} CUDA device(s); use device=auto or cpu")
        text = f"cuda:{index}"
    if model.device_map is not None and text == "cpu" and str(name) == "cpu":
        raise ConfigError("device=cpu with model.device_map set: the device map places the model; use device=auto")
    return text


def cuda_exists(name: str) -> bool:
    import torch

    return torch.cuda.is_available() and torch.device(name).index < torch.cuda.device_count()


def check_group_choices(argv: list[str]) -> None:
    """Unknown ``group=name`` overrides (``model=``, ``method=``, ``benchmark=``, ``sweep=``, ``+experiment=``,
    comma lists included) raise :class:`ConfigError` listing the valid names, before Hydra composes anything
    (Hydra itself would print a multi-line message and exit 1)."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        group = key.lstrip("+~")
        if group not in CONFIG_GROUPS or value in ("", "null") or any(c in value for c in "()[]{}$"):
            continue
        valid = sorted({p.stem for p in (CONF_DIR / group).glob("*.yaml")} | EXTRA_CHOICES.get(group, set()))
        unknown = [name for name in value.split(",") if name not in valid]
        if unknown:
            raise ConfigError(f"{group}={','.join(unknown)}: no such {group} config (conf/{group}/); "
                              f"valid: {', '.join(valid)}")


def budget_warnings(samples, configs) -> list[str]:
    """One line per token budget at or above some samples' prompts (those rows keep the whole prompt: the full
    cache, under the budget's label), with how many samples and the longest such prompt."""
    lines = []
    for budget in sorted({c.budget for c in configs if c.eviction_name is not None and c.budget >= 1}):
        covered = [len(s.input_ids) for s in samples if len(s.input_ids) <= budget]
        if covered:
            lines.append(f"budget={budget:g} is at or above the prompt of {len(covered)} of {len(samples)} samples "
                         f"(up to {max(covered)} tokens): those rows keep the whole prompt (the full cache), "
                         f"labelled @{budget:g}")
    return lines
