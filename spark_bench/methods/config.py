"""What a method configuration is and which are valid: :class:`MethodConfig` (one point of a sweep: a method name
``eviction[+channel]`` and its options, each option's type and range declared once in :data:`OPTION_TYPES`), the
rules on names (:func:`check_name`, :func:`part_kind`) and on options (:func:`relevant_options`,
:func:`unread_option`, :func:`ratio_needed`), the table labels (:attr:`MethodConfig.label`, :func:`sweep_labels`), and
the method object of each name part (:func:`build_part`: the paper's, :mod:`~spark_bench.methods.builtin`; a kvpress
press; one of one's own, :mod:`~spark_bench.methods.registry`). :mod:`~spark_bench.methods.pipeline` runs a config
on a prefill."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from spark_bench.methods.base import BUDGET_ROUNDINGS
from spark_bench.methods.builtin import (
    CHANNEL_METHODS, DISPLAY, EVICTION_METHODS, METHOD_NAMES, METHOD_OPTIONS, VALUE_METHODS,
)
from spark_bench.methods.channel.fork_recovery import FORK_MODES
from spark_bench.methods.channel.recovery import RECOVERY_MODES, STATS
from spark_bench.methods.channel.spark import GROUP_FORK_FILLS, GROUP_RATIOS, SALIENCY_DTYPES, SALIENCY_MODES, VARIANTS
from spark_bench.methods.channel.value_norm import VALUE_FILLS, VALUE_SCORES
from spark_bench.methods.eviction.adasnapkv import SAFEGUARDS
from spark_bench.methods.eviction.pyramidkv import FALLBACKS
from spark_bench.methods.eviction import kvpress_scorer
from spark_bench.methods import registry
from spark_bench.methods.channel.leank import label_ratio, load_mask
from spark_bench.options import FRACTION, LEANK_OPTIONS, POSITIVE_INT, Option, check_all

MORE_NAMES = "kvpress:<press>[+think|+spark] (kvpress installed), or a method of your own (docs/development.md)"


def part_kind(part: str) -> str | None:
    """``eviction`` / ``channel`` for a method part (the paper's, ``kvpress:<press>``, or one's own:
    :mod:`spark_bench.methods.registry`), None when nothing is called so."""
    if part in EVICTION_METHODS or part.startswith(kvpress_scorer.PREFIX):
        return "eviction"
    if part in CHANNEL_METHODS:
        return "channel"
    external = registry.lookup(part) if part and part != "full" else None
    return external.kind if external else None


def check_name(name: str) -> None:
    """``ValueError`` (one line, with the valid names) unless ``name`` is ``full``, one method part, or an eviction
    part then a channel part (``snapkv+spark``, ``kvpress:knorm+spark``, ``my_method+think``)."""
    if name in METHOD_NAMES:
        return
    parts = name.split("+")
    kinds = [part_kind(p) for p in parts]
    if not ((len(parts) == 1 and kinds[0]) or (len(parts) == 2 and kinds == ["eviction", "channel"])):
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(METHOD_NAMES)}; or {MORE_NAMES}")


def display(part: str) -> str:
    """A method part's name in table labels."""
    if part in DISPLAY:
        return DISPLAY[part]
    if part.startswith(kvpress_scorer.PREFIX):
        return kvpress_scorer.display_name(part[len(kvpress_scorer.PREFIX):])
    return part


def _frozen(value):
    """A kvpress option value as a hashable one (lists → tuples, mappings → sorted pairs)."""
    if hasattr(value, "items"):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value

# option name → allowed values, for the options with a closed set (checked before anything runs)
COMPRESS_SCOPES = ("prompt", "question", "context")
CHOICES = {"compress_scope": COMPRESS_SCOPES, "saliency": SALIENCY_MODES, "recovery": RECOVERY_MODES,
           "recovery_stats": STATS, "variant": VARIANTS, "pooling": ("max", "avg"), "pyramid_fallback": FALLBACKS,
           "ada_safeguard": SAFEGUARDS, "value_score": VALUE_SCORES, "value_fill": VALUE_FILLS,
           "saliency_dtype": SALIENCY_DTYPES, "budget_rounding": BUDGET_ROUNDINGS,
           "group_fork_fill": GROUP_FORK_FILLS}

