"""Logging and progress for the console scripts.

Every module logs through its own ``logging.getLogger(__name__)`` (all under ``spark_bench``); a console script
calls :func:`configure` once with the verbosity its ``-q`` / ``-v`` flags give (:func:`take_flags`): messages go to
stderr as ``spark-bench: <message>`` (``-q``: warnings and errors only; ``-v``: also debug lines and the
third-party progress bars). Results (tables, dry-run reports) stay on stdout; errors keep their one-line form.

Third-party bars (the GGUF conversion's, weight loading, datasets, the hub) are silenced unless ``-v``: their
libraries read ``TQDM_DISABLE`` / ``HF_*`` variables when first imported, which the console scripts do after
:func:`configure`. Our own progress (:class:`Progress`) is a tqdm bar on a terminal, one log line at most every
:data:`LINE_EVERY_S` seconds without one (SLURM, CI), and nothing under ``-q``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import ContextDecorator, contextmanager
from pathlib import Path

QUIET, NORMAL, VERBOSE = -1, 0, 1
LINE_EVERY_S = 30.0
LOGGER = logging.getLogger("spark_bench")
_SILENCE = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
            "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
_state = {"verbosity": NORMAL}


def take_flags(argv: list[str]) -> tuple[int, list[str]]:
    """The verbosity ``-q`` / ``--quiet`` / ``-v`` / ``--verbose`` give, and ``argv`` without them."""
    flags = {"-q": QUIET, "--quiet": QUIET, "-v": VERBOSE, "--verbose": VERBOSE}
    verbosity = NORMAL
    for arg in argv:
        verbosity = flags.get(arg, verbosity)
    return verbosity, [arg for arg in argv if arg not in flags]


def configure(verbosity: int = NORMAL, prefix: str = "spark-bench") -> None:
    """Route the ``spark_bench`` loggers to stderr at the verbosity's level; below ``-v``, silence third-party
    progress bars and advisory warnings (for libraries imported from here on)."""
    _state["verbosity"] = verbosity
    _state.pop("log_file", None)  # a new command: no run of its own has failed yet
    LOGGER.setLevel(logging.DEBUG if verbosity >= VERBOSE else logging.INFO)  # run.log keeps INFO under -q
    for handler in [h for h in LOGGER.handlers if getattr(h, "spark_bench", False)]:
        LOGGER.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel({QUIET: logging.WARNING, NORMAL: logging.INFO, VERBOSE: logging.DEBUG}[verbosity])
    handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
    handler.spark_bench = True
    LOGGER.addHandler(handler)
    LOGGER.propagate = False
    if verbosity < VERBOSE:
        for key, value in _SILENCE.items():
            os.environ.setdefault(key, value)
        if "transformers" in sys.modules:  # imported already: through its own switches
            import transformers

            transformers.utils.logging.set_verbosity_error()
            transformers.utils.logging.disable_progress_bar()


def verbosity() -> int:
    return _state["verbosity"]


class Progress:
    """Progress over ``total`` items: a tqdm bar on a terminal, else one ``logger`` line at most every
    ``every`` seconds (and at the end); nothing under ``-q`` or with ``enabled=False``."""

    def __init__(self, total: int, desc: str, initial: int = 0, logger: logging.Logger = LOGGER,
                 enabled: bool = True, every: float = LINE_EVERY_S, stream=None, clock=time.monotonic):
        self.total, self.desc, self.done, self.logger, self.every = total, desc, initial, logger, every
        self.postfix = ""
        self.enabled = enabled and verbosity() > QUIET
        stream = stream or sys.stderr
        self.bar = None
        if self.enabled and stream.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="sample", dynamic_ncols=True,
                            disable=False, file=stream)
        self.clock = clock
        self.last = clock()

    def update(self, n: int = 1, postfix: str = "") -> None:
        self.done += n
        self.postfix = postfix or self.postfix
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix_str(postfix)
        elif self.enabled and ((now := self.clock()) - self.last >= self.every or self.done >= self.total):
            self.last = now
            self.logger.info(f"{self.desc}: {self.done}/{self.total}" + (f" ({self.postfix})" if self.postfix else ""))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextmanager
def to_file(path: Path):
    """Within the block, the ``spark_bench`` log lines also go to ``path`` (appended, timestamped): a run's
    ``run.log``, opened once its inputs are validated (a refused run writes nothing). A failure inside the block
    leaves ``path`` as where :func:`write_traceback` / :class:`last_resort` put the traceback."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    LOGGER.addHandler(handler)
    _state["log_file"] = Path(path)
    try:
        yield
    finally:
        LOGGER.removeHandler(handler)
        handler.close()
    _state.pop("log_file", None)  # the block ended without an exception


