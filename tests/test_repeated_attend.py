"""A batched layer attended twice after one update (what a timing loop does, ``scripts/gpu/check.py``'s fused-layer
section): on the fused path (the Triton kernels under the CPU interpreter) the second attend gives the first's
output, advances the device-held tail length once and writes nothing new; an attend with no update before it is
refused in one line."""

import pytest
import torch
from conftest import DEVICE

from spark_bench.engine import cache as cache_module
from spark_bench.methods import MethodConfig, Pipeline

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="forces the Triton path onto CPU tensors")

CONFIGS = [MethodConfig(name="snapkv", budget=64), MethodConfig(name="snapkv+spark", budget=64, ratio=0.8)]


def _layers(prefill, **kwargs):
    selections = {}
    caches = [Pipeline.from_config(c).build_cache(prefill, selections=selections)[0] for c in CONFIGS]
    return cache_module.BatchedLayer([c.layers[0] for c in caches], 4, **kwargs)


def test_a_repeated_attend_is_the_first_and_writes_nothing_new(monkeypatch, tiny_lm, tiny_prefill):
    pytest.importorskip("triton")
    monkeypatch.setattr(cache_module, "compact_backend", lambda device: "triton")
    layer, reference = _layers(tiny_prefill), _layers(tiny_prefill, mode="materialize")
    assert layer.backend == "triton" and layer.kernel_writes_tail and not layer.loose
    r, h, d = len(CONFIGS), layer.tail_keys.shape[1], layer.tail_keys.shape[-1]
    g = torch.Generator().manual_seed(3)
    for step in range(2):  # the second step: the tail the repeated attends left behind is still right
        keys, values = torch.randn(r, h, 1, d, generator=g), torch.randn(r, h, 1, d, generator=g)
        query = torch.randn(r, 2 * h, 1, d, generator=g)
        layer.update(keys, values)
        reference.update(keys, values)
        first = layer.attend(query, 0.25)
        tail = layer.tail_keys[:, :, :layer.length].clone(), layer.tail_values[:, :, :layer.length].clone()
        again = layer.attend(query, 0.25)
        assert torch.equal(again, first)
        assert int(layer.length_t) == layer.length == step + 1  # advanced once per update
        assert torch.equal(layer.tail_keys[:, :, :layer.length], tail[0])
        assert torch.equal(layer.tail_values[:, :, :layer.length], tail[1])
        assert torch.equal(tail[0][:, :, -1:], keys) and torch.equal(tail[1][:, :, -1:], values)
        expected = reference.attend(query, 0.25)
        assert (first - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_an_attend_before_any_update_is_refused_in_one_line(monkeypatch, tiny_lm, tiny_prefill):
    pytest.importorskip("triton")
    monkeypatch.setattr(cache_module, "compact_backend", lambda device: "triton")
    layer = _layers(tiny_prefill)
    h, d = layer.tail_keys.shape[1], layer.tail_keys.shape[-1]
    with pytest.raises(ValueError) as error:
        layer.attend(torch.randn(len(CONFIGS), 2 * h, 1, d), 0.25)
    assert str(error.value) == ("BatchedLayer.attend: 1 new token(s) to attend but the tail holds 0; call update() "
                                "with the step's keys and values first")
