"""The ``protocol`` group (official / paper / kvcache_factory) and the points of the official SparK code it names,
each pinned by a hand computation: value scores and refill (point 6), SparK-g buckets (point 7); the windows,
PyramidKV budgets, AdaSnapKV safeguard and truncation limits are pinned in test_methods / test_longbench."""

import random
import statistics

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from spark_bench.cli import CONF_DIR, PROTOCOL_KEYS, ConfigError, method_configs
from spark_bench.methods import MethodConfig
from spark_bench.methods.channel.spark import SparK, fork_group_keep
from spark_bench.methods.channel.value_norm import ValueNorm, value_scores
from spark_bench.methods.pipeline import sweep_labels


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_official_protocol_is_the_forks_setup():
    cfg = _compose(["protocol=official", "method=snapkv+spark", "ratio=0.8", "budget=128"])
    (only,) = method_configs(cfg)
    assert (only.window_size, only.kernel_size, only.pooling, only.channel_window) == (64, 5, "avg", 32)
    assert (only.think_keep_window, only.compress_scope) == (False, "question")
    assert (only.pyramid_fallback, only.ada_safeguard, only.value_score, only.value_fill) == (
        "kvpress", "spark_fork", "fork", "mean")
    assert _compose([]).compress_scope == "question"  # official is the default
    assert cfg.longbench.protocol == "kvpress" and cfg.longbench.data_dir is None  # merged, not replaced
    assert _compose(["protocol=official", "window_size=16"]).window_size == 16  # the command line wins


@pytest.mark.parametrize("name", ["paper", "kvcache_factory"])
def test_paper_and_kvcache_factory_protocols(name):
    cfg = _compose([f"protocol={name}", "method=pyramidkv+think", "ratio=0.5"])
    (only,) = method_configs(cfg)
    assert (only.window_size, only.kernel_size, only.pooling, only.channel_window) == (32, 7, "max", None)
    assert (only.think_keep_window, only.compress_scope, only.pyramid_fallback, only.ada_safeguard) == (
        True, "prompt", "original", "kvpress")
    assert (only.value_score, only.value_fill) == ("norm", "zero")


def test_every_protocol_sets_the_same_keys_and_every_paper_target_uses_official():
    for path in (CONF_DIR / "protocol").glob("*.yaml"):
        assert sorted(OmegaConf.load(path)) == sorted((*PROTOCOL_KEYS, "longbench")), path.name
    for path in (CONF_DIR / "experiment").glob("*.yaml"):
        assert "override /protocol: official" in path.read_text(), path.name


def test_a_sweep_entry_names_its_own_protocol():
    cfg = _compose(["sweep=protocols"])
    configs = method_configs(cfg)
    factory = [c for c in configs if c.compress_scope == "prompt" and c.window_size == 32]
    assert {c.name for c in factory} == {"full", "snapkv", "snapkv+think", "snapkv+spark"}
    labels = sweep_labels(configs)
    assert len(set(labels)) == len(labels)
    assert ("SnapKV @0.3 [compress_scope=prompt, budget_rounding=exact, window_size=32, kernel_size=7, pooling=max, "
            "window_q_norm=true]") in labels
    cfg.sweep.configs = [{"name": "snapkv", "protocol": "nope"}]
    with pytest.raises(ConfigError, match=r"sweep.configs\[0\]: protocol 'nope': no such protocol config .*valid: "
                                          r"kvcache_factory, official, paper"):
        method_configs(cfg)


def test_options_a_method_ignores_do_not_split_its_label():
    a = MethodConfig(name="snapkv", budget=64)
    b = MethodConfig(name="snapkv", budget=64, think_keep_window=False, channel_window=8)  # SnapKV ignores both
    with pytest.raises(ValueError, match="lists the same method config more than once: SnapKV @64"):
        sweep_labels([a, b])
    c = MethodConfig(name="snapkv+think", budget=64, ratio=0.5, think_keep_window=False)
    d = MethodConfig(name="snapkv+think", budget=64, ratio=0.5)
    assert sweep_labels([c, d]) == ["SnapKV+ThinK(0.5) @64 [think_keep_window=false]",
                                    "SnapKV+ThinK(0.5) @64 [think_keep_window=true]"]