def run_log() -> Path | None:
    """The log file of the run that failed inside :func:`to_file` (None: no run had opened one)."""
    return _state.get("log_file")


def write_traceback(err: BaseException, path: Path | None = None, header: str = "") -> Path:
    """Append ``err``'s whole traceback (its causes included) to ``path`` — the failed run's ``run.log`` when
    None and one is known, else a new temporary file — and return where it went."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    stamp = logging.Formatter(FILE_FORMAT).formatTime(logging.makeLogRecord({}))
    path = path or run_log()
    if path is not None:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{stamp} ERROR {header or 'spark_bench'}: traceback\n{text}")
            return Path(path)
        except OSError:
            pass  # the run directory cannot take it: a temporary file does
    fd, name = tempfile.mkstemp(prefix=f"{header or 'spark-bench'}-", suffix=".traceback.txt")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"{stamp} {' '.join(sys.argv)}\n{text}")
    return Path(name)


def traceback_frames(tb) -> list:
    """The frames of a traceback, innermost last."""
    import traceback

    return traceback.extract_tb(tb) if tb is not None else []


class last_resort(ContextDecorator):  # noqa: N801 — a context manager and a decorator, as quiet_placement
    """The console scripts' last resort: an exception no refusal of theirs handled (not a ``SystemExit``: user
    errors have already ended in one line, exit 2) is an internal error — one line on stderr,
    ``<tool>: internal error: <Type>: <message>; full traceback in <path>``, exit 1, the traceback appended to the
    failed run's ``run.log`` (:func:`to_file`) or else written to a temporary file; ``-v`` also prints it.
    A ``KeyboardInterrupt`` (Ctrl-C) is one line too, ``<tool>: interrupted …``, exit 130 (128 + SIGINT).

    Every console script's entry point runs under it; a Hydra task function runs its body under it too, since
    ``@hydra.main`` catches exceptions itself (printing its own traceback and exiting 1) before any wrapper outside
    it sees them. A class, not a generator: Hydra's multirun launchers pickle what runs inside them."""

    def __init__(self, tool: str):
        self.tool = tool

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if isinstance(err, KeyboardInterrupt):  # Ctrl-C (or code that raises it): one line too, exit 130
            path = write_traceback(err, header=self.tool)
            frames = traceback_frames(tb)
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            sys.stderr.write(f"\n{self.tool}: interrupted (KeyboardInterrupt{where}); traceback in {path}\n")
            sys.stderr.flush()
            raise SystemExit(130)
        if err is None or not isinstance(err, Exception):
            return False  # SystemExit (a refusal, or an inner last resort), GeneratorExit: as they are
        path = write_traceback(err, header=self.tool)
        if verbosity() >= VERBOSE:
            import traceback

            traceback.print_exception(type(err), err, tb, file=sys.stderr)
        message = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        sys.stderr.write(f"{self.tool}: internal error: {type(err).__name__}"
                         f"{': ' + message if message else ''}; full traceback in {path}\n")
        sys.stderr.flush()
        raise SystemExit(1)


def add_flags(parser) -> None:
    """``-q`` / ``-v`` on an argparse console script (its ``verbosity``; pass it to :func:`configure`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=QUIET, default=NORMAL,
                       help="warnings and errors only: no progress, no echoed tables, no third-party bars")
    group.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=VERBOSE,
                       help="debug lines and third-party progress bars too")
