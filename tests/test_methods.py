"""The method zoo: every eviction × channel method × option runs end to end, and each method's defining property."""

import dataclasses
import itertools

import conftest
import pytest
import torch

from spark_bench.engine.decode import greedy_decode
from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods import CHANNEL_METHODS, EVICTION_METHODS, METHOD_NAMES, MethodConfig, Pipeline
from spark_bench.methods.base import top_tokens
from spark_bench.methods.channel.spark import SparK, group_keep_by_rank
from spark_bench.methods.channel.value_norm import ValueNorm
from spark_bench.methods.eviction.adasnapkv import AdaSnapKV
from spark_bench.methods.eviction.pyramidkv import pyramid_budgets
from spark_bench.methods.eviction.snapkv import SnapKV, window_attention
from spark_bench.methods.eviction.tova import TOVA

# option sets per channel method: every recovery, every variant, value pruning, both saliency modes
SPARK_OPTIONS = (
    [dict(ratio=r) for r in (0.5, 0.8)]
    + [dict(ratio=0.8, recovery=rec) for rec in ("gaussian", "exponential", "zero", "constant", "none", "fork_pool0")]
    + [dict(variant="group_fork", group_fork_fill=fill) for fill in ("zero", "recovery")]
    + [dict(variant="top_p", top_p=0.9), dict(variant="group", groups=4), dict(variant="group", groups=5)]
    + [dict(ratio=0.5, value_ratio=0.3), dict(ratio=0.8, saliency="paper", recovery="gaussian"),
       dict(ratio=0.8, recovery="exponential", recovery_stats="all")]
)
OPTIONS = {"spark": SPARK_OPTIONS, "think": [dict(ratio=0.5), dict(ratio=0.8, value_ratio=0.3)],
           "mustafar": [dict(ratio=0.5, value_ratio=0.7), dict(ratio=0.7, mustafar_window=0)],
           "leank": [dict(leank={"mask": str(conftest.ROOT / "tests/fixtures/leank/tiny-llama.json"), "recent": 16}),
                     dict(leank={"mask": str(conftest.ROOT / "tests/fixtures/leank/tiny-llama.json")},
                          value_ratio=0.3)],
           None: [dict(), dict(value_ratio=0.5)]}
MATRIX = [(name, opts) for name in METHOD_NAMES
          for opts in OPTIONS[MethodConfig(name=name).channel_name]]


