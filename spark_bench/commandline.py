"""The command line composed before Hydra runs it: every job's config, or one line saying which key is wrong.

Hydra reports a composition error (a typo in a nested key, a key at the wrong level, a key the chosen model's config
lacks) in several lines and exits 1, and a multirun composes each job only when it starts. :func:`compose_jobs`
composes every job the command line makes — one, or each combination of a ``-m`` sweep, split as Hydra's basic
sweeper splits it — with Hydra's own compose API, so a console script can refuse a bad command before anything runs.
An error names the override as typed, why it fails (unknown here / only at another level / not in this model's
config / nothing reads it) and the closest valid keys (:mod:`difflib`), as a
:class:`~spark_bench.checks.ConfigError` (exit 2).
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import fields

from omegaconf import DictConfig, OmegaConf

from spark_bench.checks import CONF_DIR, CONFIG_GROUPS, ConfigError

class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` for the console scripts that take flags (report, merge, figure2): a bad flag or value ends in one
    line, ``<prog>: error: <what>``, exit 2, as every spark-bench refusal (argparse prints its whole usage first);
    ``--help`` still prints the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help: the usage)\n")


VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--info", "-i"}  # Hydra flags followed by a value
OWN_CONFIG_FLAGS = {"--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--experimental-rerun"}
MULTIRUN_FLAGS = {"-m", "--multirun"}


def split_argv(argv: list[str]) -> tuple[list[str], bool] | None:
    """``(overrides, multirun)`` of a console script's arguments; None when the command composes another config
    than the package's (``--config-name`` and the like: Hydra then reports on its own)."""
    overrides, multirun, skip = [], False, False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in OWN_CONFIG_FLAGS:
            return None
        if arg in MULTIRUN_FLAGS:
            multirun = True
        elif arg in VALUE_FLAGS:
            skip = True
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides, multirun


def _is_group(key: str) -> bool:
    return key.split("/")[0].split(".")[0] in (*CONFIG_GROUPS, "hydra") and (
        "." not in key or key.startswith("hydra"))


def compose(overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None, job_name="spark_bench"):
        return hydra_compose(config_name="config", overrides=overrides)


def compose_jobs(argv: list[str]) -> list[tuple[list[str], DictConfig]]:
    """``[(job overrides, composed config), …]``: one job, or every job of a ``-m`` sweep; raises
    :class:`ConfigError` (one line) on the first override Hydra cannot compose or that nothing reads."""
    import yaml
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from spark_bench.usercode import yaml_error

    split = split_argv(argv)
    if split is None:
        return []
    overrides, multirun = split
    parser, parsed = OverridesParser.create(), []
    for override in overrides:
        try:
            parsed += parser.parse_overrides([override])
        except HydraException as err:
            shown = override if override.isprintable() else repr(override)  # a newline in it: still one line
            raise ConfigError(f"{shown}: not an override Hydra can read ({_first_line(err)}); the form is "
                              f"key=value, key=[a,b] for a list, quoted 'key=a b' for spaces") from None
    if multirun:
        try:
            jobs = BasicSweeper.split_arguments(parsed, None)[0]
        except HydraException as err:
            raise ConfigError(f"-m: {_first_line(err)}") from None
    else:
        jobs = [overrides]
    out = []
    for job in jobs:
        try:
            cfg = compose(job)
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(explain(job, err)) from None
        except yaml.YAMLError as err:  # a config file Hydra read: named by file:line
            raise ConfigError(yaml_error(err)) from None
        check_additions(job, cfg)
        out.append((job, cfg))
    return out


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _keys(node, prefix: str = "") -> list[str]:
    """Every dotted key of a config (mappings and their leaves)."""
    out = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            full = f"{prefix}{key}"
            out.append(full)
            out += _keys(node._get_node(key), full + ".")
    return out


