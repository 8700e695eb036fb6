"""The one boundary the user's own code enters through: a method class (a method config's ``_target_``, an entry
point), a dotted kvpress press, a method config file, and, during a run, the methods' own calls.

:func:`import_object` imports every module of the user's, :func:`load_yaml` reads every config file of the user's
that spark-bench reads itself, and :func:`call` runs a user method's ``select`` / ``compress_keys`` at run time.
Whatever goes wrong there — an ImportError, a SyntaxError, any exception raised at import time (``sys.exit()``
and other ``BaseException`` s too; only Ctrl-C's ``KeyboardInterrupt`` passes), invalid YAML, an exception in the
user's method — is one :class:`UserCodeError` line naming the module (or method), the file
(``file:line``) and the exception; the console scripts print it as a refusal (exit 2), and its traceback stays on
the exception (``-v``; a run's ``run.log``). Torch-free: the command line's checks import it before any model.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from pathlib import Path

__all__ = ["UserCodeError", "call", "describe_exception", "import_object", "load_yaml", "one_line", "yaml_error"]


class UserCodeError(ValueError):
    """The user's code failed at the boundary (module docstring): one line, ``str(err)``. At run time ``method``
    names the method and ``sample`` the sample being compressed (set by the runner, :meth:`at`): the line reads
    ``method <name>, sample <id>: <message>``; ``None`` before a run or in the library."""

    def __init__(self, message: str, method: str | None = None, sample: str | None = None):
        super().__init__(message)
        self.message, self.method, self.sample = message, method, sample

    def at(self, sample: str) -> "UserCodeError":
        """The same error, naming the ``sample`` it happened on (its cause and traceback kept)."""
        err = UserCodeError(self.message, self.method, sample)
        err.__cause__, err.__traceback__ = self.__cause__, self.__traceback__
        return err

    def __str__(self) -> str:
        who = [f"method {self.method}"] * (self.method is not None) + [f"sample {self.sample}"] * (
            self.sample is not None)
        return f"{', '.join(who)}: {self.message}" if who else self.message


def one_line(text, limit: int = 300) -> str:
    """The first non-empty line of ``str(text)``, at most ``limit`` characters."""
    line = next((x.strip() for x in str(text).splitlines() if x.strip()), "")
    return line if len(line) <= limit else line[:limit - 1] + "…"


def describe_exception(err: BaseException) -> str:
    """``<Type>: <first line of the message> at <file>:<line>``: where a SyntaxError points, else the innermost
    frame of the traceback (the user's line, or the library line it called)."""
    text = f"{type(err).__name__}: {one_line(err)}" if one_line(err) else type(err).__name__
    if isinstance(err, SyntaxError) and err.filename:
        return f"{type(err).__name__}: {one_line(err.msg or '')} at {err.filename}:{err.lineno}"
    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ is not None else []
    own = [f for f in frames if "importlib" not in f.filename and not f.filename.startswith("<frozen")]
    if own:
        return f"{text} at {own[-1].filename}:{own[-1].lineno}"
    return text


def _module_file(module: str) -> str:
    """The file a module would be imported from, for the message (``?`` when it cannot be found)."""
    try:
        spec = importlib.util.find_spec(module)
    except Exception:  # noqa: BLE001 — a parent package that fails to import: named by the import itself
        return "?"
    return spec.origin if spec is not None and spec.origin else "?"


def _import_failed(who: str, module: str, err: BaseException) -> str:
    """``<who>: importing <module> failed: <Type>: <message> at <file>:<line>`` (the module's file too when the
    error is elsewhere, e.g. in a module it imports)."""
    where, what = _module_file(module), describe_exception(err)
    return f"{who}: importing {module} failed: {what}" if f" at {where}:" in what else \
        f"{who}: importing {module} ({where}) failed: {what}"


def import_object(target: str, who: str) -> object:
    """``package.module:attr`` or ``package.module.attr`` imported: the one place user code is imported. ``who``
    names what asked for it (``method my_method (conf/method/my_method.yaml)``). Any failure is one
    :class:`UserCodeError` line naming the module, its file and the exception (``file:line``)."""
    if not isinstance(target, str) or not target.strip():
        raise UserCodeError(f"{who}: the class to import is {target!r}; give 'package.module.Class' or "
                            "'package.module:Class'")
    module, sep, attr = target.partition(":")
    if not sep:
        module, _, attr = target.rpartition(".")
    if not module or not attr:
        raise UserCodeError(f"{who}: {target!r} is not 'package.module.Class' or 'package.module:Class'")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and (module == err.name or module.startswith(err.name + ".")):
            raise UserCodeError(f"{who}: no module named {err.name!r} (importing {target}); is its directory on "
                                "the Python path (PYTHONPATH=...) or its package installed?") from err
        raise UserCodeError(_import_failed(who, module, err)) from err
    except BaseException as err:  # noqa: BLE001 — anything the user's module raises on import, sys.exit() too
        if isinstance(err, KeyboardInterrupt):
            raise  # Ctrl-C: the user's, not the module's (the console scripts' last resort says "interrupted")
        raise UserCodeError(_import_failed(who, module, err)) from err
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            where = getattr(sys.modules.get(module), "__file__", None) or "?"
            raise UserCodeError(f"{who}: module {module} ({where}) has no {attr!r}") from None
        except Exception as err:  # noqa: BLE001 — a module __getattr__ of the user's
            raise UserCodeError(f"{who}: {target}: {describe_exception(err)}") from err
    return obj


def load_yaml(path: Path, what: str = "a method config is a mapping (name: ..., _target_: ...)",
              resolve: bool = True) -> dict:
    """A config file of one's own read as a mapping (``resolve``: its interpolations resolved); invalid YAML, or a
    file that is not a mapping (a list, a bare value: ``what`` says what it should be), is one
    :class:`UserCodeError` line naming ``file:line``. An empty file is an empty mapping."""
    from omegaconf import OmegaConf

    try:
        node = OmegaConf.load(path)
        values = OmegaConf.to_container(node, resolve=resolve)
    except Exception as err:  # noqa: BLE001 — yaml's errors, OmegaConf's (interpolation), an unreadable file
        raise UserCodeError(yaml_error(err, path)) from err
    if not isinstance(values, dict):
        raise UserCodeError(f"{path}:1: {what}, not a {type(values).__name__}")
    return values


def yaml_error(err: BaseException, path=None) -> str:
    """One line for an error reading a YAML file: ``file:line: <problem>`` from yaml's marks (1-based), else the
    file and the first line of the error."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or getattr(err, "context", None)
    if mark is not None:
        name = path if path is not None else getattr(mark, "name", "?")
        return f"{name}:{mark.line + 1}: invalid YAML: {problem or one_line(err)} (column {mark.column + 1})"
    return f"{path if path is not None else '?'}: cannot be read: {type(err).__name__}: {one_line(err)}"


def call(name: str, what: str, function, *args):
    """``function(*args)``, a method of the user's run at run time (``what``: ``select()``, ``compress_keys()``,
    with the layer): what it raises is one :class:`UserCodeError` line naming the method ``name``, ``what`` and the
    exception (``file:line``); the traceback stays on the error's cause."""
    try:
        return function(*args)
    except BaseException as err:  # noqa: BLE001 — the user's code: anything it raises (sys.exit() too) ends the
        if isinstance(err, KeyboardInterrupt):  # run in one line; Ctrl-C is the user's, not the method's
            raise
        raise UserCodeError(f"{what} raised {describe_exception(err)}", method=name) from err
