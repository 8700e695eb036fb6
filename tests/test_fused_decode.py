"""The CUDA decode path proven without a GPU: the fused Triton kernel run under Triton's CPU interpreter inside real
decoding (the backend forced to ``triton`` on CPU tensors), its launches under their tensors' device, its work
(programs = Σ ceil(tokens / chunk), bytes loaded ≈ bytes stored), no host sync inside a step, and the same tokens as
the C++ path, ``decode_batch=1`` and ``decode_stack=false``."""

import contextlib

import numpy as np
import pytest
import torch
from conftest import DEVICE

from spark_bench.engine import cache as cache_module
from spark_bench.engine.decode import DecodeRow, decode_rows
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.storage import dispatch

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="forces the Triton path onto CPU tensors")

CONFIGS = [MethodConfig(name="snapkv", budget=64), MethodConfig(name="snapkv+think", budget=64, ratio=0.5),
           MethodConfig(name="snapkv+spark", budget=64, ratio=0.8),
           MethodConfig(name="adasnapkv+spark", budget=48, ratio=0.5, saliency="paper"),
           MethodConfig(name="snapkv+spark", budget=64, ratio=0.5, recovery="gaussian")]  # a per-row (loose) row


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The CUDA code path on CPU tensors: compact_backend says ``triton``, the kernels run under the interpreter."""
    pytest.importorskip("triton")
    monkeypatch.setattr(cache_module, "compact_backend", lambda device: "triton")


def _rows(prefill, configs, max_new=3):
    selections = {}
    return [DecodeRow(Pipeline.from_config(c).build_cache(prefill, selections=selections)[0], prefill.first_logits,
                      prefill.prompt_length, max_new, frozenset()) for c in configs]


@pytest.fixture(scope="module")
def cpp_tokens(tiny_lm, tiny_prefill):
    return [r.tokens for r in decode_rows(tiny_lm.model, _rows(tiny_prefill, CONFIGS))]


def test_fused_path_gives_the_tokens_of_every_other_path(triton_on_cpu, tiny_lm, tiny_prefill, cpp_tokens):
    """float32: stacked fused = one fused launch per row (decode_stack=false) = decode_batch=1 = the C++ path."""
    model = tiny_lm.model
    stacked = [r.tokens for r in decode_rows(model, _rows(tiny_prefill, CONFIGS))]
    per_row = [r.tokens for r in decode_rows(model, _rows(tiny_prefill, CONFIGS), stack=False)]
    alone = [decode_rows(model, [row])[0].tokens for row in _rows(tiny_prefill, CONFIGS[:2])]
    assert stacked == per_row == cpp_tokens
    assert alone == stacked[:2]


def test_every_launch_runs_under_its_tensors_device(triton_on_cpu, monkeypatch, tiny_lm, tiny_prefill):
    """Triton launches on the current device: the dispatch enters ``torch.cuda.device(tensor.device)`` around every
    launch. The current-device guard is replaced by a recorder and each kernel launch checks it is inside one for
    its queries' device."""
    from spark_bench.storage import triton_decode

    current = []

    @contextlib.contextmanager
    def recorder(tensor):
        current.append(tensor.device)
        try:
            yield
        finally:
            current.pop()

    launches = []

    class Guarded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((current[-1] if current else None, args[0].device))
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(dispatch, "on_device", recorder)
    for name in ("_partials_kernel", "_merge_kernel"):
        monkeypatch.setattr(triton_decode, name, Guarded(getattr(triton_decode, name)))
    decode_rows(tiny_lm.model, _rows(tiny_prefill, CONFIGS[:3], max_new=2))
    assert launches and all(guard == device for guard, device in launches)


def test_on_device_enters_the_tensors_cuda_device():
    """The guard itself: a CUDA tensor's device (here a stand-in on ``cuda:1``), a no-op elsewhere."""
    class Fake:
        device = torch.device("cuda", 1)

    guard = dispatch.on_device(Fake())
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(dispatch.on_device(torch.zeros(1)), contextlib.nullcontext)


def _batch_layer(prefill, configs):
    selections = {}
    caches = [Pipeline.from_config(c).build_cache(prefill, selections=selections)[0] for c in configs]
    return cache_module.BatchedCache(caches, capacity=4)


