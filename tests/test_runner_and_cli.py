"""The runner's outputs, sweep-vs-alone equality, and the Hydra command line."""

import itertools
import json
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from spark_bench.benchmarks.ruler import load_ruler
from spark_bench.cli import CONF_DIR, ConfigError, method_configs
from spark_bench.methods import MethodConfig
from spark_bench.runner import run_sweep

SWEEP = [MethodConfig(name="full"), MethodConfig(name="snapkv+spark", budget=64, ratio=0.8),
         MethodConfig(name="snapkv+think", budget=64, ratio=0.5), MethodConfig(name="spark", ratio=0.5)]


@pytest.fixture(scope="module")
def samples(tiny_lm):
    return load_ruler(["niah_single_1", "niah_multikey_2"], 512, 1, 7, tiny_lm, max_new_tokens=6)


@pytest.fixture(scope="module")
def sweep_run(tiny_lm, samples, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    return out, run_sweep(tiny_lm, samples, SWEEP, out)


def test_sweep_writes_predictions_scores_and_table(sweep_run, samples):
    out, preds = sweep_run
    lines = [json.loads(l) for l in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(lines) == len(samples) * len(SWEEP)
    for rec in lines:
        assert {"task", "id", "prompt_length", "prediction", "answers", "score", "kv_bytes", "kv_bytes_full",
                "key_ratio"} <= rec.keys() and "prefill_s" not in rec  # timings live in timings.jsonl
        assert 0 < rec["kv_bytes"] <= rec["kv_bytes_full"]
    timings = [json.loads(l) for l in (out / "timings.jsonl").read_text().splitlines()]
    assert len(timings) == len(lines) and {"prefill_s", "compress_s", "decode_s"} <= timings[0].keys()
    scores = pd.read_csv(out / "scores.csv")
    assert len(scores) == len(SWEEP) * 2
    table = (out / "table.md").read_text().splitlines()
    assert table[0] == ("| Method | niah_single_1 | niah_multikey_2 | Avg | NLL | KL full | Agree | KV % | Key ratio | "
                        "KV MiB | Prefill s | Compress s | Decode tok/s | Peak MiB | Out tok | Stop % | s/answer | "
                        "Fidelity s |")
    assert [row.split(" | ")[0].lstrip("| ") for row in table[2:2 + len(SWEEP)]] == [c.label for c in SWEEP]
    # the cost beside the scores: positive, the bytes the predictions' own, the tokens over the decode seconds
    frame = pd.DataFrame(lines).merge(pd.DataFrame(timings), on=["id", "config"])
    for (config, task), group in frame.groupby(["config", "task"]):
        row = scores[(scores.config == config) & (scores.task == task)].iloc[0]
        assert row.kv_bytes == group.kv_bytes.mean() and row.n == len(group)
        assert row.prefill_s == pytest.approx(group.prefill_s.mean()) and row.prefill_s > 0
        assert row.compress_s >= 0 and row.peak_mem_bytes == group.peak_mem_bytes.max() > 0
        assert row.decode_tok_s == pytest.approx(group.tokens.map(len).sum() / group.decode_s.sum())
        assert row.decode_tok_s > 0
    cells = dict(zip(table[0].split(" | "), table[2].split(" | ")))
    first = scores[scores.config == SWEEP[0].label]
    assert float(cells["KV MiB"]) == pytest.approx((first.kv_bytes * first.n).sum() / first.n.sum() / 2 ** 20,
                                                   abs=0.005)


def test_sweep_shares_prefill(sweep_run):
    _, preds = sweep_run
    assert preds.groupby("id").prefill_s.nunique().eq(1).all()


@pytest.mark.parametrize("index", range(len(SWEEP)))
def test_config_in_sweep_equals_config_alone(tiny_lm, samples, sweep_run, tmp_path, index):
    _, in_sweep = sweep_run
    alone = run_sweep(tiny_lm, samples, [SWEEP[index]], tmp_path)
    mine = in_sweep[in_sweep.config == SWEEP[index].label]
    assert list(mine.id) == list(alone.id)
    assert list(mine.tokens) == list(alone.tokens)
    assert list(mine.kv_bytes) == list(alone.kv_bytes)


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_user_command_resolves_exactly_as_written():
    cfg = _compose(["model=llama3-8b", "method=snapkv+spark", "ratio=0.8"])
    assert cfg.model.path == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert list(cfg.model.stop_tokens) == ["<|eot_id|>", "<|end_of_text|>"]
    (only,) = method_configs(cfg)
    official = dict(compress_scope="question", window_size=64, channel_window=32, kernel_size=5, pooling="avg",
                    think_keep_window=False, pyramid_fallback="kvpress", ada_safeguard="spark_fork", value_score="fork",
                    value_fill="mean", window_q_norm=False, saliency_dtype="model", budget_rounding="official",
                    group_fork_fill="zero")  # the default protocol
    assert only == MethodConfig(name="snapkv+spark", ratio=0.8, budget=0.2, **official)


def test_default_is_the_offline_demo_sweep():
    cfg = _compose([])
    assert cfg.model.name == "smollm2-135m" and cfg.benchmark.name == "ruler"
    assert [c.label for c in method_configs(cfg)] == [
        "Full", "ThinK(0.8)", "SparK(0.8)", "SnapKV @0.5", "SnapKV+ThinK(0.8) @0.5", "SnapKV+SparK(0.8) @0.5"]


def test_bad_method_option_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"method: ratio must be a number >= 0 and < 1; got 1.5"):
        method_configs(_compose(["method=spark", "ratio=1.5"]))


def test_cli_multirun_end_to_end(tmp_path, monkeypatch, console):
    """Two jobs, each its own directory and its own tracked run (MLflow's local file store), grouped by the run
    (Hydra's basic launcher runs them one after the other in this process)."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("CI", "1")
    code, _, err = console(["-m", "model=tiny-llama", "method=snapkv+spark", "ratio=0.5,0.8", "budget=64",
                            "benchmark.tasks=[niah_single_1]", "benchmark.length=512", "benchmark.num_samples=1",
                            "benchmark.max_new_tokens=4", f"output_root={tmp_path}", "run=cli", "tracking=mlflow"])
    assert code == 0, err[-2000:]
    for job in ("0", "1"):
        job_dir = tmp_path / "cli" / job
        assert (job_dir / "config.yaml").exists() and (job_dir / "predictions.jsonl").exists()
        assert "SnapKV+SparK(" in (job_dir / "table.md").read_text()
    assert "ratio: 0.8" in (tmp_path / "cli" / "1" / "config.yaml").read_text()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for its local file store to be allowed
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("cli").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["cli/0", "cli/1"]
    assert {r.data.params["ratio"] for r in runs} == {"0.5", "0.8"}


def test_cli_unknown_method_lists_valid_ones(tmp_path, console):
    code, _, err = console(["method=bogus", f"output_root={tmp_path}"])  # the console script's start, in-process
    assert code == 2
    assert "snapkv+spark" in err and "bogus" in err
    assert not any(tmp_path.iterdir())


def test_missing_gguf_file_names_model_and_path():
    from spark_bench.models import ModelConfig, load_model

    with pytest.raises(FileNotFoundError, match=r"model broken: GGUF file not found: /nonexistent/m\.gguf"):
        load_model(ModelConfig(name="broken", source="gguf", path="/nonexistent/m.gguf"), "cpu")


# ---- table labels inside a sweep ----------------------------------------------------------------------------------

def test_sweep_labels_name_the_options_that_differ_and_refuse_repeats():
    from spark_bench.methods.pipeline import sweep_labels

    kept = MethodConfig(name="snapkv+think", budget=64, ratio=0.5)
    dense = MethodConfig(name="snapkv+think", budget=64, ratio=0.5, think_keep_window=False)
    narrow = MethodConfig(name="snapkv+think", budget=64, ratio=0.5, think_keep_window=False, window_size=16)
    assert sweep_labels([kept, dense, narrow, MethodConfig(name="full")]) == [
        "SnapKV+ThinK(0.5) @64 [window_size=32, think_keep_window=true]",
        "SnapKV+ThinK(0.5) @64 [window_size=32, think_keep_window=false]",
        "SnapKV+ThinK(0.5) @64 [window_size=16, think_keep_window=false]", "Full"]
    assert sweep_labels(SWEEP) == [c.label for c in SWEEP]  # nothing shared: the plain labels
    with pytest.raises(ValueError, match=r"^the sweep lists the same method config more than once: "
                                         r"SnapKV\+ThinK\(0\.5\) @64$"):
        sweep_labels([kept, MethodConfig(name="full"), kept])


def test_configs_differing_only_in_an_option_get_their_own_rows(tiny_lm, samples, tmp_path):
    from spark_bench.report.frame import read_runs
    from spark_bench.report.layouts import RULER

    configs = [MethodConfig(name="snapkv+think", budget=64, ratio=0.5),
               MethodConfig(name="snapkv+think", budget=64, ratio=0.5, think_keep_window=False)]
    preds = run_sweep(tiny_lm, samples[:1], configs, tmp_path)
    assert list(preds.config) == ["SnapKV+ThinK(0.5) @64 [think_keep_window=true]",
                                  "SnapKV+ThinK(0.5) @64 [think_keep_window=false]"]
    assert preds.kv_bytes.iloc[0] > preds.kv_bytes.iloc[1]  # the dense window really is kept in one of them
    rows = read_runs([tmp_path], RULER)
    assert sorted(rows.method.unique()) == ["+ThinK (0.5) [think_keep_window=false]",
                                            "+ThinK (0.5) [think_keep_window=true]"]


def test_repeated_sweep_config_is_one_line_before_anything_runs_even_in_a_dry_run(tmp_path, console):
    for extra in ([], ["dry_run=true"]):
        code, _, err = console(["model=tiny-llama", *extra,
                                "sweep.configs=[{name:snapkv,budget:64},{name:full},{name:snapkv,budget:64}]",
                                f"output_root={tmp_path}"])
        assert code == 2, err[-2000:]
        assert err.strip().splitlines() == [
            "spark-bench: error: sweep.configs: the sweep lists the same method config more than once: SnapKV @64"]
        assert not any(tmp_path.iterdir())


# ---- short samples: a compressed part no longer than what a method always keeps (issue 46) -----------------------

@pytest.fixture(scope="module")
def short_prefills(tiny_lm):
    """Prefills of 1 … 40 tokens: parts within the sinks, at and around the 32-token window."""
    from conftest import DEVICE
    from spark_bench.engine.prefill import QueryStatsSpec, run_prefill

    ids = torch.randint(100, 5000, (1, 40), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    return {s: run_prefill(tiny_lm.model, ids[:, :s], window=32, query_stats=QueryStatsSpec())
            for s in (1, 2, 5, 6, 31, 32, 33, 40)}


ALWAYS_KEPT = {"snapkv": 32, "pyramidkv": 32, "adasnapkv": 32, "streamingllm": 5, "expected_attention": 5, "tova": 1}


@pytest.mark.parametrize("eviction", list(ALWAYS_KEPT))
def test_a_part_no_longer_than_what_a_method_always_keeps_is_kept_whole(short_prefills, eviction):
    """A part no longer than the window (SnapKV family), the sinks and one token (StreamingLLM, ExpectedAttention)
    or one token (TOVA) is kept whole under any budget — the full cache, said by ``keeps_whole`` and counted in the
    budget-coverage warning; a longer part keeps the budget, at least what the method always keeps."""
    from spark_bench.checks import budget_warnings
    from spark_bench.methods import Pipeline

    floor = ALWAYS_KEPT[eviction]
    for budget, name in itertools.product((0.2, 0.5, 36), (eviction, f"{eviction}+spark")):
        pipeline = Pipeline.from_config(MethodConfig(name=name, budget=budget, ratio=0.5))
        for s, prefill in short_prefills.items():
            n = len(prefill.layers)
            cache, _ = pipeline.build_cache(prefill)
            kept = [layer.key_store.length for layer in cache.layers]
            whole = [pipeline.eviction.keeps_whole(s, i, n) for i in range(n)]
            if s <= floor or eviction != "pyramidkv":  # PyramidKV's budget differs per layer
                assert whole == [s <= floor or 1 <= budget >= s] * n, (name, budget, s)
            assert all(k == s for k, w in zip(kept, whole) if w), (name, budget, s, kept)
            for i, (k, w) in enumerate(zip(kept, whole)):  # AdaKV pads its heads to the longest: up to s
                assert (pipeline.eviction.select(prefill.layers[i], i, n) is None) == w
                assert w or min(s, floor) <= k <= s and (k < s or eviction == "adasnapkv"), (name, budget, s, kept)
    samples = [SimpleNamespace(input_ids=(0,) * s) for s in short_prefills]
    (line,) = budget_warnings(samples, [MethodConfig(name=eviction, budget=0.5)], num_layers=2)
    covered = [s for s in short_prefills if s <= floor]
    assert line.startswith(f"{MethodConfig(name=eviction).label.split(' ')[0]} @0.5 keeps the whole prompt of "
                           f"{len(covered)} of {len(samples)} samples (up to {max(covered)} tokens: within "
                           f"budget=0.5 or "), line


@pytest.mark.parametrize("protocol", ["official", "paper", "kvcache_factory"])
def test_the_longbench_fixture_runs_under_every_protocol(tmp_path, protocol, spark_log):
    """tests/fixtures/longbench (docs/cli.md's offline LongBench): its trec sample's user turn is shorter than the
    official protocol's 64-token window (as samsum's, lcc's and repobench-p's; gov_report's is not). The default
    sweep and every eviction method of the paper (with SparK, under the protocol's scope or the context scope) run
    to the table; the short sample is kept whole and said so."""
    import spark_bench.cli as cli

    paper = [f"{{name:{e}+spark,budget:0.5,ratio:0.8{',compress_scope:context' if i % 2 else ''}}}"
             for i, e in enumerate(["streamingllm", "expected_attention", "tova", "pyramidkv", "adasnapkv"])]
    demo = [f"{{name:{c.name}" + (f",budget:{c.budget:g}" if c.eviction_name else "")
            + (f",ratio:{c.ratio:g}" if c.channel_name else "") + "}" for c in method_configs(_compose([]))]
    from conftest import ROOT

    cfg = _compose(["model=tiny-llama", "benchmark=longbench", f"longbench.data_dir={ROOT / 'tests/fixtures/longbench'}",
                    "benchmark.tasks=[trec,gov_report]", "+benchmark.max_new_tokens=1", f"protocol={protocol}",
                    "progress=false", f"sweep.configs=[{','.join(demo + paper)}]", f"output_root={tmp_path}",
                    "run=fixture"])
    cli.run(cfg, tmp_path / "fixture")
    table = (tmp_path / "fixture" / "table.md").read_text().splitlines()
    assert len(table) >= 2 + len(demo) + len(paper) and "| trec |" in table[0] and "| gov_report |" in table[0]
    predictions = [json.loads(line) for line in (tmp_path / "fixture" / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 2 * (len(demo) + len(paper))
    warned = [line for line in spark_log if "keeps the whole" in line]
    if protocol == "official":  # trec's user turn is within the 64-token window, gov_report's is not
        assert any(line.startswith("warning: SnapKV @0.5 (") and "keeps the whole compressed part (compress_scope="
                   "question) of 1 of 2 samples (up to 57 tokens: within budget=0.5 or window_size=64)" in line
                   for line in warned), warned
        short = {p["task"]: p["kv_bytes"] == p["kv_bytes_full"] for p in predictions if p["config"] == "SnapKV @0.5"}
        assert short == {"trec": True, "gov_report": False}


def test_the_default_run_directory_is_the_configuration():
    """``run`` left out: ``<model>_<benchmark>_<8 hex of the configuration>``. docs/cli.md's commands in order (and
    any two configurations that compute different things) get different directories; the same configuration, or one
    that changes only how it runs (progress, decode batch, device), the same one (so it resumes); ``make demo``'s
    ``run=demo`` is kept as given."""
    runs = [_compose(o).run for o in ([], ["method=snapkv+spark", "ratio=0.8"], ["method=snapkv+spark", "ratio=0.5"],
                                      ["protocol=kvcache_factory", "method=snapkv"], ["benchmark.length=4096"],
                                      ["sweep=methods"], ["benchmark=ruler_all"], ["model=tiny-llama"])]
    assert len(set(runs)) == len(runs) and runs[0].startswith("smollm2-135m_ruler_"), runs
    assert runs[-1].startswith("tiny-llama_ruler_") and all(len(r.rsplit("_", 1)[1]) == 8 for r in runs)
    same = [_compose(o).run for o in ([], ["progress=false"], ["decode_batch=2", "device=cpu"], ["wait_lock=true"])]
    assert set(same) == {runs[0]}
    assert _compose(["run=demo"]).run == "demo"


def test_an_option_the_method_reads_or_leaves_at_its_default_is_accepted():
    """The refusal of unread options (tests/test_bad_inputs.py) spares options at their defaults (the protocol's
    windows on ``full``), explicit ``ratio=0`` (the base method), and a top-level option some sweep entry reads."""
    cases = {("method=full",): ["Full"], ("method=snapkv", "ratio=0"): ["SnapKV @0.2"],
             ("protocol=paper", "method=tova", "budget=64"): ["TOVA @64"],
             ("method=full", "value_ratio=0.5", "value_fill=zero"): ["Full+V(0.5)"],
             ("window_size=16", "sweep.configs=[{name: full}, {name: snapkv, budget: 64}]"): ["Full", "SnapKV @64"]}
    for overrides, labels in cases.items():
        assert [c.label for c in method_configs(_compose(list(overrides)))] == labels, overrides


# an option the config's own variant or recovery does not read (methods/config.py READ_WHEN): one line each
UNREAD = {
    ("method=spark", "ratio=0.5", "constant=0.5"):
        "method: constant=0.5 is not read by spark with recovery=degenerate, so it would change nothing; constant "
        "is read by spark (alone or after an eviction method, e.g. snapkv+spark); by spark only with "
        "recovery=constant",
    ("method=snapkv+spark", "budget=64", "variant=fixed", "ratio=0.5", "top_p=0.9"):
        "method: top_p=0.9 is not read by snapkv+spark with variant=fixed, so",
    ("method=spark", "variant=top_p", "ratio=0.8"): "method: ratio=0.8 is not read by spark with variant=top_p, "
                                                    "recovery=degenerate, so it would change nothing",
    ("method=spark", "variant=top_p", "groups=5"): "method: groups=5 is not read by spark with variant=top_p",
    ("method=spark", "ratio=0.5", "seed=3"): "method: seed=3 is not read by spark with recovery=degenerate",
    ("method=spark", "ratio=0.5", "recovery=constant", "recovery_stats=all"):
        "method: recovery_stats=all is not read by spark with recovery=constant",
    ("method=spark", "ratio=0.5", "group_fork_fill=recovery"):  # the official protocol's default is zero
        "method: group_fork_fill=recovery is not read by spark with variant=fixed",
    ("method=spark", "variant=group_fork", "recovery=gaussian"):  # zero-filled (official): no recovery at all
        "method: recovery=gaussian is not read by spark with variant=group_fork, group_fork_fill=zero",
    ("sweep.configs=[{name: spark, ratio: 0.5, top_p: 0.9}]",):
        "sweep.configs[0]: top_p=0.9 is not read by spark with variant=fixed",
    ("constant=0.5",): "constant=0.5: no entry of sweep.configs reads it (each sets its own, or its method ignores "
                       "it), so it would change nothing; constant is read by spark",
    # held out (audit of issue 56, /work/notes/audit56.md): options of another method part
    ("method=snapkv", "budget=64", "value_score=norm"): "method: value_score=norm is not read by snapkv, so it would "
                                                        "change nothing; value_score is read by any method but "
                                                        "mustafar (its own value rule), with value_ratio > 0",
    ("method=streamingllm", "budget=64", "kernel_size=3"): "method: kernel_size=3 is not read by streamingllm",
    ("method=streamingllm", "budget=64", "pooling=max"): "method: pooling=max is not read by streamingllm",
    ("method=snapkv", "budget=64", "n_sink=2"): "method: n_sink=2 is not read by snapkv",
    ("method=snapkv", "budget=64", "beta=8"): "method: beta=8 is not read by snapkv",
    ("method=pyramidkv", "budget=64", "alpha_safeguard=0.3"): "method: alpha_safeguard=0.3 is not read by pyramidkv",
    ("method=spark", "ratio=0.5", "think_keep_window=true"): "method: think_keep_window=true is not read by spark",
    ("method=full", "budget_rounding=exact"): "method: budget_rounding=exact is not read by full",
    ("method=tova", "budget=64", "window_size=32"): "method: window_size=32 is not read by tova",
    ("method=snapkv+think", "budget=64", "ratio=0.5", "recovery=gaussian"):
        "method: recovery=gaussian is not read by snapkv+think",
    ("method=snapkv", "budget=64", "kvpress={compression_ratio: 0.5}"):
        "method: kvpress={compression_ratio:0.5} is not read by snapkv",
    ("sweep.configs=[{name: snapkv, budget: 64, n_sink: 2}]",): "sweep.configs[0]: n_sink=2 is not read by snapkv",
}


@pytest.mark.parametrize("overrides", list(UNREAD))
def test_every_option_a_config_does_not_read_is_refused(overrides):
    with pytest.raises(ConfigError) as refused:
        method_configs(_compose(list(overrides)))
    (line,) = str(refused.value).splitlines()
    assert UNREAD[overrides] in line, line


def test_options_a_variant_or_recovery_reads_are_accepted():
    cases = {("method=spark", "ratio=0.5", "recovery=constant", "constant=0.5"): "SparK(0.5)[constant]",
             ("method=spark", "variant=top_p", "top_p=0.9"): "SparK-p(0.9)",
             ("method=spark", "variant=group", "groups=5"): "SparK-g(5)",
             ("method=spark", "ratio=0.5", "recovery=gaussian", "seed=3", "recovery_stats=all"):
                 "SparK(0.5)[gaussian][all-stats]",
             ("method=spark", "variant=group_fork", "group_fork_fill=recovery", "recovery=gaussian", "top_p=0.9"):
                 "SparK-g(fork)[gaussian]",
             ("method=spark", "variant=top_p", "recovery=fork_pool0", "ratio=0.5"): "SparK-p(0.99)[fork_pool0]"}
    for overrides, label in cases.items():
        assert [c.label for c in method_configs(_compose(list(overrides)))] == [label], overrides


@pytest.mark.parametrize("run", [".", "..", "./.", "a/..", "a/../..", "/tmp/abs", " ", ""])
def test_a_run_name_that_is_not_a_directory_inside_output_root_is_refused(run):
    """``run=.`` would write into ``output_root`` itself; ``..`` / absolute names outside it; empty: nowhere."""
    from spark_bench.checks import check_options

    with pytest.raises(ConfigError) as refused:
        check_options(_compose([f"run={run}"] if run else ["run=''"]))
    (line,) = str(refused.value).splitlines()
    assert line.startswith(f"run={run}: must stay inside output_root=results (a relative name of a directory below "
                           "it: not empty, not '.', without '..'); e.g. run=") or \
        line == "run must be a non-empty string; got ''", line


# held out (audit of issue 56): names the run would create that no directory listing shows right, or none can hold
PLACES = {
    "run with a tab": ("run", "a\tb", "run='a\\tb': holds the control character '\\t'; a directory name is printable "
                                      "text"),
    "run with a NUL": ("run", "a\0b", "run='a\\x00b': holds the control character '\\x00'"),
    "run with a newline": ("run", "a\nb", "run='a\\nb': holds the control character '\\n'"),
    "run too long": ("run", "x" * 300, "run='" + "x" * 59 + "…': has a part 300 bytes long; a directory name holds at "
                                                             "most 255"),
    "run too long in bytes": ("run", "é" * 130, "has a part 260 bytes long"),
    "output_root with a tab": ("output_root", "/tmp/o\tx", "output_root/run: '/tmp/o\\tx/r' holds the control "
                                                             "character '\\t'"),
}


@pytest.mark.parametrize("case", list(PLACES))
def test_a_place_no_directory_can_be_named_is_refused(case):
    from pathlib import Path

    from spark_bench.checks import check_inside, check_output

    key, value, message = PLACES[case]
    with pytest.raises(ConfigError) as refused:
        check_inside("run", value, "output_root=results") if key == "run" else check_output(Path(value) / "r")
    (line,) = str(refused.value).splitlines()
    assert line.startswith(message) or message in line, line
