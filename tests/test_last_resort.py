"""The console scripts' last resort (issue 56, :class:`spark_bench.logs.last_resort`): each script, run into an
internal error (a function it calls forced to raise), says so in one line — ``<tool>: internal error: <Type>:
<message>; full traceback in <path>`` — and exits 1; the traceback is in that file (the run's ``run.log`` once a run
has one, else a temporary file); ``-v`` prints it too. User errors stay one line, exit 2."""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import pytest

import spark_bench.cli as cli
from spark_bench import logs

BASE = ["model=tiny-llama", "benchmark.tasks=[niah_single_1]", "benchmark.num_samples=1", "benchmark.length=512",
        "benchmark.max_new_tokens=4", "progress=false", "method=snapkv"]
MESSAGE = "forced by the test"


@pytest.fixture(autouse=True)
def _no_hydra_left():
    """A console script stopped inside its Hydra task leaves Hydra's run config set for the process; later tests
    composing configs (``sweep.protocol_name``) would read its choices: put it back."""
    from hydra.core.hydra_config import HydraConfig

    before = HydraConfig.instance().cfg
    yield
    HydraConfig.instance().cfg = before


def _raise(*args, **kwargs):
    raise RuntimeError(f"{MESSAGE}\na second line the one line leaves out")


def _hydra_tool(module: str, function: str, patch: str):
    """A Hydra console script (``module.function``) with ``patch`` (``module.attr``) forced to raise."""
    def run(monkeypatch, tmp_path, verbose):
        import importlib

        target, _, attr = patch.rpartition(".")
        monkeypatch.setattr(importlib.import_module(target), attr, _raise)
        monkeypatch.setattr(sys, "argv", ["tool", *BASE, "budget=64", f"output_root={tmp_path / 'out'}", *(["-v"] * verbose)])
        getattr(importlib.import_module(module), function)()
    return run


def _merge(monkeypatch, tmp_path, verbose):
    import spark_bench.shards
    from spark_bench.tools import merge

    monkeypatch.setattr(spark_bench.shards, "merge_shards", _raise)
    merge([str(tmp_path), *(["-v"] * verbose)])


def _report(monkeypatch, tmp_path, verbose):
    import spark_bench.report as report

    monkeypatch.setattr(report, "build", _raise)
    report.main([str(tmp_path), *(["-v"] * verbose)])


def _export_kvpress(monkeypatch, tmp_path, verbose):
    import spark_bench.report.kvpress_format as kvpress_format

    monkeypatch.setattr(kvpress_format, "export_run", _raise)
    kvpress_format.main([str(tmp_path), "--out", str(tmp_path / "kvpress"), *(["-v"] * verbose)])


def _figure2(monkeypatch, tmp_path, verbose):
    import spark_bench.analysis.command as command

    (tmp_path / "memory.json").write_text("{}")
    monkeypatch.setattr(command, "check_output", _raise)
    command.figure2(["--memory", str(tmp_path / "memory.json"), "--out", str(tmp_path / "fig"), *(["-v"] * verbose)])


def _lm_eval(monkeypatch, tmp_path, verbose):
    pytest.importorskip("lm_eval")
    import lm_eval.__main__

    from spark_bench.lm_eval_model import main

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", _raise)
    monkeypatch.setattr(sys, "argv", ["spark-bench-lm-eval", "--model", "spark-bench", "--tasks", "x",
                                      *(["-v"] * verbose)])
    main()


# console script (pyproject.toml [project.scripts]) → how to run it into an internal error
SCRIPTS = {
    "spark-bench": _hydra_tool("spark_bench.cli", "main", "spark_bench.cli.validate"),
    "spark-bench-export": _hydra_tool("spark_bench.tools", "export", "spark_bench.tools.validate"),
    "spark-bench-memory": _hydra_tool("spark_bench.tools", "memory", "spark_bench.tools.validate"),
    "spark-bench-merge": _merge,
    "spark-bench-export-kvpress": _export_kvpress,
    "spark-bench-report": _report,
    "spark-bench-saliency": _hydra_tool("spark_bench.analysis.command", "saliency",
                                        "spark_bench.analysis.command.prepare"),
    "spark-bench-figure2": _figure2,
    "spark-bench-lm-eval": _lm_eval,
    "spark-bench-leank": _hydra_tool("spark_bench.leank.command", "main", "spark_bench.leank.command.prepare"),
}