def _tensor_bytes_of(obj) -> int:
    """Bytes of every tensor reachable through a store's dataclass fields (independent of ``nbytes``)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj):
        return sum(_tensor_bytes_of(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


@pytest.mark.parametrize("name,options", MATRIX, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                                                     for n, o in MATRIX])
def test_method_matrix_end_to_end(tiny_lm, tiny_prefill, name, options):
    """Every method × option: compact decode attention equals the dense reference, bytes equal the tensors."""
    cfg = MethodConfig(name=name, budget=64, **options)
    pipeline = Pipeline.from_config(cfg)
    compact, _ = pipeline.build_cache(tiny_prefill)
    reference, _ = pipeline.build_cache(tiny_prefill, attention="materialize")
    tokens = greedy_decode(tiny_lm.model, compact, tiny_prefill.first_logits, tiny_prefill.prompt_length, 4,
                           frozenset())
    ref_tokens = greedy_decode(tiny_lm.model, reference, tiny_prefill.first_logits, tiny_prefill.prompt_length, 4,
                               frozenset())
    assert tokens == ref_tokens and len(tokens) == 4
    fresh, _ = pipeline.build_cache(tiny_prefill)
    for layer in fresh.layers:
        expected = _tensor_bytes_of(layer.key_store) + _tensor_bytes_of(layer.value_store)
        expected += 0 if layer.valid_bits is None else layer.valid_bits.numel()
        assert layer.nbytes() == expected
    assert fresh.nbytes() <= tiny_prefill.dense_kv_bytes()
    assert 0.0 < fresh.kept_key_fraction() <= 1.0


@pytest.mark.parametrize("name", [n for n in METHOD_NAMES if n != "full"])
def test_every_method_resolves_from_the_cli(name):
    from spark_bench.cli import method_configs
    from test_runner_and_cli import _compose

    from spark_bench.methods.pipeline import relevant_options

    # only the options this method reads: the others are refused (tests/test_bad_inputs.py)
    given = {"ratio": 0.5, "value_ratio": 0.3, "recovery": "gaussian", "seed": 3}
    given = {k: v for k, v in given.items() if k in relevant_options({"name": name, "value_ratio": 0.3})}
    assert "value_ratio" in given and ("ratio" in given) == (name.endswith(("think", "spark", "mustafar")))
    (mc,) = method_configs(_compose([f"method={name}", *(f"{k}={v}" for k, v in given.items())]))
    assert mc.name == name and {k: getattr(mc, k) for k in given} == given


def test_attention_over_every_store_equals_dense_reference(tiny_prefill):
    """One attention call with a tail of decoded tokens: compact == materialize-then-SDPA, for each store kind."""
    g = torch.Generator().manual_seed(0)
    for cfg in [MethodConfig(name="full"), MethodConfig(name="snapkv+think", budget=64, ratio=0.8),
                MethodConfig(name="adasnapkv+spark", budget=64, ratio=0.8, value_ratio=0.5),
                MethodConfig(name="spark", ratio=0.8, variant="top_p")]:
        cache, _ = Pipeline.from_config(cfg).build_cache(tiny_prefill)
        layer = cache.layers[1]
        b, h, _, d = tiny_prefill.layers[1].keys.shape
        device = tiny_prefill.layers[1].keys.device
        layer.update(torch.randn(b, h, 3, d, generator=g).to(device), torch.randn(b, h, 3, d, generator=g).to(device))
        query = torch.randn(b, 2 * h, 1, d, generator=g).to(device)
        assert torch.allclose(layer.attend(query, d ** -0.5), layer.attend(query, d ** -0.5, "materialize"),
                              atol=1e-5)


# ---- eviction properties ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget,prompt,layers", [(128, 4096, 32), (512, 8000, 30), (2048, 16000, 32),
                                                  (1000, 1500, 2), (300, 4096, 28)])
def test_pyramid_budgets_average_to_the_requested_budget(budget, prompt, layers):
    ramp = pyramid_budgets(budget, prompt, 32, layers)
    assert ramp == sorted(ramp, reverse=True)  # more tokens low down
    # the integer `steps` of the original formula can only raise the mean, by less than (L − 1) / 2 tokens
    assert budget <= sum(ramp) / layers < budget + (layers - 1) / 2


def test_pyramid_fallbacks():
    # original: a short prompt (S < 2(B − W)) keeps B in every layer; a prompt within budget keeps everything
    assert pyramid_budgets(1000, 1500, 32, 4) == [1000] * 4
    assert pyramid_budgets(2000, 1500, 32, 4) == [1500] * 4
    # keep90 (official SparK fork): (B − W) // β = 4 < W makes the ramp infeasible → 90% of the prompt everywhere
    assert pyramid_budgets(128, 4096, 32, 32, fallback="keep90") == [round(0.9 * 4096)] * 32
    assert pyramid_budgets(2048, 16000, 32, 32, fallback="keep90") == pyramid_budgets(2048, 16000, 32, 32)


def test_pyramid_kvpress_budgets_by_hand():
    """The fork's kvpress ``get_layer_budget`` at S=6000, 32 layers, β=20 (window counted inside the budget)."""
    from spark_bench.methods.eviction.pyramidkv import kvpress_budgets

    # B=2048, W=64: min_num = 1984/20 = 99.2, max_num = 3968 − 99.2 = 3868.8, steps = 3769.6/31 = 121.6
    ramp = kvpress_budgets(2048, 6000, 64, 32)
    assert ramp[:3] == [3869, 3747, 3626] and ramp[-1] == 99
    assert abs(sum(ramp) / 32 - (2048 - 64)) < 1  # layers average B − W
    # B=1024, W=64: min_num = 960/20 = 48 < W → infeasible → round(6000 · (1 − 0.1)) in every layer
    assert kvpress_budgets(1024, 6000, 64, 32) == [5400] * 32
    # B=1024, W=32: min_num = 49.6 ≥ W → it ramps (what `keep90` with W=32 does differently from the fork)
    ramp = kvpress_budgets(1024, 6000, 32, 32)
    assert (ramp[0], ramp[1], ramp[-1]) == (1934, 1874, 50)
    # a 20% fraction, W=64: capacity 64 + 1200, min_num = 60 < W → round(6000 · 0.2)
    assert kvpress_budgets(0.2, 6000, 64, 32) == [1200] * 32
    cfg = MethodConfig(name="pyramidkv", budget=2048, window_size=64, pyramid_fallback="kvpress")
    pyramid = Pipeline.from_config(cfg).eviction
    assert [pyramid.layer_budget(6000, i, 32) for i in (0, 31)] == [3869, 99]


