"""A method of one's own, without editing spark-bench: a class on methods/base.py's interface in a module of its own
and a method config naming it (``_target_``) on Hydra's search path; it composes with SparK by name
(``my_method+spark``), sweeps beside the paper's methods over the shared prefill, and reports bytes and scores,
from the command line and the library."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import spark_bench
from spark_bench.methods import registry
from spark_bench.methods.base import gather_tokens

MODULE = '''
from dataclasses import dataclass

from spark_bench.methods.base import EvictionMethod, TokenSelection, resolve_budget


@dataclass(frozen=True)
class TopValueNorm(EvictionMethod):
    """Keep the tokens whose values have the largest norm, and the last token."""

    budget: float
    rounding: str = "exact"
    power: int = 2

    def select(self, layer, layer_idx, num_layers):
        s = layer.keys.shape[2]
        n = resolve_budget(self.budget, s, self.rounding)
        if n >= s:
            return None
        scores = layer.values.float().norm(p=self.power, dim=-1)
        scores[..., -1] = float("inf")
        return TokenSelection(scores.topk(n, dim=-1).indices.sort(dim=-1).values)
'''


@pytest.fixture
def own_method(tmp_path, monkeypatch):
    """``my_methods.py`` and ``conf/method/my_method.yaml`` (+ a sweep beside SnapKV) in a temporary directory."""
    (tmp_path / "my_methods.py").write_text(MODULE)
    (tmp_path / "conf" / "method").mkdir(parents=True)
    (tmp_path / "conf" / "method" / "my_method.yaml").write_text("name: my_method\n_target_: my_methods.TopValueNorm\n"
                                                                 "power: 1\n")
    (tmp_path / "conf" / "sweep").mkdir()
    (tmp_path / "conf" / "sweep" / "mine.yaml").write_text(textwrap.dedent("""\
        configs:
          - {name: snapkv+spark, ratio: 0.8}
          - {name: my_method}
          - {name: my_method+spark, ratio: 0.8}
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    registry.set_search_dirs([])
    registry._REGISTERED.pop("my_method", None)


def test_the_command_line_sweeps_it_beside_snapkv(own_method, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "spark_bench.cli", "model=tiny-llama", "sweep=mine",
           f"hydra.searchpath=[file://{own_method / 'conf'}]", "budget=64", "benchmark.tasks=[niah_single_1]",
           "benchmark.length=320", "benchmark.num_samples=1", "benchmark.max_new_tokens=2", f"output_root={out}",
           "run=mine"]
    env = {**os.environ, "PYTHONPATH": f"{own_method}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "CI": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import pandas as pd

    scores = pd.read_csv(out / "mine" / "scores.csv").set_index("config")
    assert list(scores.index) == ["SnapKV+SparK(0.8) @64", "my_method @64", "my_method+SparK(0.8) @64"]
    assert scores["prefill_s"].nunique() == 1  # one prefill per sample, shared by the three configs
    # my_method keeps 64 tokens per head in every layer: its bytes are the 64 tokens' keys and values; SparK(0.8)
    # then stores 20% of the key channels (+ its recovery statistics), the same bytes as SnapKV+SparK at 64
    assert scores.loc["my_method+SparK(0.8) @64", "kv_bytes"] < scores.loc["my_method @64", "kv_bytes"]
    assert scores.loc["my_method+SparK(0.8) @64", "kv_bytes"] == scores.loc["SnapKV+SparK(0.8) @64", "kv_bytes"]
    assert scores.loc["my_method+SparK(0.8) @64", "key_ratio"] == scores.loc["SnapKV+SparK(0.8) @64", "key_ratio"] > 0.7
    assert scores["answer_nll"].notna().all() and "my_method+SparK(0.8) @64" in (out / "mine" / "table.md").read_text()
    unknown = subprocess.run([*cmd[:4], "method=not_mine+spark", "ratio=0.8", f"output_root={out}"],
                             capture_output=True, text=True, timeout=120, env=env)
    assert unknown.returncode == 2 and "unknown method 'not_mine+spark'" in unknown.stderr


def test_the_library_builds_it_by_name_and_its_tokens_are_its_own(own_method, tiny_lm):
    registry.set_search_dirs([own_method / "conf"])
    config = spark_bench.method("my_method+spark", ratio=0.8, budget=48)
    assert config.label == "my_method+SparK(0.8) @48"
    ids = torch.randint(100, 5000, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    alone, pruned = spark_bench.compress(tiny_lm.model, ids, [spark_bench.method("my_method", budget=48), config])
    first = alone.cache.layers[0]
    keys = first.key_store.materialize()
    # the stored tokens are those of the largest value L1 norms (power: 1 from the yaml), the last token kept
    from spark_bench.engine.prefill import run_prefill

    prefill = run_prefill(tiny_lm.model, torch.tensor([ids], device=tiny_lm.device), window=32)
    scores = prefill.layers[0].values.float().norm(p=1, dim=-1)
    scores[..., -1] = float("inf")
    expected = scores.topk(48, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(keys, gather_tokens(prefill.layers[0].keys, expected))
    assert pruned.kv_bytes < alone.kv_bytes and pruned.key_ratio > 0.7
    registry.register("my_method_too", "my_methods:TopValueNorm", power=3)
    assert spark_bench.method("my_method_too+think", ratio=0.5).label == "my_method_too+ThinK(0.5) @0.2"
    with pytest.raises(ValueError, match="not a subclass"):
        registry.register("bad", "os:getcwd")