# every method option's type and range (:mod:`spark_bench.options`), checked when a MethodConfig is made
OPTION_TYPES = {
    "budget": Option("number", 0, open_low=True, whole_from=1),  # tokens (whole, >= 1) or a fraction (< 1)
    "ratio": FRACTION, "value_ratio": FRACTION,
    "window_size": POSITIVE_INT, "channel_window": Option("int", 1, nullable=True, null="window_size"),
    "kernel_size": Option("int", 1, odd=True),  # SnapKV's pooling keeps a token's neighbours on both sides
    "top_p": Option("number", 0, 1, open_low=True), "groups": Option("int", choices=tuple(sorted(GROUP_RATIOS))),
    "constant": Option("number"), "seed": Option("int"),
    "think_keep_window": Option("bool"), "window_q_norm": Option("bool"),
    "n_sink": Option("int", 0), "beta": Option("int", 1), "alpha_safeguard": Option("number", 0, 1),
    "mustafar_window": Option("int", 0), "mustafar_block": Option("int", 1),  # Mustafar's dense window, its schedule
    **{key: Option("str", choices=tuple(allowed)) for key, allowed in CHOICES.items()},
}


@dataclass(frozen=True)
class MethodConfig:
    """One point of a sweep. Every field except ``name`` is also a top-level config key.

    ``budget``: KV size in tokens (≥ 1) or a fraction of the prompt (< 1). ``ratio``: key-channel pruning ratio
    λ; ``value_ratio``: value-channel pruning ratio λ_v (Appendix D, composes with any method). SparK options:
    ``saliency``, ``recovery`` (+ ``recovery_stats``), ``variant`` (``fixed``/``top_p``/``group``) with ``top_p`` and ``groups``,
    ``constant`` (for ``recovery=constant``) and ``seed`` (Gaussian/Exponential sampling). Observation windows:
    ``window_size`` for SnapKV / PyramidKV / AdaSnapKV (and for ThinK / SparK unless ``channel_window`` is set;
    the official SparK fork uses 64 for the former, kvpress's default, and 32 for the latter).
    Mustafar (``mustafar``, ``methods/channel/mustafar.py``): ``ratio`` is its key sparsity, ``value_ratio`` its
    value sparsity (its own magnitude rule, so ``value_score`` / ``value_fill`` are not read), ``mustafar_window``
    the most recent prompt tokens kept dense (32, its code's ``residual_length``) and ``mustafar_block`` how many
    tokens its schedule prunes at a time (1: its accuracy code; 256: its kernel code).

    ``compress_scope``: which part of the prompt is compressed. ``prompt``: all of it, the first answer token from
    the full-cache prefill (SnapKV / KVCache-Factory style); ``question``: the user turn (context + question), then
    the end of turn, assistant header and answer prefix run through the compressed cache and give the first answer
    token (the official SparK fork: kvpress with ``compress_questions=1``); ``context``: query-agnostic, the
    question runs through the compressed cache too (kvpress ``compress_questions=0``).

    Where the official SparK code differs from the paper's text, both are options (``conf/protocol/*.yaml`` set
    them together): ``value_score`` / ``value_fill`` (Appendix D: ``norm`` / ``zero`` vs the code's ``fork`` /
    ``mean``), ``variant=group_fork`` (the code's SparK-g), the ``fork_*`` recoveries (the code's distribution
    draws), ``window_q_norm`` (Qwen3 window queries with or without ``q_norm``) and ``saliency_dtype``
    (``float32`` or the model dtype, as the code scores), ``budget_rounding`` (``exact`` ``int(S·b)`` vs the code's
    floating-point ``int(S·(1 − (1 − b)))``, one token fewer at 20% for S divisible by 5) and ``group_fork_fill``
    (``zero``: SparK-g's pruned entries read as zeros, as the code's ``eval.py`` runs it — it never sets
    ``pooling_ratio`` for SparK-g, so the press falls through to ``keys * mask``; ``recovery``: the ``recovery``
    option refills them, the paper's reading).
    """

    name: str = "full"
    compress_scope: str = "prompt"
    budget: float = 0.2
    budget_rounding: str = "exact"
    ratio: float = 0.0
    value_ratio: float = 0.0
    value_score: str = "norm"
    value_fill: str = "zero"
    window_size: int = 32
    channel_window: int | None = None
    kernel_size: int = 7
    pooling: str = "max"
    saliency: str = "official"
    recovery: str = "degenerate"
    recovery_stats: str = "pruned"
    variant: str = "fixed"
    group_fork_fill: str = "recovery"
    top_p: float = 0.99
    groups: int = 4
    constant: float = 0.01
    seed: int = 0
    think_keep_window: bool = True
    window_q_norm: bool = True
    saliency_dtype: str = "float32"
    n_sink: int = 4
    beta: int = 20
    pyramid_fallback: str = "original"
    alpha_safeguard: float = 0.2
    ada_safeguard: str = "kvpress"
    mustafar_window: int = 32
    mustafar_block: int = 1
    # kvpress:<press> methods: the press's own options (kvpress={window_size: 64}), kept as sorted (key, value)
    # pairs so a config stays hashable; to_dict gives them back as a mapping
    kvpress: tuple = ()
    # method=leank / <eviction>+leank: its mapping (leank.mask=<file>, leank.recent=768; LEANK_OPTIONS), kept as
    # sorted (key, value) pairs like kvpress's, every key present (the defaults filled in)
    leank: tuple = (("mask", None), ("recent", 768))
    # the protocol whose options the library's spark_bench.method() started from (None: not said); shown first by
    # repr, not an option: no effect on what is computed, equality, to_dict or from_dict
    protocol: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.kvpress is None or hasattr(self.kvpress, "items"):
            object.__setattr__(self, "kvpress", _frozen(self.kvpress or {}))
        elif not (isinstance(self.kvpress, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in self.kvpress)):
            raise ValueError(f"kvpress must be a mapping of the press's options, e.g. kvpress={{window_size:64}}; "
                             f"got {self.kvpress!r}")
        check_name(self.name)
        _leank_options(self)
        check_all({name: getattr(self, name) for name in option_names()}, OPTION_TYPES)
        for part in self.name.split("+"):  # a kvpress press or a method of one's own is built now: a bad option
            if part_kind(part) is not None and part not in EVICTION_METHODS and part not in CHANNEL_METHODS:
                build_part(part, self)  # is refused before any model loads

    def __repr__(self) -> str:
        body = ", ".join(f"{name}={getattr(self, name)!r}" for name in ("name", *option_names()))
        return f"MethodConfig(protocol={self.protocol!r}, {body})"

    @classmethod
    def from_dict(cls, values: dict) -> "MethodConfig":
        known = {"name", *option_names()}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown method option(s) {unknown}; valid: {sorted(known)}")
        return cls(**values)

    @property
    def channel_window_size(self) -> int:
        """ThinK / SparK observation window: ``channel_window``, else ``window_size``."""
        return self.channel_window if self.channel_window is not None else self.window_size

    @property
    def observation_window(self) -> int:
        """Window queries the prefill must keep for this config (the larger window it uses)."""
        return max(self.window_size, self.channel_window_size if self.channel_name else 1)

    @property
    def eviction_name(self) -> str | None:
        head = self.name.split("+")[0]
        return head if part_kind(head) == "eviction" else None

    @property
    def channel_name(self) -> str | None:
        tail = self.name.split("+")[-1]
        return tail if part_kind(tail) == "channel" else None

    @property
    def label(self) -> str:
        """Row label in tables, e.g. ``SnapKV+SparK(0.8) @128``, ``SnapKV+SparK(0.5+0.3) @128``,
        ``SnapKV+SparK-p(0.99) @128``, ``SnapKV+SparK(0.8)[gaussian] @128``."""
        text = "+".join(display(p) for p in self.name.split("+"))
        if self.eviction_name == "pyramidkv" and self.pyramid_fallback != "original":
            text = text.replace("PyramidKV", f"PyramidKV[{self.pyramid_fallback}]", 1)
        vr = f"+{self.value_ratio:g}" if self.value_ratio else ""
        if self.channel_name == "spark" and self.variant == "top_p":
            text += f"-p({self.top_p:g}{vr})"
        elif self.channel_name == "spark" and self.variant == "group":
            text += f"-g({self.groups}{vr})"
        elif self.channel_name == "spark" and self.variant == "group_fork":
            text += f"-g(fork{vr})"
        elif self.channel_name == "leank":  # the pruned fraction its mask file holds
            text += f"({label_ratio(self.leank)}{vr})"
        elif self.channel_name:
            text += f"({self.ratio:g}{vr})"
        elif self.value_ratio:
            text += f"+V({self.value_ratio:g})"
        if self.channel_name == "spark":
            tags = [t for t in (self.recovery if self.recovery != "degenerate" else "",
                                "all-stats" if self.recovery_stats == "all" else "",
                                "paper" if self.saliency == "paper" else "") if t]
            text += "".join(f"[{t}]" for t in tags)
        if self.eviction_name:
            text += f" @{self.budget:g}"
        return text

    def to_dict(self) -> dict:
        values = asdict(self)
        del values["protocol"]
        values["kvpress"] = dict(self.kvpress)
        values["leank"] = dict(self.leank)
        return values


