"""A study survives an upgrade (issue 56 item 4) and every run says where its numbers came from (issue 54 item 1):
provenance in the manifest from the start, the old default directory found, old predictions brought up to date
(rescored, or recomputed where they need the caches), a changed sweep named, damaged records named and repaired,
shards of different versions refused unless --allow-mixed, two runs with one label told apart in a report."""

import json
import re
import shutil

import pytest
from conftest import reproducible
from test_protocol import _compose

import spark_bench.cli as cli
from spark_bench.checks import ConfigError
from spark_bench.results import fingerprint
from spark_bench.upgrade import old_default_dir

BASE = ["model=tiny-llama", "benchmark.tasks=[niah_single_1]", "benchmark.num_samples=2", "benchmark.length=512",
        "benchmark.max_new_tokens=4", "progress=false"]
FIDELITY = ("answer_nll", "kl_full", "agree_full", "kl_tokens")


def _cfg(root, *extra):
    return _compose([*BASE, f"output_root={root}", *extra])


def _run(cfg, root):
    cli.run(cfg, root / cfg.run)
    return root / cfg.run


def _manifest(run):
    return json.loads((run / "manifest.json").read_text())


def _records(run):
    return [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The demo sweep on tiny-llama (2 samples) under its default run directory, run once for the module."""
    root = tmp_path_factory.mktemp("study")
    cfg = _cfg(root)
    return cfg, _run(cfg, root)


def _as_old_version(run, old, strip=range(0)):
    """``run`` copied to ``old`` as the previous version left it: no provenance (``runs``), no ``benchmark.truncate``
    in the payload (that version had no such option; the fingerprint over its payload), and the predictions at
    positions ``strip`` without the fidelity numbers, their score altered."""
    shutil.copytree(run, old)
    manifest = _manifest(old)
    del manifest["runs"]
    del manifest["payload"]["benchmark"]["truncate"]
    manifest["fingerprint"] = fingerprint(manifest["payload"])
    (old / "manifest.json").write_text(json.dumps(manifest))
    records = _records(old)
    for i in strip:
        for field in FIDELITY:
            records[i].pop(field)
        records[i]["score"] = 55.0
    (old / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name in ("table.md", "scores.csv"):
        (old / name).unlink()


def test_the_manifest_records_provenance_from_start_to_end(study, tmp_path, monkeypatch):
    cfg, run = study
    (record,) = _manifest(run)["runs"]
    assert record["status"] == "finished" and record["ended"] >= record["started"]
    assert record["spark_bench"]["version"] == "0.1.0"
    assert re.fullmatch(r"[0-9a-f]{40}", record["spark_bench"]["commit"]) and record["spark_bench"]["dirty"] in (
        True, False)  # the tests run from a checkout
    assert set(record["packages"]) == {"torch", "transformers", "triton", "kvpress", "datasets", "hydra-core"}
    assert record["packages"]["torch"] and record["packages"]["hydra-core"] and record["python"].count(".") == 2
    assert record["device"]["name"] and record["device"]["count"] >= 1
    assert (record["dtype"], record["attn_implementation"]) == ("float32", "sdpa")
    assert record["host"] and record["command"]
    # git absent (an install, a bare machine): no commit, the rest as before
    from spark_bench import provenance

    provenance.git_state.cache_clear()
    monkeypatch.setattr(provenance.shutil, "which", lambda name: None)
    assert provenance.version()["commit"] is None and provenance.session("cpu")["spark_bench"]["version"]
    provenance.git_state.cache_clear()


def test_the_record_is_written_as_the_run_starts(tmp_path, monkeypatch):
    """Before the model loads, the session is in the manifest (a SIGKILL from then on leaves it: ``status:
    running``, no end; tests/test_durability.py kills a real run); a failure to load says how it stopped."""
    seen = []

    def load(*args, **kwargs):
        seen.append(_manifest(tmp_path / "r")["runs"][-1])
        raise RuntimeError("the model could not be loaded")

    monkeypatch.setattr(cli, "load_model", load)
    with pytest.raises(RuntimeError):
        _run(_cfg(tmp_path, "method=snapkv", "budget=64", "run=r"), tmp_path)
    (started,) = seen
    assert started["status"] == "running" and started["ended"] is None and "dtype" not in started
    (ended,) = _manifest(tmp_path / "r")["runs"]
    assert ended["status"] == "stopped: RuntimeError: the model could not be loaded" and ended["ended"]


def test_an_old_studys_default_directory_is_found_and_continued(study, tmp_path, spark_log):
    """The previous version's default ``<model>_<benchmark>``: a rerun of the study's command without ``run=`` is
    refused in one line giving the ``run=`` that continues it; continued, its predictions that lack the fidelity
    numbers are computed again (the others rescored from their text), so the table equals the uninterrupted run's
    and the last log lines print what the table prints."""
    cfg, run = study
    root = run.parent
    old = root / "tiny-llama_ruler"
    _as_old_version(run, old, strip=range(6))  # the first sample's six configs
    aside = run.with_name("aside")
    run.rename(aside)  # the study as a user has it: only the old directory (a default one of its own resumes there)
    try:
        with pytest.raises(ConfigError) as refused:
            _run(_cfg(root), root)
        (line,) = str(refused.value).splitlines()
        assert line.startswith(f"run: {old} holds a run begun by an older spark-bench") and \
            f"continue it with run=tiny-llama_ruler, or start afresh in {run} with run={run.name}" in line
        # a default directory under another hash (a newer version added benchmark.truncate: every hash moved)
        hashed = root / "tiny-llama_ruler_0badc0de"
        _as_old_version(aside, hashed)
        manifest = _manifest(hashed)
        manifest["runs"] = []
        (hashed / "manifest.json").write_text(json.dumps(manifest))
        refusal, _ = old_default_dir(_cfg(root), run, json.loads((aside / "manifest.json").read_text())["payload"])
        assert refusal.startswith(f"run: {old}") and "run=tiny-llama_ruler," in refusal  # the un-hashed one first
        old.rename(root / "old-aside")
        refusal, _ = old_default_dir(_cfg(root), run, json.loads((aside / "manifest.json").read_text())["payload"])
        assert refusal.startswith(f"run: {hashed} holds a run begun under another default run directory") and \
            f"continue it with run={hashed.name}, or start afresh in {run} with run={run.name}" in refusal
        (root / "old-aside").rename(old)
        shutil.rmtree(hashed)
    finally:
        aside.rename(run)
    assert old_default_dir(_cfg(root), run, {"any": "payload"}) == (None, None)  # its own directory holds a run
    records = _records(old)
    # another configuration there: said, and the run starts in its own directory
    other = _cfg(root, "method=snapkv", "budget=64")
    refusal, note = old_default_dir(other, root / other.run, {"another": "payload"})
    assert refusal is None and note.startswith(f"note: {old} holds a run begun by an older spark-bench")
    spark_log.clear()
    _run(_cfg(root, "run=tiny-llama_ruler"), root)
    assert any("was begun by an older spark-bench without benchmark.truncate (added since, here at its default): "
               "the same study, resumed" in line for line in spark_log), spark_log
    assert any("6 stored prediction(s) of 1 sample(s) lack answer_nll, kl_full, agree_full, kl_tokens (written by "
               "an older spark-bench; they need the caches): computed again" in line for line in spark_log)
    assert "resuming" in " ".join(spark_log) and "6 of 12 predictions already done" in " ".join(spark_log)
    after = _records(old)
    assert len(after) == 12 and all(all(f in r for f in FIDELITY) for r in after)
    timings = [json.loads(line) for line in (old / "timings.jsonl").read_text().splitlines()]
    assert len(timings) == len({(t["id"], t["config"]) for t in timings}) == 12  # the old lines of those: gone
    assert [r["prediction"] for r in after] == [r["prediction"] for r in records]
    for name in ("table.md", "scores.csv"):  # the measured times aside, the uninterrupted run's tables
        assert reproducible(old / name) == reproducible(run / name)
    manifest = _manifest(old)
    assert manifest["upgraded"][0]["added"] == ["benchmark.truncate"] and manifest["runs"][0]["status"] == "finished"
    table = (old / "table.md").read_text()
    for line in spark_log:  # stderr's last lines: the table's numbers
        label, _, rest = line.partition(": score ")
        if rest:
            row = next(r for r in table.splitlines() if r.startswith(f"| {label} |"))
            assert f"answer NLL {row.split(' | ')[3].split(' ±')[0]}" in rest, (line, row)


def test_stored_scores_are_recomputed_by_this_versions_metric(study, tmp_path):
    from spark_bench.methods import Pipeline
    from spark_bench.runner import CACHE_FIELDS
    from spark_bench.upgrade import refresh

    cfg, run = study
    stored = {(r["id"], r["config"]): r for r in _records(run)}
    records = {key: {**r, "score": 55.0} for key, r in stored.items()}
    del records[next(iter(records))]["task"]
    samples = [type("S", (), {"id": i, "task": "niah_single_1", "answers": r["answers"], "metric": "string_match_all",
                              "metric_args": {}, "meta": {}})() for (i, _), r in records.items()]
    pipelines = [Pipeline.from_config(cli.method_configs(cfg)[k], label) for k, label in
                 enumerate(dict.fromkeys(c for _, c in records))]
    rescored, dropped, lines = refresh(records, samples, pipelines, CACHE_FIELDS)
    assert (rescored, dropped) == (12, 0) and lines == [
        "resume: 12 stored score(s) differ from this version's scoring of the stored predictions: rescored"]
    assert all(r["score"] == stored[key]["score"] and r["task"] == "niah_single_1" for key, r in records.items())


def test_a_changed_builtin_sweep_is_named(study, tmp_path):
    """The demo sweep as it was when the run began differs from today's: the refusal names the file, the configs
    added, removed and changed, and the two ways on."""
    cfg, run = study
    copy = tmp_path / "changed"
    shutil.copytree(run, copy)
    manifest = _manifest(copy)
    configs = manifest["payload"]["configs"]
    configs[3]["window_size"] = 32  # SnapKV @0.5 ran with another window
    removed = dict(configs.pop(), ratio=0.5)  # today's SnapKV+SparK(0.8) was SnapKV+SparK(0.5)
    configs.append(removed)
    manifest["fingerprint"] = fingerprint(manifest["payload"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.name != ".lock"}
    with pytest.raises(ConfigError) as refused:
        _run(_cfg(tmp_path, "run=changed"), tmp_path)
    (line,) = str(refused.value).splitlines()
    assert (f"{copy} holds results of a different configuration (differs in: configs); sweep=demo "
            "(conf/sweep/demo.yaml) now differs from the configs the run began with: 1 added (SnapKV+SparK(0.8) "
            "@0.5), 1 removed (SnapKV+SparK(0.5) @0.5), 1 changed (SnapKV @0.5: window_size 32 → 64); to continue "
            "the run, use the configs it began with (payload.configs in") in line
    assert "begun by spark-bench 0.1.0 (git " in line and re.search(r"give the changed configs a new run= \(e\.g\. "
                                                                      r"run=changed_[0-9a-f]{8}\)$", line)
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.name != ".lock"} == before  # nothing written
    # another kind of difference names the values
    shutil.copytree(run, tmp_path / "seeded")
    with pytest.raises(ConfigError, match=r"differs in: benchmark, samples\): benchmark.seed 42 → 7; choose"):
        _run(_cfg(tmp_path, "run=seeded", "benchmark.seed=7"), tmp_path)


def test_damaged_or_null_fast_paths_are_named_and_repaired(study, tmp_path, capsys, spark_log):
    from spark_bench.report import main as report

    cfg, run = study
    copy = tmp_path / "damaged"
    shutil.copytree(run, copy)
    for value, said in ((None, "fast_paths is null, not a list of records"),
                        ("oops", 'fast_paths is "oops", not a list of records'),
                        ([{"numbers_from": "numbers from the reference"}, 3],
                         "fast_paths holds 1 entry that is not a record")):
        manifest = _manifest(copy)
        (copy / "manifest.json").write_text(json.dumps({**manifest, "fast_paths": value}))
        spark_log.clear()
        report([str(copy), "--layout", "ruler"])
        warned = [line for line in spark_log if "fast_paths" in line]
        assert warned == [f"warning: {copy / 'manifest.json'}: {said}; a resume of the run repairs it"], spark_log
    _run(_cfg(tmp_path, "run=damaged"), tmp_path)  # every prediction on disk: no model, the manifest repaired
    assert any(f"repair: {copy / 'manifest.json'}: fast_paths holds 1 entry that is not a record: kept its 1 whole "
               "record(s)" in line for line in spark_log), spark_log
    assert _manifest(copy)["fast_paths"] == [{"numbers_from": "numbers from the reference"}]
    assert len(_manifest(copy)["runs"]) == 2


def _shards(run, root):
    """Two shard directories (copies of one run) under ``root``."""
    for i in range(2):
        shutil.copytree(run, root / f"shard-{i}-of-2")
    return root


def test_merge_refuses_shards_of_different_versions_unless_allowed(study, tmp_path, capsys):
    from spark_bench.tools import merge

    cfg, run = study
    root = _shards(run, tmp_path / "sharded")
    manifest = _manifest(root / "shard-1-of-2")
    manifest["runs"][0]["spark_bench"] = {"version": "0.0.9", "commit": None, "dirty": None}
    manifest["runs"][0]["packages"]["torch"] = "2.0.0"
    (root / "shard-1-of-2" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as refused:
        merge([str(root)])
    assert refused.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"spark-bench-merge: error: {root}: shards were computed by different spark-bench "
                           "versions: 0.1.0 (git ") and line.endswith(
        "0.0.9 (shard-1-of-2); rerun the odd shards with one version, or merge anyway with --allow-mixed")
    assert not (root / "table.md").exists()
    merge([str(root), "--allow-mixed", "-q"])
    err = capsys.readouterr().err
    assert (root / "table.md").exists() and "the shards' provenance differs: spark_bench.version 0.1.0 " \
        "(shard-0-of-2) vs 0.0.9 (shard-1-of-2)" in err and "packages.torch " in err


def test_a_report_of_two_runs_with_one_label_keeps_both_rows(study, tmp_path, capsys, spark_log):
    """Two runs holding the same labels: their rows are told apart by what differs (here the model; when nothing
    does, the run's name), both in the table and in the cost table; the same run given twice is refused."""
    from spark_bench.report import main as report

    cfg, run = study
    other = tmp_path / "other"
    shutil.copytree(run, other)
    manifest = _manifest(other)
    manifest["payload"]["model"]["name"] = "tiny-qwen3"
    manifest["runs"][0]["packages"]["transformers"] = "4.0.0"
    (other / "manifest.json").write_text(json.dumps(manifest))
    spark_log.clear()
    report([str(run), str(other), "--layout", "ruler", "--out", str(tmp_path / "out")])
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| SnapKV [model=tiny-llama] |" in table and "| SnapKV [model=tiny-qwen3] |" in table
    assert "| +SparK (0.8) [model=tiny-llama] |" in table and "| +SparK (0.8) [model=tiny-qwen3] |" in table
    cost = (tmp_path / "out" / "cost.md").read_text()
    first = cost.split("\n\n")[0] if cost.lstrip().startswith("|") else cost.split("\n\n")[1]  # (the cost table; a
    assert first.count("SnapKV @0.5 [") == 2  # paired output-length table follows it, with the same rows again)
    assert any(line.startswith(f"warning: the runs' provenance differs: packages.transformers ") and
               f"({other})" in line for line in spark_log), spark_log
    assert f"{run}: made by spark-bench 0.1.0" in table  # each run's provenance above its tables
    twin = tmp_path / "twin" / run.name
    shutil.copytree(run, twin)
    report([str(run), str(twin), "--layout", "ruler", "--out", str(tmp_path / "out2")])
    assert f"| SnapKV [run={run}] |" in (tmp_path / "out2" / "table.md").read_text()
    with pytest.raises(SystemExit) as refused:
        report([str(run), str(run), "--layout", "ruler"])
    assert refused.value.code == 2
    assert f"{run} is given more than once" in capsys.readouterr().err


def test_the_paper_setup_reads_only_the_budgets_the_configs_read(study):
    """The demo's ThinK / SparK alone carry the default budget 0.2 but read none: ``--paper`` does not see a 20%
    budget the run does not have."""
    from spark_bench.report.setup import differences, run_setup

    cfg, run = study
    assert run_setup(run)["budgets"] == (0.5,)
    assert differences(run, "tab_main_ruler")["budgets"].endswith("budgets 0.5 (paper: 0.2)")


def test_provenance_on_a_gpu_names_the_gpu_cuda_and_driver(monkeypatch, tmp_path):
    """The CUDA branch (no GPU here): the run's GPU by its index, the visible count, CUDA's and the driver's
    versions (the kernel module's line in /proc, open or proprietary)."""
    import torch

    from spark_bench import provenance

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"NVIDIA H100 80GB HBM3 #{i}")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs-"
                       "builder@U16-I3-C03-1-1)  Thu Jan 16 02:12:34 UTC 2025\nGCC version:  gcc version 12.3.0\n")
    assert provenance._driver(version) == "570.86.15" and provenance._driver(tmp_path / "absent") is None
    monkeypatch.setattr(provenance, "_driver", lambda: "570.86.15")
    assert provenance.device_info("cuda:3") == {"name": "NVIDIA H100 80GB HBM3 #3", "count": 8, "cuda": "12.8",
                                                "driver": "570.86.15"}
    assert provenance.device_info("cpu")["cuda"] is None
    record = {**provenance.session("cuda:3"), "dtype": "bfloat16", "attn_implementation": "sdpa"}
    assert ", CUDA 12.8, driver 570.86.15; bfloat16, sdpa; " in provenance.summary(record)
    older = {**record, "packages": {**record["packages"], "torch": "2.0.0"},
             "device": {**record["device"], "count": 4}}
    assert provenance.differences([("a", record), ("b", older)]) == [
        f"packages.torch {record['packages']['torch']} (a) vs 2.0.0 (b)", "device.count 8 (a) vs 4 (b)"]
    unknown = provenance.differences([("a", record), ("c", {})])  # a run from before provenance: unknown in all
    assert len(unknown) == len(provenance.COMPARED) and unknown[0] == "spark_bench.version 0.1.0 (a) vs unknown (c)"


