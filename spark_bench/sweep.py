"""A run's method configs from its composed config: ``method=`` (one config from the top-level options) or each
``sweep.configs`` entry over them, a ``protocol:`` entry's options under the entry's own, and the refusals that need
the whole config (an unset ``ratio`` where one is needed, an option the method does not read, a budget below the
observation window or the sinks). Called by :func:`spark_bench.cli.validate` before the model loads; each refusal
is one :class:`~spark_bench.checks.ConfigError` line naming ``method`` or ``sweep.configs[i]``."""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from spark_bench.checks import CONF_DIR, ConfigError, protocol_options

WINDOWED = ("snapkv", "pyramidkv", "adasnapkv")   # evictions that always keep the observation window
SINKED = ("streamingllm", "expected_attention")   # evictions that always keep n_sink tokens


def method_options() -> tuple[str, ...]:
    """The method options that are also top-level config keys (:func:`~spark_bench.methods.config.option_names`)."""
    from spark_bench.methods.config import option_names

    return option_names()


def protocol_name(cfg: DictConfig) -> str | None:
    """The protocol the run chose: Hydra's choice when it runs the command, else (a config composed elsewhere) the
    protocol whose options the config's agree with most (paper and kvcache_factory set the same method options)."""
    try:
        return HydraConfig.get().runtime.choices.get("protocol")
    except ValueError:  # not under Hydra's run (compose API: tests, multirun checks, scripts)
        pass
    names = sorted(p.stem for p in (CONF_DIR / "protocol").glob("*.yaml"))
    agree = {n: sum(cfg.get(k) == v for k, v in protocol_options(n).items()) for n in names}
    return max(names, key=lambda n: agree[n]) if names else None


def default_options(cfg: DictConfig) -> dict:
    """Each method option's default: ``conf/config.yaml``'s value, or the chosen protocol's."""
    top = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))
    protocol = protocol_name(cfg)
    return {**{k: top.get(k) for k in method_options()}, **(protocol_options(protocol) if protocol else {})}


def method_configs(cfg: DictConfig) -> list[MethodConfig]:
    """``method=`` selects one config built from the top-level options; otherwise every ``sweep.configs``
    entry, each overriding the top-level options. An entry's ``protocol: <name>`` puts that protocol's options
    under the entry's own (so one sweep can compare protocols over one shared prefill).

    An option set away from its default that the method does not read is refused
    (:func:`~spark_bench.methods.config.unread_option`): with ``method=``, a top-level option; in a sweep, an
    entry's own option, or a top-level one that no entry reads (each entry that reads it without setting it)."""
    from spark_bench.methods.config import MethodConfig, ratio_needed, relevant_options, unread_option

    base = {k: cfg[k] for k in method_options() if k in cfg}
    if isinstance(base.get("kvpress"), DictConfig):
        base["kvpress"] = OmegaConf.to_container(base["kvpress"])
    plain = {k: OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig) else v
             for k, v in ((k, cfg.get(k)) for k in method_options())}  # the method options only (run= may not resolve)
    defaults = default_options(cfg)
    explicit = [k for k in method_options() if plain.get(k) != defaults.get(k)
                and not (k == "ratio" and not plain.get(k))]  # ratio null or 0: the base method
    single = bool(cfg.get("method"))
    entries = [{"name": cfg.method.name}] if single else OmegaConf.to_container(cfg.sweep.configs)
    out, readers = [], {k: 0 for k in explicit}
    for i, entry in enumerate(entries):
        where = "method" if single else f"sweep.configs[{i}]"
        try:
            entry = dict(entry)
            protocol = protocol_options(entry.pop("protocol")) if "protocol" in entry else {}
            values = {**base, **protocol, **entry}
            unset = values.get("ratio") is None  # required where top-T channels are kept, else 0 (unused)
            config = MethodConfig.from_dict({**values, "ratio": 0.0} if unset else values)
            needed = ratio_needed(config) if unset else None
            if needed:
                raise ConfigError(f"{where}: {needed}")
            unread = unread_option(config, explicit if single else [k for k in entry if k != "name"])
            if unread:
                raise ConfigError(f"{where}: {unread}")
            relevant = relevant_options(config.to_dict())
            for k in readers:
                readers[k] += k in relevant and k not in entry and k not in protocol
            out.append(config)
        except (TypeError, ValueError) as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"{where}: {err}") from None
    if not single:
        from spark_bench.methods.config import _option_text, option_readers

        for k, n in readers.items():
            if not n:
                raise ConfigError(f"{k}={_option_text(plain.get(k))}: no entry of sweep.configs reads it (each sets "
                                  f"its own, or its method ignores it), so it would change nothing; {k} is read by "
                                  f"{option_readers(k)}; set it in the entries, or use method=")
    return out


def check_budgets(cfg: DictConfig, configs: list) -> None:
    """Each eviction config's budget (tokens, or a fraction of ``benchmark.length``) against what its method always
    keeps: the observation window (:data:`WINDOWED`) or ``n_sink`` tokens (:data:`SINKED`)."""
    length = cfg.benchmark.get("length")
    for i, c in enumerate(configs):
        where = "method" if cfg.get("method") else f"sweep.configs[{i}]"
        if c.eviction_name is None:
            continue
        tokens = c.budget if c.budget >= 1 else (int(c.budget * length) if length else None)
        of = f" of benchmark.length={length}" if c.budget < 1 else ""
        fix = "; raise benchmark.length or the budget" if c.budget < 1 else ""
        if c.eviction_name in WINDOWED and tokens is not None and tokens < c.window_size:
            raise ConfigError(f"{where}: budget={c.budget:g}{of} ({tokens} tokens) is smaller than the observation "
                              f"window window_size={c.window_size}{fix}")
        if c.eviction_name in SINKED and tokens is not None and tokens <= c.n_sink:
            raise ConfigError(f"{where}: budget={c.budget:g}{of} ({tokens} tokens) must exceed n_sink={c.n_sink}"
                              f"{fix}")
