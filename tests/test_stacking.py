"""Stacked decoding: one segment table serves the compact key stores of many rows (C++ on CPU, Triton on CUDA, the
Triton kernels checked here under Triton's CPU interpreter), one value table their shared values, and a decode
step's operation count does not grow with the number of stacked rows."""

import dataclasses
import importlib
import os

import pytest
import torch
from conftest import DEVICE

from spark_bench.engine.fastpaths import FastPaths
from spark_bench.engine.decode import DecodeRow, decode_rows
from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.channel.mustafar import prune_store
from spark_bench.methods.channel.recovery import ConstantFill
from spark_bench.methods.channel.spark import SparK
from spark_bench.methods.channel.think import ThinK
from spark_bench.storage import dispatch
from spark_bench.storage.bits import pack_bits
from spark_bench.storage.segments import SEG_COLS, WORK_COLS, FusedTables, SegmentStack, ValueStack
from spark_bench.storage.stores import DenseStore, UnstructuredStore
from spark_bench.storage.windowed import WindowedStore

# every store kind a compact kernel serves: SparK fixed-T in each kernel mode, ThinK with and without its dense
# recent window, Mustafar with its dense window, dense keys
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
    "mustafar_window": lambda: _UntiedMustafar(),  # its pruned tokens (zero fill), then its dense window of 32
    # ragged stores (tokens keep different numbers of channels: granule starts): Mustafar's rule with its ties kept
    # (keys on a coarse grid: many tied magnitudes), SparK-p with the official recovery (signs) and with zero fill
    "mustafar_tied": lambda: _TiedMustafar(),
    "spark_p_official": lambda: SparK(ratio=0.5, variant="top_p", top_p=0.9),
    "spark_p_zero": lambda: SparK(ratio=0.5, variant="top_p", top_p=0.9, recovery="zero"),
    "dense": None,
}
RAGGED = ["mustafar_tied", "spark_p_official", "spark_p_zero"]


class _UntiedMustafar:
    """Mustafar(0.5) with its window of 32, the rule's mask taken with magnitude ties broken (a float32 nudge by
    channel): every token keeps one count, the layout the stacked kernels serve (a store with ties decodes on the
    per-row path); the store in the keys' own dtype."""

    def compress_keys(self, keys, layer, layer_idx=0):
        nudge = 1e-4 * torch.arange(keys.shape[-1], device=keys.device) / keys.shape[-1]
        old = prune_store(keys.float().abs() + nudge, 0.5).old
        return WindowedStore(UnstructuredStore.from_mask(keys[..., :old.length, :], old.kept_mask(), ConstantFill(0.0)),
                             keys[..., old.length:, :].clone())


class _TiedMustafar:
    """Mustafar(0.5) with its window of 32 and the official rule's ties kept: the keys rounded to a grid of 0.5
    first, so that many tokens keep more channels than the fewest (a ragged store)."""

    def compress_keys(self, keys, layer, layer_idx=0):
        store = prune_store((keys.float() * 2).round().div(2).to(keys.dtype), 0.5)
        assert store.old.row_kept is None  # (ties: tokens keep different counts)
        return store


