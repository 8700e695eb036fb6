"""Long sweeps: bad input refused before anything runs, kill -9 + resume, determinism, launchers, shards."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import reproducible

FIXTURES = Path(__file__).parent / "fixtures"
BASE = ["model=tiny-llama", "benchmark.tasks=[niah_single_1,niah_multikey_2]", "benchmark.length=512",
        "benchmark.max_new_tokens=6", "progress=false"]


def cli(args, cwd, timeout=600, wait=True):
    cmd = [sys.executable, "-m", "spark_bench.cli", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _bad_longbench(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "hotpotqa.jsonl").write_text('{"input": "q", "context": "c", "answers": ["a"]}\n{oops\n')
    return [f"longbench.data_dir={tmp_path / 'data'}", "benchmark=longbench", "benchmark.tasks=[hotpotqa]"]


# the whole command line (exit code, stderr, no Hydra files), one case per stage of the checks: the last stage (a
# data file read after the tokenizer loads) in a fresh process, the others through the same console-script entry in
# this process; the table of every bad input runs in-process in tests/test_bad_inputs.py
BAD_INPUTS = {
    "unknown model": (["model=nope"], "model=nope: no such model config (conf/model/); valid: llama3-8b"),
    "ratio out of range": (["method=spark", "ratio=1.2"], "ratio must be a number >= 0 and < 1; got 1.2"),
    "budget below window": (["method=snapkv", "budget=16"], "budget=16 (16 tokens) is smaller than the observation"),
    "malformed record": (None, "hotpotqa.jsonl:2: not valid JSON"),
    "bad shard": (["shard=3/2"], "shard=3/2: need 0 <= i < n"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_clear_error_and_writes_nothing(tmp_path, case, console):
    args, message = BAD_INPUTS[case]
    if args is None:
        args = _bad_longbench(tmp_path)
    before = set(tmp_path.rglob("*"))
    base = ["model=tiny-llama"] if "benchmark=longbench" in args else BASE  # RULER-only keys don't apply
    args = [*base, *args, f"output_root={tmp_path / 'results'}"]
    if case == "malformed record":
        out = cli(args, cwd=tmp_path)
        code, stderr = out.returncode, out.stderr
    else:
        code, _, stderr = console(args)
    assert code == 2
    assert message in stderr and len(stderr.strip().splitlines()) == 1, stderr[-1500:]
    assert "Traceback" not in stderr
    assert set(tmp_path.rglob("*")) == before  # no results dir, no Hydra files, nothing


def _sweep_args(root, run):
    return [*BASE, "benchmark.num_samples=3", "method=snapkv+spark", "ratio=0.8", "budget=64",
            f"output_root={root}", f"run={run}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted run of the sweep, the reference the resumed, repeated and sharded runs must equal byte for
    byte (run once for the module)."""
    root = tmp_path_factory.mktemp("reference")
    reference = cli(_sweep_args(root, "uninterrupted"), cwd=root)
    assert reference.returncode == 0, reference.stderr[-2000:]
    return root / "uninterrupted"