def explain(job: list[str], err: Exception) -> str:
    """One line for a composition error of ``job``: the override that fails and why, with the closest valid keys;
    Hydra's first line (with the override) where no override is found wrong."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = [o for o in job if _is_group(o.split("=", 1)[0].lstrip("+~"))]
    try:
        base = compose(groups)
    except Exception:  # noqa: BLE001 — a group choice itself fails: Hydra's own reason
        return _first_line(err)
    for override in OverridesParser.create().parse_overrides(job):
        key = override.key_or_group
        if _is_group(key):
            continue
        typed = override.input_line
        exists = OmegaConf.select(base, key, default=_ABSENT) is not _ABSENT
        if override.is_add() and exists:
            return f"{typed}: {key} is already set; drop the '+' ({key}={override.get_value_element_as_str()})"
        if not override.is_add() and not override.is_force_add() and not exists:
            return f"{typed}: {_why_unknown(base, key)}"
    detail = next((line.strip() for line in str(err).splitlines() if "full_key:" in line), "")
    return f"{_first_line(err)}{' (' + detail + ')' if detail else ''}"


_ABSENT = object()


def _why_unknown(cfg: DictConfig, key: str) -> str:
    parts = key.split(".")
    node, depth = cfg, 0
    while depth < len(parts) - 1 and isinstance(node, DictConfig) and parts[depth] in node:
        node = node[parts[depth]]
        depth += 1
    level = ".".join(parts[:depth])
    if not isinstance(node, DictConfig):
        return f"{level} is a value, not a section with keys"
    siblings = [str(k) for k in node.keys()]
    last = parts[-1]
    elsewhere = [k for k in _keys(cfg) if k.split(".")[-1] == last and k != key]
    if level == "model":
        where = f"not in model {cfg.model.get('name')}'s config (conf/model/{cfg.model.get('name')}.yaml)"
    else:
        where = f"no key {parts[depth]!r} in {level}" if level else "no such top-level key"
    if elsewhere:
        return f"{where}; it is {' / '.join(elsewhere)}"
    close = difflib.get_close_matches(parts[depth], siblings, n=3, cutoff=0.6)
    prefix = f"{level}." if level else ""
    hint = f"did you mean {', '.join(prefix + c for c in close)}?" if close else \
        f"valid: {', '.join(prefix + s for s in siblings)}"
    return f"{where}; {hint}"


def readers() -> dict[str, set[str]]:
    """Nested keys a ``+`` override may add, per section: what the code reads there although the section's config
    may not set it (a model's optional fields, the benchmark options)."""
    from spark_bench.models import ModelConfig
    from spark_bench.options import BENCHMARK_OPTIONS

    return {"model": {f.name for f in fields(ModelConfig)}, "benchmark": set(BENCHMARK_OPTIONS) | {"name"}}


def check_additions(job: list[str], cfg: DictConfig) -> None:
    """``+key=value`` that nothing reads is refused (Hydra adds any key; the run would silently ignore it).
    Top-level keys are checked with the run's options (:func:`~spark_bench.checks.check_options`)."""
    allowed = readers()
    for override in job:
        if not override.startswith("+") or _is_group(override.lstrip("+").split("=", 1)[0]):
            continue
        key = override.lstrip("+").split("=", 1)[0]
        section, _, rest = key.partition(".")
        if not rest:
            continue
        if section not in allowed or rest.split(".")[0] not in allowed[section]:
            valid = sorted(allowed.get(section, ())) or [str(k) for k in (cfg.get(section) or {})]
            close = difflib.get_close_matches(rest, valid, n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(f'{section}.{c}' for c in close)}?" if close else \
                f"{section} keys: {', '.join(valid)}"
            raise ConfigError(f"{override}: nothing reads {key}; {hint}")


def check_sweep(jobs: list[tuple[list[str], DictConfig]], check_job) -> None:
    """Raise one :class:`ConfigError` listing each job of a sweep that ``check_job`` refuses (by the overrides
    that vary between jobs), so no job runs."""
    common = set.intersection(*(set(overrides) for overrides, _ in jobs))
    varying = {o.split("=", 1)[0] for overrides, _ in jobs for o in overrides if o not in common}
    bad = []
    for i, (overrides, cfg) in enumerate(jobs):
        try:
            check_job(cfg)
        except ConfigError as err:
            shown = " ".join(o for o in overrides if o.split("=", 1)[0] in varying) or " ".join(overrides)
            bad.append(f"multirun job {i} ({shown}): {err}")
    if bad:
        raise ConfigError("\n".join([f"the sweep runs no job: {len(bad)} of {len(jobs)} jobs refused"] + bad))


def prepare_command_line(argv: list[str]) -> None:
    """Before Hydra composes a command line: its ``hydra.searchpath`` directories become the search path for methods
    of one's own, and each ``method=`` name (comma lists of ``-m`` included) that no ``method/<name>.yaml`` holds
    but that resolves — ``kvpress:knorm+spark``, ``my_method+spark`` — gets a config node in Hydra's ConfigStore
    (``{name: <name>}``), so it composes and sweeps like a packaged method config. A name that does not resolve is
    refused in one line (:class:`~spark_bench.checks.ConfigError`); methods/registry.py says where a method of one's
    own is found. So is a malformed ``hydra.searchpath`` (the key and the valid form), a config of one's own named
    like one of the package's (``method/snapkv.yaml``: Hydra would silently read the package's; both files named).
    Invalid YAML in a config Hydra reads is named by ``file:line`` (:func:`compose_jobs`), as is a config of one's
    own that is not a mapping or a method config without a name (:func:`~spark_bench.methods.registry.check_user_configs`)."""
    from hydra.core.config_store import ConfigStore

    from spark_bench.checks import EXTRA_CHOICES
    from spark_bench.methods import registry

    try:
        dirs = registry.search_dirs_of(argv)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    clashes = registry.shadowed(dirs, CONF_DIR, CONFIG_GROUPS)
    if clashes:
        mine, own = clashes[0]
        raise ConfigError(f"hydra.searchpath: {mine} has the name of spark-bench's own {own} ({own.parent.name}="
                          f"{own.stem}), which Hydra reads instead; rename yours (e.g. {mine.parent.name}/my_"
                          f"{mine.name})")
    try:
        registry.check_user_configs(dirs, CONFIG_GROUPS)
    except registry.UserCodeError as err:
        raise ConfigError(str(err)) from None
    registry.set_search_dirs(dirs)

    for group in CONFIG_GROUPS:  # a search path's own configs (sweep=my_sweep, method=my_method) are valid choices
        EXTRA_CHOICES.setdefault(group, set()).update(p.stem for d in dirs for p in (d / group).glob("*.yaml"))
    files = {p.stem for d in (CONF_DIR, *dirs) for p in (d / "method").glob("*.yaml")}
    extra = set()
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key.lstrip("+") != "method" or value in ("", "null") or any(c in value for c in "()[]{}$"):
            continue
        for name in value.split(","):
            if name in files:
                continue
            from spark_bench.methods.pipeline import check_name  # torch: only for a name no config file holds

            try:
                check_name(name)
            except ValueError as err:
                raise ConfigError(f"method={name}: {err}") from None
            ConfigStore.instance().store(group="method", name=name, node={"name": name})
            extra.add(name)
    EXTRA_CHOICES.setdefault("method", set()).update(extra)
