"""The motivation analyses (§4.1, Appendix B): the CV and top-T overlap by hand, the capture against the model's own
projections, the saliency command and the Fig. 2c / memory figures from tiny runs, and their start-up checks."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import DEVICE, ROOT, model_config
from omegaconf import OmegaConf
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from spark_bench.analysis import command, observation2
from spark_bench.analysis.saliency import channel_cv, contributions, kept_channels, top_overlap
from spark_bench.benchmarks.base import Sample
from spark_bench.checks import ConfigError
from spark_bench.engine.prefill import run_prefill
from spark_bench.methods import MethodConfig
from spark_bench.models import load_model
from spark_bench.runner import run_sweep
from test_protocol import _compose


def test_cv_of_a_hand_built_tensor():
    # channel 0: 1, 2, 3, 6 → μ = 3, σ² = (4 + 1 + 0 + 9) / 4 = 3.5; channel 1 constant; channel 2 never contributes
    c = torch.tensor([[1.0, 5.0, 0.0], [2.0, 5.0, 0.0], [3.0, 5.0, 0.0], [6.0, 5.0, 0.0]])
    cv = channel_cv(c)
    assert cv[0].item() == pytest.approx(math.sqrt(3.5) / 3)
    assert cv[1].item() == 0.0 and math.isnan(cv[2].item())
    batched = channel_cv(torch.stack([c, 2 * c]))  # scale-free, and per leading index
    torch.testing.assert_close(batched[1], cv, equal_nan=True)


def test_top_overlap_by_hand():
    # D = 4, λ = 0.5 → T = 2. Tokens keep {0,1}, {0,1}, {2,3}: pairs (t≠u, ordered) share 2, 0, 0 → Σ = 2·2 = 4
    # over 3·2 ordered pairs · T = 12 → 1/3. The head's best two channels by Σ c² are {0, 1}: recall (1 + 1 + 0)/3.
    c = torch.tensor([[[5.0, 4.0, 1.0, 0.0], [3.0, 6.0, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0]]])
    overlap, recall = top_overlap(c, 0.5)
    assert overlap.item() == pytest.approx(1 / 3) and recall.item() == pytest.approx(2 / 3)
    same = c[:, :1].repeat(1, 5, 1)  # every token the same: structured
    assert top_overlap(same, 0.5)[0].item() == 1.0 and top_overlap(same, 0.5)[1].item() == 1.0
    assert kept_channels(64, 0.8) == 12 and kept_channels(128, 0.5) == 64


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_capture_equals_q_dot_k_from_the_models_own_projections(name):
    """The contributions read from the engine's prefill equal |q̄_j·k_tj| recomputed here from the decoder layers'
    inputs (hidden states), their input norm, k_proj / q_proj (+ Qwen3's k_norm / q_norm) and RoPE."""
    lm = load_model(model_config(name), str(DEVICE))
    model, window = lm.model, 16
    ids = torch.randint(100, 5000, (1, 90), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    prefill = run_prefill(model, ids, window)
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        positions = torch.arange(ids.shape[1], device=DEVICE).unsqueeze(0)
        cos, sin = model.model.rotary_emb(hidden[0], positions)
        for i, block in enumerate(model.model.layers):
            attn, x = block.self_attn, block.input_layernorm(hidden[i])
            k = attn.k_proj(x).view(1, ids.shape[1], -1, attn.head_dim)
            q = attn.q_proj(x).view(1, ids.shape[1], -1, attn.head_dim)
            if hasattr(attn, "k_norm"):
                k, q = attn.k_norm(k), attn.q_norm(q)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            hkv = k.shape[1]
            q_bar = q[:, :, -window:].reshape(1, hkv, -1, window, attn.head_dim).mean(dim=2).mean(dim=2)  # (1,Hkv,D)
            expected = (q_bar[0].unsqueeze(1) * k[0]).abs()
            torch.testing.assert_close(contributions(prefill.layers[i], "window_mean", window), expected,
                                       atol=1e-5, rtol=1e-4)
            last = q[:, :, -1:].reshape(1, hkv, -1, attn.head_dim).mean(dim=2)
            torch.testing.assert_close(contributions(prefill.layers[i], "last", window),
                                       (last[0].unsqueeze(1) * k[0]).abs(), atol=1e-5, rtol=1e-4)


SALIENCY = ["model=tiny-llama", "benchmark.tasks=[niah_single_1]", "benchmark.num_samples=2", "benchmark.length=400"]


def test_the_saliency_command_writes_its_numbers_and_figures(tiny_lm, tmp_path):
    cfg = _compose([*SALIENCY, f"analysis.out={tmp_path / 'sal'}", "analysis.ratios=[0.5,0.75]"])
    model_cfg, device, layer, head, out = command.prepare(cfg)
    assert (layer, head, out) == (1, 0, tmp_path / "sal")  # tiny-llama has no layer 18: its middle one
    samples = command.load_samples(cfg, tiny_lm)
    lines = []
    summary = command.run_saliency(tiny_lm, samples, cfg, layer, head, out, log=lines.append)
    written = {p.name for p in out.iterdir()}
    assert {"saliency.json", "summary.md", "cv_per_layer_head.csv", "fig2a_surface.png", "fig2b_cv.png",
            "appB_token_patterns.png", "appB_scatter.png", "appB_heatmap.png"} <= written
    assert all((out / f).stat().st_size > 5000 for f in written if f.endswith(".png"))
    saved = json.loads((out / "saliency.json").read_text())
    assert saved["samples"] == 2 and saved["head_dim"] == 16 and set(saved["overlap"]) == {"0.5", "0.75"}
    # the summary's average is the mean of the per-prompt CVs recomputed here
    per_prompt = []
    for sample in samples:
        pre = run_prefill(tiny_lm.model, torch.tensor([list(sample.input_ids)], device=tiny_lm.device), 32)
        per_prompt.append(np.nanmean(np.stack([channel_cv(contributions(layer_, "window_mean", 32)).cpu().numpy()
                                               for layer_ in pre.layers])))
    assert saved["cv_all"]["mean"] == pytest.approx(np.mean(per_prompt), rel=1e-5)
    assert saved["verdict"] in lines[-1] and saved["verdict"].startswith("Observation 1 (average CV > 1.1)")
    assert saved["verdict"] in (out / "summary.md").read_text()
    csv = pd.read_csv(out / "cv_per_layer_head.csv")
    assert len(csv) == 2 * 2 and summary["overlap"]["0.75"]["kept"] == 4


@pytest.mark.parametrize("overrides,message", [
    (["analysis.layer=7"], "analysis.layer=7: model tiny-llama has 2 layers (0–1), or null"),
    (["analysis.head=2"], "analysis.head=2: model tiny-llama has 2 kv-heads (0–1)"),
    (["analysis.query=first"], "analysis.query must be one of window_mean, last; got 'first'"),
    (["analysis.ratios=[0.5,1.0]"], "analysis.ratios must be a non-empty list (a number >= 0 and < 1 each)"),
    (["analysis.window=0"], "analysis.window must be an integer >= 1; got 0"),
])
def test_saliency_refuses_bad_keys_before_the_model_loads(overrides, message, tmp_path):
    cfg = _compose([*SALIENCY, f"analysis.out={tmp_path / 'sal'}", *overrides])
    with pytest.raises(ConfigError) as err:
        command.prepare(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "sal").exists()


FIGURE2C = [MethodConfig(**c) for c in OmegaConf.to_container(
    OmegaConf.load(ROOT / "conf/sweep/figure2c.yaml"))["configs"]]


def _samples(n=4):
    return [Sample(task=task, id=f"{task}-{i}", input_ids=tuple(torch.randint(100, 5000, (120,), generator=torch.
                   Generator().manual_seed(10 * i + k)).tolist()), answers=("x",), max_new_tokens=3,
                   metric="string_match_all") for k, task in enumerate(("alpha", "beta")) for i in range(n)]


def test_figure2c_table_and_figure_from_a_tiny_run(tiny_lm, tmp_path, monkeypatch):
    run = tmp_path / "obs2"
    run_sweep(tiny_lm, _samples(), FIGURE2C, run)
    # random weights answer nothing right: give the run scores whose losses are known by hand
    lines = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    for r in lines:
        idx = int(r["id"].split("-")[1])
        r["score"] = 100.0 if r["method"]["name"] == "full" else (100.0 if idx < 3 - (r["method"]["ratio"] > 0.6)
                                                                  else 0.0)
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "fig"
    memory = tmp_path / "memory.json"
    memory.write_text(json.dumps({"model": "llama3.1-8b", "seq_len": 8064, "gen_len": 128, "cap_gib": 80, "plans": [
        {"method": "Full", "kv_bytes_per_sequence": 2 ** 30, "weights_bytes": 16e9, "max_batch": 64,
         "stored_prompt_tokens": 8192},
        {"method": "SparK(0.8)", "kv_bytes_per_sequence": 0.66 * 2 ** 30, "weights_bytes": 16e9, "max_batch": 96,
         "stored_prompt_tokens": 8192}]}))
    command.figure2(["--observation2", str(run), "--memory", str(memory), "--out", str(out)])
    table = pd.read_csv(out / "observation2.csv")
    assert set(table.method) == set(observation2.METHODS) and set(table.ratio) == {0.5, 0.8}
    # λ 0.5: 3 of 4 samples right → 25% loss per task; λ 0.8: 2 of 4 → 50%
    assert np.allclose(table[table.ratio == 0.5].loss, 25.0) and np.allclose(table[table.ratio == 0.8].loss, 50.0)
    assert (table.low <= table.loss).all() and (table.loss <= table.high).all()
    assert set(table.task) == {"alpha", "beta", "Avg."} and table.paper.isna().all()  # no LongBench task here
    md = (out / "observation2.md").read_text()
    assert "| 0.8 | Unstructured + 0.01 | 50.0 [" in md and "| 0.8 | Structured (ThinK) | samsum | 55.7 |" in md
    assert (out / "fig2c_relative_loss.png").stat().st_size > 5000
    assert (out / "fig_app_batch_memory.png").stat().st_size > 5000
    mem = (out / "memory.md").read_text()
    assert mem.startswith("llama3.1-8b, 8064 prompt + 128 generated tokens per sequence, 80 GiB")
    assert "| SparK(0.8) | 0.660 |" in mem and "25.02 / 35.83, 241" in mem and "7,219 tokens" in mem


def test_figure2c_reads_the_papers_numbers_onto_longbench_tasks():
    scores = pd.DataFrame([dict(task=t, id=f"{t}{i}", score=s, method=m, ratio=r)
                           for t in ("samsum", "hotpotqa") for i in range(3)
                           for m, r, s in ((None, 0.0, 40.0), (observation2.METHODS[0], 0.8, 20.0))])
    table = observation2.loss_table(scores, observation2.paper_frame())
    by_task = table.set_index("task")
    assert by_task.loc["samsum", "loss"] == pytest.approx(50.0) and by_task.loc["samsum", "paper"] == 55.7
    assert by_task.loc["hotpotqa", "paper"] == 69.4 and np.isnan(by_task.loc["Avg.", "paper"])


def test_figure2c_configs_and_bad_inputs(tmp_path, capsys):
    names = [(c.name, c.ratio, c.recovery if c.name == "spark" else "") for c in FIGURE2C]
    assert names == [("full", 0.0, ""), ("think", 0.5, ""), ("think", 0.8, ""), ("spark", 0.5, "none"),
                     ("spark", 0.8, "none"), ("spark", 0.5, "constant"), ("spark", 0.8, "constant"),
                     ("spark", 0.5, "degenerate"), ("spark", 0.8, "degenerate")]
    assert all(c.constant == 0.01 for c in FIGURE2C if c.recovery == "constant")
    assert [observation2.method_name(c.to_dict()) for c in FIGURE2C[1:5:2]] == list(observation2.METHODS[:2])
    with pytest.raises(ValueError, match="not part of Fig. 2c"):
        observation2.method_name(MethodConfig(name="snapkv").to_dict())
    for argv, message in ((["--out", str(tmp_path / "o")], "give --observation2"),
                          (["--observation2", str(tmp_path / "none"), "--out", str(tmp_path / "o")],
                           "no such file or directory")):
        with pytest.raises(SystemExit) as stop:
            command.figure2(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_observation2_sweep_resolves_in_a_dry_run(capsys, monkeypatch):
    """`make figure2 DRY_RUN=true`'s run: the SmolLM2 sweep plans its 75 samples × 9 configs without loading; the
    paper's setting plans its three LongBench tasks and, without the model and data here, says the real run would
    stop (the command line's exit 2)."""
    from spark_bench import cli

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _compose(["+experiment=figure2"])
    cli.dry_run(cfg, Path(cfg.output_root) / cfg.run)
    out = capsys.readouterr().out
    assert "plan: 75 samples × 9 configs" in out and "SparK(0.8)[constant]" in out
    assert "→ results/figure2/observation2" in out
    cfg = _compose(["+experiment=figure2_longbench"])
    with pytest.raises(cli.DryRunStop, match="the run would stop: model llama3.1-8b"):
        cli.dry_run(cfg, Path(cfg.output_root) / cfg.run)
    out = capsys.readouterr().out
    assert "plan: samples per task (published): samsum 200, hotpotqa 200, repobench-p 500" in out
    assert "plan: 900 samples × 9 configs" in out
