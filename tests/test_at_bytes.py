"""Methods at equal KV bytes (``spark-bench-report --at-bytes``) and the bytes figures: families, the interpolation
rule (estimate and interval endpoints linear in the byte fraction, nothing outside a family's range), the table,
and the refusal of a bad fraction. Synthetic runs: every number is known in advance."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from spark_bench.methods import MethodConfig
from spark_bench.report import at_bytes
from spark_bench.report import main as report_main

FULL = 1000
TASKS = ("niah_single_1", "niah_single_2")
# (method config, byte fraction, score per sample of each task, kl_full, answer_nll)
CONFIGS = [
    (MethodConfig(name="full"), 1.0, (100, 100), 0.0, 0.5),
    (MethodConfig(name="spark", ratio=0.5), 0.8, (100, 50), 0.1, 0.6),
    (MethodConfig(name="spark", ratio=0.8), 0.6, (50, 50), 0.3, 0.9),
    (MethodConfig(name="think", ratio=0.5), 0.7, (50, 0), 0.5, 1.0),
    (MethodConfig(name="think", ratio=0.8), 0.5, (0, 0), 2.0, 2.5),
    (MethodConfig(name="snapkv", budget=0.5), 0.5, (50, 50), 0.8, 1.5),
    (MethodConfig(name="snapkv+spark", budget=0.5, ratio=0.5), 0.4, (50, 0), 1.0, 1.7),
    (MethodConfig(name="snapkv+spark", budget=0.5, ratio=0.8), 0.3, (0, 50), 1.2, 1.9),
    (MethodConfig(name="snapkv+spark", budget=0.5, ratio=0.8, recovery="none"), 0.28, (0, 0), 1.9, 2.4),
    (MethodConfig(name="snapkv+spark", budget=0.5, ratio=0.5, recovery="none"), 0.38, (0, 0), 1.6, 2.0),
]
SAMPLES = 4  # per task: the score is the same on every sample of a task, the fidelity numbers vary around their mean
JITTER = np.array([-0.1, 0.1, -0.05, 0.05])


def records() -> list[dict]:
    from spark_bench.methods.pipeline import sweep_labels

    labels = sweep_labels([c for c, *_ in CONFIGS])
    out = []
    for (config, fraction, scores, kl, nll), label in zip(CONFIGS, labels):
        for task, score in zip(TASKS, scores):
            for i in range(SAMPLES):
                jitter = 0.0 if config.name == "full" else float(JITTER[i])
                out.append({"config": label, "method": config.to_dict(), "task": task, "id": f"{task}-{i}",
                            "prompt_length": 100, "prediction": "x", "tokens": [1, 2], "answers": ["x"],
                            "score": float(score), "kv_bytes": fraction * FULL, "kv_bytes_full": FULL,
                            "key_ratio": config.ratio or 0.0, "length": None, "answer_nll": nll + jitter,
                            "kl_full": kl if config.name == "full" else kl + jitter, "agree_full": 1.0,
                            "kl_tokens": 4})
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes_run")
    (path / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    return path


@pytest.fixture(scope="module")
def pts(run):
    from spark_bench.report.figures import load_predictions

    return at_bytes.points(load_predictions([run]), resamples=200)


def test_families_follow_each_methods_own_curve(pts):
    """One family per method with its options; SnapKV+SparK runs along λ at its budget, unrecovered SparK apart;
    SnapKV alone along its budget; the measured byte fractions are each config's."""
    got = {(r.family, r.point): r.fraction for r in pts.itertuples()}
    assert got == pytest.approx({
        ("Full", "Full"): 1.0, ("SparK", "λ 0.5"): 0.8, ("SparK", "λ 0.8"): 0.6, ("ThinK", "λ 0.5"): 0.7,
        ("ThinK", "λ 0.8"): 0.5, ("SnapKV", "@0.5"): 0.5,
        ("SnapKV+SparK @0.5 [recovery=degenerate]", "λ 0.5"): 0.4,
        ("SnapKV+SparK @0.5 [recovery=degenerate]", "λ 0.8"): 0.3,
        ("SnapKV+SparK @0.5 [recovery=none]", "λ 0.8"): 0.28, ("SnapKV+SparK @0.5 [recovery=none]", "λ 0.5"): 0.38})
    spark = pts[pts.config == "SparK(0.8)"].iloc[0]
    assert spark.score == 50 and spark.score_low == spark.score_high == 50  # the same score on every sample
    assert spark.kl_full == pytest.approx(0.3) and spark.kl_full_low < 0.3 < spark.kl_full_high


