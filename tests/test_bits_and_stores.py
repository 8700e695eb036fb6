import itertools

import pytest
import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.channel.spark import SparK
from spark_bench.methods.channel.think import ThinK
from spark_bench.storage.bits import masked_entries, pack_bits, tensor_bytes, unpack_bits


@pytest.mark.parametrize("n", [1, 7, 8, 13, 64, 102])
def test_pack_unpack_roundtrip(n):
    bits = torch.rand(2, 3, 5, n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == (n + 7) // 8
    assert torch.equal(unpack_bits(packed, n), bits)


def test_pack_bits_every_byte_by_hand_and_unaligned_inputs():
    # all 256 patterns against the plain weighted sum Σ_i bit_i·2^i (the multiply-gather must never carry)
    patterns = torch.tensor(list(itertools.product([False, True], repeat=8)))
    expected = [sum(1 << i for i, bit in enumerate(row) if bit) for row in patterns.tolist()]
    assert pack_bits(patterns).squeeze(-1).tolist() == expected
    # a view starting at an odd offset, and a non-contiguous one, pack like their copies
    flat = torch.rand(203, generator=torch.Generator().manual_seed(1)) > 0.5
    assert torch.equal(pack_bits(flat[3:131]), pack_bits(flat[3:131].clone()))
    grid = flat[:200].view(10, 20)
    assert torch.equal(pack_bits(grid.t()), pack_bits(grid.t().contiguous()))
    assert torch.equal(unpack_bits(pack_bits(grid.t()), 10), grid.t())


def test_masked_entries_equals_masked_select_and_checks_the_shape():
    g = torch.Generator().manual_seed(2)
    data, mask = torch.randn(2, 3, 7, 16, generator=g), torch.rand(2, 3, 7, 16, generator=g) > 0.4
    assert torch.equal(masked_entries(data, mask), data.masked_select(mask))
    with pytest.raises(ValueError, match=r"mask of shape \(3, 16\) for data of shape \(2, 3, 7, 16\)"):
        masked_entries(data, mask[0, :, 0])


def _layer(keys, window_queries):
    return LayerPrefill(keys=keys, values=torch.zeros_like(keys), window_queries=window_queries)


# one token, D = 4, one head, W = 2 window queries: small enough to check by hand
KEYS = torch.tensor([[[[2.0, -1.0, 0.5, -3.0]]]])
QUERIES = torch.tensor([[[[1.0, 0.0, 2.0, 1.0], [1.0, 1.0, 0.0, 1.0]]]])


def test_official_degenerate_recovery_by_hand():
    # ‖q_c‖₂ = [√2, 1, 2, √2]; saliency k²·‖q‖ = [4√2, 1, 0.5, 9√2]; λ=0.5 prunes channels 1 and 2,
    # μ = (1 + 0.5) / 2 = 0.75; refill = sign(k)·sqrt(μ / ‖q_c‖): ch1 −sqrt(0.75), ch2 +sqrt(0.375)
    store = SparK(ratio=0.5, window_size=2, saliency="official").compress_keys(KEYS, _layer(KEYS, QUERIES))
    expected = torch.tensor([2.0, -(0.75 ** 0.5), (0.375) ** 0.5, -3.0])
    assert torch.allclose(store.materialize()[0, 0, 0], expected, atol=1e-6)
    assert store.kept.flatten().tolist() == [2.0, -3.0]
    assert store.recovery.sampler.mu.item() == pytest.approx(0.75)


def test_paper_degenerate_recovery_by_hand():
    # q̄ = [1, 0.5, 1, 1]; saliency |q̄|·|k| = [2, 0.5, 0.5, 3]; keep channels 0 and 3; μ = 0.5; refill μ / q̄_c
    store = SparK(ratio=0.5, window_size=2, saliency="paper").compress_keys(KEYS, _layer(KEYS, QUERIES))
    assert torch.allclose(store.materialize()[0, 0, 0], torch.tensor([2.0, 1.0, 0.5, -3.0]))
    # the refill reproduces the paper's ⟨q̄ʲ, k̃ʲ⟩ = μ
    q_bar = QUERIES.mean(dim=-2)[0, 0]
    refilled = store.materialize()[0, 0, 0]
    assert (q_bar[1] * refilled[1]).item() == pytest.approx(0.5)
    assert (q_bar[2] * refilled[2]).item() == pytest.approx(0.5)


def test_official_and_paper_keep_counts_differ_as_documented():
    assert SparK(ratio=0.8, saliency="official").n_keep(64) == 13  # D − int(0.8·64) = 64 − 51
    assert SparK(ratio=0.8, saliency="paper").n_keep(64) == 12     # ⌊0.2·64⌋
    assert SparK(ratio=0.8, saliency="official").n_keep(128) == 26
    assert SparK(ratio=0.8, saliency="paper").n_keep(128) == 25


def _random_layer(head_dim, seq=256, heads=2, q_heads=4, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(head_dim)
    keys = torch.randn(1, heads, seq, head_dim, generator=g).to(dtype)
    queries = torch.randn(1, q_heads, 32, head_dim, generator=g).to(dtype)
    return keys, _layer(keys, queries)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("saliency", ["official", "paper"])
def test_spark_store_bytes_at_0_8(head_dim, saliency):
    keys, layer = _random_layer(head_dim)
    store = SparK(ratio=0.8, saliency=saliency).compress_keys(keys, layer)
    ratio = store.nbytes() / tensor_bytes(keys)
    # kept values + D-bit mask + μ per token (+ sign bits of pruned entries, official) + per-head query stats
    assert ratio <= 0.35, ratio
    rows = keys.shape[1] * keys.shape[2]
    t = store.kept.numel() // rows
    signs = (rows * (head_dim - t) + 7) // 8 if saliency == "official" else 0  # one bit per pruned entry, packed
    assert store.nbytes() == rows * (2 * t + head_dim // 8 + 2) + signs + 4 * keys.shape[1] * head_dim


@pytest.mark.parametrize("head_dim", [64, 128])
def test_think_store_bytes_and_zero_fill(head_dim):
    keys, layer = _random_layer(head_dim)
    store = ThinK(ratio=0.8, keep_window=False).compress_keys(keys, layer)
    assert store.nbytes() / tensor_bytes(keys) <= 0.22
    dense = store.materialize()
    zero_cols = (dense == 0).all(dim=-2)  # pruned channels are zero for every token
    assert int(zero_cols.sum(-1)[0, 0]) == int(0.8 * head_dim)
    kept = ~zero_cols
    assert torch.equal(dense[..., kept[0, 0]][0, 0], keys[0, 0][:, kept[0, 0]])


def test_think_keeps_recent_window_dense():
    keys, layer = _random_layer(64)
    dense = ThinK(ratio=0.8, window_size=32, keep_window=True).compress_keys(keys, layer).materialize()
    assert torch.equal(dense[..., -32:, :], keys[..., -32:, :])
    assert (dense[..., :-32, :] == 0).any()


@pytest.mark.parametrize("method", [SparK(ratio=0.0), SparK(ratio=0.0, saliency="paper"), ThinK(ratio=0.0)])
def test_ratio_zero_materializes_exact_keys(method):
    keys, layer = _random_layer(64)
    assert torch.equal(method.compress_keys(keys, layer).materialize(), keys)


def test_spark_configs_sharing_keys_share_one_mask_and_build_the_same_stores():
    """The kept mask is memoised per (keys, saliency, keep rule) in the layer's memo: a second ratio-0.5 config with
    another recovery reuses it, and every store equals one built on a fresh memo; other keys or ratios never hit."""
    g = torch.Generator().manual_seed(3)
    keys, queries = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 4, 32, 16, generator=g)
    layer = _layer(keys, queries)
    configs = [SparK(ratio=0.5), SparK(ratio=0.5, recovery="none"), SparK(ratio=0.75),
               SparK(ratio=0.5, saliency="paper")]
    shared = [c.compress_keys(keys, layer) for c in configs]
    assert len([k for k in layer.memo if k[0] == "spark_mask"]) == 3  # two configs shared one entry
    for config, store in zip(configs, shared):
        alone = config.compress_keys(keys, _layer(keys, queries))
        assert torch.equal(store.kept, alone.kept) and torch.equal(store.mask_bits, alone.mask_bits)
        assert torch.equal(store.materialize(), alone.materialize())
    other = keys.clone()  # equal values, other tensor: no hit, a new entry
    SparK(ratio=0.5).compress_keys(other, layer)
    assert len([k for k in layer.memo if k[0] == "spark_mask"]) == 4
