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
from spark_bench.storage.segments import KINDS

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
    """float32: stacked fused = one fused launch per row (decode_stack=false: each row's own tables, as
    decode_batch=1 launches them) = the C++ path."""
    model = tiny_lm.model
    stacked = [r.tokens for r in decode_rows(model, _rows(tiny_prefill, CONFIGS))]
    per_row = [r.tokens for r in decode_rows(model, _rows(tiny_prefill, CONFIGS[1:4]), stack=False)]
    assert stacked == cpp_tokens
    assert per_row == stacked[1:4]


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
    """Counts, during the kernels' run under the interpreter, the distinct bytes each program reads (lanes of one
    load reading the same address are one memory access, as a GPU coalesces them; a program reading an address it
    has read before — its table rows and scales, again for each block of tokens — or written itself — the signed
    walk's per-step tables — hits its cache, not memory)."""

    def __init__(self):
        self.bytes = 0
        self.seen: dict = {}
        self.written: dict = {}

    @contextlib.contextmanager
    def counting(self):
        from triton.runtime import interpreter

        original = interpreter.InterpreterBuilder.create_masked_load
        original_store = interpreter.InterpreterBuilder.create_masked_store

        def stored(builder, ptrs, value, mask, *args):  # (this launch's program wrote it: read from its cache)
            addresses = np.broadcast_to(ptrs.data, mask.data.shape)[mask.data]
            self.written.setdefault(builder.grid_idx, set()).update(addresses.tolist())
            return original_store(builder, ptrs, value, mask, *args)

        launch = interpreter.GridExecutor.__call__

        def launched(executor, *args, **kwargs):  # (a program of the next launch has written nothing yet)
            self.written = {}
            return launch(executor, *args, **kwargs)

        def counted(builder, ptrs, mask, other, *args):
            out = original(builder, ptrs, mask, other, *args)
            addresses = np.unique(np.broadcast_to(ptrs.data, mask.data.shape)[mask.data])
            seen = self.seen.setdefault(builder.grid_idx, set())
            own = self.written.get(builder.grid_idx, ())
            fresh = [a for a in addresses.tolist() if a not in seen and a not in own]
            seen.update(fresh)
            self.bytes += len(fresh) * out.data.dtype.itemsize
            return out

        interpreter.InterpreterBuilder.create_masked_load = counted
        interpreter.InterpreterBuilder.create_masked_store = stored
        interpreter.GridExecutor.__call__ = launched
        try:
            yield self
        finally:
            interpreter.InterpreterBuilder.create_masked_load = original
            interpreter.InterpreterBuilder.create_masked_store = original_store
            interpreter.GridExecutor.__call__ = launch


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
        dispatch.fused_attention(tables, keys.aux_scale, tail_k, queries, 1.0, tail_k[:, :1], tail_v[:, :1],
                                 tail_k, tail_v, torch.tensor([cap]), 1)
    stored = sum(s.nbytes() for s in stores) + values.nbytes() + tail_k.numel() * 2 * 2
    assert counter.bytes <= 1.1 * stored + queries.numel() * 4, (counter.bytes, stored)


def test_a_step_makes_no_host_transfer_and_keeps_its_shapes(triton_on_cpu, tiny_lm, tiny_prefill):
    """Inside a step of the fused path: no tensor made from host data, no ``.item``/``.tolist``/``.cpu`` (the
    dispatch mode sees every aten call), and the kernels' arguments have the same shapes at every step (the tail
    length lives in a device tensor). Rows stopping cost one host→device copy for the layer (its indices and
    tables together), then steps are free of transfers again. A loose (per-row) row rides along."""
    from torch.utils._python_dispatch import TorchDispatchMode

    batch = _batch_layer(tiny_prefill, CONFIGS[:3] + CONFIGS[4:] + CONFIGS[:1])  # two rows share values
    layer = batch.layers[0]
    r, d = 5, 16
    seen, shapes = [], []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            moved = "_to_copy" in name and kwargs and kwargs.get("device") not in (None, args[0].device)
            if moved or any(k in name for k in ("_local_scalar_dense", "lift_fresh")):
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
    with Watch():
        layer.keep([0, 2, 3])
    assert seen == ["aten.lift_fresh.default"]  # the layer's one copy (tail index, row order, tables)
    seen.clear()
    for _ in range(2):
        with Watch():
            layer.update(keys[:3], keys[:3])
            layer.attend(query[:3], 0.25)
    assert seen == []


