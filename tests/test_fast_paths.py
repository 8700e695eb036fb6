"""Fast paths checked at run time and graphs only where they are safe (issue 42, items 4-5), on the CPU: the C++
kernels and the fused Triton kernel (under its interpreter) are compared with the float32 reference at their first
use; a perturbed kernel or graph is caught, warned about once, and the run continues on the reference path with the
reference's tokens; CUDA graphs (a stand-in that replays eagerly) are captured once per width bucket, never across
devices, and the manifest, run.log and report say which path produced the numbers."""

import json

import pytest
import torch
from conftest import DEVICE

from spark_bench.engine import cache as cache_module
from spark_bench.engine import decode as decode_module
from spark_bench.engine.decode import DecodeRow, _width, decode_rows
from spark_bench.engine.fastpaths import FastPaths, normalised_error, tolerance
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.storage import dispatch

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="perturbs and stands in for the CPU paths")

CONFIGS = [MethodConfig(name="snapkv", budget=64), MethodConfig(name="snapkv+think", budget=64, ratio=0.5),
           MethodConfig(name="snapkv+spark", budget=64, ratio=0.8),
           MethodConfig(name="adasnapkv+spark", budget=48, ratio=0.5, saliency="paper")]


def _rows(prefill, configs=CONFIGS, max_new=(3,), attention="compact"):
    selections, rows = {}, []
    for k, c in enumerate(configs):
        cache = Pipeline.from_config(c).build_cache(prefill, selections=selections)[0]
        cache.attention = attention
        rows.append(DecodeRow(cache, prefill.first_logits, prefill.prompt_length, max_new[k % len(max_new)],
                              frozenset()))
    return rows


@pytest.fixture(scope="module")
def reference_tokens(tiny_lm, tiny_prefill):
    """The tokens of the reference path (``attention=materialize``: keys rebuilt, plain float32 matmuls)."""
    return [r.tokens for r in decode_rows(tiny_lm.model, _rows(tiny_prefill, attention="materialize"))]


def test_the_error_measure_and_the_stated_tolerances():
    ref = torch.tensor([1.0, -2.0, 4.0])
    assert normalised_error(ref + 0.04, ref) == pytest.approx(0.01)
    assert normalised_error(torch.tensor([1.0, float("nan"), 4.0]), ref) == float("inf")
    assert tolerance(torch.float32) == 1e-4 and tolerance(torch.bfloat16) == 4 * 2 ** -8


def test_each_kernel_variant_is_checked_at_its_first_use(tiny_lm, tiny_prefill, reference_tokens):
    """One check per variant in a run, within its tolerance; later batches of the run are not checked again and the
    first use is timed apart (warmup_s), not in the decode time."""
    checks = FastPaths()
    rows = decode_rows(tiny_lm.model, _rows(tiny_prefill), checks=checks)
    assert [r.tokens for r in rows] == reference_tokens
    (check,) = checks.checks.values()
    assert check.variant == "C++ kernels (stacked, float32, D=16, one-token step)" and check.ok
    assert 0 <= check.error <= check.tolerance == 1e-4 and check.kind == "kernel"
    assert sum(r.warmup_s for r in rows) == pytest.approx(checks.seconds) and checks.seconds > 0
    again = decode_rows(tiny_lm.model, _rows(tiny_prefill), checks=checks)
    assert len(checks.checks) == 1 and all(r.warmup_s == 0 for r in again)
    assert checks.summary().startswith("numbers from the compact kernels (1 variant checked")


def test_a_kernel_that_differs_falls_back_to_the_reference(monkeypatch, tiny_lm, tiny_prefill, reference_tokens,
                                                           spark_log):
    real = dispatch.stack_apply
    monkeypatch.setattr(dispatch, "stack_apply", lambda *a, **k: real(*a, **k) + 1.0)  # a wrong kernel
    unchecked = decode_rows(tiny_lm.model, _rows(tiny_prefill), checks=FastPaths(enabled=False))
    assert [r.tokens for r in unchecked] != reference_tokens  # what the run would publish without the check
    checks = FastPaths()
    rows = decode_rows(tiny_lm.model, _rows(tiny_prefill), checks=checks)
    assert [r.tokens for r in rows] == reference_tokens  # every step, the first included, from the reference
    warned = [m for m in spark_log if "differs from its reference" in m]
    assert len(warned) == 1 and "continues without the compact kernels" in warned[0]
    assert checks.off == {"kernel": "C++ kernels (stacked, float32, D=16, one-token step)"}
    decode_rows(tiny_lm.model, _rows(tiny_prefill), checks=checks)  # the rest of the run: reference, no new warning
    assert len([m for m in spark_log if "differs" in m]) == 1
    record = checks.record()
    assert record["fallbacks"] == checks.off and not record["checks"][0]["ok"]
    assert record["numbers_from"].startswith("numbers from keys rebuilt, float32 matmuls")


