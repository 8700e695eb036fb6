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
from contextlib import contextmanager
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


@contextmanager
def to_file(path: Path):
    """Within the block, the ``spark_bench`` log lines also go to ``path`` (appended, timestamped): a run's
    ``run.log``, opened once its inputs are validated (a refused run writes nothing)."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    LOGGER.addHandler(handler)
    try:
        yield
    finally:
        LOGGER.removeHandler(handler)
        handler.close()


def add_flags(parser) -> None:
    """``-q`` / ``-v`` on an argparse console script (its ``verbosity``; pass it to :func:`configure`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=QUIET, default=NORMAL,
                       help="warnings and errors only: no progress, no echoed tables, no third-party bars")
    group.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=VERBOSE,
                       help="debug lines and third-party progress bars too")