def test_a_step_launches_no_more_kernels_than_a_dense_step(triton_on_cpu, monkeypatch, tiny_lm, tiny_prefill):
    """Kernels one decode step runs on the CUDA path (the model's own ops that run a kernel, counted by the
    dispatch mode, plus the two fused launches per layer, recorded not run) ≤ a dense ``DynamicCache`` batch's step
    of the same rows (sdpa attention): the kernel scales the queries, writes the step's tokens into the tail and
    advances the device length itself, so a layer's attention is its two launches (dense: sdpa and two cats)."""
    from transformers import DynamicCache

    from spark_bench.engine.attention import compressed_attention_enabled
    from spark_bench.engine.clock import OpCounter
    from spark_bench.storage import triton_decode

    launches = [0]

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.__setitem__(0, launches[0] + 1)

    model, r = tiny_lm.model, 4
    batch = _batch_layer(tiny_prefill, CONFIGS[:4])
    assert all(layer.kernel_writes_tail for layer in batch.layers)
    ids = torch.full((r, 1), 7)
    positions = torch.full((r, 1), tiny_prefill.prompt_length)

    def step(cache, **kwargs):
        model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1,
              **kwargs).logits[:, -1].argmax(-1)

    with compressed_attention_enabled(model):
        step(batch, compressed_cache=batch)  # the first step builds the kernel tables
        monkeypatch.setattr(triton_decode, "_partials_kernel", Recorded())
        monkeypatch.setattr(triton_decode, "_merge_kernel", Recorded())
        with OpCounter() as fused:
            step(batch, compressed_cache=batch)
    dense_cache = DynamicCache(config=model.config)
    for i, layer in enumerate(batch.layers):
        keys = torch.randn(r, layer.tail_keys.shape[1], tiny_prefill.prompt_length, layer.tail_keys.shape[-1])
        dense_cache.update(keys, keys.clone(), i)
    with OpCounter() as dense:
        step(dense_cache)
    assert launches[0] == 2 * len(batch.layers)
    assert fused.kernels + launches[0] <= dense.kernels, (fused.kernel_ops, dense.kernel_ops)


class _LiveBytes:
    """Live tensor storage made inside the block, tracked through a ``TorchDispatchMode``: every storage an op
    creates (not an alias of its inputs) is counted until it is freed (a finalizer on the storage, whose Python object torch keeps while the
    storage lives), with the peak."""

    def __init__(self):
        self.live = self.peak = 0
        self.known: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.known.discard(key)
        self.live -= n

    def mode(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor)}  # views and in-place results alias an input
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        storage = t.untyped_storage()
                        key = storage.data_ptr()
                        if key and key not in inputs and key not in tracker.known and storage.nbytes():
                            tracker.known.add(key)
                            tracker.live += storage.nbytes()
                            tracker.peak = max(tracker.peak, tracker.live)
                            weakref.finalize(storage, tracker._free, key, storage.nbytes())
                return out

        return Mode()


def _unique_bytes(caches) -> int:
    seen, total = set(), 0
    for cache in caches:
        for layer in cache.layers:
            for store in (layer.key_store, layer.value_store):
                if id(store) not in seen:
                    seen.add(id(store))
                    total += store.nbytes()
    return total


def _planned_step(batch, q_rows: int) -> int:
    from conftest import model_config

    from spark_bench.memory import Arch, step_work

    layer = batch.layers[0]
    ada = sum(row.valid_bits is not None for row in layer.rows)
    arch = Arch.of(model_config("tiny-llama"))
    return step_work(arch, len(layer.rows), layer.s_max, layer.tail_keys.shape[2], layer.tail_keys.element_size(),
                     len(layer.loose), ada, q_rows if q_rows > 1 else 0)[1]


