"""Mustafar (methods/channel/mustafar.py) against its official pruning rule, re-implemented here from its code
(github dhjoo98/mustafar; its package needs CUDA and flash-attn, so it is not imported):

* ``models/llama_mustafar_Kt_Mag_Vt_Mag.py``, ``LlamaAttention_MUSTAFAR.dh_prune_key`` / ``dh_prune_value``: the
  per-token rule (:func:`official_prune`);
* the same file, ``LlamaFlashAttention_MUSTAFAR.forward``: the prefill keeps the last ``residual_length`` tokens
  dense (:func:`official_prefill`) and each decode step, after attending, prunes the token leaving that window
  (:func:`official_generate` with ``rolling=True``);
* ``models/llama_mustafar_kernel.py``, ``LlamaFlashAttention_MUSTAFAR.forward``: the kernel code's prefill prunes
  ``((S − residual_length) // 256) · 256`` tokens.
"""

from __future__ import annotations

import pytest
import torch

import spark_bench
from spark_bench.engine.cache import StoredLayer, stackable
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.channel.mustafar import prune_store
from spark_bench.methods.channel.recovery import TokenFill
from spark_bench.storage import dispatch
from spark_bench.storage.segments import PART_COLUMNS, SegmentStack, store_blocker
from spark_bench.storage.sparse_values import ValueSegments, sparse_weighted_sum
from spark_bench.storage.stores import DenseStore, UnstructuredStore
from spark_bench.storage.windowed import WindowedStore

RESIDUAL = 32  # long_test.sh: --residual_length $group_size, group_size=32


def official_prune(states: torch.Tensor, target_sparsity: float) -> torch.Tensor:
    """``dh_prune_key`` (and ``dh_prune_value``, the same body) as its code reads."""
    b, h, t, d = states.shape
    num_to_keep = max(1, int((target_sparsity) * d))
    flat = states.reshape(-1, d)
    threshold_values, _ = torch.kthvalue(torch.abs(flat), num_to_keep, dim=-1, keepdim=True)
    mask = torch.abs(flat) >= threshold_values
    return (flat * mask).view(b, h, t, d)


def official_prefill(states: torch.Tensor, sparsity: float, residual: int = RESIDUAL) -> torch.Tensor:
    """The prefill branch of ``LlamaFlashAttention_MUSTAFAR.forward``: ``(S / residual) == 0`` only for S = 0, so
    the prefix before the last ``residual`` tokens is pruned and the suffix kept."""
    prefix, suffix = states[:, :, :-residual, :], states[:, :, -residual:, :]
    return torch.cat([official_prune(prefix, sparsity), suffix], dim=2)


