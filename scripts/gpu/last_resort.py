"""The last resort of the Makefile's script steps that run before the project is importable (``make wheelhouse``,
``make node-install``, ``make test-compat``: standard library only, by a Python that may not have spark-bench).

The same contract as the console scripts' :class:`spark_bench.logs.last_resort`: what a script refuses ends in one
line, exit 2 (:func:`refuse`); an exception nothing handled is an internal error — one line on stderr,
``<tool>: internal error: <Type>: <message>; full traceback in <path>`` (a temporary file), exit 1; ``-v`` (or
``--verbose``) on the command line prints the traceback too. A step that failed also removes what it had begun
(:func:`guarded`'s ``cleanup``), so nothing is left half built.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback


def refuse(tool: str, message: str) -> None:
    """One line on stderr, exit 2 (a user error: a bad input or an unusable place)."""
    print(f"{tool}: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def write_traceback(tool: str, err: BaseException) -> str:
    """The traceback of ``err`` (and the command line) in a new temporary file; its path."""
    fd, path = tempfile.mkstemp(prefix=f"{tool}-", suffix=".traceback.txt")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n")
        f.write("".join(traceback.format_exception(type(err), err, err.__traceback__)))
    return path


def guarded(tool: str, main, cleanup=None) -> None:
    """Run ``main()``; an exception that is not a ``SystemExit`` (a refusal) or a ``KeyboardInterrupt`` is an
    internal error (one line, exit 1, the traceback in a temporary file). ``cleanup()``, when given, runs after any
    failure (a refusal, an internal error, an interrupt) to remove what the step had begun."""
    try:
        main()
    except SystemExit as done:
        if done.code not in (0, None) and cleanup is not None:
            cleanup()
        raise
    except KeyboardInterrupt:
        if cleanup is not None:
            cleanup()
        raise
    except Exception as err:  # noqa: BLE001 — the last resort
        if cleanup is not None:
            cleanup()
        path = write_traceback(tool, err)
        if "-v" in sys.argv[1:] or "--verbose" in sys.argv[1:]:
            traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
        message = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        print(f"{tool}: internal error: {type(err).__name__}{': ' + message if message else ''}; full traceback in "
              f"{path}", file=sys.stderr, flush=True)
        sys.exit(1)