@pytest.mark.parametrize("suffix", [1, 8], ids=["step", "suffix"])
def test_the_cuda_path_holds_what_the_planner_says(triton_on_cpu, monkeypatch, tiny_lm, suffix):
    """Live storage of the CUDA code path (the Triton backend forced onto CPU tensors, the kernels interpreted):
    building the batch from the rows' caches adds ≤ 5% of their compressed bytes besides the tail (the kernel reads
    the rows' own tensors: the data is held once); one layer's step peaks at ≤ 1.1× the planner's step work
    (``memory.step_work``), and a suffix of query tokens over a long prompt too, its chunks bounded by the work
    bound (shrunk here so that the tiny model's suffix is chunked as an 8B model's would be)."""
    from spark_bench.engine.prefill import QueryStatsSpec, run_prefill
    from spark_bench.memory import STEP_WORK_BOUND

    from spark_bench.storage import triton_decode

    launched = []
    rows_arg = triton_decode._partials_kernel.arg_names.index("n_rows")  # (a launch's query rows per head)

    class Skipped:  # a kernel allocates nothing (it writes buffers made before it): its launch is recorded, not run
        def __init__(self, name):  # (the interpreter's own argument copies are not the CUDA path's bytes, and
            self.name = name       # the kernels' arithmetic is tested elsewhere)

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.name, args[rows_arg] if self.name == "partials"
                                                            else 0))

    monkeypatch.setattr(triton_decode, "_partials_kernel", Skipped("partials"))
    monkeypatch.setattr(triton_decode, "_merge_kernel", Skipped("merge"))
    prompt = 160 if suffix == 1 else 1024
    ids = torch.randint(100, 5000, (1, prompt), generator=torch.Generator().manual_seed(5))
    prefill = run_prefill(tiny_lm.model, ids, window=32, query_stats=QueryStatsSpec())
    budget = 64 if suffix == 1 else 384
    configs = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=budget),
               MethodConfig(name="snapkv+think", budget=budget, ratio=0.5),
               MethodConfig(name="snapkv+spark", budget=budget, ratio=0.8),
               MethodConfig(name="adasnapkv+spark", budget=budget, ratio=0.5)]
    selections = {}
    caches = [Pipeline.from_config(c).build_cache(prefill, selections=selections)[0] for c in configs]
    del prefill
    rows_bytes = _unique_bytes(caches)
    tracker = _LiveBytes()
    with tracker.mode():
        batch = cache_module.BatchedCache(caches, capacity=2 * suffix, consume=True)
    tail = sum(2 * layer.tail_keys.numel() * layer.tail_keys.element_size() for layer in batch.layers)
    assert tracker.live - tail <= 0.05 * rows_bytes, (tracker.live, tail, rows_bytes)
    if suffix > 1:
        bound = 6 * 2 ** 10  # (the tiny model's 1,024-token rows: one or two 512-token chunks a head)
        monkeypatch.setattr(cache_module.BatchedLayer, "work_bytes", bound)
        monkeypatch.setattr("spark_bench.memory.STEP_WORK_BOUND", bound)
    layer = batch.layers[0]
    r, h, d = len(configs), layer.tail_keys.shape[1], layer.tail_keys.shape[-1]
    g = torch.Generator().manual_seed(6)
    keys = torch.randn(r, h, suffix, d, generator=g)
    query = torch.randn(r, 2 * h, suffix, d, generator=g)
    layer.update(keys, keys)
    layer.attend(query, 0.25)  # the first call builds the kernel tables (held for the batch, not step work)
    layer.length -= suffix  # the same call again, measured (the skipped kernels left the device length alone)
    tracker = _LiveBytes()
    with tracker.mode():
        layer.update(keys, keys)
        out = layer.attend(query, 0.25)
    del out
    planned = _planned_step(batch, suffix)
    chunks = [n for name, n in launched if name == "partials"][-4:]
    assert (suffix == 1) == (len(set(chunks)) == 1 and chunks[0] == 2 * suffix), chunks  # the suffix went in chunks
    assert tracker.peak <= 1.1 * planned, (tracker.peak, planned)
    assert STEP_WORK_BOUND == 256 * 2 ** 20


def test_decode_graph_is_used_only_where_the_step_is_static(monkeypatch, tiny_prefill):
    """A step is captured in a CUDA graph only when every layer runs the fused kernel with no per-row row (their
    attention reads the host's tail length) on CUDA; everywhere else :func:`graph_step` returns None and the batch
    decodes eagerly (the CPU suite's decoding tests run with ``graph=True``, the default)."""
    from spark_bench.engine.decode import graph_step

    assert "cpp backend" in _batch_layer(tiny_prefill, CONFIGS[:3]).graph_blocker()
    monkeypatch.setattr(cache_module, "compact_backend", lambda device: "triton")
    assert "per-row path" in _batch_layer(tiny_prefill, CONFIGS).graph_blocker()  # the gaussian row
    batch = _batch_layer(tiny_prefill, CONFIGS[:3])
    assert batch.graph_blocker() == "the batch is not on a CUDA device"
    assert graph_step(None, batch, None, None, wanted=True) is None  # never reaches the capture


def test_the_rank_popcount_counts_the_set_bits_of_every_word(triton_on_cpu):
    """The kept-channel ranks rest on ``_popc``: on the GPU the ``POPC`` instruction, under the interpreter SWAR bit
    sums, which must count the set bits of any 32-bit word (the top bit and the all-ones word included)."""
    import triton
    import triton.language as tl

    from spark_bench.storage import triton_math

    globals()["triton_math"] = triton_math  # (a kernel reads its module's names, not the test's locals)

    @triton.jit
    def count(x_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, triton_math._popc(tl.load(x_ptr + i).to(tl.uint32, bitcast=True)))

    words = [0, 1, 3, -1, -2 ** 31, 2 ** 31 - 1, 0x55555555, 0x0F0F0F0F, -0x55555556, 0x00010000]
    words += torch.randint(-2 ** 31, 2 ** 31, (54,), generator=torch.Generator().manual_seed(0)).tolist()
    x = torch.tensor(words, dtype=torch.int32)
    out = torch.zeros_like(x)
    count[(1,)](x, out, len(words))
    assert out.tolist() == [bin(w & 0xFFFFFFFF).count("1") for w in words]


