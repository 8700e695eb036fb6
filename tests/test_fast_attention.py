"""The compact SparK decode kernel (a one-store segment table) equals the dense reference for every recovery it
supports, every variant included (SparK-p / -g: tokens keep different counts); others fall back."""

import pytest
import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.channel.spark import SparK
from spark_bench.storage import dispatch, fast_logits
from spark_bench.storage.stores import UnstructuredStore

SUPPORTED = [dict(saliency="official"), dict(saliency="paper"), dict(recovery="zero"), dict(recovery="none"),
             dict(recovery="constant", constant=0.01), dict(saliency="paper", recovery="constant"),
             dict(variant="top_p"), dict(variant="group", recovery="zero")]  # (ragged: tokens keep different counts)


def _store(dtype, head_dim, group, ratio=0.8, seq=300, **options):
    g = torch.Generator().manual_seed(head_dim + group)
    keys = torch.randn(1, 2, seq, head_dim, generator=g).to(dtype)
    window = torch.randn(1, 2 * group, 32, head_dim, generator=g).to(dtype)
    store = SparK(ratio=ratio, **options).compress_keys(keys, LayerPrefill(keys, torch.zeros_like(keys), window))
    return store, torch.randn(1, 2, group, head_dim, generator=g).to(dtype)


def _float64_reference(store: UnstructuredStore, queries: torch.Tensor) -> torch.Tensor:
    """q·k̃ in float64 with the recovered entries computed in float32 (no rounding to the model dtype)."""
    mask = store.kept_mask()
    keys = store.recovery.fill(mask, torch.float32).masked_scatter(mask, store.kept.float())
    return queries.double() @ keys.double().transpose(-1, -2)


@pytest.fixture(scope="module")
def kernel():
    k = fast_logits.load_kernel()
    if isinstance(k, str):
        pytest.fail(f"the compact kernel must build here (make installs ninja and a compiler is present): {k}")
    return k


@pytest.mark.parametrize("options", SUPPORTED, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4), (64, 1), (128, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(kernel, options, head_dim, group, dtype):
    store, queries = _store(dtype, head_dim, group, **options)
    assert dispatch.kernel_blocker(store, queries.device) is None
    fast = dispatch.compact_logits(store, queries).double()
    ref = _float64_reference(store, queries)
    assert torch.allclose(fast, ref, rtol=1e-4, atol=1e-4), (fast - ref).abs().max()
    if dtype == torch.float32:  # and the store's own reference path (rebuild keys, then matmul)
        assert torch.allclose(fast, store.logits(queries).double(), atol=1e-4)


@pytest.mark.parametrize("options,reason", [
    (dict(recovery="gaussian"), "GaussianScores draws a random score"),
    (dict(recovery="exponential"), "ExponentialScores draws a random score"),
])
def test_unsupported_recoveries_fall_back_visibly(kernel, options, reason):
    store, queries = _store(torch.float32, 64, 3, **options)
    dispatch._seen_fallbacks.discard(next((r for r in dispatch.fallback_reasons() if reason in r), ""))
    with pytest.warns(UserWarning, match=reason):
        out = dispatch.compact_logits(store, queries)
    assert torch.equal(out, dispatch.reference_logits(store, queries))
    assert any(reason in r for r in dispatch.fallback_reasons())