def _leank_options(config: MethodConfig) -> None:
    """``config.leank`` as sorted pairs with every key of :data:`~spark_bench.options.LEANK_OPTIONS` (its defaults
    filled in), each checked; a mask named is read and checked (:func:`~spark_bench.methods.channel.leank.read_mask`:
    one line on a problem). ``ValueError`` naming ``leank.<key>``."""
    given = config.leank
    if given is None or hasattr(given, "items"):
        given = dict(given.items()) if given is not None else {}
    elif isinstance(given, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in given):
        given = dict(given)
    else:
        raise ValueError(f"leank must be a mapping, e.g. leank={{mask:mask.json}}; got {given!r}")
    unknown = sorted(set(given) - set(LEANK_OPTIONS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join('leank.' + str(k) for k in unknown)}; valid: "
                         f"{', '.join('leank.' + k for k in LEANK_OPTIONS)}")
    values = {**dict(MethodConfig.__dataclass_fields__["leank"].default), **given}
    check_all(values, LEANK_OPTIONS, "leank.")
    object.__setattr__(config, "leank", tuple(sorted(values.items())))
    if values["mask"] and config.channel_name == "leank":
        load_mask(values["mask"])


def option_names() -> tuple[str, ...]:
    """The method options (every :class:`MethodConfig` field but ``name`` and ``protocol``): top-level config keys."""
    return tuple(f.name for f in fields(MethodConfig) if f.name not in ("name", "protocol"))


