"""Methods defined outside the package: a class on the interface of :mod:`spark_bench.methods.base`
(:class:`~spark_bench.methods.base.EvictionMethod` or :class:`~spark_bench.methods.base.ChannelMethod`) under a
name that composes with the paper's methods like theirs do (``my_method``, ``my_method+spark``).

A name is found, first match wins, in

* :func:`register` (the library: ``spark_bench.register_method("my_method", MyEviction)``);
* a method config ``method/<name>.yaml`` whose ``_target_`` names the class (Hydra's convention) in a directory
  of the search path (the command line's ``hydra.searchpath=[file:///path/to/conf]``, :func:`set_search_dirs`);
  its other keys, except ``name``, are the class's fixed arguments;
* the ``spark_bench.methods`` entry points of installed packages (``my_method = "my_package.methods:MyEviction"``).

The class is built per method config with the config's options its constructor names (``budget``, ``ratio``,
``window_size``, …; ``rounding`` is ``budget_rounding``), so ``budget=`` / ``ratio=`` sweeps reach it.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from spark_bench.methods.builtin import CHANNEL_METHODS, EVICTION_METHODS

ENTRY_POINT_GROUP = "spark_bench.methods"
_REGISTERED: dict[str, "External"] = {}
_SEARCH_DIRS: list[Path] = []


@dataclass(frozen=True)
class External:
    """A method of one's own: its ``name``, class ``target``, fixed ``arguments`` and ``kind`` (eviction|channel)."""

    name: str
    target: type
    arguments: tuple = ()
    kind: str = "eviction"
    origin: str = ""

    def parameters(self) -> set[str]:
        return set(inspect.signature(self.target).parameters)


def _import(target: str) -> type:
    module, sep, attr = target.partition(":")
    if not sep:
        module, _, attr = target.rpartition(".")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"cannot import {target!r} ({err}); is its package on the Python path?") from None
    return obj


def _external(name: str, target, arguments: dict, origin: str) -> External:
    from spark_bench.methods.base import ChannelMethod, EvictionMethod

    cls = _import(target) if isinstance(target, str) else target
    if not isinstance(cls, type) or not issubclass(cls, (EvictionMethod, ChannelMethod)):
        raise ValueError(f"method {name!r} ({origin}): {getattr(cls, '__name__', cls)!r} is not a subclass of "
                         "spark_bench.methods.base.EvictionMethod or ChannelMethod")
    if not name or "+" in name or ":" in name:
        raise ValueError(f"method name {name!r}: a name of one's own has no '+' or ':' (it composes as name+spark)")
    kind = "eviction" if issubclass(cls, EvictionMethod) else "channel"
    return External(name, cls, tuple(sorted(arguments.items())), kind, origin)


def register(name: str, target, **arguments) -> None:
    """Make ``name`` a method part: ``target`` is the class (or ``"package.module:Class"``); ``arguments`` are
    fixed constructor arguments. Replaces an earlier registration of the same name."""
    if name in EVICTION_METHODS or name in CHANNEL_METHODS or name == "full":
        raise ValueError(f"method name {name!r} is one of spark-bench's own; choose another")
    _REGISTERED[name] = _external(name, target, arguments, "registered")


def set_search_dirs(dirs) -> None:
    """Config directories (each holding ``method/<name>.yaml``) searched for methods of one's own."""
    _SEARCH_DIRS[:] = [Path(d) for d in dirs]


def search_dirs_of(argv: list[str]) -> list[Path]:
    """The ``file://`` directories of a command line's ``hydra.searchpath=[...]``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    dirs = []
    for arg in argv:
        if arg.lstrip("+").startswith("hydra.searchpath="):
            (override,) = OverridesParser.create().parse_overrides([arg.lstrip("+")])
            value = override.value()
            dirs += [Path(p[len("file://"):]) for p in (value if isinstance(value, list) else [value])
                     if isinstance(p, str) and p.startswith("file://")]
    return dirs


def lookup(name: str) -> External | None:
    """The method of one's own called ``name`` (module docstring for where it is looked up), or None."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if Path(name).name != name or name.startswith("."):  # a name, never a path (method/<name>.yaml stays inside)
        return None
    for directory in _SEARCH_DIRS:
        path = directory / "method" / f"{name}.yaml"
        if path.is_file():
            from omegaconf import OmegaConf

            values = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
            if "_target_" in values:
                arguments = {k: v for k, v in values.items() if k not in ("_target_", "name")}
                _REGISTERED[name] = _external(name, values["_target_"], arguments, str(path))
                return _REGISTERED[name]
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            _REGISTERED[name] = _external(name, entry.value, {}, f"entry point {entry.value}")
            return _REGISTERED[name]
    return None


def instantiate(external: External, options: dict):
    """The method object for one config: the fixed arguments, then each config option the constructor names
    (``options``: :meth:`~spark_bench.methods.MethodConfig.to_dict`; ``rounding`` is ``budget_rounding``)."""
    values = {**options, "rounding": options.get("budget_rounding")}
    fixed = dict(external.arguments)
    kwargs = {k: values[k] for k in external.parameters() if k in values and k not in fixed}
    try:
        method = external.target(**fixed, **kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"method {external.name!r}: {external.target.__name__}(...) failed: {err}") from None
    try:  # configs sharing a method share its selection through a dict keyed by the method object
        hash(method)
    except TypeError:
        raise ValueError(f"method {external.name!r}: {external.target.__name__} objects must be hashable (a frozen "
                         "dataclass, or a class without __eq__)") from None
    return method