def _fork_scores_by_hand(v):
    """Plain Python: 0.7·|v| + 0.3·(Var over tokens + Var over channels)/2, divided by the head's maximum."""
    s, d = len(v), len(v[0])
    across_tokens = [statistics.variance([v[t][c] for t in range(s)]) for c in range(d)]
    across_channels = [statistics.variance(v[t]) for t in range(s)]
    div = [[(across_tokens[c] + across_channels[t]) / 2 for c in range(d)] for t in range(s)]
    peak = max(max(row) for row in div)
    return [[0.7 * abs(v[t][c]) + 0.3 * div[t][c] / (peak + 1e-8) for c in range(d)] for t in range(s)]


def test_value_scores_and_mean_refill_by_hand():
    # two tokens, four channels: norm scores |v|; fork scores by the formula above
    v = [[1.0, -2.0, 0.5, 0.0], [0.0, 1.0, -1.0, 3.0]]
    # Var over tokens: 0.5, 4.5, 1.125, 4.5; over channels: 83/48 (token 0), 35/12 (token 1); max (4.5 + 35/12)/2
    expected = _fork_scores_by_hand(v)
    assert expected[0][0] == pytest.approx(0.7 + 0.3 * (0.5 + 83 / 48) / (4.5 + 35 / 12))
    got = value_scores(torch.tensor([[v]]), "fork")[0, 0]
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(value_scores(torch.tensor([[v]]), "norm")[0, 0], torch.tensor(v).abs())

    # λ_v = 0.5 prunes int(0.5·4) = 2 entries per token; the mean refill is the mean of the token's pruned values
    store = ValueNorm(0.5, "fork", "mean").compress_values(torch.tensor([[v]]))
    assert store.kept_mask()[0, 0].tolist() == [[True, True, False, False], [False, True, False, True]]
    assert store.materialize()[0, 0].tolist() == [[1.0, -2.0, 0.25, 0.25], [-0.5, 1.0, -0.5, 3.0]]
    zero = ValueNorm(0.5, "norm", "zero").compress_values(torch.tensor([[v]]))
    assert zero.materialize()[0, 0].tolist() == [[1.0, -2.0, 0.0, 0.0], [0.0, 0.0, -1.0, 3.0]] or \
        zero.materialize()[0, 0].tolist() == [[1.0, -2.0, 0.0, 0.0], [0.0, 1.0, 0.0, 3.0]]  # |1| = |-1|: a tie
    assert store.nbytes() == zero.nbytes() + 2 * 4  # one float32 fill per token and head


def test_fork_value_scores_change_which_entries_are_kept():
    rng = random.Random(3)
    v = [[rng.gauss(0, 1) * (3 if c == 5 else 1) for c in range(8)] for _ in range(12)]
    fork = value_scores(torch.tensor([[v]]), "fork")[0, 0]
    torch.testing.assert_close(fork, torch.tensor(_fork_scores_by_hand(v)), atol=1e-5, rtol=1e-5)
    keep = lambda scores: scores.topk(4, dim=-1).indices.sort(-1).values
    assert not torch.equal(keep(fork), keep(torch.tensor(v).abs()))


def test_spark_g_fork_buckets_and_overall_ratio_by_hand():
    # D = 10: bucket bounds int(0.2·10)=2, 4, 6, 8; keep int(0.1·10)=1, 3, 5, 7, 9 channels
    sal = torch.tensor([
        [100.0, 0.5, 0.5, 0, 0, 0, 0, 0, 0, 0],   # 100/101 > 0.99 at rank 0 → bucket 0 → keep 1
        [1.0, 1, 1, 1, 0, 0, 0, 0, 0, 0],         # passes 99% at rank 3 → bucket 1 (2 < 3 ≤ 4) → keep 3
        [1.0] * 10,                               # at rank 9 → bucket 4 → keep 9
        [1.0] * 6 + [0.0] * 4,                    # at rank 5 → bucket 2 (4 < 5 ≤ 6) → keep 5
        [1.0] * 8 + [0.0] * 2,                    # at rank 7 → bucket 3 → keep 7
    ])
    assert fork_group_keep(sal).squeeze(-1).tolist() == [1, 3, 9, 5, 7]
    # the same through SparK: keys whose official saliency k²·‖q‖ is that pattern (‖q_c‖ = 1 on every channel)
    keys = sal.sqrt().view(1, 1, 5, 10)
    window = torch.zeros(1, 1, 1, 10)
    window[..., :] = 1.0
    from spark_bench.engine.prefill import LayerPrefill
    store = SparK(ratio=0.0, window_size=1, variant="group_fork").compress_keys(
        keys, LayerPrefill(keys, torch.zeros_like(keys), window))
    kept = store.kept_mask()[0, 0]
    assert kept.sum(-1).tolist() == [1, 3, 9, 5, 7]
    assert kept[0].tolist() == [True] + [False] * 9  # the most salient channels are the kept ones
    assert 1 - store.kept_fraction() == pytest.approx(1 - 25 / 50)  # overall ratio: 25 of 50 entries pruned
    assert MethodConfig(name="snapkv+spark", variant="group_fork").label == "SnapKV+SparK-g(fork) @0.2"


