"""The last differences between ``protocol=official`` and the official SparK code (GitHub Xnhyacinth/SparK): the
floating-point kept-token count of fraction budgets, SparK-g's zero refill, and the ``pooling_ratio=0.0`` refill
(``recovery=fork_pool0``)."""

import pytest
import torch

from spark_bench.engine.decode import greedy_decode
from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.channel.spark import SparK
from spark_bench.methods.base import resolve_budget
from spark_bench.storage import dispatch
from test_protocol import _compose
from spark_bench.cli import method_configs

FRACTION_METHODS = ["snapkv", "adasnapkv", "tova", "streamingllm", "expected_attention"]
LENGTHS = [100, 185, 1890, 4095, 16385]


@pytest.mark.parametrize("s", LENGTHS + [101, 999])
def test_budget_rounding_rule(s):
    fork = int(s * (1 - 0.8))  # kvpress: compression_ratio = 1 − 0.2, n_kept = int(k_len * (1 − compression_ratio))
    assert resolve_budget(0.2, s, "official") == fork
    assert resolve_budget(0.2, s, "exact") == int(s * 0.2)
    if s % 5 == 0:
        assert (resolve_budget(0.2, s, "official"), resolve_budget(0.2, s, "exact")) == (s // 5 - 1, s // 5)
    for b in (0.3, 0.5):  # unaffected
        assert resolve_budget(b, s, "official") == resolve_budget(b, s, "exact") == int(s * (1 - (1 - b)))
    assert resolve_budget(128, s, "official") == resolve_budget(128, s, "exact") == min(128, s)  # token budgets


def _layer(s, heads=2, group=3, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, heads, s, d, generator=g)
    window = torch.randn(1, heads * group, 64, d, generator=g)
    return LayerPrefill(keys, torch.randn(1, heads, s, d, generator=g), window,
                        torch.randn(1, heads * group, d, generator=g), torch.rand(1, heads * group, d, d, generator=g))


@pytest.mark.parametrize("name", FRACTION_METHODS)
@pytest.mark.parametrize("s", [185, 1890])
def test_every_fraction_budget_method_keeps_s5_minus_1_under_official(name, s):
    layer = _layer(s)
    kept = {}
    for rounding in ("official", "exact"):
        method = Pipeline.from_config(MethodConfig(name=name, budget=0.2, budget_rounding=rounding,
                                                   window_size=32, n_sink=4)).eviction
        selection = method.select(layer, 0, 1)
        per_head = (selection.indices.shape[-1] if selection.valid is None  # AdaKV: heads share H·n, padded
                    else selection.valid.sum().item() / selection.valid.shape[1])
        kept[rounding] = per_head
    assert (kept["official"], kept["exact"]) == (s // 5 - 1, s // 5)


def test_pyramidkv_keeps_its_own_rule():
    a = MethodConfig(name="pyramidkv", budget=0.2, budget_rounding="official")
    b = MethodConfig(name="pyramidkv", budget=0.2, budget_rounding="exact")
    layer = _layer(1890)
    sa = Pipeline.from_config(a).eviction.select(layer, 3, 8)
    sb = Pipeline.from_config(b).eviction.select(layer, 3, 8)
    assert torch.equal(sa.indices, sb.indices)


def test_protocols_set_the_rounding_and_the_spark_g_fill():
    official, = method_configs(_compose(["method=snapkv+spark", "variant=group_fork"]))
    paper, = method_configs(_compose(["method=snapkv+spark", "variant=group_fork", "protocol=paper"]))
    assert (official.budget_rounding, official.group_fork_fill) == ("official", "zero")
    assert (paper.budget_rounding, paper.group_fork_fill) == ("exact", "recovery")
    assert Pipeline.from_config(official).channel.recovery == "zero"
    assert Pipeline.from_config(paper).channel.recovery == "degenerate"


def test_spark_g_fork_under_official_is_the_zero_refill(tiny_lm, tiny_prefill):
    """Token for token: group_fork with the official fill = recovery=zero, and not the paper's reading."""
    def tokens(**options):
        cache, _ = Pipeline.from_config(MethodConfig(name="snapkv+spark", budget=64, variant="group_fork",
                                                     **options)).build_cache(tiny_prefill)
        return greedy_decode(tiny_lm.model, cache, tiny_prefill.first_logits, tiny_prefill.prompt_length, 8,
                             frozenset())

    official = tokens(group_fork_fill="zero")
    assert official == tokens(group_fork_fill="recovery", recovery="zero")
    paper_cache, _ = Pipeline.from_config(MethodConfig(name="snapkv+spark", budget=64, variant="group_fork",
                                                       group_fork_fill="recovery")).build_cache(tiny_prefill)
    zero_cache, _ = Pipeline.from_config(MethodConfig(name="snapkv+spark", budget=64, variant="group_fork",
                                                      group_fork_fill="zero")).build_cache(tiny_prefill)
    assert not torch.equal(paper_cache.layers[0].key_store.materialize(), zero_cache.layers[0].key_store.materialize())


# ---- recovery=fork_pool0 --------------------------------------------------------------------------------------

def _fork_pool0_float64(keys, window_queries, ratio):
    """The official code's ``dynamic_score_selection_norm`` with ``threshold_ratio = pooling_ratio = 0``, re-derived
    in float64: group-averaged window queries, ``contributions = k²·‖q‖₂``, the ``int(λ·D)`` lowest channels
    pruned, then ``exponential_attn_grouped`` with one group (``topk_ratios=[λ]``, averaging): μ' = mean of the
    contributions strictly below the ``max(1, int(λ·D))``-th largest, pruned entries
    ``sign(k)·sqrt(μ'/‖q‖)``."""
    b, h, s, d = keys.shape
    q = window_queries.double().view(b, h, -1, *window_queries.shape[-2:]).mean(2)  # (B, H, W, D)
    q_norm = q.norm(dim=-2).unsqueeze(-2)  # (B, H, 1, D)
    k = keys.double()
    contributions = k.pow(2) * q_norm
    order = contributions.argsort(dim=-1, descending=True)
    mask = torch.ones_like(k, dtype=torch.bool).scatter_(-1, order[..., -int(ratio * d):], False)
    top = max(1, int(ratio * d))
    threshold = contributions.topk(top, dim=-1).values[..., -1:]
    low = contributions < threshold
    count = low.sum(-1, keepdim=True)
    mu = (contributions * low).sum(-1, keepdim=True) / (count + (count == 0))
    refill = torch.sqrt(mu / q_norm)
    return torch.where(mask, k, torch.where(k > 0, refill, -refill))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_fork_pool0_equals_the_forks_formula(head_dim, ratio):
    g = torch.Generator().manual_seed(head_dim)
    keys = torch.randn(1, 2, 50, head_dim, generator=g)
    window = torch.randn(1, 6, 32, head_dim, generator=g)  # GQA: 3 query heads per kv-head
    store = SparK(ratio=ratio, recovery="fork_pool0").compress_keys(keys, LayerPrefill(keys, keys, window))
    expected = _fork_pool0_float64(keys, window, ratio)
    torch.testing.assert_close(store.materialize().double(), expected, rtol=1e-5, atol=1e-5)
    degenerate = SparK(ratio=ratio).compress_keys(keys, LayerPrefill(keys, keys, window))
    same = torch.allclose(store.materialize(), degenerate.materialize())
    assert same == (ratio == 0.5)  # the averaged sets coincide at λ = 0.5 only
    assert store.nbytes() == degenerate.nbytes()  # μ' per token + the same signs, norms, kept entries and mask
    queries = torch.randn(1, 2, 3, head_dim, generator=g)
    torch.testing.assert_close(dispatch.compact_logits(store, queries), store.logits(queries), rtol=1e-4, atol=1e-4)


def test_fork_pool0_needs_the_official_saliency():
    with pytest.raises(ValueError, match="needs saliency=official"):
        SparK(ratio=0.8, saliency="paper", recovery="fork_pool0")
