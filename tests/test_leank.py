"""LeanK (issue 53 item 2): its mask files (spark-bench's JSON and the authors' release format) read, written and
refused in one line; ``method=leank`` equal to the full cache under an all-ones mask and to ThinK's structured
pruning with the same channel set; ``spark-bench-leank`` training a mask on the tiny model and resuming."""

from __future__ import annotations

import json
import sys

import conftest
import numpy as np
import pytest
import torch

import spark_bench.cli as cli
from spark_bench.engine.decode import greedy_decode
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.channel.leank import LeanK, LeanKMask, MaskFileError, align_mask, read_mask, write_mask
from spark_bench.methods.channel.think import ThinK

MASK = conftest.ROOT / "tests" / "fixtures" / "leank" / "tiny-llama.json"  # heads keep 8, 4, 16 and 0 channels
BASE = ["model=tiny-llama", "benchmark.tasks=[niah_single_1]", "benchmark.num_samples=2", "benchmark.length=512",
        "benchmark.max_new_tokens=8", "progress=false"]


def _mask(kept) -> LeanKMask:
    return LeanKMask(torch.as_tensor(kept, dtype=torch.bool), None)


# ---- mask files -----------------------------------------------------------------------------------------------------

def test_mask_file_round_trip_and_the_release_format(tmp_path):
    mask = read_mask(MASK)
    assert mask.shape == (2, 2, 16) and mask.align == 4 and mask.counts().tolist() == [[8, 4], [16, 0]]
    assert mask.ratio == 1 - 28 / 64
    again = read_mask(write_mask(mask, tmp_path / "again.json", model="tiny-llama"))
    assert torch.equal(again.kept, mask.kept) and again.align == 4
    # LeanK's release format (minference/configs/leank/*.pth): torch.save of a float32 (L, H, D) tensor of 0/1,
    # head counts multiples of 32; what patch_leank loads
    kept = torch.zeros(3, 2, 128)
    kept[0, 0, :32] = kept[1, 1, 32:96] = kept[2, 0, ::2] = 1
    torch.save(kept, tmp_path / "release.pth")
    release = read_mask(tmp_path / "release.pth")
    assert torch.equal(release.kept, kept.bool()) and release.align is None
    assert release.counts().tolist() == [[32, 0], [0, 64], [64, 0]]
    # what LeanK's train.py saves (a numpy bool array) and a list of per-layer tensors read as the same mask
    torch.save(kept.bool().numpy(), tmp_path / "numpy.pth")
    torch.save(list(kept), tmp_path / "list.pth")
    for name in ("numpy.pth", "list.pth"):
        assert torch.equal(read_mask(tmp_path / name).kept, kept.bool())
    # ours written in the release format: the same float32 0/1 tensor
    write_mask(mask, tmp_path / "ours.pth")
    assert torch.equal(torch.load(tmp_path / "ours.pth", weights_only=True), mask.kept.float())


def _json(tmp_path, **change):
    data = {**json.loads(MASK.read_text()), **change}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