def _option_text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):  # kvpress' pairs
        return "{" + ", ".join(f"{k}:{_option_text(v)}" for k, v in value) + "}"
    return f"{value:g}" if isinstance(value, float) else str(value)


# Options a method part reads only under some values of its other options (what SparK computes,
# ``channel/spark.py`` via ``builtin.CHANNEL_METHODS``): part → selecting option → value → the options read then.
# An option named under a selector is read only where the config's value of that selector names it; under
# ``variant=group_fork`` with ``group_fork_fill=zero`` SparK fills the pruned entries with zeros, so its recovery
# (and what the recovery reads) is not read at all.
READ_WHEN = {
    "spark": {
        "variant": {"fixed": ("ratio",), "top_p": ("top_p",), "group": ("groups",),
                    "group_fork": ("top_p", "group_fork_fill")},
        "recovery": {"gaussian": ("recovery_stats", "seed"), "exponential": ("recovery_stats", "seed"),
                     "constant": ("constant",), "fork_pool0": ("ratio",), **{m: ("seed",) for m in FORK_MODES}},
    },
}


def _effective(part: str, method: dict) -> dict:
    """``method``'s values as ``part`` applies them (SparK's zero-filled SparK-g reads no recovery)."""
    if part == "spark" and method.get("variant") == "group_fork" and method.get("group_fork_fill") == "zero":
        return {**method, "recovery": None}
    return method


