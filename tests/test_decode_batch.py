"""Batched decoding: every method config of a sample decoded in one batch gives exactly the tokens of decoding
each alone (float32), whatever the stores, stops, budgets or prompt lengths; the kernel dispatch decision; a stale
kernel build lock cannot hang a run."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import DEVICE, reproducible

from spark_bench.engine.decode import DecodeRow, decode_rows
from spark_bench.engine.prefill import run_prefill
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.storage import dispatch, fast_logits
from test_methods import MATRIX

CONFIGS = [MethodConfig(name=name, budget=64, **options) for name, options in MATRIX]


def _rows(prefill, configs, max_new=lambda i: 6, stops=lambda i: frozenset(), min_new=lambda i: 0):
    selections = {}
    return [DecodeRow(Pipeline.from_config(c).build_cache(prefill, selections=selections)[0], prefill.first_logits,
                      prefill.prompt_length, max_new(i), stops(i), min_new(i)) for i, c in enumerate(configs)]


def _alone(model, rows):
    return [decode_rows(model, [row])[0].tokens for row in rows]


@pytest.fixture(scope="module")
def free_run(tiny_lm, tiny_prefill):
    """Each config alone, 6 tokens, no stop token: used to choose stop tokens that end rows early."""
    return _alone(tiny_lm.model, _rows(tiny_prefill, CONFIGS))


def test_whole_matrix_in_one_batch_equals_one_at_a_time(tiny_lm, tiny_prefill, free_run):
    batched = [row.tokens for row in decode_rows(tiny_lm.model, _rows(tiny_prefill, CONFIGS))]
    assert batched == free_run
    assert len(CONFIGS) > 100 and all(len(t) == 6 for t in batched)


def test_rows_stopping_early_and_min_new_tokens(tiny_lm, tiny_prefill, free_run):
    # every third row stops at its 3rd token; every fourth row bans its 2nd token as a stop until 4 tokens exist;
    # max_new_tokens differs per row (2..7)
    def stops(i):
        if i % 3 == 0:
            return frozenset({free_run[i][2]})
        return frozenset({free_run[i][1]}) if i % 4 == 1 else frozenset()

    spec = dict(max_new=lambda i: 2 + i % 6, stops=stops, min_new=lambda i: 4 if i % 4 == 1 else 0)
    alone = _alone(tiny_lm.model, _rows(tiny_prefill, CONFIGS, **spec))
    batched = [row.tokens for row in decode_rows(tiny_lm.model, _rows(tiny_prefill, CONFIGS, **spec))]
    assert batched == alone
    lengths = {len(t) for t in alone}
    assert min(lengths) < 3 and max(lengths) == 7  # rows really left the batch at different steps
    for i, tokens in enumerate(alone):
        if i % 4 == 1 and len(tokens) >= 2:
            assert free_run[i][1] not in tokens[:4] or len(tokens) >= 4


def test_rows_with_different_prompts_and_positions(tiny_lm, tiny_prefill):
    """Rows of two samples (160 and 97 prompt tokens: different positions and cache lengths) in one batch."""
    ids = torch.randint(100, 5000, (1, 97), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    other = run_prefill(tiny_lm.model, ids, window=32)
    configs = [CONFIGS[0], MethodConfig(name="snapkv+spark", budget=48, ratio=0.8),
               MethodConfig(name="adasnapkv+think", budget=48, ratio=0.5, value_ratio=0.3)]
    rows = lambda: _rows(tiny_prefill, configs) + _rows(other, configs[::-1], max_new=lambda i: 3 + i)
    assert [r.tokens for r in decode_rows(tiny_lm.model, rows())] == _alone(tiny_lm.model, rows())


def test_materialize_reference_batches_too(tiny_lm, tiny_prefill, free_run):
    selections, rows = {}, []
    for c in CONFIGS[::7]:
        cache, _ = Pipeline.from_config(c).build_cache(tiny_prefill, attention="materialize", selections=selections)
        rows.append(DecodeRow(cache, tiny_prefill.first_logits, tiny_prefill.prompt_length, 6, frozenset()))
    assert [r.tokens for r in decode_rows(tiny_lm.model, rows)] == free_run[::7]


@pytest.mark.parametrize("decode_batch,decode_samples", [(None, 1), (2, 1), (None, 2), (3, 2)])
def test_sweep_results_do_not_depend_on_decode_batch(tiny_lm, tmp_path, decode_batch, decode_samples):
    from spark_bench.benchmarks.ruler import load_ruler
    from spark_bench.runner import run_sweep

    samples = load_ruler(["niah_single_1", "niah_multikey_1", "niah_single_2"], 512, 1, 3, tiny_lm, max_new_tokens=5)
    configs = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=64),
               MethodConfig(name="snapkv+think", budget=64, ratio=0.5),
               MethodConfig(name="snapkv+spark", budget=64, ratio=0.8),
               MethodConfig(name="pyramidkv+spark", budget=64, ratio=0.5)]
    run_sweep(tiny_lm, samples, configs, tmp_path / "one", decode_batch=1)
    run_sweep(tiny_lm, samples, configs, tmp_path / "many", decode_batch=decode_batch,
              decode_samples=decode_samples)
    for name in ("predictions.jsonl", "scores.csv", "table.md"):
        assert reproducible(tmp_path / "one" / name) == reproducible(tmp_path / "many" / name)


@pytest.mark.parametrize("decode_batch", [None, 2])
def test_a_prefill_is_dropped_once_its_last_row_is_built(tiny_lm, monkeypatch, decode_batch):
    """Several samples in one batch hold their compressed caches, not their prefills: when a sample is prefilled,
    no earlier sample's prefill is alive (without ``full``, whose cache is the prefill's own keys and values)."""
    import weakref

    from spark_bench import runner
    from spark_bench.benchmarks.ruler import load_ruler

    samples = load_ruler(["niah_single_1", "niah_multikey_1", "niah_single_2"], 512, 1, 3, tiny_lm, max_new_tokens=3)
    pipelines = [Pipeline.from_config(c, c.name) for c in (
        MethodConfig(name="snapkv", budget=64), MethodConfig(name="snapkv+spark", budget=64, ratio=0.8),
        MethodConfig(name="think", ratio=0.5))]
    made, alive_at_call = [], []
    prefill = runner._prefill

    def tracked(lm, sample, todo):
        alive_at_call.append(sum(ref() is not None for ref in made))
        result = prefill(lm, sample, todo)
        made.append(weakref.ref(result))
        return result

    monkeypatch.setattr(runner, "_prefill", tracked)
    out = runner.run_samples(tiny_lm, [(s, pipelines) for s in samples], decode_batch)
    assert [len(p) for p in out] == [3, 3, 3]
    assert alive_at_call == [0, 0, 0]
    assert all(ref() is None for ref in made)


def test_bad_decode_batch_is_one_line(tmp_path, console):
    code, _, err = console(["model=tiny-llama", "decode_batch=0", f"output_root={tmp_path}"])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "decode_batch must be an integer >= 1, or null" in err and not any(tmp_path.iterdir())


# ---- kernel dispatch ----------------------------------------------------------------------------------------------

def _spark_store(**options):
    from spark_bench.engine.prefill import LayerPrefill
    from spark_bench.methods.channel.spark import SparK

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 50, 64, generator=g)
    window = torch.randn(1, 6, 32, 64, generator=g)
    return SparK(ratio=0.8, **options).compress_keys(keys, LayerPrefill(keys, torch.zeros_like(keys), window))


def test_dispatch_decision_by_device_and_store():
    """CPU tensors → the C++ kernel; CUDA tensors → Triton when importable, else no compact kernel (rows are not
    stacked and a lone store rebuilds its keys); other devices → none. Decided without a GPU."""
    from spark_bench.storage.dispatch import compact_backend

    kernel = fast_logits.load_kernel()
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert compact_backend(cpu, cpp_kernel=kernel) == "cpp"
    assert compact_backend(cpu, cpp_kernel="kernel unavailable (no compiler)") == "no: kernel unavailable (no compiler)"
    assert compact_backend(cuda, triton_ready=True) == "triton"
    assert compact_backend(cuda, triton_ready=False).startswith("no: triton is not installed")
    assert compact_backend(torch.device("meta")).startswith("no: no compact kernel for meta tensors")
    store = _spark_store()
    assert dispatch.kernel_blocker(store, cpu) is None
    assert dispatch.kernel_blocker(_spark_store(variant="top_p"), cpu) is None  # (ragged: granule starts)
    assert "draws a random score" in dispatch.kernel_blocker(_spark_store(recovery="gaussian"), cpu)


def test_more_query_rows_than_the_kernel_takes_go_in_chunks():
    """A suffix run through the cache gives G·n query rows per kv-head: served by the kernel 8 rows at a time,
    equal to the dense reference, with no fallback."""
    store = _spark_store()
    queries = torch.randn(1, 2, 3 * 7, 64, generator=torch.Generator().manual_seed(1))
    before = set(dispatch.fallback_reasons())
    got = dispatch.compact_logits(store, queries)
    torch.testing.assert_close(got, store.logits(queries), rtol=1e-4, atol=1e-4)
    assert dispatch.fallback_reasons() == before


def test_non_cpu_queries_never_reach_the_kernel(monkeypatch):
    store = _spark_store()

    def no_kernel():
        raise AssertionError("the CPU kernel was asked for on a non-CPU device")

    monkeypatch.setattr(fast_logits, "load_kernel", no_kernel)
    queries = torch.empty(1, 2, 3, 64, device="meta")
    monkeypatch.setattr(dispatch, "reference_logits", lambda store, q: "reference path")
    with pytest.warns(UserWarning, match="no compact kernel for meta tensors"):
        out = dispatch.compact_logits(store, queries)
    assert out == "reference path"


# ---- a stale build lock --------------------------------------------------------------------------------------------

PROBE = """
import time, torch, warnings
from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.channel.spark import SparK
from spark_bench.storage import dispatch
g = torch.Generator().manual_seed(0)
keys = torch.randn(1, 2, 40, 64, generator=g)
store = SparK(ratio=0.8).compress_keys(keys, LayerPrefill(keys, keys, torch.randn(1, 4, 32, 64, generator=g)))
q = torch.randn(1, 2, 2, 64, generator=g)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out = dispatch.compact_logits(store, q)
assert torch.allclose(out, store.logits(q), atol=1e-4)
print("fallbacks:", sorted(dispatch.fallback_reasons()))
"""


def _probe(tmp_path, wait_s):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "SPARK_BENCH_KERNEL_WAIT_S": str(wait_s)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    return proc, time.perf_counter() - start


def _lock_in(tmp_path):
    directory = tmp_path / "spark_bench" / fast_logits.kernel_name()
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")
    return directory


def test_stale_build_lock_is_named_and_the_run_finishes(tmp_path):
    _lock_in(tmp_path)
    proc, seconds = _probe(tmp_path, wait_s=3)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert seconds < 60
    assert "lock exists: another process is building the SparK kernel, or a killed build left it" in proc.stderr
    assert "kernel build did not finish within 3 s" in proc.stdout


def test_a_prebuilt_kernel_loads_without_touching_the_lock(tmp_path):
    built = fast_logits.load_kernel()
    if isinstance(built, str):
        pytest.fail(f"the kernel must build here: {built}")
    directory = _lock_in(tmp_path)
    for so in fast_logits.build_directory().glob(f"{fast_logits.kernel_name()}*.so"):
        shutil.copy(so, directory)
    proc, _ = _probe(tmp_path, wait_s=3)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "lock exists" not in proc.stderr and "fallbacks: []" in proc.stdout
