"""Engine invariants on tiny-llama: prefill capture, λ=0 equivalence, budget ≥ prompt = full, sweep = alone."""

import itertools
import time
import math

import pytest
import torch
from conftest import DEVICE

from spark_bench.engine.decode import greedy_decode
from spark_bench.engine.prefill import run_prefill
from spark_bench.methods import EVICTION_METHODS, MethodConfig, Pipeline
from spark_bench.methods.eviction.snapkv import SnapKV, window_attention


def decode(lm, prefill, cfg: MethodConfig, n=6):
    cache, _ = Pipeline.from_config(cfg).build_cache(prefill)
    return greedy_decode(lm.model, cache, prefill.first_logits, prefill.prompt_length, n, frozenset())


def test_prefill_captures_post_rope_window_queries(tiny_lm):
    """The window queries reproduce the model's own attention weights (eager attention, output_attentions)."""
    model = tiny_lm.model
    ids = torch.randint(100, 5000, (1, 48), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    prefill = run_prefill(model, ids, window=16)
    model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            ref = model(input_ids=ids, output_attentions=True).attentions
    finally:
        model.config._attn_implementation = "sdpa"
    for layer, attn in zip(prefill.layers, ref):
        ours = window_attention(layer, 16)
        assert torch.allclose(ours, attn[:, :, -16:, :].float(), atol=1e-5)


def test_prefill_first_token_matches_generate(tiny_lm):
    ids = torch.randint(100, 5000, (1, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    prefill = run_prefill(tiny_lm.model, ids, window=32)
    tokens = decode(tiny_lm, prefill, MethodConfig(name="full"), n=5)
    with torch.inference_mode():
        ref = tiny_lm.model.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert tokens == ref[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("base,channel,saliency", list(itertools.product(
    ["full", *EVICTION_METHODS], ["think", "spark"], ["official", "paper"])))
def test_ratio_zero_equals_base_method(tiny_lm, tiny_prefill, base, channel, saliency):
    name = channel if base == "full" else f"{base}+{channel}"
    composite = MethodConfig(name=name, budget=64, ratio=0.0, saliency=saliency)
    assert decode(tiny_lm, tiny_prefill, composite) == decode(tiny_lm, tiny_prefill, MethodConfig(name=base, budget=64))


@pytest.mark.parametrize("name", [*EVICTION_METHODS, "snapkv+spark", "snapkv+think", "pyramidkv+spark",
                                  "adasnapkv+spark", "streamingllm+spark"])
def test_budget_at_least_prompt_equals_full_eviction(tiny_lm, tiny_prefill, name):
    big = MethodConfig(name=name, budget=10_000, ratio=0.5)
    none = MethodConfig(name=name.split("+")[1] if "+" in name else "full", ratio=0.5)
    assert decode(tiny_lm, tiny_prefill, big) == decode(tiny_lm, tiny_prefill, none)


def test_snapkv_keeps_budget_and_window(tiny_prefill):
    layer = tiny_prefill.layers[0]
    s = layer.keys.shape[-2]
    for budget, expected in [(64, 64), (0.25, int(s * 0.25))]:
        idx = SnapKV(budget=budget).select(layer, 0, 2).indices
        assert idx.shape == (1, layer.num_kv_heads, expected)
        assert torch.equal(idx[..., -32:], torch.arange(s - 32, s, device=idx.device).expand(1, layer.num_kv_heads, 32))
        assert bool((idx.diff(dim=-1) > 0).all())  # ascending, no duplicates
    with pytest.raises(ValueError, match="smaller than the observation window"):
        SnapKV(budget=16).select(layer, 0, 2).indices


def test_snapkv_scores_follow_attention(tiny_prefill):
    """Tokens SnapKV keeps get more (pooled) window attention than the ones it drops."""
    layer = tiny_prefill.layers[1]
    method = SnapKV(budget=64)
    scores = method.token_scores(layer)
    idx = method.select(layer, 1, 2).indices[..., :-32]
    kept = scores.gather(-1, idx)
    dropped_mask = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, idx, False)
    for h in range(scores.shape[1]):
        assert kept[0, h].min() >= scores[0, h][dropped_mask[0, h]].max()


def test_compression_never_mutates_prefill(tiny_lm, tiny_prefill):
    before = [(l.keys.clone(), l.values.clone()) for l in tiny_prefill.layers]
    for cfg in [MethodConfig(name="snapkv+spark", budget=64, ratio=0.8), MethodConfig(name="think", ratio=0.8)]:
        decode(tiny_lm, tiny_prefill, cfg)
    for (k, v), layer in zip(before, tiny_prefill.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)


def test_compressed_cache_bytes_are_below_dense(tiny_prefill):
    dense = tiny_prefill.dense_kv_bytes()
    for cfg, bound in [(MethodConfig(name="full"), 1.0), (MethodConfig(name="spark", ratio=0.8), 0.75),
                       (MethodConfig(name="snapkv", budget=40), 40 / 160)]:
        cache, _ = Pipeline.from_config(cfg).build_cache(tiny_prefill)
        assert cache.nbytes() <= math.ceil(bound * dense)


def test_streamingllm_keeps_sinks_and_recent(tiny_prefill):
    from spark_bench.methods.eviction.streamingllm import StreamingLLM

    layer = tiny_prefill.layers[0]
    s = layer.keys.shape[-2]
    idx = StreamingLLM(budget=20).select(layer, 0, 2).indices
    assert idx[0, 0].tolist() == [0, 1, 2, 3, *range(s - 16, s)]
    with pytest.raises(ValueError, match="must exceed n_sink=4"):
        StreamingLLM(budget=4).select(layer, 0, 2).indices


def test_every_method_name_has_a_hydra_option():
    from spark_bench.cli import CONF_DIR
    from spark_bench.methods import METHOD_NAMES

    assert sorted(p.stem for p in (CONF_DIR / "method").glob("*.yaml")) == sorted(METHOD_NAMES)


def test_shared_token_selection_is_computed_once_and_counted_in_every_config(tiny_prefill, monkeypatch):
    """Configs sharing an eviction method score tokens once and hold the same evicted tensors; each still reports
    the selection's seconds in its compression time (what compressing under it alone costs), not only the first."""
    calls, select = [], SnapKV.select

    def slow_select(self, *args):
        calls.append(args[1])
        time.sleep(0.01)
        return select(self, *args)

    monkeypatch.setattr(SnapKV, "select", slow_select)
    selections = {}
    built = [Pipeline.from_config(MethodConfig(name=name, budget=40, ratio=0.5)).build_cache(tiny_prefill,
                                                                                             selections=selections)
             for name in ("snapkv", "snapkv+think", "snapkv+spark")]
    layers = len(tiny_prefill.layers)
    assert calls == list(range(layers))  # one selection per layer, for all three configs
    assert all(seconds >= 0.01 * layers for _, seconds in built)
    values = [cache.layers[0].value_store.data for cache, _ in built]
    assert all(v.data_ptr() == values[0].data_ptr() for v in values)  # one copy of the kept values