def part_reads(part: str, method: dict) -> set[str]:
    """The options the method part ``part`` reads under ``method``'s values (a :meth:`MethodConfig.to_dict`): its
    own (:data:`METHOD_OPTIONS`; a kvpress press or one's own: :func:`_part_options`), less those
    :data:`READ_WHEN` ties to selector values this config does not have."""
    own = set(METHOD_OPTIONS.get(part, ()) or _part_options(part))
    tables = READ_WHEN.get(part, {})
    if not tables:
        return own
    values = _effective(part, {**MethodConfig().to_dict(), **method})
    conditional = {k for table in tables.values() for keys in table.values() for k in keys}
    selected = {k for selector, table in tables.items() for k in table.get(values.get(selector), ())}
    unread = {selector for selector in tables if values.get(selector) is None}  # e.g. zero-filled SparK-g's recovery
    return (own - conditional - unread) | (selected & own)


def relevant_options(method: dict) -> set[str]:
    """The options that matter for the method config ``method`` (a :meth:`MethodConfig.to_dict`): what each of its
    parts reads under its values (:func:`part_reads`: e.g. ``constant`` only under ``recovery=constant``,
    ``top_p`` only under ``variant=top_p`` / ``group_fork``), plus the scope, the budget of an eviction method and
    the value pruning ratio (its ``value_score`` / ``value_fill`` only when it is above 0)."""
    parts = str(method.get("name", "full")).split("+")
    keys = {"compress_scope", "value_ratio"} | ({"budget"} if part_kind(parts[0]) == "eviction" else set())
    if method.get("value_ratio") and parts[-1] not in VALUE_METHODS:  # Mustafar prunes values by its own rule
        keys |= {"value_score", "value_fill"}
    return keys.union(*(part_reads(p, method) for p in parts))


def _part_options(part: str) -> tuple[str, ...]:
    """The options a kvpress press or a method of one's own reads: ``kvpress`` and the rounding; the options its
    constructor names."""
    if part.startswith(kvpress_scorer.PREFIX):
        return ("kvpress", "budget_rounding")
    external = registry.lookup(part) if part != "full" else None
    if external is None:
        return ()
    names = external.parameters() | ({"budget_rounding"} if "rounding" in external.parameters() else set())
    return tuple(sorted(names & set(option_names())))


def tell_apart(labels: list[str], methods: list[dict]) -> list[str]:
    """``labels`` with `` [key=value, ...]`` appended wherever several entries share a label but not their options:
    the options that matter to the method (:func:`relevant_options`) in which the entries of that label differ
    (e.g. two ``SnapKV+ThinK(0.5) @128`` rows that differ in ``think_keep_window``, or in the window). Entries that
    differ only in options their method ignores keep equal labels (they compute the same thing)."""
    out = list(labels)
    for label in dict.fromkeys(labels):
        members = [i for i, other in enumerate(labels) if other == label]
        relevant = relevant_options(methods[members[0]])
        keys = [k for k in methods[members[0]] if k in relevant
                and len({repr(methods[i].get(k)) for i in members}) > 1]
        if keys:
            for i in members:
                out[i] = f"{label} [" + ", ".join(f"{k}={_option_text(methods[i].get(k))}" for k in keys) + "]"
    return out


def ratio_needed(config: "MethodConfig") -> str | None:
    """The one rule for an unset ``ratio`` (CLI and library): a fixed-T ``+think`` / ``+spark`` method must say its
    key-channel pruning ratio λ (an explicit ``ratio=0`` means the base method); every other method prunes no key
    channel by ratio, so an unset ratio is 0. The refusal's text, or None."""
    if config.channel_name not in (None, "leank") and config.variant == "fixed":  # LeanK: its mask's ratio
        return (f"{config.name} needs ratio= (the key-channel pruning ratio λ), e.g. ratio=0.5 or ratio=0.8 as in "
                f"the paper (ratio=0 is the base method)")
    return None


