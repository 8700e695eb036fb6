"""Stacked decoding: one segment table serves the compact key stores of many rows (C++ on CPU, Triton on CUDA, the
Triton kernels checked here under Triton's CPU interpreter), one value table their shared values, and a decode
step's operation count does not grow with the number of stacked rows."""

import importlib
import os

import pytest
import torch
from conftest import DEVICE

from spark_bench.engine.decode import DecodeRow, decode_rows
from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.channel.spark import SparK
from spark_bench.methods.channel.think import ThinK
from spark_bench.storage.segments import SegmentStack, ValueStack
from spark_bench.storage.stores import DenseStore

# every store kind a compact kernel serves: SparK fixed-T in each kernel mode, ThinK with and without its dense
# recent window, dense keys
KINDS = {
    "spark_official": lambda: SparK(ratio=0.8),
    "spark_official_0.5": lambda: SparK(ratio=0.5),
    "spark_paper": lambda: SparK(ratio=0.8, saliency="paper"),
    "spark_zero": lambda: SparK(ratio=0.8, recovery="zero"),
    "spark_none": lambda: SparK(ratio=0.5, recovery="none"),
    "spark_constant": lambda: SparK(ratio=0.8, recovery="constant", constant=0.01),
    "spark_paper_constant": lambda: SparK(ratio=0.3, saliency="paper", recovery="constant"),
    "spark_fork_pool0": lambda: SparK(ratio=0.8, recovery="fork_pool0"),
    "think_window": lambda: ThinK(ratio=0.5, window_size=32),
    "think_no_window": lambda: ThinK(ratio=0.8, window_size=32, keep_window=False),
    "dense": None,
}