def test_a_decode_step_without_recovering_members_launches_lean():
    """The partials launch's register limit: 128 (4 CTAs of 4 warps per SM) for a bfloat16 decode step whose work
    items hold dense or structured keys only, 168 (3 CTAs) with bare keys among them, no ragged or value-sparse store
    either way; else 255 (every recovering, ragged or value-sparse launch, a suffix, the float32 kernel's 8 warps) —
    what the dispatch passes Triton; and where it walks the official recovery's rows, and where it builds them into
    tiles."""
    from spark_bench.storage import triton_decode as td
    from spark_bench.storage.gpu_compile import Launch, _arguments
    from spark_bench.storage.triton_versions import TILES

    lean = {("dense",): 128, ("structured",): 128, ("dense", "structured"): 128, ("bare",): 168,
            ("structured", "bare"): 168, ("dense", "structured", "bare"): 168}
    for kinds, limit in lean.items():
        mask = sum(1 << KINDS.index(k) for k in kinds)
        assert td.max_registers(mask, 4, True, False, False) == limit
        assert td.max_registers(mask, 8, True, False, False) == td.max_registers(mask, 4, False, False, False) == 255
        assert td.max_registers(mask, 4, True, True, False) == td.max_registers(mask, 4, True, False, True) == 255
    for kind in ("plain", "signed"):
        assert td.max_registers(1 << KINDS.index(kind) | 1, 4, True, False, False) == td.MAX_REGISTERS == 255
    assert (td.DENSE_REGISTERS, td.LEAN_REGISTERS) == (128, 168)
    asked = {kinds: _arguments(Launch("partials", 128, 4, kinds=kinds))[2]["maxnreg"] for kinds in (2, 6, 31)}
    assert asked == {2: 128, 6: 168, 31: 255} or td.PARTIAL_WARPS[2] != 4
    # the signed walk at a decode step, except in a float32 launch holding a ragged store (its registers would
    # spill); a bfloat16 step whose members hold 4 query rows or more (GQA 4, 8) builds tiles instead
    # (storage/triton_tiles.py)
    signed = {(group, size, ragged): (kw["WALK"], kw["TILE"]) for group in (2, 4, 8) for size in (2, 4)
              for ragged in (False, True)
              for kw in [_arguments(Launch("partials", 128, group, 1, size, ragged=ragged))[2]]}
    walk, tile, neither = (True, False), (False, True), (False, False)
    for group in (4, 8):  # (tiles from Triton 3.6 on: triton_versions.TILES)
        assert signed.pop((group, 2, False)) == signed.pop((group, 2, True)) == (tile if TILES else walk)
    assert signed == {(2, 2, False): walk, (2, 2, True): walk, (2, 4, False): walk, (2, 4, True): neither,
                      (4, 4, False): walk, (4, 4, True): neither, (8, 4, False): walk, (8, 4, True): neither}


def test_the_launch_shape_follows_the_triton_that_compiles_it():
    """One table decides the bfloat16 warps, the L2 prefetch, the signed rows' tiles and what check.py reports, by
    Triton version: 3.9 the tuned kernel, 3.6–3.8 the same launch with its spill named, before 3.6 (torch 2.6's 3.2)
    8 warps, no prefetch and the signed rows walked."""
    from spark_bench.storage import triton_versions as td

    tuned, spilling, old = td.triton_launch((3, 9)), td.triton_launch((3, 6)), td.triton_launch((3, 2))
    assert (tuned.bf16_warps, tuned.prefetch, tuned.notes) == (4, True, ())
    assert td.triton_launch((3, 8)) == spilling and (spilling.bf16_warps, spilling.prefetch) == (4, True)
    assert "spills" in spilling.notes[0] and td.triton_launch((4, 0)) == tuned
    assert (old.bf16_warps, old.prefetch, len(old.notes)) == (8, False, 4) and td.triton_launch((3, 5)) == old
    # SparK's signed rows: tiles from 3.6 on, walked before (at 8 warps the tiles spill)
    assert (tuned.tiles, spilling.tiles, old.tiles) == (True, True, False) and "walked" in old.notes[-1]
    assert td.PARTIAL_WARPS == {2: td.SHAPE.bf16_warps, 4: 8} and td.PREFETCH == {2: td.SHAPE.prefetch, 4: False}
    assert td.TRITON_NOTES == list(td.triton_launch(td.TRITON).notes)