def option_readers(key: str) -> str:
    """The methods that read option ``key`` (from :data:`METHOD_OPTIONS` and :func:`relevant_options`), in words."""
    if key in ("value_score", "value_fill"):
        return f"any method but {', '.join(VALUE_METHODS)} (its own value rule), with value_ratio > 0"
    parts = [p for p in (*EVICTION_METHODS, *CHANNEL_METHODS)
             if key in relevant_options({"name": p, "value_ratio": 1}) or _conditions(p, key)]
    channel_only = all(p in CHANNEL_METHODS for p in parts)
    if key in _part_options(kvpress_scorer.PREFIX) or key == "budget":
        parts.append(f"{kvpress_scorer.PREFIX}<press>")
    how = ("alone or after an eviction method, e.g. snapkv+spark" if channel_only else
           "alone or with +think / +spark" if not any(p in CHANNEL_METHODS for p in parts) else
           "alone or combined, e.g. snapkv+spark")
    return f"{', '.join(parts)} ({how})"


def _conditions(part: str, key: str) -> str:
    """``variant=fixed or recovery=fork_pool0`` when ``part`` reads option ``key`` only under some values of its
    selectors (:data:`READ_WHEN`), else ''."""
    return " or ".join(f"{selector}={'/'.join(v for v, keys in table.items() if key in keys)}"
                       for selector, table in READ_WHEN.get(part, {}).items()
                       if any(key in keys for keys in table.values()))


def unread_option(config: "MethodConfig", explicit) -> str | None:
    """The one rule for options a method does not read (CLI, sweep files, multiruns, library): of the ``explicit``
    options (those set away from their defaults), the first one ``config``'s method ignores (not in
    :func:`relevant_options`: e.g. ``ratio`` on ``snapkv``, ``budget`` on ``full``, ``variant`` on ``+think``) gives
    the refusal's text, naming it and the methods that read it; None when every one is read. ``ratio=0`` is the
    base method of any method, so it is never refused."""
    method = config.to_dict()
    relevant = relevant_options(method)
    for key in explicit:
        value = getattr(config, key)
        if key in relevant or (key == "ratio" and not value):
            continue
        parts = config.name.split("+")
        under = [f"{selector}={_option_text(method.get(selector))}" for p in parts if _conditions(p, key)
                 for selector, table in READ_WHEN[p].items() if any(key in keys for keys in table.values())]
        if "spark" in parts and _effective("spark", method).get("recovery") is None and key in (
                "recovery", *READ_WHEN["spark"]["recovery"].get(method.get("recovery"), ())):
            under = ["variant=group_fork", "group_fork_fill=zero"]  # zero-filled: no recovery at all
        where = f" with {', '.join(dict.fromkeys(under))}" if under else ""
        only = "".join(f"; by {p} only with {_conditions(p, key)}" for p in dict.fromkeys(parts)
                       if _conditions(p, key))
        return (f"{key}={_option_text(value)} is not read by {config.name}{where}, so it would change nothing; "
                f"{key} is read by {option_readers(key)}{only}")
    return None


def sweep_labels(configs: list[MethodConfig]) -> list[str]:
    """One distinct table label per config of a sweep (:attr:`MethodConfig.label`, told apart by
    :func:`tell_apart`); ``ValueError`` (one line) when the sweep lists the same config twice."""
    labels = tell_apart([c.label for c in configs], [c.to_dict() for c in configs])
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(f"the sweep lists the same method config more than once: {'; '.join(twice)}")
    return labels


def build_part(part: str, cfg: MethodConfig):
    """The method object of one part of ``cfg``'s name: the paper's, a kvpress press
    (:mod:`~spark_bench.methods.eviction.kvpress_scorer`) or one of one's own (:mod:`~spark_bench.methods.registry`)."""
    if part in EVICTION_METHODS:
        return EVICTION_METHODS[part](cfg)
    if part in CHANNEL_METHODS:
        return CHANNEL_METHODS[part](cfg)
    if part.startswith(kvpress_scorer.PREFIX):
        return kvpress_scorer.from_config(part[len(kvpress_scorer.PREFIX):], cfg.kvpress, cfg.budget,
                                          cfg.budget_rounding)
    return registry.instantiate(registry.lookup(part), cfg.to_dict())