def _stores(dtype, head_dim, group, kinds, seed=0, device="cpu", length=None):
    """One store per kind, each over its own keys of a different length (rows of different budgets), or all of
    ``length`` tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, kind in enumerate(kinds):
        s = length or 40 + 23 * i
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
    assert all(stores[ALL.index(k)].old.row_kept is None if k == "mustafar_tied" else
               stores[ALL.index(k)].row_kept is None for k in RAGGED)  # (ragged: granule starts)
    stack = SegmentStack(stores)
    queries = torch.randn(len(stores), 2, group, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    _check_stack(dispatch.stack_logits(stack, queries), stores, queries, 1e-4)


def test_a_segment_too_long_for_32_bit_offsets_is_refused():
    """The fused kernel's offsets inside a segment are 32-bit: the tables refuse a segment of 2³¹ entries or more
    (here 2²⁴ tokens × 128 channels) in one line, before any address is read."""
    from types import SimpleNamespace

    keys = SimpleNamespace(head_dim=128, _rows=[(0, 0, 1 << 24, 26, 0, 0, 0, 0, 1, -1, 0, -1, 0, 0, -1, 0)],
                           _fills=[0.0],
                           _chans=[(-1, 0)])
    with pytest.raises(ValueError, match="32-bit"):
        FusedTables.layout(keys, None, [None], 4)


def test_segment_stack_reads_the_rows_stores_in_place():
    """A stack copies nothing: its parts are the stores' own tensors (views), and the fused kernel's tables hold
    addresses into those same tensors, so decoding holds the compressed data once on every device."""
    stores = _stores(torch.bfloat16, 64, 3, ["spark_official", "spark_zero", "think_window", "dense"])
    stack = SegmentStack(stores)
    own = [stores[0].kept, stores[1].kept, stores[2].kept, stores[2].recent, stores[3].data]
    assert [p.data_ptr() for p in stack.kept_parts] == [t.data_ptr() for t in own]  # ThinK's recent: a view too
    assert stack.mask_parts[0].data_ptr() == stores[0].mask_bits.data_ptr()
    assert stack.nbytes() < 0.1 * sum(s.nbytes() for s in stores)  # the table and per-head scales only
    values = ValueStack([DenseStore(torch.zeros(1, 2, s.length, 64, dtype=torch.bfloat16)) for s in stores], 200)
    tables = FusedTables.build(stack, values, [None] * 8, members=4)
    kept_addresses = set(tables.seg[2::SEG_COLS].tolist())
    assert {stores[0].kept.data_ptr(), stores[3].data.data_ptr()} <= kept_addresses
    assert tables.nbytes() < 0.1 * sum(s.nbytes() for s in stores)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_value_sparse_rows_join_the_cpp_value_stack(dtype):
    """Mustafar's values (kept entries + masks, ties kept: tokens keep different counts), alone and with its dense
    window (a second segment of each head), beside dense and shared values in one ``pv_segments`` call, with a
    decoded tail: equal to the weights times the rebuilt values (float32 sums; 1e-5 relative)."""
    g = torch.Generator().manual_seed(8)
    grid = lambda *shape: (torch.randn(*shape, generator=g) * 2).round().div(2).to(dtype)  # noqa: E731 (ties)
    shared = DenseStore(grid(1, 2, 60, 64))
    stores = [prune_store(grid(1, 2, 70, 64), 0.6), prune_store(grid(1, 2, 50, 64), 0.5, window=0), shared,
              DenseStore(grid(1, 2, 40, 64)), shared]
    assert isinstance(stores[0], WindowedStore) and stores[0].old.row_kept is None  # (ragged, windowed)
    stack = ValueStack(stores, 70)
    assert stack.sparse and stores[0].old.kept.data_ptr() in [p.data_ptr() for p in stack.parts]  # read in place
    assert dispatch.value_blocker(stores[0], "cpp") is None and dispatch.value_blocker(stores[0], "triton") is None
    weights = torch.softmax(torch.randn(5, 2, 3, 70 + 4, generator=g), -1)
    for i, store in enumerate(stores):
        weights[i, ..., store.length:70] = 0
    tail = grid(5, 2, 6, 64)
    out = dispatch.stack_apply(stack, weights, tail, 4)
    for i, store in enumerate(stores):
        ref = weights[i:i + 1, ..., :store.length].double() @ store.materialize().double() + \
            weights[i:i + 1, ..., 70:].double() @ tail[i:i + 1, :, :4].double()
        assert ((out[i:i + 1].double() - ref).abs().max() / ref.abs().max()) < 1e-5, i


def test_value_stack_stores_shared_values_once():
    g = torch.Generator().manual_seed(2)
    shared, own = DenseStore(torch.randn(1, 2, 30, 64, generator=g)), DenseStore(torch.randn(1, 2, 50, 64, generator=g))
    stack = ValueStack([shared, own, shared, shared], 50)
    assert [p.data_ptr() for p in stack.parts] == [shared.data.data_ptr(), own.data.data_ptr()]
    weights = torch.softmax(torch.randn(4, 2, 3, 50, generator=g), -1)
    weights[[0, 2, 3], ..., 30:] = 0
    out = dispatch.stack_apply(stack, weights)
    for i, store in enumerate([shared, own, shared, shared]):
        torch.testing.assert_close(out[i:i + 1], weights[i:i + 1, ..., :store.length] @ store.data, rtol=1e-5,
                                   atol=1e-6)


def _float64_attention(store, value, queries, tail_k, tail_v, filled, q_len, valid=None):
    """Softmax attention in float64 over a row's rebuilt prompt keys (−inf where ``valid`` is False) and its tail
    (the last ``q_len`` tokens causal among themselves)."""
    prompt = _float64_logits(store, queries)
    if valid is not None:
        prompt = prompt.masked_fill(~valid[:, :, None, :], float("-inf"))
    b, h, gq, _ = queries.shape
    tail = queries.double() @ tail_k[:, :, :filled].double().transpose(-1, -2)
    visible = torch.ones(q_len, filled, dtype=torch.bool, device=queries.device).tril(filled - q_len)
    tail = tail.view(b, h, gq // q_len, q_len, filled).masked_fill(~visible, float("-inf")).view(b, h, gq, filled)
    weights = torch.cat([prompt, tail], -1).softmax(-1)
    return weights @ torch.cat([value.materialize(), tail_v[:, :, :filled]], -2).double()


@pytest.mark.parametrize("q_len", [1, 3])
def test_decoded_tail_joins_the_cpp_kernel_calls(q_len):
    """The decoded tail of every row scored after the prompt (its last q_len tokens causal among themselves) and
    weighted into the output by the same two calls; equal to a dense float64 softmax attention."""
    group, d, cap, filled = 2, 64, 9, 6
    stores = _stores(torch.float32, d, group, ["spark_official", "think_window", "dense"], seed=7)
    g = torch.Generator().manual_seed(8)
    values = [DenseStore(torch.randn(1, 2, s.length, d, generator=g)) for s in stores]
    keys_stack, value_stack = SegmentStack(stores), ValueStack(values, max(s.length for s in stores))
    tail_k, tail_v = torch.randn(3, 2, cap, d, generator=g), torch.randn(3, 2, cap, d, generator=g)
    queries = torch.randn(3, 2, group * q_len, d, generator=g)
    scores = dispatch.stack_logits(keys_stack, queries, tail_k, filled, q_len)
    out = dispatch.stack_apply(value_stack, scores.softmax(-1), tail_v, filled)
    for i, (store, value) in enumerate(zip(stores, values)):
        ref = _float64_attention(store, value, queries[i:i + 1], tail_k[i:i + 1], tail_v[i:i + 1], filled, q_len)
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=1e-4, atol=1e-5)


# ---- the fused Triton decode, under Triton's CPU interpreter ------------------------------------------------------

@pytest.fixture(scope="module")
def triton_kernels():
    """The Triton kernels: compiled on a CUDA test run, else on CPU tensors under the interpreter (conftest sets
    ``TRITON_INTERPRET=1`` before triton is first imported)."""
    pytest.importorskip("triton")
    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py)")
    return importlib.import_module("spark_bench.storage.triton_decode")


FUSED_CASES = [  # head_dim, group, q_len, dtype, chunk: every kind in one launch; a suffix; head_dim 96 padded to
    # 128; the production shape; work items of 48 tokens (a whole block and a masked one each; ThinK's items before
    # its recent tokens read as structured keys); a bfloat16 suffix; rows without compact keys (a kernel with the
    # dense, structured and bare loops alone)
    (64, 3, 1, torch.bfloat16, None), (32, 2, 3, torch.float32, 48), (96, 4, 1, torch.float32, None),
    (128, 4, 1, torch.bfloat16, 48), (32, 4, 5, torch.bfloat16, None),  # (20 query rows: two merge programs)
    (64, 4, 1, torch.bfloat16, 48, ["dense", "think_no_window", "think_window"]),
    (64, 2, 1, torch.float32, None, ["spark_official", "mustafar_tied", "spark_p_zero", "think_no_window", "dense"])]
# (the last: float32 at a decode step with ragged stores, its walkable signed row through the compact loop)


@pytest.mark.parametrize("head_dim,group,q_len,dtype,chunk,only", [(*c, None)[:6] for c in FUSED_CASES],
                         ids=lambda x: str(x).replace("torch.", ""))
def test_fused_decode_equals_float64_attention(triton_kernels, head_dim, group, q_len, dtype, chunk, only):
    """Every store kind (SparK official / paper degenerate, zero, none, constant, fork_pool0, ThinK with and without
    its dense window, Mustafar with its window, dense keys) in one launch (or ``only`` these), rows of different lengths, three rows sharing
    one value tensor (read once per work item), AdaKV validity bits on one row, the decoded tail causal for a suffix:
    equal to float64 softmax attention within 1e-5 relative (float32 logits and softmax; the only rounding is float32
    summation; the output asked in float32). A bfloat16 decode step's queries are bfloat16, as a bfloat16 model's (the
    dense and structured keys' dots take them unscaled, in one term); the bfloat16 suffix's float32 (three terms). With ``chunk``, every member loop of the kernel runs (``kinds``: its columns of the work table); the
    kernel is specialised to the kinds the work items hold (``tables.kinds``: a bit each, the others' loops absent)."""
    kinds = ["spark_official", "spark_paper", "spark_zero", "spark_fork_pool0", "think_window", "dense"]
    if head_dim == 64:
        kinds += ["spark_none", "spark_constant", "think_no_window", "spark_paper_constant", "mustafar_window"] + RAGGED
    kinds = only or kinds
    stores = _stores(dtype, head_dim, group, kinds, seed=3, device=DEVICE)
    g = torch.Generator().manual_seed(4)
    values = [DenseStore(torch.randn(1, 2, s.length, head_dim, generator=g).to(DEVICE, dtype)) for s in stores]
    if only is None:  # two rows' values value-sparse (Mustafar's, ties kept), one with its dense window, one without
        for i, window in ((1, 32), (2, 0)):
            x = (torch.randn(1, 2, stores[i].length, head_dim, generator=g) * 2).round().div(2).to(DEVICE, dtype)
            values[i] = prune_store(x, 0.5, window=window)
    shared = DenseStore(torch.randn(1, 2, 60, head_dim, generator=g).to(DEVICE, dtype))  # rows sharing values
    same = _stores(dtype, head_dim, group, only or ["spark_official", "think_window", "dense"], seed=5, device=DEVICE,
                   length=60)
    stores, values = stores + same, values + [shared] * len(same)
    n, cap, filled = len(stores), 7, 5
    valid = torch.rand(1, 2, stores[0].length, generator=g).to(DEVICE) > 0.3
    valid[..., 0] = True
    keys_stack, value_stack = SegmentStack(stores), ValueStack(values, max(s.length for s in stores))
    bits = pack_bits(valid)
    per_head = [(bits, j * bits.shape[-1]) for j in range(2)] + [None] * (2 * n - 2)
    tail_k = torch.randn(n, 2, cap, head_dim, generator=g).to(DEVICE, dtype)
    tail_v = torch.randn(n, 2, cap, head_dim, generator=g).to(DEVICE, dtype)
    queries = torch.randn(n, 2, group * q_len, head_dim, generator=g).to(DEVICE)
    if dtype == torch.bfloat16 and q_len == 1:  # a bfloat16 model's decode step: bfloat16 queries (the dense and
        queries = queries.bfloat16()  # structured keys' one-term dot, logits scaled after); the output in float32
    members = triton_kernels.launch_shape(group * q_len)[1]
    tables = FusedTables.build(keys_stack, value_stack, per_head, members, chunk)
    assert tables.ragged == any(k in RAGGED for k in kinds)  # (the kernel's granule starts compiled in)
    assert tables.vsparse == (only is None)  # (a value-sparse item's values rebuilt from their masks)
    assert tables.walk_tab is None or "spark_p_official" not in kinds  # (a ragged signed segment is not walked)
    work = tables.work.view(-1, WORK_COLS)
    assert work[:, 1].max() > 1 or members == 1  # rows sharing values are served by one work item (read once)
    runs = torch.diff(work[:, 6:10], dim=1, prepend=torch.zeros_like(work[:, :1]),
                      append=work[:, 1:2])  # members per kind: dense, structured, bare, plain, signed
    kinds = (runs > 0).any(0).tolist()
    assert tables.kinds == sum(1 << k for k, held in enumerate(kinds) if held)  # the kernel's loops: these kinds'
    assert (all(kinds) if only is None else kinds == [True, True, True, False, False]) or chunk is None, kinds
    assert tables.pairs == (head_dim != 64)  # ThinK's entries read in pairs, unless a segment keeps an odd count
    # the step's q_len tokens go in beside the tail (filled − q_len tokens in it), which the kernel writes them into
    new_k, new_v = tail_k[:, :, filled - q_len:filled].clone(), tail_v[:, :, filled - q_len:filled].clone()
    buf_k, buf_v = tail_k.clone(), tail_v.clone()
    buf_k[:, :, filled - q_len:], buf_v[:, :, filled - q_len:] = 0, 0
    length = torch.tensor([filled - q_len], device=DEVICE)
    out = dispatch.fused_attention(tables, keys_stack.aux_scale, tail_k, queries.reshape(2 * n, -1, head_dim), 1.0,
                                   new_k.reshape(2 * n, q_len, head_dim), new_v.reshape(2 * n, q_len, head_dim),
                                   buf_k.reshape(2 * n, cap, head_dim), buf_v.reshape(2 * n, cap, head_dim),
                                   length, q_len, advance=q_len,
                                   out=torch.empty(2 * n, group * q_len, head_dim, device=DEVICE)).view(n, 2, -1,
                                                                                                        head_dim)
    assert length.item() == filled
    assert torch.equal(buf_k[:, :, :filled], tail_k[:, :, :filled]) and torch.equal(buf_v[:, :, :filled],
                                                                                     tail_v[:, :, :filled])
    for i, (store, value) in enumerate(zip(stores, values)):
        ref = _float64_attention(store, value, queries[i:i + 1], tail_k[i:i + 1], tail_v[i:i + 1], filled, q_len,
                                 valid if i == 0 else None)
        err = ((out[i:i + 1].double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, (i, err)


@pytest.mark.parametrize("group", [2, 8], ids=["walk", "tiles"])
def test_the_signed_walk_equals_float64_on_clustered_masks(triton_kernels, group, monkeypatch):
    """A decode step's official-recovery rows — walked at 2 query rows a member
    (:mod:`spark_bench.storage.triton_walk`), built into tiles a nibble at a time from 4
    (:mod:`spark_bench.storage.triton_tiles`; the float64 test above runs both at head_dim 32 to 128 with bfloat16
    queries, these float32) — where the masks are hardest: every kept channel in one mask word (the others empty), in
    a run crossing a word boundary, T = 2 (lanes with no kept rank), T close to head_dim; rows of three ratios and
    lengths in one launch (masked last blocks), bfloat16: equal to float64 attention within 1e-5 relative. The tiles
    equal the compact loop's key and sign tiles entry for entry, so their output is the compact loop's bit for bit
    (the same launch without the constant table). The partial softmaxes' 64-bit row offsets (``WIDE``: a buffer of
    2³¹ floats or more) give the 32-bit ones' output bit for bit (checked once, on the tiles' launch)."""
    g = torch.Generator().manual_seed(11)
    head_dim = 128
    n_words = head_dim // 32
    stores, values = [], []
    for i, ratio in enumerate((0.99, 0.9, 0.1)):
        s = 45 + 19 * i
        keys = torch.randn(1, 2, s, head_dim, generator=g) * 0.1
        for t in range(s):  # a token's salient channels: one word, or 30 in a row across a word boundary
            lo, span = (32 * (t // 2 % n_words), 32) if t % 3 == 0 else (16 + 7 * t % (head_dim - 46), 30)
            if t % 3 < 2:
                keys[..., t, lo:lo + span] *= 40
        window = torch.randn(1, 2 * group, 32, head_dim, generator=g)
        store = SparK(ratio=ratio).compress_keys(keys.bfloat16(), LayerPrefill(keys.bfloat16(), keys.bfloat16(),
                                                                               window.bfloat16()))
        stores.append(store)
        values.append(DenseStore(torch.randn(1, 2, s, head_dim, generator=g).bfloat16()))
    kept = [s.row_kept for s in stores]
    assert min(kept) < 4 and max(kept) > head_dim - 16  # (lanes with no kept rank; nearly every channel kept)
    n, cap, filled = len(stores), 3, 2
    keys_stack, value_stack = SegmentStack(stores), ValueStack(values, max(s.length for s in stores))
    tail_k = torch.randn(n, 2, cap, head_dim, generator=g).bfloat16()
    tail_v = torch.randn(n, 2, cap, head_dim, generator=g).bfloat16()
    queries = torch.randn(n, 2, group, head_dim, generator=g)
    tables = FusedTables.build(keys_stack, value_stack, [None] * 2 * n, triton_kernels.launch_shape(group)[1], 32)
    assert tables.walk_tab is not None and tables.kinds == 1 << 4  # (signed members only: the walk serves them)
    new_k, new_v = tail_k[:, :, filled - 1:filled].clone(), tail_v[:, :, filled - 1:filled].clone()

    def attend(tables):
        return dispatch.fused_attention(tables, keys_stack.aux_scale, tail_k, queries.reshape(2 * n, -1, head_dim),
                                        1.0, new_k.reshape(2 * n, 1, head_dim), new_v.reshape(2 * n, 1, head_dim),
                                        tail_k.clone().reshape(2 * n, cap, head_dim),
                                        tail_v.clone().reshape(2 * n, cap, head_dim), torch.tensor([filled - 1]), 1,
                                        advance=1, out=torch.empty(2 * n, group, head_dim, device=queries.device)).view(
            n, 2, -1, head_dim)

    out = attend(tables)
    kw = triton_kernels.launches(queries.reshape(2 * n, -1, head_dim), 1.0, keys_stack.aux_scale, tables, tail_k,
                                 new_k, new_v, tail_k, tail_v, torch.tensor([0]), 1, 0, out, 1)[0][3]
    from spark_bench.storage.triton_versions import TILES
    from spark_bench.storage.walk_layout import tiled

    tiles = tiled(triton_kernels.launch_shape(group)[1], 2)  # (group 8, from Triton 3.6 on)
    assert (kw["WALK"], kw["TILE"]) == ((False, True) if tiles else (True, False)) and tiles == (group == 8 and TILES)
    if tiles:  # the compact loop's logits, bit for bit
        assert torch.equal(out, attend(dataclasses.replace(tables, walk_tab=None)))
    assert not kw["WIDE"]
    if group == 8:  # (the epilogue is the same whatever the member loops)
        monkeypatch.setattr(triton_kernels, "WIDE_FLOATS", 0)
        assert torch.equal(out, attend(tables))
    for i, (store, value) in enumerate(zip(stores, values)):
        ref = _float64_attention(store, value, queries[i:i + 1], tail_k[i:i + 1], tail_v[i:i + 1], filled, 1)
        err = ((out[i:i + 1].double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, (i, err)


def test_the_tiles_need_four_kept_entries_in_every_signed_segment():
    """A bfloat16 decode step's signed rows are built into tiles only where every signed segment holds four kept
    entries or more (a nibble's four are read together, moved back to stay inside the segment): one of three tokens
    keeping one channel each (3 entries) sends the whole launch to the walk, its constant table the walk's; and
    members of 2 query rows are walked whatever they hold (``walk_layout.tiled``)."""
    from spark_bench.storage.walk_layout import TILE_TABLE_BYTES, WALK_TABLE_BYTES, tiled

    g = torch.Generator().manual_seed(5)

    def store(length, ratio):
        keys = torch.randn(1, 2, length, 128, generator=g).bfloat16()
        window = torch.randn(1, 16, 32, 128, generator=g).bfloat16()
        return SparK(ratio=ratio).compress_keys(keys, LayerPrefill(keys, keys, window))

    def tables(stores, members):
        values = [DenseStore(torch.randn(1, 2, s.length, 128, generator=g).bfloat16()) for s in stores]
        return FusedTables.build(SegmentStack(stores), ValueStack(values, 64), [None] * 2 * len(stores), members)

    wide, few = store(40, 0.8), store(3, 0.995)
    on = tiled(2, 2)  # (8 rows a member: False only under a Triton before 3.6, triton_versions.TILES)
    assert few.row_kept * few.length == 3 and not tiled(8, 2)
    for stores, members, tiles in (([wide], 2, on), ([wide, few], 2, False), ([wide], 8, False)):
        t = tables(stores, members)
        assert t.tiles == tiles and t.walk_tab is not None
        assert t.walk_tab.numel() * 8 == (TILE_TABLE_BYTES if tiles else WALK_TABLE_BYTES)


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


def test_bf16_tokens_do_not_depend_on_stacking_or_batching(tiny_lm):
    """bf16 (the paper's dtype): logits and softmax are float32 on every path, so the tokens of the whole mix are
    the same stacked, unstacked (``decode_stack=false``) and one row at a time (``decode_batch=1``). Measured
    tolerance: exact on this CPU (oneDNN's bf16 GEMMs give each row the same result whatever the batch); on a GPU,
    cuBLAS may pick other GEMM kernels per batch size for the model's own linear layers (not the attention), which
    ``make gpu-check`` measures (``tokens_equal_decode_batch_1``)."""
    import copy

    from spark_bench.engine.prefill import QueryStatsSpec, run_prefill

    model = copy.deepcopy(tiny_lm.model).to(torch.bfloat16)
    ids = torch.randint(100, 5000, (1, 160), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    prefill = run_prefill(model, ids, window=32, query_stats=QueryStatsSpec())
    stacked = [r.tokens for r in decode_rows(model, _rows(prefill, MIX, max_new=8))]
    unstacked = [r.tokens for r in decode_rows(model, _rows(prefill, MIX, max_new=8), stack=False)]
    alone = [decode_rows(model, [row])[0].tokens for row in _rows(prefill, MIX, max_new=8)]
    assert stacked == unstacked == alone
    assert len({tuple(t) for t in stacked}) > 3  # the configs really differ


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
            decode_rows(model, rows, checks=FastPaths(enabled=False))  # the steps alone (no first-use check)
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
