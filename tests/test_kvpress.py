"""kvpress beside spark-bench (methods/eviction/kvpress_scorer.py): a kvpress press as the eviction stage.

Without channel pruning the harness gives kvpress' own greedy tokens (kvpress' press alone, ``with press(model):
model.generate``, against ``with spark_bench.press(model, press): model.generate``) on the embedded SmolLM2; with
SparK the same press's tokens are channel-pruned into the compact stores (fewer bytes), from the library and the
command line. The kvpress tests run where kvpress is installed (``make test-compat``'s environment) and skip,
saying so, elsewhere; the matching of kept keys needs no kvpress and runs everywhere."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import spark_bench
from spark_bench.methods.eviction.kvpress_scorer import kept_positions

SKIP = "kvpress is not installed here: make test-compat runs these (pip install 'spark-bench[kvpress]')"
needs_kvpress = pytest.mark.skipif(importlib.util.find_spec("kvpress") is None, reason=SKIP)  # before any fixture
TEXT = ("The secret code of the vault is 4521. Remember it well. " * 4
        + "Birds sang and the river ran all day long. " * 4 + "What is the secret code of the vault? The code is")


def test_kept_positions_finds_each_kept_key_exactly_and_refuses_changed_keys():
    keys = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(0))
    order = torch.stack([torch.randperm(40, generator=torch.Generator().manual_seed(h))[:12] for h in range(2)])[None]
    kept = keys.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, 8))   # kvpress gathers in top-k (score) order
    assert torch.equal(kept_positions(keys, kept), order.sort(dim=-1).values)
    assert torch.equal(kept_positions(keys, keys), torch.arange(40).expand(1, 2, 40))
    with pytest.raises(ValueError, match="changes the keys it keeps"):
        kept_positions(keys, kept * torch.tensor([1.0] * 4 + [0.0] * 4))  # ThinK-style zeroed channels
    with pytest.raises(ValueError, match="not a selection of tokens"):
        kept_positions(keys, kept[..., :4])


def _greedy(model, ids, n=8):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def prompt(smollm2):
    return smollm2.tokenizer(TEXT, return_tensors="pt").input_ids.to(smollm2.model.device)


@needs_kvpress
@pytest.mark.parametrize("make", ["KnormPress(0.5)", "SnapKVPress(0.5, window_size=16)",
                                  "ExpectedAttentionPress(0.5)"])
def test_a_press_alone_gives_kvpress_own_tokens_and_with_spark_fewer_bytes(smollm2, prompt, make):
    kvpress = pytest.importorskip("kvpress", reason=SKIP)
    model = smollm2.model
    press = eval(f"kvpress.{make}")
    with press(model):                                  # kvpress itself: its hooks prune the dense cache
        reference = _greedy(model, prompt)
    with spark_bench.press(model, press) as alone:     # the same press through spark-bench's compact stores
        ours = _greedy(model, prompt)
    assert ours == reference
    kept = alone.context.cache.layers[0].key_store.length
    assert kept == kvpress.utils.compute_n_kept(prompt.shape[1], 0.5)  # kvpress' own count of kept tokens
    with spark_bench.press(model, press, ratio=0.8) as pruned:
        assert len(_greedy(model, prompt, 2)) == 2
    assert pruned.context.cache.layers[0].key_store.length == kept
    assert pruned.context.kv_bytes < alone.context.kv_bytes and pruned.context.key_ratio == pytest.approx(0.8, abs=0.01)
    assert pruned.context.label == f"kvpress:{make.split('Press')[0]}+SparK(0.8) @0.5"


@needs_kvpress
def test_per_layer_and_composed_presses_keep_kvpress_own_tokens(smollm2, prompt):
    kvpress = pytest.importorskip("kvpress", reason=SKIP)
    model = smollm2.model
    n = model.config.num_hidden_layers
    for press in (kvpress.PerLayerCompressionPress(kvpress.KnormPress(), [0.25 + 0.5 * (i % 2) for i in range(n)]),
                  kvpress.ComposedPress([kvpress.KnormPress(0.2), kvpress.SnapKVPress(0.3, window_size=16)])):
        with press(model):
            reference = _greedy(model, prompt)
        with spark_bench.press(model, press) as record:
            assert _greedy(model, prompt) == reference
        lengths = [layer.key_store.length for layer in record.context.cache.layers]
        if isinstance(press, kvpress.PerLayerCompressionPress):
            assert lengths[:2] == [kvpress.utils.compute_n_kept(prompt.shape[1], r) for r in (0.25, 0.75)]
    with pytest.raises(ValueError, match="changes the keys it keeps"), \
            spark_bench.press(model, kvpress.ThinKPress(key_channel_compression_ratio=0.5)):
        _greedy(model, prompt, 1)


@needs_kvpress
def test_the_command_line_sweeps_kvpress_presses_beside_snapkv(tmp_path, console):
    pytest.importorskip("kvpress", reason=SKIP)
    (tmp_path / "conf" / "sweep").mkdir(parents=True)
    (tmp_path / "conf" / "sweep" / "kv.yaml").write_text(
        "configs:\n  - {name: snapkv+spark, ratio: 0.8}\n  - {name: 'kvpress:knorm'}\n"
        "  - {name: 'kvpress:knorm+spark', ratio: 0.8}\n"
        "  - {name: 'kvpress:snapkv+think', ratio: 0.5, kvpress: {window_size: 16}}\n")
    common = ["model=tiny-llama", "budget=0.5", "benchmark.tasks=[niah_single_1]", "benchmark.length=320",
              "benchmark.num_samples=1", "benchmark.max_new_tokens=2", f"output_root={tmp_path}"]
    env = {**os.environ, "CI": "1"}
    proc = subprocess.run([sys.executable, "-m", "spark_bench.cli", "sweep=kv",
                           f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "run=kv", *common],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import pandas as pd

    scores = pd.read_csv(tmp_path / "kv" / "scores.csv").set_index("config")
    assert list(scores.index) == ["SnapKV+SparK(0.8) @0.5", "kvpress:Knorm @0.5", "kvpress:Knorm+SparK(0.8) @0.5",
                                  "kvpress:SnapKV+ThinK(0.5) @0.5"]
    assert scores["prefill_s"].nunique() == 1  # one shared prefill
    assert scores.loc["kvpress:Knorm+SparK(0.8) @0.5", "kv_bytes"] < scores.loc["kvpress:Knorm @0.5", "kv_bytes"]
    assert scores.loc["kvpress:Knorm+SparK(0.8) @0.5", "kv_bytes"] == scores.loc["SnapKV+SparK(0.8) @0.5", "kv_bytes"]
    # the single press and the refusals through the console script's own start in this process (the sweep above is
    # the real process)
    code, _, err = console(["method=kvpress:snapkv+spark", "ratio=0.8", "kvpress={window_size:16,kernel_size:3}",
                            "run=one", *common])
    assert code == 0, err[-2000:]
    assert "kvpress:SnapKV+SparK(0.8) @0.5" in (tmp_path / "one" / "table.md").read_text()
    for bad, said in (("method=kvpress:nope+spark", "no such kvpress press"),
                      ("kvpress={wnd:3}", "SnapKVPress has no option wnd; its options: ")):
        args = [bad, "method=kvpress:snapkv"] if bad.startswith("kvpress=") else [bad]
        code, _, err = console([*args, "ratio=0.8", *common])
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err[-1000:]