def _spark_store(keys, recovery, ratio=0.5, seed=0):
    from spark_bench.engine.prefill import LayerPrefill

    window = torch.ones(1, keys.shape[1], 1, keys.shape[-1])  # ‖q_c‖₂ = 1: the official saliency is k²
    return SparK(ratio=ratio, window_size=1, recovery=recovery, seed=seed).compress_keys(
        keys, LayerPrefill(keys, torch.zeros_like(keys), window))


def _folded_normal_mean(mu, sigma):
    import math
    return sigma * math.sqrt(2 / math.pi) * math.exp(-mu * mu / (2 * sigma * sigma)) + mu * math.erf(
        mu / (sigma * math.sqrt(2)))


@pytest.mark.parametrize("mode", ["fork_key_normal", "fork_key_exponential"])
def test_fork_key_draws_follow_the_tokens_key_statistics(mode):
    """Codes 0.7 / 0.6: every token is k = (1, −2, 0.5, 3); saliency k² keeps channels 1 and 3 (λ=0.5); the pruned
    entries 0 and 2 (both positive) are drawn from the token's key mean 0.625 (and unbiased std sqrt(12.6875/3))."""
    keys = torch.tensor([1.0, -2.0, 0.5, 3.0]).repeat(1, 1, 4000, 1)
    store = _spark_store(keys, mode)
    kept, filled = store.kept_mask()[0, 0], store.materialize()[0, 0]
    assert kept[0].tolist() == [False, True, False, True]
    assert torch.equal(filled[:, 1], keys[0, 0, :, 1]) and torch.equal(filled[:, 3], keys[0, 0, :, 3])
    pruned = filled[:, [0, 2]]
    assert bool((pruned > 0).all())  # the original entries' signs
    expected = 0.625 if mode.endswith("exponential") else _folded_normal_mean(0.625, (12.6875 / 3) ** 0.5)
    assert pruned.mean().item() == pytest.approx(expected, rel=0.05)
    assert torch.equal(store.materialize(), store.materialize())  # the same draws at every decode step


@pytest.mark.parametrize("kind", ["normal", "exponential"])
def test_fork_ranked_draws_by_hand(kind):
    """Codes 0.755 / 0.654 on one token k = (1, −2, 0.5, 3), saliency (1, 4, 0.25, 9): four draws from the all-channel
    statistics (mean 3.5625), sorted high to low; pruned channel 0 (rank 2) takes the 3rd, channel 2 (rank 3) the
    4th; a draw above the smallest kept saliency (4) becomes μ_pruned = 0.625; the key is sign·sqrt(w̃ / 1)."""
    keys = torch.tensor([[[[1.0, -2.0, 0.5, 3.0]]]])
    for seed in range(20):
        store = _spark_store(keys, f"fork_ranked_{kind}", seed=seed)
        recovery = store.recovery
        assert recovery.ranks.tolist() == [2, 3] and recovery.threshold.item() == 4.0
        assert recovery.mu_pruned.item() == 0.625 and recovery.mean.item() == pytest.approx(3.5625)
        g = torch.Generator().manual_seed(seed * 100_003)  # the store's per-layer seed (layer 0)
        if kind == "normal":
            assert recovery.std.item() == pytest.approx(statistics.stdev([1, 4, 0.25, 9]))
            draws = (3.5625 + recovery.std.item() * torch.randn(1, 1, 1, 4, generator=g)).abs()
        else:
            draws = 3.5625 * torch.empty(1, 1, 1, 4).exponential_(generator=g)
        ordered = sorted(draws.flatten().tolist(), reverse=True)
        want = [w if w <= 4.0 else 0.625 for w in ordered[2:]]
        got = store.materialize()[0, 0, 0]
        assert got[[1, 3]].tolist() == [-2.0, 3.0]
        assert got[[0, 2]].tolist() == pytest.approx([w ** 0.5 for w in want], rel=1e-5)
    assert store.nbytes() > _spark_store(keys, "degenerate").nbytes()  # ranks, statistics, threshold