def official_generate(model, ids: list[int], k_sparsity: float, v_sparsity: float, steps: int,
                      rolling: bool) -> list[int]:
    """Greedy tokens with the official cache: a dense prefill (its first token), the prompt's cache pruned as
    :func:`official_prefill`, then one token per step; ``rolling``: after each step the token at ``-(residual+1)``
    is pruned, as the decode branch does (``False``: the window stays dense, as the harness keeps it)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        cache = out.past_key_values
        for layer in cache.layers:
            layer.keys = official_prefill(layer.keys, k_sparsity)
            layer.values = official_prefill(layer.values, v_sparsity)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(steps - 1):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
            if rolling:
                for layer in cache.layers:
                    for name, s in (("keys", k_sparsity), ("values", v_sparsity)):
                        x = getattr(layer, name)
                        at = x.shape[2] - (RESIDUAL + 1)
                        setattr(layer, name, torch.cat([x[:, :, :at], official_prune(x[:, :, at:at + 1], s),
                                                        x[:, :, at + 1:]], dim=2))
    return tokens


def _ties(shape, seed=0) -> torch.Tensor:
    """Small integers: many magnitudes tie with the threshold, as bf16 entries do."""
    return torch.randint(-6, 7, shape, generator=torch.Generator().manual_seed(seed)).float()


@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.7])
def test_the_rule_and_window_equal_the_official_prefill_and_bytes_are_exact(sparsity):
    x = _ties((1, 2, 100, 64))
    store = prune_store(x, sparsity)
    assert isinstance(store, WindowedStore) and isinstance(store.old, UnstructuredStore)
    assert torch.equal(store.materialize(), official_prefill(x, sparsity))
    old = x[:, :, :68].abs()
    kept = int((old >= torch.kthvalue(old, max(1, int(sparsity * 64)), -1, keepdim=True).values).sum())
    assert store.nbytes() == kept * 4 + 2 * 68 * 64 // 8 + 2 * 32 * 64 * 4  # kept entries + D-bit masks + window
    # D − int(s·D) + 1 kept without ties: one entry more than the paper's sparsity
    smooth = prune_store(torch.randn(1, 2, 40, 64, generator=torch.Generator().manual_seed(1)), sparsity, window=0)
    assert smooth.row_kept == 64 - int(sparsity * 64) + 1


def test_the_kernel_codes_schedule_prunes_whole_blocks_of_256():
    x = torch.randn(1, 1, 600, 64, generator=torch.Generator().manual_seed(2))
    store = prune_store(x, 0.5, window=RESIDUAL, block=256)
    compressed = ((600 - RESIDUAL) // 256) * 256  # llama_mustafar_kernel.py's compressed_length: 512
    assert store.old.length == compressed and store.recent.shape[2] == 600 - compressed
    assert torch.equal(store.materialize()[:, :, :compressed], official_prune(x[:, :, :compressed], 0.5))
    assert isinstance(prune_store(x[:, :, :200], 0.5, block=256), DenseStore)  # nothing old enough


def test_zero_sparsity_is_the_base_method_store():
    x = torch.randn(1, 2, 80, 64)
    assert isinstance(prune_store(x, 0.0), DenseStore) and isinstance(prune_store(x, 1 / 64), DenseStore)


def test_tokens_equal_the_official_rule_on_smollm2(smollm2):
    """fp32, one short prompt: every token equals the official rule with the window held dense, and the first two
    equal the official decode (which prunes the window's oldest token after each step from the second on)."""
    ids = smollm2.tokenizer("The capital of France is Paris. The capital of Italy is Rome. " * 3
                            + "The capital of Spain is Madrid. So the capital of Italy is").input_ids
    assert len(ids) > RESIDUAL + 8
    _check_tokens(smollm2.model, ids, steps=4)


def test_tokens_equal_the_official_rule_on_the_tiny_model(tiny_lm):
    ids = torch.randint(100, 5000, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    _check_tokens(tiny_lm.model, ids, steps=4)


def _check_tokens(model, ids, steps):
    config = spark_bench.method("mustafar", protocol=None, ratio=0.5, value_ratio=0.7)
    context = spark_bench.compress(model, ids, config)
    ours = spark_bench.generate(model, context, max_new_tokens=steps)[0, len(ids):].tolist()
    held = official_generate(model, ids, 0.5, 0.7, steps, rolling=False)
    rolling = official_generate(model, ids, 0.5, 0.7, 2, rolling=True)
    assert ours == held[:len(ours)] and len(ours) >= 2
    assert ours[:2] == rolling


def test_zero_ratios_are_the_base_methods(tiny_lm):
    ids = torch.randint(100, 5000, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    names = [("full", {}), ("mustafar", dict(ratio=0.0, value_ratio=0.0)), ("snapkv", dict(budget=0.5)),
             ("snapkv+mustafar", dict(ratio=0.0, value_ratio=0.0, budget=0.5))]
    contexts = spark_bench.compress(tiny_lm.model, ids, [spark_bench.method(n, protocol=None, **o) for n, o in names])
    tokens = [spark_bench.generate(tiny_lm.model, c, max_new_tokens=6)[0, len(ids):].tolist() for c in contexts]
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3]
    assert contexts[0].kv_bytes == contexts[1].kv_bytes and contexts[2].kv_bytes == contexts[3].kv_bytes


def test_after_snapkv_the_rule_prunes_the_kept_tokens(tiny_prefill):
    base = Pipeline.from_config(MethodConfig(name="snapkv", budget=0.5)).build_cache(tiny_prefill)[0]
    both = Pipeline.from_config(MethodConfig(name="snapkv+mustafar", budget=0.5, ratio=0.7, value_ratio=0.5))
    cache = both.build_cache(tiny_prefill)[0]
    for dense, pruned in zip(base.layers, cache.layers):
        assert torch.equal(pruned.key_store.materialize(), official_prefill(dense.key_store.materialize(), 0.7))
        assert torch.equal(pruned.value_store.materialize(), official_prefill(dense.value_store.materialize(), 0.5))
    assert cache.nbytes() < base.nbytes()


def test_keys_are_the_bare_kind_and_sparse_values_stack():
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(1, 2, 70, 64, generator=g), torch.randn(1, 2, 70, 64, generator=g)
    bare = prune_store(keys, 0.5, window=0)  # no window: one compact key store, pruned entries 0
    assert store_blocker(bare) is None
    stack = SegmentStack([bare])
    mode = PART_COLUMNS.index("mode")
    assert {(r[mode], f) for r, f in zip(stack._rows, stack._fills)} == {(0, 0.0)}  # mode constant, fill 0: "bare"
    layer = StoredLayer(bare, DenseStore(values))
    assert stackable(layer, "cpp") is None
    windowed = StoredLayer(prune_store(keys, 0.5), prune_store(values, 0.5))
    assert store_blocker(windowed.key_store) is None  # its pruned tokens' segments, then its window's (dense)
    modes = [r[mode] for r in SegmentStack([windowed.key_store])._rows]
    assert modes == [0, 3] * 2  # per head: the bare segment (constant fill 0), then the dense window
    assert stackable(StoredLayer(windowed.key_store, DenseStore(values)), "cpp") is None
    sparse = StoredLayer(bare, prune_store(values, 0.5))
    assert dispatch.value_blocker(DenseStore(values), "triton") is None
    assert stackable(sparse, "cpp") is None and stackable(sparse, "triton") is None  # both stacked kernels read
    # value-sparse segments (tests/test_stacking.py); a value store refilled with its mean does not stack
    mean = UnstructuredStore.from_mask(values, prune_store(values, 0.5, window=0).kept_mask(),
                                       TokenFill(values.mean(-1)))
    assert "per-row path, values rebuilt per step" in dispatch.value_blocker(mean, "triton")
    # a decode batch says why a row leaves the stacks: never silently
    refilled = StoredLayer(windowed.key_store, mean)
    dispatch._seen_fallbacks.discard(dispatch.value_blocker(mean, "triton"))
    with pytest.warns(UserWarning) as record:
        assert stackable(refilled, "triton", warn=True)
    said = " | ".join(str(w.message) for w in record)
    assert "pruned entries are zeros" in said and "key" not in said
    # the per-row path's keys: the compact part through the C++ kernel, the window as plain rows
    q = torch.randn(1, 2, 3, 64, generator=g)
    store = windowed.key_store
    assert dispatch.kernel_blocker(store, torch.device("cpu")) is None
    torch.testing.assert_close(dispatch.compact_logits(store, q), dispatch.reference_logits(store, q))


def test_the_value_sparse_member_reference_equals_dense_weights_times_values():
    values = _ties((1, 2, 75, 64), seed=6)  # ties: tokens keep different counts
    store = prune_store(values, 0.6, window=10)
    assert store.old.row_kept is None
    seg = ValueSegments.of(store.old)
    assert seg.block_start[:, -1].tolist() == store.old.kept_mask().sum((-1, -2)).flatten().tolist()
    assert (seg.n_old, seg.kept_off[1].item()) == (65, seg.block_start[0, -1].item())
    weights = torch.rand(1, 2, 3, 75, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(sparse_weighted_sum(weights, store), weights @ store.materialize())


def test_the_command_line_names_it_and_refuses_bad_options():
    from test_protocol import _compose

    import spark_bench.cli as cli

    (config,) = cli.validate(_compose(["method=snapkv+mustafar", "ratio=0.5", "value_ratio=0.7", "budget=0.5",
                                       "mustafar_block=256"]), sources=False)[1]
    assert (config.label, config.mustafar_window, config.mustafar_block) == ("SnapKV+Mustafar(0.5+0.7) @0.5", 32, 256)
    with pytest.raises(cli.ConfigError, match="^method: mustafar_window must be an integer >= 0; got -1$"):
        cli.validate(_compose(["method=mustafar", "ratio=0.5", "mustafar_window=-1"]), sources=False)
    with pytest.raises(cli.ConfigError, match="value_fill=zero is not read by mustafar"):
        cli.validate(_compose(["method=mustafar", "ratio=0.5", "value_ratio=0.5", "value_fill=zero"]), sources=False)