def test_every_console_script_is_covered():
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    scripts = re.search(r"\[project\.scripts\]\n(.*?)\n\n", text, re.S).group(1)
    assert sorted(line.split(" = ")[0] for line in scripts.splitlines()) == sorted(SCRIPTS)


def _internal_error(capsys, call) -> tuple[list[str], Path]:
    with pytest.raises(SystemExit) as exit_:
        call()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 1, err
    found = re.fullmatch(r"(\S+): internal error: RuntimeError: forced by the test; full traceback in (\S+)", err[-1])
    assert found, err
    return err, Path(found.group(2))


@pytest.mark.parametrize("tool", list(SCRIPTS))
def test_an_internal_error_is_one_line_exit_1_and_its_traceback_in_a_file(tool, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    err, path = _internal_error(capsys, lambda: SCRIPTS[tool](monkeypatch, tmp_path, False))
    assert len(err) == 1 and err[0].startswith(f"{tool}: internal error: "), err
    assert path.parent == tmp_path / "tmp" and path.name.startswith(f"{tool}-")  # no run directory: a temporary file
    text = path.read_text()
    assert "Traceback (most recent call last)" in text and f"RuntimeError: {MESSAGE}" in text
    assert "in _raise" in text  # the frame that raised
    err, again = _internal_error(capsys, lambda: SCRIPTS[tool](monkeypatch, tmp_path, True))  # -v: printed too
    assert err[0] == "Traceback (most recent call last):" and f"RuntimeError: {MESSAGE}" in err, err
    assert again != path and again.is_file()


def test_an_internal_error_during_a_run_goes_into_its_run_log(tmp_path, monkeypatch, capsys):
    """Once the run's ``run.log`` is open, the traceback is appended there; the run directory keeps its record."""
    monkeypatch.setattr(cli, "_compute", _raise)
    monkeypatch.setattr(sys, "argv", ["spark-bench", "-q", *BASE, "budget=64", f"output_root={tmp_path}", "run=r"])
    err, path = _internal_error(capsys, cli.main)
    assert err == [f"spark-bench: internal error: RuntimeError: {MESSAGE}; full traceback in {path}"]
    assert path == tmp_path / "r" / "run.log"
    assert "Traceback (most recent call last)" in path.read_text() and "in _raise" in path.read_text()
    assert logs.run_log() == path  # until the next command configures the logging


def test_a_multirun_job_that_fails_internally_is_one_line_too(tmp_path, monkeypatch, capsys):
    """``-m``: Hydra runs each job through its launcher, which would report the exception itself."""
    monkeypatch.setattr(cli, "validate", lambda cfg, sources=True: _raise())
    monkeypatch.setattr(cli, "check_sweep", lambda jobs, check_job: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["spark-bench", "-m", *BASE, "budget=64,96", f"output_root={tmp_path}"])
    err, path = _internal_error(capsys, cli.main)
    assert len(err) == 1 and path.is_file(), err


def test_a_user_error_stays_exit_2_with_hydra_verbose(tmp_path, monkeypatch, capsys):
    """``hydra.verbose=true`` shows a refusal's traceback, and it stays a user error: exit 2, not an internal one."""
    monkeypatch.setattr(sys, "argv", ["spark-bench", *BASE, "budget=64", "kernel_size=4", "hydra.verbose=true",
                                      f"output_root={tmp_path / 'out'}"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "internal error" not in err
    assert err.strip().splitlines()[-1].startswith("spark-bench: error: method: kernel_size must be an odd integer")


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("tool", list(SCRIPTS))
def test_an_interrupt_is_one_line_exit_130(tool, tmp_path, monkeypatch, capsys):
    """Ctrl-C (a ``KeyboardInterrupt``, or code of the user's that raises one) in any console script: one line
    naming where it stopped, exit 130 (128 + SIGINT), the traceback in a file — not 70 lines of traceback."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setitem(globals(), "_raise", _interrupt)
    with pytest.raises(SystemExit) as exit_:
        SCRIPTS[tool](monkeypatch, tmp_path, False)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 130 and len(err) == 1, err
    found = re.fullmatch(rf"{tool}: interrupted \(KeyboardInterrupt at .*test_last_resort\.py:\d+\); traceback in "
                         r"(.*)", err[0])
    assert found, err
    assert "KeyboardInterrupt" in Path(found.group(1)).read_text()