def test_fork_recoveries_need_the_official_saliency():
    with pytest.raises(ValueError, match="fork_key_normal is the official code's .* needs saliency=official"):
        SparK(ratio=0.5, saliency="paper", recovery="fork_key_normal")


@pytest.fixture(scope="module")
def tiny_qwen():
    from conftest import DEVICE, model_config
    from spark_bench.models import load_model

    return load_model(model_config("tiny-qwen3"), str(DEVICE))


def test_qwen3_window_queries_without_q_norm(tiny_qwen, tiny_lm):
    """Point 11: the official code recomputes window queries as q_proj → RoPE, without Qwen3's q_norm. One prefill
    records both; a Llama prefill has one kind only; a prefill that did not record raw queries says so."""
    from conftest import DEVICE
    from spark_bench.engine.prefill import _rotate_half, attention_modules, run_prefill

    ids = torch.randint(100, 5000, (1, 90), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    model = tiny_qwen.model
    captured = {}

    def keep(module, args, kwargs):
        captured[module.layer_idx] = kwargs

    handles = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in attention_modules(model)]
    prefill = run_prefill(model, ids, window=16, ends=(60,), raw_queries=True)
    for h in handles:
        h.remove()
    for end in (60, 90):
        raw, normed = prefill.at(end, q_norm=False), prefill.at(end)
        for i, module in enumerate(attention_modules(model)):
            hidden, (cos, sin) = captured[i]["hidden_states"], captured[i]["position_embeddings"]
            with torch.inference_mode():
                q = module.q_proj(hidden[:, end - 16:end]).view(1, 16, -1, module.head_dim).transpose(1, 2)
            c, s = cos[:, end - 16:end].unsqueeze(1), sin[:, end - 16:end].unsqueeze(1)
            torch.testing.assert_close(raw.layers[i].window_queries, q * c + _rotate_half(q) * s)
            assert not torch.allclose(raw.layers[i].window_queries, normed.layers[i].window_queries, atol=1e-3)
            assert torch.equal(raw.layers[i].keys, normed.layers[i].keys)
    with pytest.raises(ValueError, match="without q_norm"):
        run_prefill(model, ids, window=16).at(90, q_norm=False)
    llama = run_prefill(tiny_lm.model, ids, window=16)
    assert llama.at(90, q_norm=False) is llama  # no query norm: one kind of window query


def test_qwen3_sweep_mixing_query_kinds_and_score_dtypes(tiny_qwen, tmp_path):
    from spark_bench.benchmarks.ruler import load_ruler
    from spark_bench.runner import run_sweep

    samples = load_ruler(["niah_single_1"], 400, 1, 0, tiny_qwen, max_new_tokens=3)
    configs = [MethodConfig(name="snapkv+spark", budget=0.5, ratio=0.8, window_size=16, window_q_norm=q)
               for q in (True, False)]
    preds = run_sweep(tiny_qwen, samples, configs, tmp_path / "q")
    assert list(preds.config) == ["SnapKV+SparK(0.8) @0.5 [window_q_norm=true]",
                                  "SnapKV+SparK(0.8) @0.5 [window_q_norm=false]"]


def test_saliency_in_the_model_dtype():
    """Point 11: ``saliency_dtype=model`` does the score arithmetic in the keys' dtype (bf16 on GPUs)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 64, 64, generator=g).bfloat16()
    stat = torch.rand(1, 2, 64, generator=g) + 0.5
    wide, narrow = SparK(ratio=0.8), SparK(ratio=0.8, saliency_dtype="model")
    assert torch.equal(narrow.saliency_scores(keys, stat), (keys.pow(2) * stat.bfloat16().unsqueeze(-2)).float())
    assert torch.equal(wide.saliency_scores(keys, stat), keys.float().pow(2) * stat.unsqueeze(-2))
    assert not torch.equal(narrow.saliency_scores(keys, stat), wide.saliency_scores(keys, stat))
    keys32 = keys.float()
    assert torch.equal(narrow.saliency_scores(keys32, stat), wide.saliency_scores(keys32, stat))  # fp32 model: same