BAD_FILES = {
    "scaling factors, not a mask": (lambda p: torch.save(torch.rand(2, 2, 16), p / "f.pth") or p / "f.pth",
                                    "entries are neither 0 nor 1"),
    "complex dtype": (lambda p: torch.save(torch.ones(2, 2, 16, dtype=torch.complex64), p / "c.pth") or p / "c.pth",
                      "dtype complex64; a mask is bool, integer or float of 0/1"),
    "2-D shape": (lambda p: torch.save(torch.ones(2, 32), p / "s.pth") or p / "s.pth",
                  "a mask of shape (2, 32); a mask is (layers, kv_heads, head_dim)"),
    "keeps nothing": (lambda p: torch.save(torch.zeros(2, 2, 16), p / "z.pth") or p / "z.pth",
                      "the mask keeps no channel at all (ratio 1)"),
    "ratio not its mask's": (lambda p: _json(p, ratio=0.7), "says ratio 0.7 but its mask prunes 0.5625"),
    "ratio out of range": (lambda p: _json(p, ratio=1.5), "ratio 1.5; the pruned fraction is a number >= 0 and < 1"),
    "alignment broken": (lambda p: _json(p, align=8), "says align 8 but layer 0, kv-head 1 keeps 4 channels"),
    "channel out of range": (lambda p: _json(p, kept=[[[1, 16], [0]], [[0], [2]]]),
                             "layer 0, kv-head 0: the kept channels are ascending distinct integers in [0, 16)"),
    "not a mask at all": (lambda p: (p / "t.pth").write_bytes(b"PK\x03\x04 damaged") and p / "t.pth",
                          "torch.load (weights only) cannot read it"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_mask_file_is_one_line(case, tmp_path):
    make, message = BAD_FILES[case]
    path = make(tmp_path)
    with pytest.raises(MaskFileError) as err:
        read_mask(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"leank.mask={path}: ") and message in text, text


def test_the_command_line_refuses_a_mask_of_another_shape_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """One line naming leank.mask and the shape the model needs, exit 2, nothing written, no model loaded."""
    kept = torch.ones(3, 2, 16)
    torch.save(kept, tmp_path / "three_layers.pth")
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for mask, message in ((tmp_path / "three_layers.pth", "the mask is 3 × 2 × 16 (layers × kv-heads × head_dim) but "
                           "model tiny-llama has 2 × 2 × 16"), (None, "leank needs leank.mask=<file>")):
        given = [f"leank.mask={mask}"] if mask else []
        monkeypatch.setattr(sys, "argv", ["spark-bench", *BASE, "method=leank", *given,
                                          f"output_root={tmp_path / 'out'}"])
        with pytest.raises(SystemExit) as exit_:
            cli.main()
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and "\n" not in err and message in err, err
        assert not (tmp_path / "out").exists()


def test_leank_reads_no_ratio_and_labels_with_its_masks():
    config = MethodConfig(name="snapkv+leank", budget=64, leank={"mask": str(MASK)})
    assert config.label == "SnapKV+LeanK(0.56) @64" and config.to_dict()["leank"] == {"mask": str(MASK),
                                                                                         "recent": 768}
    from spark_bench.methods.config import ratio_needed, unread_option

    assert ratio_needed(MethodConfig(name="leank")) is None
    assert "ratio=0.5 is not read by leank" in unread_option(MethodConfig(name="leank", ratio=0.5), ["ratio"])
    with pytest.raises(ValueError, match="unknown key.s. leank.recnt; valid: leank.mask, leank.recent"):
        MethodConfig(name="leank", leank={"recnt": 4})


# ---- what it computes -------------------------------------------------------------------------------------------

def test_the_alignment_rule_is_leanks(tmp_path):
    """LeanK's sparsify_scaling_factors by hand: the 0.5 quantile of the 8 scales is 0.35 (linear), so each head
    has two above it; align 2 keeps those two, align 4 rounds 2 up to 4 (half up) and keeps all."""
    scales = torch.tensor([[[0.9, 0.1, 0.8, 0.2], [0.3, 0.4, 0.05, 0.6]]])
    assert align_mask(scales, 0.5, 2).tolist() == [[[True, False, True, False], [False, True, False, True]]]
    assert bool(align_mask(scales, 0.5, 4).all())
    assert align_mask(scales, 0.9, 2).sum().item() == 2  # one head keeps 0: (1 + 1) // 2 * 2 = 2, the other 0


def test_an_all_ones_mask_is_the_full_cache(tiny_lm, tiny_prefill, tmp_path):
    write_mask(_mask(torch.ones(2, 2, 16)), tmp_path / "ones.json")
    leank = MethodConfig(name="leank", leank={"mask": str(tmp_path / "ones.json"), "recent": 0})
    cache, _ = Pipeline.from_config(leank).build_cache(tiny_prefill)
    full, _ = Pipeline.from_config(MethodConfig(name="full")).build_cache(tiny_prefill)
    for stored, layer in zip(cache.layers, tiny_prefill.layers):
        assert torch.equal(stored.key_store.materialize(), layer.keys)
        q = torch.randn(1, 2, 2, 16, generator=torch.Generator().manual_seed(0)).to(layer.keys.device)
        assert torch.equal(stored.key_store.logits(q), q @ layer.keys.transpose(-1, -2))
    n = tiny_prefill.prompt_length
    assert greedy_decode(tiny_lm.model, cache, tiny_prefill.first_logits, n, 6, frozenset()) == \
        greedy_decode(tiny_lm.model, full, tiny_prefill.first_logits, n, 6, frozenset())


def test_a_given_mask_is_the_reference_masked_computation(tiny_lm, tiny_prefill):
    """Older keys × mask (a head pruned whole reads zeros, a whole head its keys), the last ``recent`` dense: the
    store's keys and logits are exactly that; the compact decode gives the tokens of the dense reference."""
    mask = read_mask(MASK)
    config = MethodConfig(name="snapkv+leank", budget=96, leank={"mask": str(MASK), "recent": 16})
    pipeline = Pipeline.from_config(config)
    cache, _ = pipeline.build_cache(tiny_prefill)
    evicted, _ = pipeline.evict(tiny_prefill)
    for i, (stored, (keys, _, _)) in enumerate(zip(cache.layers, evicted)):
        s = keys.shape[-2]
        reference = torch.cat([keys[..., : s - 16, :] * mask.kept[i].to(keys.device).unsqueeze(-2),
                               keys[..., s - 16:, :]], dim=-2)
        assert torch.equal(stored.key_store.materialize(), reference)
        q = torch.randn(1, 2, 2, 16, generator=torch.Generator().manual_seed(i)).to(keys.device)
        assert torch.allclose(stored.key_store.logits(q), q @ reference.transpose(-1, -2), atol=1e-5)
        # bytes as ThinK's: kept entries (each layer's heads padded to its largest count), indices, dense recent
        t = int(mask.counts()[i].max())
        assert stored.key_store.kept.shape[-1] == t and stored.key_store.nbytes() == (
            (s - 16) * 2 * t * 4 + 2 * t + 16 * 2 * 16 * 4)
    reference_cache, _ = pipeline.build_cache(tiny_prefill, attention="materialize")
    n = tiny_prefill.prompt_length
    assert greedy_decode(tiny_lm.model, cache, tiny_prefill.first_logits, n, 6, frozenset()) == \
        greedy_decode(tiny_lm.model, reference_cache, tiny_prefill.first_logits, n, 6, frozenset())


def test_with_equal_counts_it_is_thinks_store_for_the_same_channels(tiny_prefill, tmp_path, monkeypatch):
    """Every head keeping 4 channels: LeanK's store is exactly the one ThinK(0.75) builds when its scores pick the
    same channels (the structured store, member kind and bytes are ThinK's)."""
    kept = torch.zeros(2, 2, 16, dtype=torch.bool)
    for i, h in np.ndindex(2, 2):
        kept[i, h, torch.randperm(16, generator=torch.Generator().manual_seed(4 * i + h))[:4]] = True
    write_mask(_mask(kept), tmp_path / "four.json")
    leank = LeanK(mask=str(tmp_path / "four.json"), recent=32)
    think = ThinK(ratio=0.75, window_size=32, keep_window=True)
    for i, layer in enumerate(tiny_prefill.layers):
        monkeypatch.setattr(ThinK, "channel_scores", lambda self, old, lay, i=i: kept[i].float().expand(
            old.shape[0], -1, -1).to(old.device))
        ours, theirs = leank.compress_keys(layer.keys, layer, i), think.compress_keys(layer.keys, layer, i)
        assert type(ours) is type(theirs)
        for name in ("kept", "channels", "recent"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
        assert ours.nbytes() == theirs.nbytes()


# ---- training -----------------------------------------------------------------------------------------------------

TRAIN = [*BASE, "leank_train.align=4", "leank_train.ratio=0.7", "leank_train.stage1_steps=3",
         "leank_train.stage2_steps=2", "leank_train.sink=4", "leank_train.recent=32", "leank_train.save_steps=2"]


def _train(monkeypatch, out, *extra):
    from spark_bench.leank import command

    monkeypatch.setattr(sys, "argv", ["spark-bench-leank", *TRAIN, f"leank_train.out={out}", *extra])
    command.main()


def test_training_writes_a_mask_of_the_model_shape_and_resumes(tmp_path, monkeypatch, capsys):
    from spark_bench.leank import train

    out = tmp_path / "leank"
    _train(monkeypatch, out)
    mask = read_mask(out / "mask.json")
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert mask.shape == (2, 2, 16) and mask.align == 4 and bool((mask.counts() % 4 == 0).all())
    assert torch.equal(mask.kept, align_mask(state["scales"], 0.7, 4))  # LeanK's rule on the final scales
    assert state["stage"] == 2 and state["step"] == 2 and state["stage1_scales"].shape == (2, 2, 16)
    log = json.loads((out / "train_log.json").read_text())
    assert [(r["stage"], r["step"]) for r in log["history"]] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2)]
    assert log["ratio"] == pytest.approx(mask.ratio, abs=1e-6) and len(log["examples"]) == 2
    assert all(0 <= r["kept"] <= 1 for r in log["history"] if r["stage"] == 2)

    # a run stopped after stage 1's third step resumes from its checkpoint to the same scales and mask
    crash_out = tmp_path / "crash"
    original = train.Trainer.train_step
    calls = []

    def stop_after_three(self):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return original(self)

    monkeypatch.setattr(train.Trainer, "train_step", stop_after_three)
    with pytest.raises(SystemExit) as exit_:
        _train(monkeypatch, crash_out)
    assert exit_.value.code == 130
    assert torch.load(crash_out / "checkpoint.pt", weights_only=True)["stage"] == 2  # saved at stage 1's end
    monkeypatch.setattr(train.Trainer, "train_step", original)
    capsys.readouterr()
    _train(monkeypatch, crash_out)
    assert "resumed at stage 2, step 0" in capsys.readouterr().err
    resumed = torch.load(crash_out / "checkpoint.pt", weights_only=True)
    assert torch.equal(resumed["scales"], state["scales"])
    assert torch.equal(read_mask(crash_out / "mask.json").kept, mask.kept)

    # a rerun with other settings is refused before the model loads: one line, exit 2
    with pytest.raises(SystemExit) as exit_:
        _train(monkeypatch, crash_out, "leank_train.ratio=0.5")
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err and "was made with ratio=0.7" in err, err

    # masks at other ratios share that stage 1: stage 2 from out's checkpoint is a whole run at that ratio
    _train(monkeypatch, tmp_path / "at_05_whole", "leank_train.ratio=0.5")
    _train(monkeypatch, tmp_path / "at_05", "leank_train.ratio=0.5", f"leank_train.stage1={out}")
    whole = torch.load(tmp_path / "at_05_whole" / "checkpoint.pt", weights_only=True)
    shared = torch.load(tmp_path / "at_05" / "checkpoint.pt", weights_only=True)
    assert torch.equal(shared["stage1_scales"], state["stage1_scales"])
    assert torch.equal(shared["scales"], whole["scales"]) and shared["history"] == whole["history"]
    capsys.readouterr()
    for extra, expected in ((f"leank_train.stage1={tmp_path / 'nowhere'}", "is not a file"),
                            (f"leank_train.stage1={out}", "stage 1 was made with stage1_steps=3")):
        with pytest.raises(SystemExit) as exit_:
            _train(monkeypatch, tmp_path / "refused", "leank_train.stage1_steps=4", extra)
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and "\n" not in err and expected in err and "leank_train.stage1" in err, err
    assert not (tmp_path / "refused").exists()
