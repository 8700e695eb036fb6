"""Methods defined outside the package: a class on the interface of :mod:`spark_bench.methods.base`
(:class:`~spark_bench.methods.base.EvictionMethod` or :class:`~spark_bench.methods.base.ChannelMethod`) under a
name that composes with the paper's methods like theirs do (``my_method``, ``my_method+spark``).

A name is found, first match wins, in

* :func:`register` (the library: ``spark_bench.methods.registry.register("my_method", MyEviction)``);
* a method config ``method/<name>.yaml`` whose ``_target_`` names the class (Hydra's convention) in a directory
  of the search path (the command line's ``hydra.searchpath=[file:///path/to/conf]``, :func:`set_search_dirs`);
  its other keys, except ``name``, are the class's fixed arguments;
* the ``spark_bench.methods`` entry points of installed packages (``my_method = "my_package.methods:MyEviction"``).

The class is built per method config with the config's options its constructor names (``budget``, ``ratio``,
``window_size``, …; ``rounding`` is ``budget_rounding``), so ``budget=`` / ``ratio=`` sweeps reach it.

Everything of the user's enters through :mod:`spark_bench.usercode` (importing the class, reading the config) and
:func:`instantiate` (building it): a failure is one :class:`~spark_bench.usercode.UserCodeError` line naming the
module, the file and the exception.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from spark_bench.methods.builtin import CHANNEL_METHODS, EVICTION_METHODS
from spark_bench.usercode import UserCodeError, describe_exception, import_object, load_yaml, one_line

__all__ = ["External", "UserCodeError", "check_user_configs", "instantiate", "is_own", "lookup", "register",
           "search_dirs_of", "set_search_dirs", "shadowed"]

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


def _external(name: str, target, arguments: dict, origin: str) -> External:
    from spark_bench.methods.base import ChannelMethod, EvictionMethod

    cls = import_object(target, f"method {name!r} ({origin})") if isinstance(target, str) else target
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


SEARCHPATH_FORM = "hydra.searchpath=[file:///path/to/conf] (a list; each entry file://<directory> or pkg://<module>)"


def search_dirs_of(argv: list[str]) -> list[Path]:
    """The directories of a command line's ``hydra.searchpath=[...]`` (``file://<dir>``, or a plain path, as Hydra
    reads one; ``pkg://`` entries hold no files to search here). A value Hydra cannot parse, not a list, an entry
    of another scheme or a directory that does not exist is one ``ValueError`` line naming the key and the valid
    form (Hydra would print a traceback, or silently search nothing)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    dirs = []
    for arg in argv:
        if not arg.lstrip("+~").startswith("hydra.searchpath="):
            continue
        if arg.startswith("~"):
            continue  # deleting it: nothing is searched
        try:
            (override,) = OverridesParser.create().parse_overrides([arg.lstrip("+")])
            value = override.value()
        except HydraException as err:
            raise ValueError(f"{arg}: not a value Hydra can read ({one_line(err)}); the form is "
                             f"{SEARCHPATH_FORM}") from None
        if not isinstance(value, list):
            raise ValueError(f"{arg}: hydra.searchpath is a list, not {type(value).__name__}; the form is "
                             f"{SEARCHPATH_FORM}")
        for entry in value:
            if not isinstance(entry, str) or not entry:
                raise ValueError(f"{arg}: the entry {entry!r} is not a path; the form is {SEARCHPATH_FORM}")
            scheme, sep, rest = entry.partition("://")
            if sep and scheme == "pkg":
                continue
            if sep and scheme != "file":
                raise ValueError(f"{arg}: {entry!r} has the scheme {scheme}://, which Hydra does not read; the "
                                 f"form is {SEARCHPATH_FORM}")
            directory = Path(rest if sep else entry).expanduser()
            if not directory.is_dir():
                what = "a file, not a directory" if directory.exists() else "no such directory"
                raise ValueError(f"{arg}: {directory}: {what} (Hydra would search nothing there); the form is "
                                 f"{SEARCHPATH_FORM}")
            dirs.append(directory)
    return dirs


def shadowed(dirs: list[Path], conf_dir: Path, groups) -> list[tuple[Path, Path]]:
    """``(user file, built-in file)`` for each ``<group>/<name>.yaml`` of a search directory that has the name of
    one of spark-bench's own configs: Hydra's search path reads the package's first, so the user's would be silently
    ignored (the package's own directory, searched again, shadows nothing)."""
    out = []
    for directory in dirs:
        if directory.resolve() == conf_dir.resolve():
            continue
        for group in groups:
            for path in sorted((directory / group).glob("*.yaml")):
                own = conf_dir / group / path.name
                if own.is_file():
                    out.append((path, own))
    return out


