"""Logging: status lines through ``logging`` on stderr (``-q``: none; ``run.log`` in the run directory), no
third-party progress bars unless ``-v``, and progress without a terminal at most one line every 30 s."""

import io
import logging
import subprocess
import sys

from conftest import cli_env

from spark_bench import logs


def _cli(*args, tmp_path):
    command = [sys.executable, "-m", "spark_bench.cli", *args, "method=snapkv", "budget=64",
               "benchmark.tasks=[niah_single_1]", "benchmark.length=512", "benchmark.num_samples=1",
               "benchmark.max_new_tokens=2", f"output_root={tmp_path}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=cli_env())


def test_a_run_logs_lines_not_bars_and_quiet_logs_nothing(smollm2_run, tmp_path):
    """The embedded GGUF model (whose loader draws a 272-step bar) without a terminal: a few ``spark-bench:``
    lines and no carriage return; ``-q``: nothing on stderr; both runs keep their lines in ``run.log``. The SmolLM2
    run is conftest's ``smollm2_run`` (the default sweep, shared with the peak-memory test)."""
    out, default = smollm2_run
    lines = out.stderr.splitlines()
    assert "\r" not in out.stderr and "Converting" not in out.stderr and "Loading weights" not in out.stderr
    assert lines and all(line.startswith("spark-bench: ") for line in lines), lines
    per_config = [line for line in lines if ": score " in line]  # the summary: one line per config of the sweep
    assert len(per_config) == 6 and len(lines) - len(per_config) <= 7, lines  # and a few status lines
    assert any("smollm2-135m on ruler (1 samples)" in line for line in lines)
    assert "| Method |" in out.stdout
    quiet = _cli("-q", "model=tiny-llama", "run=quiet", tmp_path=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == "" and "| Method |" in quiet.stdout
    for run in (default, tmp_path / "quiet"):
        text = (run / "run.log").read_text()
        assert "INFO spark_bench.cli:" in text and "INFO spark_bench.runner:" in text


def test_progress_without_a_terminal_is_one_line_per_30_seconds():
    readings = iter([0.0, 1.0, 10.0, 29.0, 31.0, 40.0, 50.0, 70.0])  # the clock: start, then one per update
    logger = logging.getLogger("spark_bench.test_progress")
    seen = []
    logger.addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: seen.append(r.getMessage())})())
    logger.setLevel(logging.INFO)
    progress = logs.Progress(7, "run", logger=logger, stream=io.StringIO(), clock=lambda: next(readings))
    for _ in range(7):
        progress.update(1, "2.0 tok/s")
    assert seen == ["run: 4/7 (2.0 tok/s)", "run: 7/7 (2.0 tok/s)"]  # at 31 s, then the last item


def test_flags_and_levels():
    assert logs.take_flags(["-q", "model=x"]) == (logs.QUIET, ["model=x"])
    assert logs.take_flags(["--verbose", "run=a"]) == (logs.VERBOSE, ["run=a"])
    try:
        logs.configure(logs.QUIET)
        console = [h for h in logs.LOGGER.handlers if getattr(h, "spark_bench", False)]
        assert [h.level for h in console] == [logging.WARNING] and logs.LOGGER.level == logging.INFO
        assert not logs.Progress(3, "x", stream=io.StringIO()).enabled
    finally:
        logs.configure(logs.NORMAL)
    assert logs.LOGGER.level == logging.INFO