def _stores(dtype, head_dim, group, kinds, seed=0, device="cpu"):
    """One store per kind, each over its own keys of a different length (rows of different budgets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, kind in enumerate(kinds):
        s = 40 + 23 * i
        keys = torch.randn(1, 2, s, head_dim, generator=g).to(device, dtype)
        window = torch.randn(1, 2 * group, 32, head_dim, generator=g).to(device, dtype)
        method = KINDS[kind]
        out.append(DenseStore(keys) if method is None else
                   method().compress_keys(keys, LayerPrefill(keys, torch.zeros_like(keys), window)))
    return out


def _float64_logits(store, queries):
    """q·k̃ in float64, the recovered entries computed in float32 (no rounding to the model dtype)."""
    if isinstance(store, DenseStore):
        keys = store.data.double()
    elif hasattr(store, "recovery"):
        mask = store.kept_mask()
        keys = store.recovery.fill(mask, torch.float32).masked_scatter(mask, store.kept.float()).double()
    else:
        keys = store.materialize().double()
    return queries.double() @ keys.transpose(-1, -2)


def stack_width(logits):
    return logits.shape[-1]


def _check_stack(logits, stores, queries, tol):
    for i, store in enumerate(stores):
        ref = _float64_logits(store, queries[i:i + 1])
        got = logits[i:i + 1, :, :, :store.length].double()
        scale = ref.abs().max().clamp(min=1)
        assert ((got - ref).abs().max() / scale) < tol, (i, (got - ref).abs().max())
        assert torch.isneginf(logits[i, :, :, store.length:stack_width(logits)]).all()  # past a row's length


ALL = list(KINDS)
CASES = [(64, 3, torch.float32), (128, 4, torch.float32), (64, 1, torch.bfloat16), (128, 8, torch.bfloat16)]


@pytest.mark.parametrize("head_dim,group,dtype", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_cpp_segment_stack_equals_reference(head_dim, group, dtype):
    """All kinds in one stack and one call, rows of different lengths; tolerance 1e-4 relative (float32
    accumulation vs float64)."""
    stores = _stores(dtype, head_dim, group, ALL)
    stack = SegmentStack(stores)
    queries = torch.randn(len(stores), 2, group, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert stack.backend() == "cpp"
    _check_stack(stack.logits(queries), stores, queries, 1e-4)


def test_segment_stack_reads_the_rows_stores_in_place():
    """On the CPU a stack copies nothing: its parts are the stores' own tensors (views), so decoding holds the
    compressed data once; the Triton layout concatenates them once, on first use."""
    stores = _stores(torch.bfloat16, 64, 3, ["spark_official", "spark_zero", "think_window", "dense"])
    stack = SegmentStack(stores)
    own = [stores[0].kept, stores[1].kept, stores[2].kept, stores[2].recent, stores[3].data]
    assert [p.data_ptr() for p in stack.kept_parts] == [t.data_ptr() for t in own]  # ThinK's recent: a view too
    assert stack.mask_parts[0].data_ptr() == stores[0].mask_bits.data_ptr()
    assert stack.nbytes() < 0.1 * sum(s.nbytes() for s in stores)  # the table and per-head scales only
    flat, _ = stack.flat()
    assert flat["kept"].numel() == sum(t.numel() for t in own)


def test_value_stack_stores_shared_values_once():
    g = torch.Generator().manual_seed(2)
    shared, own = DenseStore(torch.randn(1, 2, 30, 64, generator=g)), DenseStore(torch.randn(1, 2, 50, 64, generator=g))
    stack = ValueStack([shared, own, shared, shared], 50)
    assert [p.data_ptr() for p in stack.parts] == [shared.data.data_ptr(), own.data.data_ptr()]
    weights = torch.softmax(torch.randn(4, 2, 3, 50, generator=g), -1)
    weights[[0, 2, 3], ..., 30:] = 0
    out = stack.apply(weights)
    for i, store in enumerate([shared, own, shared, shared]):
        torch.testing.assert_close(out[i:i + 1], weights[i:i + 1, ..., :store.length] @ store.data, rtol=1e-5,
                                   atol=1e-6)


# ---- the Triton kernels, under Triton's CPU interpreter -------------------------------------------------------------

@pytest.fixture(scope="module")
def triton_kernels():
    """The Triton kernels: compiled on a CUDA test run, else on CPU tensors under the interpreter (conftest sets
    ``TRITON_INTERPRET=1`` before triton is first imported)."""
    pytest.importorskip("triton")
    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py)")
    return importlib.import_module("spark_bench.storage.triton_logits")


@pytest.mark.parametrize("head_dim,group,dtype", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_triton_segment_logits_equal_reference(triton_kernels, head_dim, group, dtype):
    """Every supported mode (official / paper degenerate, zero, none, constant, ThinK, dense) in one call; tolerance
    1e-4 relative to the float64 reference (float32 accumulation in another order than the C++ kernel)."""
    stores = _stores(dtype, head_dim, group, ALL, seed=3, device=DEVICE)
    stack = SegmentStack(stores)
    stack._backend = "triton"  # the CUDA path (on CPU tensors under the interpreter)
    queries = torch.randn(len(stores), 2, group, head_dim, generator=torch.Generator().manual_seed(4)).to(DEVICE,
                                                                                                       dtype)
    _check_stack(stack.logits(queries), stores, queries, 1e-4)


def test_triton_pv_equals_reference(triton_kernels):
    g = torch.Generator().manual_seed(5)
    a = DenseStore(torch.randn(1, 2, 37, 64, generator=g).to(DEVICE))
    b = DenseStore(torch.randn(1, 2, 70, 64, generator=g).to(DEVICE))
    rows = [a, b, a]
    stack = ValueStack(rows, 70)
    stack._backend = "triton"
    weights = torch.softmax(torch.randn(3, 2, 12, 70, generator=g), -1).to(DEVICE)  # G·q = 12 rows (a suffix)
    out = stack.apply(weights)
    for i, store in enumerate(rows):
        torch.testing.assert_close(out[i:i + 1], weights[i:i + 1, ..., :store.length] @ store.data, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_decoded_tail_joins_the_kernel_calls(request, backend, q_len):
    """The decoded tail of every row scored after the prompt (its last q_len tokens causal among themselves) and
    weighted into the output by the same two calls; equal to a dense float64 softmax attention."""
    if backend == "triton":
        request.getfixturevalue("triton_kernels")
    device = DEVICE if backend == "triton" else torch.device("cpu")
    group, d, cap, filled = 2, 64, 9, 6
    stores = _stores(torch.float32, d, group, ["spark_official", "think_window", "dense"], seed=7, device=device)
    g = torch.Generator().manual_seed(8)
    values = [DenseStore(torch.randn(1, 2, s.length, d, generator=g).to(device)) for s in stores]
    keys_stack, value_stack = SegmentStack(stores), ValueStack(values, max(s.length for s in stores))
    keys_stack._backend = value_stack._backend = backend
    tail_k = torch.randn(3, 2, cap, d, generator=g).to(device)
    tail_v = torch.randn(3, 2, cap, d, generator=g).to(device)
    queries = torch.randn(3, 2, group * q_len, d, generator=g).to(device)
    scores = keys_stack.logits(queries, tail_k, filled, q_len)
    out = value_stack.apply(scores.softmax(-1), tail_v, filled)
    for i, (store, value) in enumerate(zip(stores, values)):
        prompt = _float64_logits(store, queries[i:i + 1])
        tail = queries[i:i + 1].double() @ tail_k[i:i + 1, :, :filled].double().transpose(-1, -2)
        visible = torch.ones(q_len, filled, dtype=torch.bool, device=device).tril(filled - q_len)
        tail = tail.view(1, 2, group, q_len, filled).masked_fill(~visible, float("-inf")).view(1, 2, -1, filled)
        weights = torch.cat([prompt, tail], -1).softmax(-1)
        ref = weights @ torch.cat([value.data, tail_v[i:i + 1, :, :filled]], -2).double()
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=1e-4, atol=1e-5)


# ---- batched decoding with stacks --------------------------------------------------------------------------------

MIX = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=64),
       MethodConfig(name="snapkv+think", budget=64, ratio=0.5), MethodConfig(name="snapkv+spark", budget=48, ratio=0.8),
       MethodConfig(name="snapkv+spark", budget=64, ratio=0.5, saliency="paper"),
       MethodConfig(name="snapkv+spark", budget=64, ratio=0.8, recovery="none"),
       MethodConfig(name="adasnapkv+spark", budget=64, ratio=0.5),
       MethodConfig(name="snapkv+spark", budget=56, ratio=0.8, recovery="fork_pool0"),
       # rows that keep the per-row path, mixed into the same batch
       MethodConfig(name="snapkv+spark", budget=64, ratio=0.5, recovery="gaussian"),
       MethodConfig(name="snapkv+spark", budget=64, ratio=0.5, variant="top_p"),
       MethodConfig(name="snapkv+think", budget=64, ratio=0.5, value_ratio=0.3)]


def _rows(prefill, configs, max_new=6, stops=lambda i: frozenset(), min_new=lambda i: 0):
    selections = {}
    return [DecodeRow(Pipeline.from_config(c).build_cache(prefill, selections=selections)[0], prefill.first_logits,
                      prefill.prompt_length, max_new, stops(i), min_new(i)) for i, c in enumerate(configs)]


def test_stacked_and_per_row_paths_give_the_same_tokens(tiny_lm, tiny_prefill):
    """Stacked kinds and per-row kinds mixed in one batch, rows stopping early and min_new_tokens bans: the tokens
    of decode_batch=1 and of the unstacked path (decode_stack=false)."""
    model = tiny_lm.model
    free = [decode_rows(model, [row])[0].tokens for row in _rows(tiny_prefill, MIX)]
    spec = dict(stops=lambda i: frozenset({free[i][2]}) if i % 2 else frozenset(),
                min_new=lambda i: 3 if i % 3 == 1 else 0)
    alone = [decode_rows(model, [row])[0].tokens for row in _rows(tiny_prefill, MIX, **spec)]
    stacked = [r.tokens for r in decode_rows(model, _rows(tiny_prefill, MIX, **spec))]
    unstacked = [r.tokens for r in decode_rows(model, _rows(tiny_prefill, MIX, **spec), stack=False)]
    assert stacked == alone == unstacked
    assert len({len(t) for t in alone}) > 1  # rows really stopped at different steps


def test_release_drops_the_rows_caches_and_keeps_the_tokens(tiny_lm, tiny_prefill):
    model = tiny_lm.model
    kept = [r.tokens for r in decode_rows(model, _rows(tiny_prefill, MIX[:4]))]
    rows = _rows(tiny_prefill, MIX[:4])
    assert [r.tokens for r in decode_rows(model, rows, release=True)] == kept
    assert all(r.cache is None for r in rows)


def _ops_per_step(model, prefill, configs) -> float:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for steps in (3, 7):
        rows = _rows(prefill, configs, max_new=steps + 1)
        Count.n = 0
        with Count():
            decode_rows(model, rows)
        counts.append(Count.n)
    return (counts[1] - counts[0]) / 4


@pytest.mark.skipif(DEVICE.type != "cpu", reason="counts the CPU dispatch (the C++ kernel path)")
def test_ops_per_step_do_not_grow_with_stacked_rows(tiny_lm, tiny_prefill):
    """R = 2 vs 8 rows of one stacked kind (SparK at different ratios, budgets and recoveries): the same number of
    operations per decode step; the per-row path grows with R."""
    def mix(r):
        return [MethodConfig(name="snapkv+spark", budget=48 + 4 * i, ratio=(0.3, 0.5, 0.8)[i % 3],
                             recovery=("degenerate", "zero")[i % 2]) for i in range(r)]

    model = tiny_lm.model
    assert _ops_per_step(model, tiny_prefill, mix(2)) == _ops_per_step(model, tiny_prefill, mix(8))