def test_pyramidkv_layers_keep_their_ramp(tiny_prefill):
    cfg = MethodConfig(name="pyramidkv", budget=96)
    cache, _ = Pipeline.from_config(cfg).build_cache(tiny_prefill)
    assert [layer.key_store.length for layer in cache.layers] == pyramid_budgets(96, 160, 32, 2)


def test_adasnapkv_spends_the_layer_budget_across_heads(tiny_prefill):
    layer = tiny_prefill.layers[1]
    method = AdaSnapKV(budget=64)
    sel = method.select(layer, 1, 2)
    h = layer.num_kv_heads
    per_head = sel.valid.sum(-1)
    assert int(per_head.sum()) == h * 64                         # the layer's total equals H × budget
    assert int(per_head.min()) >= 32 + int(0.2 * 32)            # window + safeguard share
    scores = method.token_scores(layer)
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    for head in range(h):
        idx = sel.indices[0, head][sel.valid[0, head]]
        idx = idx[idx < scores.shape[-1]]
        chosen[0, head, idx] = True
    # outside the safeguard, the kept tokens are the best scores of the whole layer
    safe = torch.zeros_like(chosen).scatter_(-1, scores.topk(int(0.2 * 32), dim=-1).indices, True)
    free_kept, free_dropped = scores[chosen & ~safe], scores[~chosen]
    assert free_kept.min() >= free_dropped.max()


def test_adasnapkv_safeguard_modes_by_hand(tiny_prefill):
    from spark_bench.methods.eviction.adasnapkv import safeguard_tokens

    assert safeguard_tokens("kvpress", 0.2, 128, 32) == 19      # int(0.2 · 96)
    assert safeguard_tokens("spark_fork", 0.2, 128, 32) == 0    # max(int(25.6) − 32, 0): none at B=128
    assert safeguard_tokens("spark_fork", 0.2, 128, 64) == 0
    assert safeguard_tokens("spark_fork", 0.2, 1024, 64) == 140  # int(204.8) − 64
    assert safeguard_tokens("kvpress", 0.2, 1024, 64) == 192
    # B=64, W=32 on the tiny prefill: kvpress reserves int(0.2 · 32) = 6 per head, the fork max(12 − 32, 0) = 0,
    # so with no reserve the layer's tokens go wherever the scores are highest
    layer = tiny_prefill.layers[1]
    fork = AdaSnapKV(budget=64, safeguard="spark_fork").select(layer, 1, 2)
    scores = AdaSnapKV(budget=64).token_scores(layer)
    n_scored = scores.shape[-1]
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    for head in range(layer.num_kv_heads):
        idx = fork.indices[0, head][fork.valid[0, head]]
        chosen[0, head, idx[idx < n_scored]] = True
    assert int(chosen.sum()) == layer.num_kv_heads * 32
    assert scores[chosen].min() >= scores[~chosen].max()
    with pytest.raises(ValueError, match="ada_safeguard must be one of kvpress, spark_fork"):
        MethodConfig(name="adasnapkv", ada_safeguard="bogus")


def test_tova_keeps_last_token_and_its_top_attention(tiny_prefill):
    layer = tiny_prefill.layers[0]
    s = layer.keys.shape[-2]
    sel = TOVA(budget=40).select(layer, 0, 2).indices
    assert torch.equal(sel[0, 0], sel[0, 1]) and int(sel[0, 0, -1]) == s - 1
    scores = window_attention(layer, 1)[0, :, 0, :-1].mean(0)
    kept = sel[0, 0, :-1]
    dropped = torch.ones(s - 1, dtype=torch.bool, device=kept.device).scatter_(0, kept, False)
    assert scores[kept].min() >= scores[dropped].max()


