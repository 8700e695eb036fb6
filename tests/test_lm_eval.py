"""The lm-eval-harness model (``spark-bench[lm-eval]``): its loglikelihood is the dense model's when nothing is
compressed, generation stops at lm-eval's ``until`` strings, and ``spark-bench-lm-eval --model spark-bench`` runs
a local JSONL task (generation and multiple choice) end to end on the embedded SmolLM2, offline (in process; the
command itself on a tiny model)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

pytest.importorskip("lm_eval", reason="lm-eval is an optional extra: pip install 'spark-bench[lm-eval]'")
from lm_eval.api.instance import Instance  # noqa: E402

from spark_bench.lm_eval_model import SparkBenchLM  # noqa: E402

TASKS = ROOT / "tests" / "fixtures" / "lm_eval"


def _requests(kind: str, pairs) -> list:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(pairs)]


@pytest.fixture(scope="module")
def full_lm():
    return SparkBenchLM(pretrained="tiny-llama", method="full", device="cpu")


def test_loglikelihood_without_compression_is_the_dense_models(full_lm):
    """method=full: the continuation scored through the compressed-cache path equals the plain forward's
    log-probabilities (the first token from the prefill's logits, the rest over the stores)."""
    context = " ".join(f"word{i}" for i in range(60))
    pairs = [(context, " word60 word61 word62"), (context, " end")]
    got = full_lm.loglikelihood(_requests("loglikelihood", pairs))
    for (ctx, cont), (total, greedy) in zip(pairs, got):
        head = full_lm._ids(ctx)
        tail = full_lm._ids(ctx + cont)[len(head):]
        with torch.no_grad():
            logits = full_lm.model(torch.tensor([head + tail])).logits[0].float().log_softmax(-1)
        picked = logits[len(head) - 1:-1]
        expected = float(picked.gather(1, torch.tensor(tail)[:, None]).sum())
        assert total == pytest.approx(expected, abs=1e-4)
        assert greedy == bool((picked.argmax(-1) == torch.tensor(tail)).all())


def test_generation_stops_at_until_and_rolling_is_refused(full_lm):
    context = " ".join(f"word{i}" for i in range(60))
    (free,) = full_lm.generate_until(_requests("generate_until", [(context, {"max_gen_toks": 6})]))
    assert free
    cut = free[len(free) // 2]
    (stopped,) = full_lm.generate_until(_requests("generate_until", [(context, {"max_gen_toks": 6,
                                                                                 "until": [cut]})]))
    assert stopped == free.split(cut)[0]
    with pytest.raises(ValueError, match="loglikelihood_rolling: perplexity tasks"):
        full_lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [("text",)]))


def test_a_local_task_runs_end_to_end_on_smollm2(smollm2):
    """lm-eval's own evaluator over the local JSONL tasks (generation and multiple choice), SnapKV+SparK at half
    the context, on the embedded SmolLM2 (the session's, in process), offline."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model = SparkBenchLM(lm=smollm2, method="snapkv+spark", ratio=0.8, budget=0.5, window_size=16)
    cwd = os.getcwd()
    os.chdir(TASKS)  # the task files name their data relative to here
    try:
        results = simple_evaluate(model=model, tasks=["spark_capitals_gen", "spark_capitals_mc"],
                                  task_manager=TaskManager(include_path=str(TASKS)))["results"]
    finally:
        os.chdir(cwd)
    assert results["spark_capitals_gen"]["sample_len"] == results["spark_capitals_mc"]["sample_len"] == 2
    assert 0 <= results["spark_capitals_gen"]["exact_match,none"] <= 1
    assert results["spark_capitals_mc"]["acc,none"] == 1.0  # the capital is in the kept context


def test_the_lm_eval_command_registers_the_model(tmp_path):
    """``spark-bench-lm-eval`` is lm-eval's command line with ``--model spark-bench`` registered (a tiny model)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "spark_bench.lm_eval_model", "--model", "spark-bench", "--model_args",
               "pretrained=tiny-llama,method=snapkv+spark,ratio=0.8,budget=0.5,window_size=16", "--device", "cpu",
               "--tasks", "spark_capitals_mc", "--include_path", str(TASKS), "--output_path", str(tmp_path)]
    out = subprocess.run(command, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (path,) = tmp_path.rglob("results_*.json")
    results = json.loads(path.read_text())
    assert results["results"]["spark_capitals_mc"]["sample_len"] == 2
    assert results["config"]["model"] == "spark-bench" and results["config"]["model_args"]["method"] == "snapkv+spark"
