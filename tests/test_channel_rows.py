"""Every channel method the registry lists (``spark_bench.methods.builtin.CHANNEL_METHODS``) is named, paired and
exported as one: alone it is a row of the full cache (no KV block, group ``Vanilla``), after an eviction method a
``+<Method> (λ)`` row of that method's group — LeanK and Mustafar as ThinK and SparK, with no list to extend."""

from __future__ import annotations

import torch

from spark_bench.methods.builtin import CHANNEL_METHODS
from spark_bench.methods.channel.leank import LeanKMask, write_mask
from spark_bench.report.frame import row_names
from spark_bench.report.kvpress_format import _key_channel_ratio
from spark_bench.tables import base_label


def _method(name: str, **values) -> dict:
    return {"name": name, "budget": 128, "ratio": 0.5, "value_ratio": 0.0, **values}


def _mask(tmp_path) -> dict:
    kept = torch.zeros(2, 1, 8, dtype=torch.bool)
    kept[..., :2] = True  # keeps 2 of 8 channels: prunes 0.75
    return {"mask": str(write_mask(LeanKMask(kept), tmp_path / "mask.json")), "recent": 768}


def test_a_channel_method_alone_is_a_full_cache_row(tmp_path):
    assert {"think", "spark", "mustafar", "leank"} <= set(CHANNEL_METHODS)
    leank = _mask(tmp_path)
    assert row_names(_method("leank", ratio=0.0, leank=leank)) == ("", "Vanilla", "LeanK (0.75)")
    assert row_names(_method("mustafar", value_ratio=0.3)) == ("", "Vanilla", "Mustafar (0.5+0.3)")
    assert row_names(_method("think")) == ("", "Vanilla", "ThinK (0.5)")
    assert row_names(_method("snapkv+leank", ratio=0.0, leank=leank)) == ("KV-size 128", "SnapKV", "+LeanK (0.75)")
    assert row_names(_method("snapkv+mustafar")) == ("KV-size 128", "SnapKV", "+Mustafar (0.5)")
    assert row_names(_method("snapkv")) == ("KV-size 128", "SnapKV", "SnapKV")
    assert row_names(_method("leank", leank={"mask": str(tmp_path / "gone.json")}))[2] == "LeanK (?)"


def test_a_channel_method_pairs_with_its_base_and_exports_its_key_ratio(tmp_path):
    leank = _mask(tmp_path)
    others = {"Full": _method("full"), "SnapKV @128": _method("snapkv")}
    for name in ("leank", "mustafar"):
        assert base_label(_method(name, leank=leank), others) == ["Full"]
        assert base_label(_method(f"snapkv+{name}", leank=leank), others) == ["SnapKV @128"]
    assert _key_channel_ratio(_method("leank", ratio=0.0, leank=leank)) == 0.75  # its mask's, not ``ratio``
    assert _key_channel_ratio(_method("snapkv+mustafar")) == 0.5
    assert _key_channel_ratio(_method("snapkv")) is None