def test_expected_attention_keeps_sinks_and_budget(tiny_prefill):
    layer = tiny_prefill.layers[1]
    sel = EVICTION_METHODS["expected_attention"](MethodConfig(name="expected_attention", budget=50)).select(
        layer, 1, 2)
    assert sel.indices.shape[-1] == 50 and sel.indices[0, :, :4].tolist() == [[0, 1, 2, 3]] * 2
    assert layer.query_mean.shape == (1, 4, 16) and layer.query_cov.shape == (1, 4, 16, 16)
    assert torch.allclose(layer.query_cov, layer.query_cov.transpose(-1, -2), atol=1e-5)


# ---- channel properties -------------------------------------------------------------------------------------------

def _layer(keys, queries):
    return LayerPrefill(keys=keys, values=torch.zeros_like(keys), window_queries=queries)


def test_spark_p_keeps_fewest_channels_covering_p():
    # one token, D = 8, official saliency k²·‖q‖ with ‖q_c‖ = 1: saliency = k² = [16, 9, 4, 1, 1, 0.25, 0.25, 0.5]
    keys = torch.tensor([[[[4.0, 3.0, 2.0, 1.0, -1.0, 0.5, -0.5, 0.70710678]]]])
    queries = torch.ones(1, 1, 1, 8)
    store = SparK(ratio=0.0, window_size=1, variant="top_p", top_p=0.9).compress_keys(keys, _layer(keys, queries))
    # total 32; sorted 16, 9, 4 → 29/32 = 0.906 ≥ 0.9 after 3 channels → keep 3 of 8, achieved ratio 5/8
    assert store.kept_mask()[0, 0, 0].tolist() == [True, True, True] + [False] * 5
    assert 1 - store.kept_fraction() == pytest.approx(5 / 8)


def test_spark_g_ratios_by_hand():
    # g=4 over D=8: segments of 2 ranks, pruning 0.25/0.5/0.75/1.0 → keep 2−0, 2−1, 2−1, 2−2 = ranks {0,1,2,4}
    assert group_keep_by_rank(8, 4).tolist() == [True, True, True, False, True, False, False, False]
    # g=5 over D=10: pruning 0.1/0.3/0.5/0.7/0.9 of 2 each → keep 2, 2, 1, 1, 1 → achieved ratio 3/10
    assert int(group_keep_by_rank(10, 5).sum()) == 7
    assert 1 - group_keep_by_rank(64, 4).float().mean().item() == pytest.approx(40 / 64)


@pytest.mark.parametrize("recovery", ["gaussian", "exponential"])
def test_sampled_recovery_is_seeded_and_stable(recovery):
    g = torch.Generator().manual_seed(1)
    keys, queries = torch.randn(1, 2, 64, 16, generator=g), torch.randn(1, 4, 32, 16, generator=g)
    layer = _layer(keys, queries)

    def materialize(seed):
        return SparK(ratio=0.8, recovery=recovery, seed=seed).compress_keys(keys, layer, layer_idx=1).materialize()

    first = materialize(7)
    assert torch.equal(first, materialize(7))             # same seed → same keys, build after build
    store = SparK(ratio=0.8, recovery=recovery, seed=7).compress_keys(keys, layer, layer_idx=1)
    assert torch.equal(store.materialize(), store.materialize())  # the same at every decode step
    assert not torch.equal(first, materialize(8))
    kept = store.kept_mask()
    assert torch.equal(first[kept], keys[kept])            # kept entries are exact
    assert bool((first[~kept] != 0).any())


def test_gaussian_recovery_matches_its_distribution():
    """Paper mode maps a sampled score back through q̄, so q̄_c · k̃_tc recovers the N(μ_t, σ_t²) samples."""
    g = torch.Generator().manual_seed(2)
    keys, queries = torch.randn(1, 1, 2000, 64, generator=g), torch.randn(1, 1, 32, 64, generator=g) + 1.0
    spark = SparK(ratio=0.8, saliency="paper", recovery="gaussian", seed=0)
    store = spark.compress_keys(keys, _layer(keys, queries))
    q_bar = queries.mean(dim=-2)[0, 0]
    scores = (store.materialize() * q_bar)[~store.kept_mask()]
    sal = spark.saliency_scores(keys, q_bar.view(1, 1, 64))
    pruned = ~store.kept_mask()
    mu = (sal * pruned).sum(-1, keepdim=True) / pruned.sum(-1, keepdim=True)  # recovery_stats=pruned
    assert scores.mean().item() == pytest.approx(mu.expand_as(sal)[pruned].mean().item(), rel=0.05)
    sigma = (((sal - mu) ** 2 * pruned).sum(-1, keepdim=True) / pruned.sum(-1, keepdim=True)).sqrt()
    assert (scores - mu.expand_as(sal)[pruned]).std().item() == pytest.approx(
        sigma.expand_as(sal)[pruned].pow(2).mean().sqrt().item(), rel=0.05)


