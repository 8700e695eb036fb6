"""Start-up checks of :mod:`spark_bench.cli`: everything about a run that can be refused before the model or its
tokenizer loads (config names, unknown keys, option types and ranges, the device, the output place, exported
samples' token ids). Each failure is a :class:`ConfigError`: one line naming the key, what it was and what is valid,
reported with exit code 2."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from spark_bench.models import ModelConfig

_PACKAGED_CONF = Path(__file__).resolve().parent / "conf"  # a wheel install: conf/ ships as spark_bench/conf
CONF_DIR = _PACKAGED_CONF if _PACKAGED_CONF.is_dir() else _PACKAGED_CONF.parent.parent / "conf"  # a checkout
CONFIG_GROUPS = ("model", "benchmark", "method", "sweep", "experiment", "protocol")  # conf/<group>/<name>.yaml


class ConfigError(ValueError):
    """Bad user input: reported as one line, exit code 2."""


# keys that change how a run goes, not what it computes: left out of the default run name's hash, so a rerun that
# changes only them (a smaller decode batch after running out of memory, another device, progress off) resumes
OPERATIONAL_KEYS = ("run", "output_root", "dry_run", "progress", "wait_lock", "repair", "hub_timeout_s", "tracking",
                    "export_path", "decode_batch", "decode_samples", "decode_stack", "decode_graph", "device", "shard",
                    "memory", "analysis", "leank_train", "hydra", "fidelity")  # fidelity=false: the same study, measured less


def config_hash(*, _root_: DictConfig) -> str:
    """The default run name's suffix (``run: ${model.name}_${benchmark.name}_${config_hash:}``): 8 hex digits of
    SHA-256 over the resolved configuration without :data:`OPERATIONAL_KEYS` (and without the sweep when ``method=``
    chooses one config), so different configurations never share a default results directory and the same one
    resumes in its own."""
    import hashlib
    import json

    skip = set(OPERATIONAL_KEYS) | ({"sweep"} if _root_.get("method") else set())
    values = {str(k): OmegaConf.to_container(_root_._get_node(k), resolve=True)
              if isinstance(_root_._get_node(k), DictConfig | ListConfig) else _root_[k]
              for k in _root_.keys() if str(k) not in skip}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:8]


if not OmegaConf.has_resolver("config_hash"):
    OmegaConf.register_new_resolver("config_hash", config_hash)


def check_inside(key: str, value, root) -> None:
    """A path made from user input (``run=``, a sweep entry's protocol name) names a place strictly inside
    ``root``: not empty, relative, no ``..`` part, and not ``root`` itself (``.``, ``./.``, ``a/..``)."""
    text = str(value)
    problem = name_problem(text)
    if problem:
        shown = repr(text if len(text) <= 60 else text[:59] + "…")
        raise ConfigError(f"{key}={shown}: {problem}")
    path = Path(text)
    if not text.strip() or path.is_absolute() or ".." in path.parts or not path.parts:
        name = path.name if path.name not in ("", "..", ".") else "my_run"
        raise ConfigError(f"{key}={value}: must stay inside {root} (a relative name of a directory below it: not "
                          f"empty, not '.', without '..'); e.g. {key}={name}")


NAME_MAX = 255  # bytes in one file or directory name (ext4, xfs, btrfs, tmpfs, NFS)


def name_problem(text: str) -> str | None:
    """What makes ``text`` unusable as a path the run creates, in words (None: nothing): a control character (a
    newline, a tab, NUL: a directory no listing or table shows right, or none at all) or a part longer than a
    directory name can be."""
    bad = next((c for c in text if not c.isprintable() and c != " "), None)
    if bad is not None:
        return f"holds the control character {bad!r}; a directory name is printable text"
    long = next((part for part in Path(text).parts if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX), None)
    if long is not None:
        return (f"has a part {len(long.encode('utf-8', 'surrogateescape'))} bytes long; a directory name holds at "
                f"most {NAME_MAX}")
    return None


# group → config names that exist besides conf/<group>/*.yaml: a search path's files and the method names Hydra's
# ConfigStore holds for this command line (spark_bench.commandline.prepare_command_line)
EXTRA_CHOICES: dict[str, set[str]] = {}


PROTOCOL_KEYS = ("compress_scope", "window_size", "channel_window", "kernel_size", "pooling", "think_keep_window",
                 "pyramid_fallback", "ada_safeguard", "value_score", "value_fill", "window_q_norm",
                 "saliency_dtype", "budget_rounding", "group_fork_fill")  # what conf/protocol/*.yaml set


def protocol_options(name: str) -> dict:
    """The method options ``conf/protocol/<name>.yaml`` sets (its ``longbench.protocol``, the prompt path, belongs to
    the run's samples, which every entry of a sweep shares, so a sweep entry cannot change it)."""
    path = CONF_DIR / "protocol" / f"{name}.yaml"
    names = sorted(p.stem for p in (CONF_DIR / "protocol").glob("*.yaml"))
    if name not in names:  # a name, never a path (``../method/full`` would read another group's file)
        valid = ", ".join(names)
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
    """``path`` is a regular file the run can read (a directory, a device, a file without read permission: one
    line, :func:`file_problem`)."""
    problem = None if path is None else file_problem(path)
    if problem:
        raise ConfigError(f"{key}: {problem}")


def file_problem(path) -> str | None:
    """Why ``path`` is not a regular, readable file, in words starting with the path (None: it is one)."""
    file = Path(path)
    try:
        if file.is_file():
            if os.access(file, os.R_OK):
                return None
            return f"{path} is not readable (permission denied)"
        if file.is_dir():
            return f"{path} is a directory, not a file"
        if file.exists():
            return f"{path} is not a regular file (a device, a pipe or a socket)"
    except OSError as err:  # a name too long, a loop of links
        return f"{path}: {err.strerror or err}"
    return f"{path} does not exist"


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
        if "run" in plain:
            check_inside("run", plain["run"], f"output_root={plain.get('output_root')}")
        for prefix, options in (("benchmark.", BENCHMARK_OPTIONS), ("longbench.", LONGBENCH_OPTIONS),
                                ("ruler.", RULER_OPTIONS), ("memory.", MEMORY_OPTIONS), ("model.", MODEL_OPTIONS),
                                ("analysis.", ANALYSIS_OPTIONS)):
            check_all(plain.get(prefix[:-1]) or {}, options, prefix)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_output(out_dir: Path, key: str = "output_root/run") -> None:
    """The results directory (or ``key``'s directory) can be made and written: no file in its place or above it, the
    nearest existing directory writable. Nothing is created here."""
    fix = "output_root= or run=" if key == "output_root/run" else f"{key}="
    problem = name_problem(str(out_dir))
    if problem:
        raise ConfigError(f"{key}: {str(out_dir)!r} {problem}; choose another {fix}")
    for place in (out_dir, *out_dir.parents):
        if place.exists():
            if not place.is_dir():
                raise ConfigError(f"{key}: {place} is a file, not a directory; choose another {fix}")
            if not os.access(place, os.W_OK | os.X_OK):
                raise ConfigError(f"{key}: {place} is not writable; choose another {fix.split(' or ')[0]}")
            return


def vocab_size(model: ModelConfig) -> int | None:
    """The size of the model's vocabulary (its ``config.json`` or ``arch:``), which every token id a user brings (a
    data file's ``input_ids`` and ``stop_token_ids``, :mod:`spark_bench.benchmarks.records`) must stay under; None
    when no shape is known (the model's own embedding will say so)."""
    from spark_bench.memory import Arch

    try:
        return Arch.of(model).vocab_size
    except ValueError:
        return None


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


def check_launcher(argv: list[str]) -> None:
    """``hydra/launcher=slurm`` needs SLURM's ``sbatch`` here (submitit submits through it); off a cluster the
    command is refused in one line before Hydra starts (submitit would fail in a traceback)."""
    import shutil

    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+~") == "hydra/launcher" and value == "slurm" and shutil.which("sbatch") is None:
            raise ConfigError("hydra/launcher=slurm: sbatch is not on this machine's PATH (not a SLURM cluster's "
                              "login node); submit from the cluster, or run the jobs here with "
                              "hydra/launcher=local_parallel")


def budget_warnings(samples, configs, num_layers: int = 1) -> list[str]:
    """One line per eviction (method and budget) and scope that keeps some samples' compressed part whole in every
    layer (:meth:`~spark_bench.methods.base.EvictionMethod.keeps_whole`: a token budget at or above the part, or a
    part no longer than what the method always keeps, e.g. SnapKV's observation window): those rows are the full
    cache under the budget's label. Says how many samples and the longest such part. ``num_layers``: the model's
    (PyramidKV's budget differs per layer)."""
    from spark_bench.methods.pipeline import build_eviction, display

    groups: dict = {}
    for c in configs:
        if c.eviction_name is not None:
            groups.setdefault((build_eviction(c), c.compress_scope), []).append(c)
    lines = []
    for (eviction, scope), members in groups.items():
        lengths = [s.scope_end(scope) if hasattr(s, "scope_end") else len(s.input_ids) for s in samples]
        whole = [n for n in lengths if all(eviction.keeps_whole(n, i, num_layers) for i in range(num_layers))]
        if not whole:
            continue
        c = members[0]
        always = {"snapkv": f"window_size={c.window_size}", "pyramidkv": f"window_size={c.window_size}",
                  "adasnapkv": f"window_size={c.window_size}", "streamingllm": f"n_sink+1={c.n_sink + 1}",
                  "expected_attention": f"n_sink+1={c.n_sink + 1}", "tova": "its last token"}.get(
                      c.eviction_name, "what it always keeps")  # kvpress:<press>, a method of one's own
        part = "prompt" if scope == "prompt" else f"compressed part (compress_scope={scope})"
        which = f"{display(c.eviction_name)} @{c.budget:g}" + (f" ({len(members)} configs)" if len(members) > 1
                                                                 else "")
        lines.append(f"{which} keeps the whole {part} of {len(whole)} of {len(samples)} samples (up to {max(whole)} "
                     f"tokens: within budget={c.budget:g} or {always}): those rows are the full cache, labelled "
                     f"@{c.budget:g}")
    return lines