def test_interpolation_is_linear_in_bytes_and_never_extrapolated(pts):
    spark = pts[pts.family == "SparK"]
    a, b = spark[spark.point == "λ 0.8"].iloc[0], spark[spark.point == "λ 0.5"].iloc[0]
    w = (0.7 - 0.6) / (0.8 - 0.6)
    est, low, high = at_bytes.interpolate(spark, 0.7, "kl_full")
    assert est == pytest.approx(a.kl_full + w * (b.kl_full - a.kl_full))
    assert low == pytest.approx(a.kl_full_low + w * (b.kl_full_low - a.kl_full_low))  # endpoints the same way
    assert high == pytest.approx(a.kl_full_high + w * (b.kl_full_high - a.kl_full_high))
    assert at_bytes.interpolate(spark, 0.7, "score")[0] == pytest.approx(62.5)  # halfway from 50 to 75
    assert at_bytes.interpolate(spark, 0.6, "kl_full") == pytest.approx((a.kl_full, a.kl_full_low, a.kl_full_high))
    assert at_bytes.interpolate(spark, 0.59, "score") is None and at_bytes.interpolate(spark, 0.81, "score") is None
    table = at_bytes.at_bytes(pts, (0.3, 0.5, 0.7, 0.95))
    kl = table[table.metric == "kl_full"].set_index(["fraction", "family"])
    assert np.isnan(kl.loc[(0.5, "SparK"), "value"]) and kl.loc[(0.5, "SparK"), "note"] == "outside"
    assert kl.loc[(0.5, "ThinK"), "value"] == pytest.approx(2.0)
    assert 0.95 not in set(table.fraction)  # no family reaches 95% (the full cache sits at 100%, alone)


def test_markdown_sets_families_side_by_side(pts):
    table = at_bytes.at_bytes(pts, (0.3, 0.7))
    md = at_bytes.to_markdown(table, pts)
    assert "Score at equal KV bytes (mean over tasks, 95% interval; higher is better):" in md
    assert "| KV bytes | SparK | ThinK | SnapKV+SparK @0.5 [recovery=degenerate] | SnapKV+SparK @0.5 " \
        "[recovery=none] |" in md  # Full (100%) and SnapKV (50%) have no number at 30% or 70%: no column
    assert "| 70% | 62.50 [62.50, 62.50] | 25.00 [25.00, 25.00] | – | – |" in md
    assert "| 30% | – | – | 1.200 [1.144, 1.256] | 1.840 [1.784, 1.896] |" in md
    assert "never extrapolated" in md and "SparK 60.0–80.0%" in md and "KL full at equal KV bytes" in md