# held out (audit of issue 56, /work/notes/audit56.md): a stored record a hand edit or another tool damaged → the
# line and what is wrong, as for a torn line (spark_bench/results.py RECORD_FIELDS), never a traceback mid-report
DAMAGED_RECORDS = {
    "empty record": (lambda r: {}, "a record without config, task, id, method, score (a predictions.jsonl line holds "
                                   "config, task, id, method, score, …)"),
    "no score": (lambda r: {k: v for k, v in r.items() if k != "score"}, "a record without score"),
    "score a string": (lambda r: {**r, "score": "abc"}, 'score must be a number >= 0 and <= 100; got "abc"'),
    "score a percentage above 100": (lambda r: {**r, "score": 250}, "score must be a number >= 0 and <= 100; got 250"),
    "config a number": (lambda r: {**r, "config": 3}, "config must be a non-empty string; got 3"),
    "method a string": (lambda r: {**r, "method": "snapkv"}, 'method must be an object (a mapping of names to values); '
                                                             'got "snapkv"'),
    "answers a bare string": (lambda r: {**r, "answers": "42"}, 'answers must be a list (a string each); got "42"'),
    "length a string": (lambda r: {**r, "length": "long"}, 'length must be an integer >= 0, or null'),
    "kl_full a string": (lambda r: {**r, "kl_full": "n/a"}, 'kl_full must be a number, or null (not measured); got '
                                                            '"n/a"'),
}