def test_kill_9_then_resume_loses_and_repeats_nothing(tmp_path, uninterrupted, console, capsys):
    """A real process killed with SIGKILL; the report, the refused and the repaired resume, and the reruns after it
    go through the console scripts' own entries in this process (conftest's ``console``): every comparison
    is still across processes, against the reference run's."""
    proc = cli(_sweep_args(tmp_path, "killed"), cwd=tmp_path, wait=False)
    predictions = tmp_path / "killed" / "predictions.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:  # kill after two of the six samples are on disk
        if predictions.exists() and len(predictions.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = predictions.read_text().splitlines()
    assert 2 <= len(partial) < 6 and not (tmp_path / "killed" / "table.md").exists()
    # the session's record was written as it started: the kill leaves it, running, with no end
    (killed,) = json.loads((tmp_path / "killed" / "manifest.json").read_text())["runs"]
    assert (killed["status"], killed["ended"], killed["dtype"], killed["pid"]) == ("running", None, "float32", proc.pid)
    _report_says_the_run_is_incomplete(tmp_path / "killed", len(partial), capsys)
    # a damaged middle line: the resume names it and refuses (nothing changed), repair=true moves it aside
    lines = predictions.read_bytes().split(b"\n")
    lines[0] = lines[0][:40]
    predictions.write_bytes(b"\n".join(lines))
    before = {p: p.read_bytes() for p in (tmp_path / "killed").iterdir() if p.name != ".lock"}
    code, _, err = console(_sweep_args(tmp_path, "killed"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert f"run=killed: {predictions}:1: not a JSON record (Unterminated string" in err
    assert "rerun with repair=true" in err
    assert {p: p.read_bytes() for p in (tmp_path / "killed").iterdir() if p.name != ".lock"} == before
    code, _, err = console([*_sweep_args(tmp_path, "killed"), "repair=true"])
    assert code == 0, err[-2000:]
    assert f"{len(partial) - 1} of 6 predictions already done" in err
    assert (tmp_path / "killed" / "predictions.jsonl.damaged").read_bytes() == lines[0] + b"\n"
    for name in ("predictions.jsonl", "scores.csv", "table.md"):  # byte-identical to the uninterrupted run
        assert reproducible(tmp_path / "killed" / name) == reproducible(uninterrupted / name)
    timings = [json.loads(line) for line in (tmp_path / "killed" / "timings.jsonl").read_text().splitlines()]
    # nothing computed twice (a kill between the two appends may lose one sample's timing line, never a prediction)
    assert len(timings) == len({(t["id"], t["config"]) for t in timings}) >= 5
    runs = json.loads((tmp_path / "killed" / "manifest.json").read_text())["runs"]
    assert [r["status"] for r in runs] == ["running", "finished"] and runs[0] == killed  # the refusal: no record
    code, _, err = console(_sweep_args(tmp_path, "killed"))
    assert code == 0 and "6 of 6 predictions already done" in err, err[-2000:]
    code, _, err = console([*_sweep_args(tmp_path, "killed"), "ratio=0.5"])
    assert code == 2 and "holds results of a different configuration (differs in: configs" in err, err[-2000:]


def _report_says_the_run_is_incomplete(run: Path, done: int, capsys) -> None:
    import re

    from spark_bench.report import main as report

    capsys.readouterr()
    report([str(run), "--layout", "ruler"])
    out = capsys.readouterr()
    assert f"incomplete: {run}: {done} of 6 predictions (" in out.err and "configs missing some)" in out.err
    assert "**Incomplete:" in out.out and re.search(r"\d\*", out.out)  # the cells marked
    with pytest.raises(SystemExit) as refused:
        report([str(run), "--layout", "ruler", "--require-complete"])
    assert refused.value.code == 2


def test_same_seed_same_bytes(tmp_path, uninterrupted, console):
    """The sweep again, in another process than the reference (this one): the same predictions, byte for byte."""
    code, _, err = console(_sweep_args(tmp_path, "again"))
    assert code == 0, err[-2000:]
    assert (tmp_path / "again" / "predictions.jsonl").read_bytes() == (uninterrupted / "predictions.jsonl").read_bytes()


def test_the_parallel_launcher_composes(console):
    """``hydra/launcher=local_parallel`` (joblib processes on one machine) resolves with the run's options; the
    two-job sweep below runs through submitit's local launcher, the cluster's path."""
    code, out, err = console([*BASE, "hydra/launcher=local_parallel", "--cfg", "hydra"])
    assert code == 0 and "JoblibLauncher" in out and "n_jobs: 2" in out, (out[-2000:], err[-2000:])


@pytest.mark.parametrize("launcher", ["local_submitit"])
def test_two_job_sweep_through_launcher(tmp_path, launcher):
    out = cli(["-m", f"hydra/launcher={launcher}", *BASE, "benchmark.num_samples=1", "method=snapkv,tova",
               "budget=64", f"output_root={tmp_path}", "run=multi"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    for job in ("0", "1"):
        table = (tmp_path / "multi" / job / "table.md").read_text()
        assert ("SnapKV @64" if job == "0" else "TOVA @64") in table


def test_shards_merge_into_the_unsharded_result(tmp_path, uninterrupted, console):
    for shard in ("0/2", "1/2"):
        code, _, err = console([*_sweep_args(tmp_path, "sharded"), f"shard={shard}"])
        assert code == 0, err[-2000:]
    code, _, err = console([tmp_path / "sharded"], "spark-bench-merge")
    assert code == 0, err
    for name in ("predictions.jsonl", "scores.csv", "table.md"):
        assert reproducible(tmp_path / "sharded" / name) == reproducible(uninterrupted / name)