def test_zero_and_none_recovery_are_the_same_attention_and_constant_fills():
    g = torch.Generator().manual_seed(3)
    keys, queries = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 4, 32, 16, generator=g)
    layer = _layer(keys, queries)
    zero = SparK(ratio=0.5, recovery="zero").compress_keys(keys, layer)
    none = SparK(ratio=0.5, recovery="none").compress_keys(keys, layer)
    const = SparK(ratio=0.5, recovery="constant", constant=0.01).compress_keys(keys, layer)
    assert torch.equal(zero.materialize(), none.materialize()) and zero.recovery.nbytes() == 0
    assert torch.allclose(const.materialize()[~const.kept_mask()], torch.tensor(0.01))


def test_value_pruning_zeroes_smallest_magnitudes():
    values = torch.randn(1, 2, 30, 16, generator=torch.Generator().manual_seed(4))
    dense = ValueNorm(ratio=0.3).compress_values(values).materialize()
    pruned = dense == 0
    assert bool((pruned.sum(-1) == int(0.3 * 16)).all())
    assert torch.equal(dense[~pruned], values[~pruned])
    assert bool((values.abs()[pruned].view(1, 2, 30, -1).amax(-1) <= values.abs()[~pruned].view(1, 2, 30, -1)
                 .amin(-1)).all())


def test_every_channel_and_eviction_pair_is_a_method():
    for e, c in itertools.product(EVICTION_METHODS, CHANNEL_METHODS):
        cfg = MethodConfig(name=f"{e}+{c}")
        assert (cfg.eviction_name, cfg.channel_name) == (e, c)


def test_labels_name_variants_and_value_ratio():
    assert MethodConfig(name="snapkv+spark", ratio=0.5, value_ratio=0.3, budget=128).label == \
        "SnapKV+SparK(0.5+0.3) @128"
    assert MethodConfig(name="snapkv+spark", variant="top_p", budget=128).label == "SnapKV+SparK-p(0.99) @128"
    assert MethodConfig(name="pyramidkv+spark", ratio=0.8, recovery="gaussian", budget=0.2).label == \
        "PyramidKV+SparK(0.8)[gaussian] @0.2"
    with pytest.raises(ValueError, match="recovery must be one of"):
        MethodConfig(name="spark", recovery="uniform")
    with pytest.raises(ValueError, match="top_p must be a number > 0 and <= 1"):
        MethodConfig(name="spark", top_p=0.0)


@pytest.mark.parametrize("name", list(EVICTION_METHODS))
def test_fraction_budget_on_a_short_prompt_keeps_the_minimum_instead_of_failing(tiny_prefill, name):
    """0.1 of a 160-token prompt is 16 tokens, below SnapKV's window (32) and fine for sinks: never an error."""
    cache, _ = Pipeline.from_config(MethodConfig(name=name, budget=0.1)).build_cache(tiny_prefill)
    assert all(layer.key_store.length <= 160 for layer in cache.layers)