@pytest.mark.parametrize("case", list(DAMAGED_RECORDS))
def test_a_damaged_record_is_named_by_file_and_line(study, tmp_path, case):
    from spark_bench.results import DamagedFile, parse_records

    _, run = study
    change, message = DAMAGED_RECORDS[case]
    records = _records(run)
    records[1] = change(records[1])
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    with pytest.raises(DamagedFile) as err:
        parse_records(tmp_path / "predictions.jsonl", data)
    assert str(err.value) == f"{tmp_path / 'predictions.jsonl'}:2: {message}" or \
        str(err.value).startswith(f"{tmp_path / 'predictions.jsonl'}:2: {message}"), str(err.value)


def test_the_report_the_resume_and_merge_name_a_damaged_record(study, tmp_path, capsys):
    """End to end: the report refuses in one line, the resume names it and ``repair=true`` moves it aside; a shard
    without its manifest and ``--out`` on a file are one line too."""
    from spark_bench.report import main as report
    from spark_bench.results import DamagedFile, ResultsDir
    from spark_bench.shards import merge_shards

    _, run = study
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    with (copy / "predictions.jsonl").open("a") as f:
        f.write('{"id": "x", "score": "abc"}\n')
    lines = len(_records(run)) + 1
    with pytest.raises(SystemExit) as exit_:
        report([str(copy)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == [f"spark-bench-report: error: {copy / 'predictions.jsonl'}:{lines}: a "
                                             f"record without config, task, method (a predictions.jsonl line holds "
                                             f"config, task, id, method, score, …)"], err
    results = ResultsDir(copy, _manifest(copy)["payload"])
    with pytest.raises(DamagedFile, match=rf"predictions.jsonl:{lines}: a record without .*; rerun with repair=true"):
        results.check_files()
    assert results.check_files(repair=True) and (copy / "predictions.jsonl.damaged").read_text().startswith('{"id"')
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exit_:
        report([str(run), "--out", str(tmp_path / "file")])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip() == (
        f"spark-bench-report: error: --out: {tmp_path / 'file'} is a file, not a directory; choose another --out=")
    shard = tmp_path / "sharded" / "shard-0-of-1"
    shutil.copytree(run, shard)
    (shard / "manifest.json").unlink()
    with pytest.raises(ValueError, match=rf"^{re.escape(str(shard / 'manifest.json'))}: missing \(it records what "
                                         r"computed the directory\); restore it, or rerun"):
        merge_shards(tmp_path / "sharded")