def check_user_configs(dirs: list[Path], groups) -> None:
    """Every config file of one's own (``<group>/*.yaml`` in the search directories), read before Hydra composes:
    invalid YAML, a file that is not a mapping (Hydra would compose a list where the run reads keys: an internal
    error after the checks), a method config without a ``name`` (an empty ``method/mine.yaml`` leaves
    ``method=mine`` empty, so the default sweep would run instead, silently) or a sweep config without its list of
    ``configs`` is one :class:`UserCodeError` line naming ``file:line``."""
    for directory in dirs:
        for group in groups:
            for path in sorted((directory / group).glob("*.yaml")):
                values = load_yaml(path, f"a {group} config is a mapping (key: value lines)", resolve=False)
                name = values.get("name")
                if group == "method" and not (isinstance(name, str) and name.strip()):
                    got = "none" if name is None else repr(name)
                    raise UserCodeError(f"{path}:1: a method config names its method (name: {path.stem}, with "
                                        f"_target_: package.module.Class for a class of one's own; or name: snapkv, "
                                        f"snapkv+spark, … with options); got name {got}")
                if group == "sweep" and not (isinstance(values.get("configs"), list) and values["configs"]):
                    got = f"keys {', '.join(map(str, values))}" if values else "an empty file"
                    raise UserCodeError(f"{path}:1: a sweep config holds configs: a non-empty list of method configs "
                                        f"(configs: [{{name: snapkv, budget: 64}}, …]); got {got}")


def lookup(name: str) -> External | None:
    """The method of one's own called ``name`` (module docstring for where it is looked up), or None."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if Path(name).name != name or name.startswith("."):  # a name, never a path (method/<name>.yaml stays inside)
        return None
    for directory in _SEARCH_DIRS:
        path = directory / "method" / f"{name}.yaml"
        if path.is_file():
            values = load_yaml(path)
            if "_target_" in values:
                arguments = {k: v for k, v in values.items() if k not in ("_target_", "name")}
                _REGISTERED[name] = _external(name, values["_target_"], arguments, str(path))
                return _REGISTERED[name]
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            _REGISTERED[name] = _external(name, entry.value, {}, f"entry point {entry.value}")
            return _REGISTERED[name]
    return None


def _where(cls) -> str:
    """``file:line`` of a class's definition (``?`` when Python cannot tell)."""
    try:
        return f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):
        return getattr(inspect.getmodule(cls), "__file__", None) or "?"


def instantiate(external: External, options: dict):
    """The method object for one config: the fixed arguments, then each config option the constructor names
    (``options``: :meth:`~spark_bench.methods.MethodConfig.to_dict`; ``rounding`` is ``budget_rounding``)."""
    values = {**options, "rounding": options.get("budget_rounding")}
    fixed = dict(external.arguments)
    kwargs = {k: values[k] for k in external.parameters() if k in values and k not in fixed}
    given = ", ".join(f"{k}={v!r}" for k, v in {**fixed, **kwargs}.items())
    try:  # arguments the constructor requires but nothing gives: named with the class's file, not this line
        inspect.signature(external.target).bind(**fixed, **kwargs)
    except TypeError as err:
        raise UserCodeError(f"{external.target.__name__}({given}) cannot be built: {err} ({_where(external.target)}); "
                            "a method's constructor takes the options spark-bench passes (budget, ratio, window_size, "
                            "…) and its method config's own keys", external.name) from None
    except ValueError:
        pass  # no signature to read: the call says what is wrong
    try:
        method = external.target(**fixed, **kwargs)
    except BaseException as err:  # noqa: BLE001 — whatever the user's constructor raises, sys.exit() too
        if isinstance(err, KeyboardInterrupt):
            raise
        raise UserCodeError(f"{external.target.__name__}({given}) failed: {describe_exception(err)}",
                            external.name) from err
    try:  # configs sharing a method share its selection through a dict keyed by the method object
        hash(method)
    except Exception:  # noqa: BLE001 — unhashable (TypeError), or a __hash__ of the user's that raises
        raise UserCodeError(f"{external.target.__name__} objects must be hashable (a frozen dataclass, or a class "
                            "without __eq__)", external.name) from None
    return method


def is_own(method) -> bool:
    """Whether a method object is the user's: its class is defined outside spark-bench (registered, a config's
    ``_target_`` or an entry point). Its results are checked at run time (:mod:`spark_bench.methods.pipeline`)."""
    return type(method).__module__.split(".")[0] != "spark_bench"