def test_channel_window_is_separate_from_the_eviction_window(tiny_lm):
    """window_size=64 for SnapKV, channel_window=32 for SparK (the official fork's split): the pipeline equals
    SnapKV(W=64) eviction followed by SparK(W=32) on the evicted keys, and the prefill keeps 64 window queries."""
    from conftest import DEVICE
    from spark_bench.engine.prefill import run_prefill
    from spark_bench.methods.base import gather_tokens
    from spark_bench.methods.channel.spark import SparK
    from spark_bench.methods.eviction.snapkv import SnapKV

    cfg = MethodConfig(name="snapkv+spark", budget=80, ratio=0.8, window_size=64, channel_window=32)
    assert (cfg.channel_window_size, cfg.observation_window) == (32, 64)
    assert MethodConfig(name="snapkv+spark", window_size=48).channel_window_size == 48  # null: follows window_size
    ids = torch.randint(100, 5000, (1, 200), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    prefill = run_prefill(tiny_lm.model, ids, window=cfg.observation_window)
    pipeline = Pipeline.from_config(cfg)
    assert (pipeline.eviction.window_size, pipeline.channel.window_size) == (64, 32)
    cache, _ = pipeline.build_cache(prefill)
    n = len(prefill.layers)
    for i, layer in enumerate(prefill.layers):
        indices = SnapKV(budget=80, window_size=64).select(layer, i, n).indices
        keys = gather_tokens(layer.keys, indices)
        expected = SparK(ratio=0.8, window_size=32).compress_keys(keys, layer, i)
        assert torch.equal(cache.layers[i].key_store.materialize(), expected.materialize())
        assert torch.equal(cache.layers[i].key_store.kept_mask(), expected.kept_mask())
    with pytest.raises(ValueError, match=r"channel_window must be an integer >= 1, or null \(window_size\); got 0"):
        MethodConfig(name="spark", channel_window=0)


@pytest.mark.parametrize("ties", [False, True])
def test_unsorted_topk_selects_the_sorted_topk_set(ties):
    """Selections call ``topk(sorted=False)`` (2× faster on CPU) and use only the set: on this device it is exactly
    the set of ``sorted=True``, ties included (values drawn from {0, …, 4})."""
    g = torch.Generator().manual_seed(5)
    for n in (8, 64, 130, 3000):
        scores = (torch.randint(0, 5, (2, 3, n), generator=g).float() if ties
                  else torch.randn(2, 3, n, generator=g)).to(conftest.DEVICE)
        for k in {1, n // 3, n // 2, n - 1}:
            expected = scores.topk(k, dim=-1).indices.sort(dim=-1).values
            assert torch.equal(top_tokens(scores, k).indices, expected)
            mask = SparK(ratio=1 - k / n, saliency="paper").kept_mask(scores)
            assert bool((mask.sum(-1) == k).all())
            assert torch.equal(mask.nonzero()[:, -1].view(2, 3, -1), expected)


# ---- what SparK reads: the unread-option rule against what it computes -----------------------------------------------

# each conditional option and two values for it (methods/config.py READ_WHEN)
OTHER_VALUES = {"ratio": (0.5, 0.8), "top_p": (0.99, 0.5), "groups": (4, 5), "group_fork_fill": ("recovery", "zero"),
                "constant": (0.01, 0.5), "seed": (0, 7), "recovery_stats": ("pruned", "all"),
                "recovery": ("degenerate", "gaussian")}


def test_spark_reads_exactly_what_the_unread_option_rule_says(tiny_prefill):
    """For every variant under a recovery of each kind (and both SparK-g fills), changing an option changes what
    SparK computes (the keys attention reads from its store) exactly when :func:`relevant_options` says the config reads it:
    the refusal of unread options (``constant`` without ``recovery=constant``, ``top_p`` under ``variant=fixed``,
    ``seed`` under the degenerate refill, ``recovery`` of a zero-filled SparK-g, …) is derived from the method."""
    from spark_bench.methods.config import build_part, relevant_options

    layer = tiny_prefill.layers[1]

    def attention(cfg):  # the keys attention reads from SparK's store (kept entries and the refill)
        return build_part("spark", cfg).compress_keys(layer.keys, layer, 1).materialize()

    checked = 0
    for variant, recovery, fill in itertools.product(("fixed", "top_p", "group", "group_fork"),
                                                     ("degenerate", "gaussian", "constant", "fork_pool0",
                                                      "fork_key_normal"), ("recovery", "zero")):
        if fill == "zero" and variant != "group_fork":
            continue
        base = MethodConfig(name="spark", ratio=0.5, variant=variant, recovery=recovery, group_fork_fill=fill)
        reads = relevant_options(base.to_dict())
        reference = attention(base)
        for option, values in OTHER_VALUES.items():
            if option == "recovery" and "recovery" in reads:
                continue  # another recovery is another row of this loop
            value = values[1] if getattr(base, option) == values[0] else values[0]
            changed = not torch.equal(attention(dataclasses.replace(base, **{option: value})), reference)
            assert changed == (option in reads), (variant, recovery, fill, option, changed)
            checked += 1
    assert checked >= 150
