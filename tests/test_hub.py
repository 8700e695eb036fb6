"""First contact with hub models and data: resolved before anything runs (local directory, hub cache, or a
reachable hub), one line and exit 2 otherwise; unknown config names exit 2 too."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spark_bench import hub
from spark_bench.cli import ConfigError, check_group_choices

LLAMA3 = "meta-llama/Meta-Llama-3-8B-Instruct"


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    """No hub (a refused local port as the endpoint) and an empty hub cache, in this process and subprocesses."""
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(tmp_path / "hub-cache"),
           "HF_HUB_OFFLINE": ""}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return {**os.environ, **env, "CI": "1"}


def cli(args, env, timeout=300):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "spark_bench.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    return proc, time.perf_counter() - start


def test_offline_hub_model_fails_fast_with_one_line(offline_env, tmp_path):
    proc, seconds = cli(["model=llama3-8b", "method=snapkv+spark", "ratio=0.8", f"output_root={tmp_path / 'out'}"],
                        offline_env)
    assert proc.returncode == 2 and seconds < 10
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert LLAMA3 in lines[0] and "model.path=" in lines[0] and "hub cache" in lines[0]
    assert "127.0.0.1:9 unreachable" in lines[0]
    assert not (tmp_path / "out").exists()


def test_offline_longbench_without_data_dir_names_the_key(offline_env, tmp_path):
    proc, seconds = cli(["model=tiny-llama", "benchmark=longbench", "method=snapkv", f"output_root={tmp_path / 'o'}"],
                        offline_env)
    assert proc.returncode == 2 and seconds < 30
    (line,) = proc.stderr.strip().splitlines()
    assert "longbench.data_dir" in line and "Xnhyacinth/LongBench" in line
    assert not (tmp_path / "o").exists()


def test_offline_ruler_qa_without_files_names_the_key(offline_env, tmp_path):
    proc, _ = cli(["model=tiny-llama", "benchmark=ruler_all", "method=snapkv", f"output_root={tmp_path / 'o'}"],
                  offline_env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "ruler.squad_file" in line and "rajpurkar/squad_v2" in line


def test_dry_run_reports_sources_and_exits_2_when_the_run_would_stop(offline_env):
    proc, _ = cli(["model=llama3-8b", "benchmark=longbench", "method=snapkv", "dry_run=true"], offline_env)
    assert f"source: model llama3-8b: NOT AVAILABLE: {LLAMA3} is not on disk" in proc.stdout
    assert "source: LongBench data: NOT AVAILABLE" in proc.stdout
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()  # one line per problem: the model, then the data
    assert len(lines) == 2 and all(line.startswith("spark-bench: error: the run would stop: ") for line in lines)
    assert LLAMA3 in lines[0] and "longbench.data_dir" in lines[1]


def test_dry_run_of_a_runnable_config_exits_0(offline_env):
    proc, _ = cli(["model=tiny-llama", "method=snapkv", "budget=64", "dry_run=true"], offline_env)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("arg, group", [("model=nope", "model"), ("method=snapkv,bogus", "method"),
                                        ("benchmark=rulr", "benchmark"), ("+experiment=table9", "experiment"),
                                        ("sweep=nothing", "sweep")])
def test_unknown_config_names_exit_2(arg, group, tmp_path, console):
    code, _, err = console([arg, f"output_root={tmp_path}"])  # the console script's own start, in this process
    assert code == 2
    (line,) = err.strip().splitlines()
    # a method name may also be kvpress:<press> or a method of one's own, so its line says so (methods/pipeline.py)
    expected = ("unknown method 'bogus'; valid: full," if group == "method" else
                f"no such {group} config (conf/{group}/); valid:")
    assert expected in line
    assert not any(tmp_path.iterdir())


def test_group_check_passes_known_names_and_non_group_keys():
    check_group_choices(["model=llama3-8b", "method=snapkv,snapkv+spark", "+experiment=table1", "model.path=/x",
                         "method=null", "-m", "ratio=0.5,0.8", "sweep=demo"])
    with pytest.raises(ConfigError, match=r"method=bogus: no such method config .*snapkv\+spark"):
        check_group_choices(["method=bogus"])


def test_hub_cache_layout_is_found(offline_env, tmp_path):
    snapshot = tmp_path / "hub-cache" / "models--org--m" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert hub.cached_snapshot("org/m") is None  # empty snapshot: nothing usable
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    assert hub.cached_snapshot("org/m") == snapshot
    assert hub.resolve("org/m", "model", "model m", "fix") == str(snapshot)
    assert hub.cached_snapshot("org/m", "dataset") is None
    with pytest.raises(hub.HubUnavailable, match=r"model m: org/other is not on disk .* unreachable.*; fix"):
        hub.resolve("org/other", "model", "model m", "fix")
    with pytest.raises(hub.HubUnavailable, match=r"model m: /no/such/dir is not a directory; fix"):
        hub.resolve("/no/such/dir", "model", "model m", "fix")


def test_offline_mode_is_respected_without_probing(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.unreachable_reason() == "HF_HUB_OFFLINE is set"


@pytest.fixture(scope="module")
def saved_tiny_model(tiny_lm, tmp_path_factory):
    """tiny-llama written as a hub-format model directory (config.json, safetensors, tokenizer files)."""
    directory = tmp_path_factory.mktemp("tiny-model")
    tiny_lm.model.save_pretrained(directory)
    tiny_lm.tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("where", ["model.path", "hub cache"])
def test_local_and_cached_models_run_with_no_network(where, saved_tiny_model, offline_env, tmp_path):
    args = ["model=llama3-8b", "model.dtype=float32", "model.max_length=4096", "method=snapkv", "budget=64",
            "benchmark.tasks=[niah_single_1]", "benchmark.length=512", "benchmark.num_samples=1",
            "benchmark.max_new_tokens=2", f"output_root={tmp_path}", "run=offline"]
    if where == "model.path":
        args.append(f"model.path={saved_tiny_model}")
    else:
        repo = tmp_path / "hub-cache" / f"models--{LLAMA3.replace('/', '--')}"
        shutil.copytree(saved_tiny_model, repo / "snapshots" / "0123abcd")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd")
    proc, _ = cli(args, {**offline_env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "offline" / "predictions.jsonl").read_text().count("\n") == 1
    assert "SnapKV @64" in (tmp_path / "offline" / "table.md").read_text()


def test_longbench_hub_mirror_from_a_local_copy(tmp_path, offline_env):
    """A copy of the parquet mirror on disk (``longbench.hub_path=DIR`` or the hub cache) loads with no network."""
    import json

    import pandas as pd

    from spark_bench.benchmarks.longbench import read_records

    fixture = [json.loads(line) for line in open(Path(__file__).parent / "fixtures" / "longbench" / "qasper.jsonl")]
    (tmp_path / "mirror" / "qasper").mkdir(parents=True)
    pd.DataFrame(fixture).to_parquet(tmp_path / "mirror" / "qasper" / "test-00000-of-00001.parquet")
    (tmp_path / "mirror" / "README.md").write_text(
        "---\nconfigs:\n- config_name: qasper\n  data_files:\n  - split: test\n    path: qasper/test-*.parquet\n---\n")
    records = read_records("qasper", None, hub_path=str(tmp_path / "mirror"))
    assert [r["_id"] for r in records] == [r["_id"] for r in fixture]
    assert records[0]["answers"] == fixture[0]["answers"]


def test_a_gguf_tokenizer_is_converted_once_and_read_back_the_same(tmp_path, monkeypatch):
    """The GGUF's tokenizer is converted on first use and cached (``SPARK_BENCH_CACHE``): the cached one encodes,
    templates and names its special tokens as the GGUF's own; a damaged entry is rebuilt, not read."""
    from conftest import model_config
    from transformers import AutoTokenizer

    from spark_bench.models import _gguf_tokenizer, gguf_location

    monkeypatch.setenv("SPARK_BENCH_CACHE", str(tmp_path))
    cfg = model_config("smollm2-135m")
    directory, file = gguf_location(cfg.path, cfg.package)
    gguf = Path(directory) / file
    made = _gguf_tokenizer(gguf)
    [entry] = list((tmp_path / "tokenizers").iterdir())
    cached = _gguf_tokenizer(gguf)
    reference = AutoTokenizer.from_pretrained(directory, gguf_file=file)
    chat = [{"role": "user", "content": "Where is the needle? ünïcode\tand tabs"}]
    for tok in (made, cached):
        assert tok.apply_chat_template(chat, add_generation_prompt=True) == reference.apply_chat_template(
            chat, add_generation_prompt=True)
        assert (tok.eos_token_id, tok.bos_token_id, len(tok)) == (reference.eos_token_id, reference.bos_token_id,
                                                                  len(reference))
    (entry / "tokenizer.json").write_text("{damaged")
    assert _gguf_tokenizer(gguf).encode("a needle") == reference.encode("a needle")