def test_report_writes_the_view_and_the_family_figures(run, tmp_path, capsys):
    out = tmp_path / "rep"
    report_main([str(run), "--at-bytes", "30%,0.7", "--figures", "--resamples", "100", "--out", str(out)])
    assert "At equal KV bytes" in capsys.readouterr().out
    csv = pd.read_csv(out / "at_bytes.csv")
    assert set(csv.fraction) == {0.3, 0.7} and set(csv.metric) == {"score", "kl_full", "answer_nll"}
    for name in ("fig5c_score_vs_bytes.png", "fig_kl_vs_bytes.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("value", ["0", "1.5", "abc", "30%,x"])
def test_a_bad_fraction_is_refused_in_one_line(run, tmp_path, capsys, value):
    out = tmp_path / "rep"
    with pytest.raises(SystemExit) as stop:
        report_main([str(run), f"--at-bytes={value}", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "--at-bytes:" in err and "(0, 1]" in err
    assert not out.exists()


# ---- claims at equal bytes (spark_bench.report.bytes_claims) -------------------------------------------------------

def _bytes_claim_run(root):
    """SparK, Mustafar and LeanK (two mask files) at two byte fractions each, 20 samples in each of two tasks; the
    fidelity numbers differ per sample, so the paired interval has width."""
    import torch

    from spark_bench.methods.channel.leank import LeanKMask, write_mask

    masks = []
    for pruned in (8, 12):  # of 16 channels: λ 0.5 and 0.75
        kept = torch.zeros(2, 2, 16, dtype=torch.bool)
        kept[..., pruned:] = True
        masks.append(root / f"mask{pruned}.json")
        write_mask(LeanKMask(kept, 4), masks[-1])
    configs = [(MethodConfig(name="spark", ratio=0.5), 0.8, 0.10), (MethodConfig(name="spark", ratio=0.8), 0.6, 0.30),
               (MethodConfig(name="mustafar", ratio=0.5), 0.75, 0.40), (MethodConfig(name="mustafar", ratio=0.8),
                                                                         0.55, 0.80),
               (MethodConfig(name="leank", leank={"mask": str(masks[0])}), 0.75, 0.35),
               (MethodConfig(name="leank", leank={"mask": str(masks[1])}), 0.62, 0.60)]
    from spark_bench.methods.pipeline import sweep_labels

    out = []
    for (config, fraction, kl), label in zip(configs, sweep_labels([c for c, *_ in configs])):
        for task in TASKS:
            for i in range(20):
                out.append({"config": label, "method": config.to_dict(), "task": task, "id": f"{task}-{i}",
                            "prompt_length": 100, "prediction": "x", "tokens": [1], "answers": ["x"],
                            "score": float(100 * (i % 2)), "kv_bytes": fraction * FULL, "kv_bytes_full": FULL,
                            "key_ratio": 0.5, "length": None, "answer_nll": kl + 0.5, "kl_full": kl + 0.01 * i,
                            "agree_full": 1.0, "kl_tokens": 4})
    run = root / "run"
    run.mkdir()
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))
    return run


def test_claims_at_equal_bytes_pair_each_samples_interpolated_value(tmp_path, capsys):
    from spark_bench.report import bytes_claims
    from spark_bench.report.figures import load_predictions

    run = _bytes_claim_run(tmp_path)
    preds = load_predictions([run])
    pts = at_bytes.points(preds, resamples=100)
    assert {(r.family, r.point) for r in pts.itertuples()} >= {("LeanK", "λ 0.5"), ("LeanK", "λ 0.75")}
    spark = pts[pts.family == "SparK"]
    mine = bytes_claims.per_sample(preds, spark, 0.7, "kl_full")  # halfway between SparK's 0.6 and 0.8
    assert mine.loc[("niah_single_1", "niah_single_1-3")] == pytest.approx(0.5 * (0.13 + 0.33))
    assert mine.mean() == pytest.approx(at_bytes.interpolate(spark, 0.7, "kl_full")[0])
    assert bytes_claims.per_sample(preds, spark, 0.55, "kl_full") is None  # outside: never extrapolated

    claims = bytes_claims.check(preds, (0.55, 0.7), resamples=200).set_index(["claim", "block"])
    kl = claims.loc[("SparK moves the distribution less than Mustafar at equal KV bytes (KL to full)", "70% KV bytes")]
    # Mustafar at 0.7: 0.75 → 0.8 weight 0.25 from its 0.55 point: 0.4 + 0.25·(0.8 − 0.4) = 0.5; SparK 0.2
    assert kl.estimate == pytest.approx(0.2 - 0.5) and kl.n == 40 and kl.verdict == "holds"
    assert kl.row == "SparK" and kl.vs == "Mustafar" and kl.low == pytest.approx(-0.3) == kl.high  # same jitter
    score = claims.loc[("SparK scores above Mustafar at equal KV bytes", "70% KV bytes")]
    assert score.estimate == pytest.approx(0.0) and score.verdict == "fails"  # the same score on every sample
    assert ("SparK moves the distribution less than LeanK at equal KV bytes (KL to full)",
            "70% KV bytes") in claims.index
    assert not any(block == "55% KV bytes" for _, block in claims.index)  # SparK's range is 60-80%

    report_main([str(run), "--claims", "--at-bytes", "0.7", "--resamples", "100", "--out", str(tmp_path / "rep")])
    written = pd.read_csv(tmp_path / "rep" / "claims.csv")
    assert "SparK moves the distribution less than Mustafar at equal KV bytes (KL to full)" in set(written.claim)