def test_programs_per_layer_are_the_work_not_segments_times_the_longest(triton_on_cpu, tiny_prefill):
    """One full row beside budgeted rows: programs = Σ over value tensors (and batches of heads reading one) of
    ceil(tokens / chunk); the old grid was (segments + heads) × ceil(longest / 32)."""
    from spark_bench.storage.segments import FusedTables
    from spark_bench.storage.triton_decode import launch_shape

    configs = [MethodConfig(name="full"), MethodConfig(name="snapkv+spark", budget=32, ratio=0.8),
               MethodConfig(name="snapkv+spark", budget=32, ratio=0.5), MethodConfig(name="snapkv", budget=32)]
    layer = _batch_layer(tiny_prefill, configs).layers[0]
    g = 2  # query heads per kv-head of the tiny model
    members = launch_shape(g)[1]
    tables = layer._tables(layer.units[0], members)
    n_full, n_budget, heads = tiny_prefill.prompt_length, 32, 2
    chunk = FusedTables.chunk_of
    # the full row reads its own values; the three budgeted rows share one selection's values (one batch of heads)
    expected = heads * -(-n_full // chunk(n_full)) + heads * -(-3 // members) * -(-n_budget // chunk(n_budget))
    assert tables.n_work == expected
    old_grid = (len(layer.units[0]["keys"]._rows) + 4 * heads) * -(-n_full // 32)
    assert tables.n_work < old_grid / 3


class _LoadCounter:
    """Counts, during the kernels' run under the interpreter, the distinct bytes each load instruction reads (lanes
    of one load reading the same address are one memory access, as a GPU coalesces them)."""

    def __init__(self):
        self.bytes = 0

    @contextlib.contextmanager
    def counting(self):
        from triton.runtime import interpreter

        original = interpreter.InterpreterBuilder.create_masked_load

        def counted(builder, ptrs, mask, other, *args):
            out = original(builder, ptrs, mask, other, *args)
            addresses = np.unique(np.broadcast_to(ptrs.data, mask.data.shape)[mask.data])
            self.bytes += addresses.size * out.data.dtype.itemsize
            return out

        interpreter.InterpreterBuilder.create_masked_load = counted
        try:
            yield self
        finally:
            interpreter.InterpreterBuilder.create_masked_load = original


def test_the_kernel_loads_about_what_is_stored(triton_on_cpu):
    """Bytes one layer's launch loads (kept entries, masks, μ, signs, ThinK's keys, dense keys, the values — shared
    by the four rows, read once per work item —, the tail, the tables, the queries and the partials) ≤ 1.1 × the
    bytes stored + the queries: bf16, head_dim 64, four configs sharing one 512-token selection, 4 query heads per
    kv-head (Llama-3-8B's grouping)."""
    from test_stacking import _stores

    from spark_bench.storage.segments import FusedTables, SegmentStack, ValueStack
    from spark_bench.storage.stores import DenseStore
    from spark_bench.storage.triton_decode import launch_shape

    dtype, d, group, n, cap = torch.bfloat16, 64, 4, 512, 4
    stores = _stores(dtype, d, group, ["spark_official", "spark_zero", "think_window", "dense"], seed=9, length=n)
    values = DenseStore(torch.randn(1, 2, n, d).to(dtype))
    keys, value_stack = SegmentStack(stores), ValueStack([values] * 4, n)
    tables = FusedTables.build(keys, value_stack, [None] * 8, launch_shape(group)[1])
    tail_k, tail_v = torch.randn(8, cap, d).to(dtype), torch.randn(8, cap, d).to(dtype)
    queries = torch.randn(8, group, d)
    with _LoadCounter().counting() as counter:
        dispatch.fused_attention(tables, keys.aux_scale, tail_k, queries, tail_k, tail_v, torch.tensor([cap]), 1)
    stored = sum(s.nbytes() for s in stores) + values.nbytes() + tail_k.numel() * 2 * 2
    assert counter.bytes <= 1.1 * stored + queries.numel() * 4, (counter.bytes, stored)


def test_a_step_makes_no_host_transfer_and_keeps_its_shapes(triton_on_cpu, tiny_lm, tiny_prefill):
    """Inside a step of the fused path: no tensor made from host data, no ``.item``/``.tolist``/``.cpu`` (the
    dispatch mode sees every aten call), and the kernels' arguments have the same shapes at every step (the tail
    length lives in a device tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    batch = _batch_layer(tiny_prefill, CONFIGS[:3])
    layer = batch.layers[0]
    r, d = 3, 16
    seen, shapes = [], []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if any(k in name for k in ("_local_scalar_dense", "lift_fresh", "_to_copy")):
                seen.append(name)
            return func(*args, **(kwargs or {}))

    for step in range(4):  # the first step builds the batch's kernel tables (one host→device copy), then none
        keys = torch.randn(r, 2, 1, d)
        query = torch.randn(r, 4, 1, d)
        with Watch() if step else contextlib.nullcontext():
            layer.update(keys, keys)
            layer.attend(query, 0.25)
        unit = layer.units[0]
        shapes.append((tuple(layer.tail_keys.shape), tuple(layer.length_t.shape),
                       tuple(t.packed.shape for t in unit["tables"].values())))
    assert seen == []
    assert len(set(shapes[1:])) == 1