def test_a_call_given_no_record_is_a_run_of_its_own(monkeypatch, tiny_lm, tiny_prefill, reference_tokens,
                                                     spark_log):
    """No record outlives a call or is shared across the process: each decode_rows call given none checks its first
    uses afresh (a wrong kernel is caught and warned about in each, and each decodes the reference's tokens), and a
    batch built without one starts with an empty record of its own."""
    real = dispatch.stack_apply
    monkeypatch.setattr(dispatch, "stack_apply", lambda *a, **k: real(*a, **k) + 1.0)  # a wrong kernel
    for call in (1, 2):
        assert [r.tokens for r in decode_rows(tiny_lm.model, _rows(tiny_prefill))] == reference_tokens
        assert len([m for m in spark_log if "differs from its reference" in m]) == call
    batch = cache_module.BatchedCache([row.cache for row in _rows(tiny_prefill, CONFIGS[:2])], capacity=4)
    assert batch.fast_paths.checks == {} and batch.fast_paths.on("kernel")
    assert all(layer.fast_paths is batch.fast_paths for layer in batch.layers)


def test_library_calls_given_one_record_check_once_and_fall_back_together(monkeypatch, tiny_lm, spark_log):
    """spark_bench.generate over two calls with one record (checks=): a wrong kernel is caught and warned about once,
    and both calls decode the tokens of the correct kernel; a press block holds one record for the caches it makes."""
    import spark_bench

    ids = torch.randint(100, 5000, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    context = spark_bench.compress(tiny_lm.model, ids, CONFIGS[2])
    right = spark_bench.generate(tiny_lm.model, context, max_new_tokens=3)
    real = dispatch.stack_apply
    monkeypatch.setattr(dispatch, "stack_apply", lambda *a, **k: real(*a, **k) + 1.0)  # a wrong kernel
    checks = FastPaths()
    for _ in range(2):
        assert torch.equal(spark_bench.generate(tiny_lm.model, context, max_new_tokens=3, checks=checks), right)
    assert len([m for m in spark_log if "differs from its reference" in m]) == 1
    assert checks.off == {"kernel": "C++ kernels (stacked, float32, D=16, one-token step)"}
    with spark_bench.press(tiny_lm.model, "snapkv", budget=64) as pressed:
        first = tiny_lm.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    assert first.fast_paths is pressed.checks


@pytest.fixture
def triton_on_cpu(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(cache_module, "compact_backend", lambda device: "triton")


def test_the_fused_kernel_is_checked_and_a_mismatch_falls_back_mid_step(triton_on_cpu, monkeypatch, tiny_lm,
                                                                        tiny_prefill, reference_tokens):
    """Under the interpreter: the fused kernel agrees with the reference; perturbed, layer 0 catches it and every
    later layer of the same step writes its pending tokens into the tail itself (the kernel would have): the
    reference's tokens."""
    checks = FastPaths()
    rows = decode_rows(tiny_lm.model, _rows(tiny_prefill, CONFIGS[:2], max_new=(2,)), checks=checks)
    assert [r.tokens for r in rows] == [t[:2] for t in reference_tokens[:2]]
    (check,) = checks.checks.values()
    assert check.variant.startswith("fused kernel (float32, D=16, ") and check.variant.endswith("one-token step)")
    assert check.ok
    real = dispatch.fused_attention

    def wrong(*args, **kwargs):
        return real(*args, **kwargs).add_(1.0)
    monkeypatch.setattr(dispatch, "fused_attention", wrong)
    checks = FastPaths()
    rows = decode_rows(tiny_lm.model, _rows(tiny_prefill, CONFIGS[:2], max_new=(2,)), checks=checks)
    assert [r.tokens for r in rows] == [t[:2] for t in reference_tokens[:2]] and "kernel" in checks.off
    unchecked = decode_rows(tiny_lm.model, _rows(tiny_prefill, CONFIGS[:2], max_new=(2,)),
                            checks=FastPaths(enabled=False))
    assert [r.tokens for r in unchecked] != [t[:2] for t in reference_tokens[:2]]


class StandInGraph:
    """A captured step stand-in on the CPU: replays by running the step eagerly (``wrong``: logits rolled by one
    token, a graph that computes something else)."""

    captured: list = []
    wrong = False

    def __init__(self, model, cache, ids, positions):
        self.model, self.variant, self.dtype = model, f"CUDA graph of a {ids.shape[0]}-row step", torch.float32
        StandInGraph.captured.append(ids.shape[0])

    def __call__(self, cache, ids, positions):
        logits = decode_module._eager(self.model, cache, ids, positions)
        return logits.roll(1, dims=-1) if StandInGraph.wrong else logits


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """The graphed decode loop on the CPU: every batch passes the blocker (unless graphs went off) and steps
    "replay" through :class:`StandInGraph`."""
    monkeypatch.setattr(cache_module.BatchedCache, "graph_blocker",
                        lambda self: None if self.fast_paths.on("graph") else "graphs off")
    monkeypatch.setattr(decode_module, "StepGraph", StandInGraph)
    StandInGraph.captured, StandInGraph.wrong = [], False


def test_graphs_are_captured_once_per_width_bucket(graphs_on_cpu, monkeypatch, tiny_lm, tiny_prefill):
    """Six rows stopping one after another: the batch keeps stopped rows as no-ops until the live ones fit the next
    power of two, so it is captured at widths 6, 4, 2, 1 (not once per stop), each width's first replay checked
    against an eager step; the tokens are those of eager decoding."""
    configs = CONFIGS[:3] * 2
    max_new = (3, 5, 7, 9, 11, 13)
    eager = [r.tokens for r in decode_rows(tiny_lm.model, _rows(tiny_prefill, configs, max_new), graph=False)]
    keeps = []
    real_keep = cache_module.BatchedCache.keep
    monkeypatch.setattr(cache_module.BatchedCache, "keep", lambda self, rows: keeps.append(len(rows)) or
                        real_keep(self, rows))
    checks = FastPaths()
    rows = decode_rows(tiny_lm.model, _rows(tiny_prefill, configs, max_new), checks=checks)
    assert [r.tokens for r in rows] == eager and [len(t) for t in eager] == list(max_new)
    assert StandInGraph.captured == [6, 4, 2, 1] and keeps == [4, 2, 1]
    graphs = [c for c in checks.checks.values() if c.kind == "graph"]
    assert [c.variant for c in graphs] == [f"CUDA graph of a {w}-row step" for w in (6, 4, 2, 1)]
    assert all(c.ok and c.error == 0 for c in graphs)
    assert [_width(n, 56) for n in (56, 33, 32, 17, 3, 1)] == [56, 56, 32, 32, 4, 1]


def test_a_graph_that_differs_is_dropped_for_eager_steps(graphs_on_cpu, tiny_lm, tiny_prefill, spark_log):
    eager = [r.tokens for r in decode_rows(tiny_lm.model, _rows(tiny_prefill, max_new=(6,)), graph=False)]
    StandInGraph.wrong = True
    checks = FastPaths()
    rows = decode_rows(tiny_lm.model, _rows(tiny_prefill, max_new=(6,)), checks=checks)
    assert [r.tokens for r in rows] == eager
    assert checks.off == {"graph": "CUDA graph of a 4-row step"} and StandInGraph.captured == [4]
    assert "eager decode steps after CUDA graph of a 4-row step differed" in checks.summary()
    assert len([m for m in spark_log if "differs from its reference" in m]) == 1


class StandIn:
    """A tensor as graph_blocker reads it: on a CUDA device (``cuda:k``, none needed here)."""

    is_cuda = True

    def __init__(self, device: str):
        self.device = torch.device(device)


def test_no_graph_when_a_batchs_layers_span_devices(triton_on_cpu, tiny_prefill):
    """A device map puts layers on several GPUs: one graph captures one device's stream, so no capture; on one
    device the same batch is captured."""
    batch = cache_module.BatchedCache([Pipeline.from_config(c).build_cache(tiny_prefill)[0] for c in CONFIGS[:3]],
                                      capacity=4)
    for k, layer in enumerate(batch.layers):
        layer.tail_keys = StandIn(f"cuda:{k % 2}")  # the device map's layer placement
    assert batch.graph_blocker() == "the layers span 2 devices (cuda:0, cuda:1)"
    assert decode_module.graph_step(None, batch, None, None, wanted=True) is None  # never reaches the capture
    for layer in batch.layers:
        layer.tail_keys = StandIn("cuda:0")
    assert batch.graph_blocker() is None


def test_the_manifest_run_log_and_report_say_which_path_computed_the_numbers(monkeypatch, tmp_path, spark_log):
    """A run whose kernel differs: one warning (its decode batches and scoring passes share the run's record), the
    reference's numbers, and the record in manifest.json, run.log and the report's note."""
    from test_protocol import _compose

    from spark_bench.cli import run
    from spark_bench.report.setup import fast_path_note

    real = dispatch.stack_apply
    monkeypatch.setattr(dispatch, "stack_apply", lambda *a, **k: real(*a, **k) + 1.0)
    run(_compose(["model=tiny-llama", "benchmark.tasks=[niah_single_1]", "benchmark.num_samples=1",
                  "benchmark.length=512", "benchmark.max_new_tokens=4", "progress=false", f"output_root={tmp_path}",
                  "run=r"]), tmp_path / "r")
    (record,) = json.loads((tmp_path / "r" / "manifest.json").read_text())["fast_paths"]
    assert list(record["fallbacks"]) == ["kernel"] and record["numbers_from"].startswith("numbers from keys rebuilt")
    log = (tmp_path / "r" / "run.log").read_text()
    assert log.count("differs from its reference") == 1 and f"decode: {record['numbers_from']}" in log
    assert fast_path_note(tmp_path / "r") == f"{tmp_path / 'r'}: decode: {record['numbers_from']}"
    timings = [json.loads(line) for line in (tmp_path / "r" / "timings.jsonl").open()]
    assert sum(t["warmup_s"] for t in timings) == pytest.approx(record["warmup_s"], abs=1e-3)
