"""Query-agnostic beside query-aware (issue 54 item 3): when a sweep holds a method under both ``compress_scope``
values, the paired table sets each query-agnostic row beside itself query-aware and the claims are checked within
each scope and across them, with intervals; several questions per context get a table by question position."""

import numpy as np
import pandas as pd
import pytest

from spark_bench.report import claims
from spark_bench.report.compare import paired_frame, position_markdown, scope_pairs
from spark_bench.report.frame import SAMPLE_COLUMNS
from spark_bench.report.layouts import RULER

B = "KV 50%"
CTX, Q = " [compress_scope=context]", " [compress_scope=question]"
N = 40


def _samples(rows: dict, kl: dict | None = None) -> pd.DataFrame:
    """Per-sample frame of rows (block, group, method) → scores, over two tasks; ``kl``: method → kl_full."""
    out = []
    for (block, group, method), scores in rows.items():
        for task in ("niah_single_1", "niah_multikey_1"):
            for i, s in enumerate(scores):
                out.append((block, group, method, RULER.task_names[task], f"{task}-{i}", float(s), 640, 1000, 0.5,
                            None, (kl or {}).get(method, float("nan"))))
    frame = pd.DataFrame(out, columns=[*SAMPLE_COLUMNS, "kl_full"])
    return frame.assign(answer_nll=float("nan"), agree_full=float("nan"))


def _both(scores_ctx: dict, scores_q: dict, kl: dict | None = None) -> pd.DataFrame:
    rows = {}
    for tag, scores in ((CTX, scores_ctx), (Q, scores_q)):
        rows.update({("", "Vanilla", "Vanilla" + tag): [100] * N, (B, "SnapKV", "SnapKV" + tag): scores["snap"],
                     (B, "SnapKV", "+SparK (0.8)" + tag): scores["spark"],
                     (B, "SnapKV", "+ThinK (0.8)" + tag): scores["think"]})
    return _samples(rows, kl)


def test_each_query_agnostic_row_pairs_with_itself_query_aware():
    present = {("", "Vanilla", "Vanilla" + Q), (B, "SnapKV", "+SparK (0.8)" + Q),
               (B, "SnapKV", "+SparK (0.8) [compress_scope=question, window_size=64]")}
    assert scope_pairs((B, "SnapKV", "+SparK (0.8)" + CTX), present) == [(B, "SnapKV", "+SparK (0.8)" + Q)]
    assert scope_pairs((B, "SnapKV", "+SparK (0.8) [compress_scope=context, window_size=64]"), present) == [
        (B, "SnapKV", "+SparK (0.8) [compress_scope=question, window_size=64]")]  # every other option kept
    assert scope_pairs((B, "SnapKV", "+SparK (0.8)" + Q), present) == []  # listed once: agnostic − aware
    assert scope_pairs((B, "SnapKV", "+ThinK (0.8)" + CTX), present) == []  # no partner in the run


def test_the_paired_table_sets_a_row_beside_itself_under_the_other_scope():
    run = _both({"snap": [0, 100] * (N // 2), "spark": [100] * N, "think": [0] * N},
                {"snap": [100] * N, "spark": [100] * N, "think": [100] * N})
    paired = paired_frame(run, RULER, values=("score",))
    across = paired[paired.base.str.endswith(Q) & paired.method.str.endswith(CTX)]
    got = {(r.method, r.base): (r.delta, r.low, r.high, r.wins, r.ties, r.losses) for r in across.itertuples()}
    assert got == {
        ("Vanilla" + CTX, "Vanilla" + Q): (0.0, 0.0, 0.0, 0, 2 * N, 0),
        ("SnapKV" + CTX, "SnapKV" + Q): pytest.approx((-50.0, *got["SnapKV" + CTX, "SnapKV" + Q][1:3], 0, N, N)),
        ("+SparK (0.8)" + CTX, "+SparK (0.8)" + Q): (0.0, 0.0, 0.0, 0, 2 * N, 0),
        ("+ThinK (0.8)" + CTX, "+ThinK (0.8)" + Q): (-100.0, -100.0, -100.0, 0, 0, 2 * N)}
    low, high = got["SnapKV" + CTX, "SnapKV" + Q][1:3]
    assert -75 < low < -50 < high < -25  # a real interval around the paired mean
    within = {(r.method, r.base) for r in paired.itertuples() if r.base.endswith(CTX)}  # within a scope, as before
    assert within == {("SnapKV" + CTX, "Vanilla" + CTX), ("+SparK (0.8)" + CTX, "SnapKV" + CTX),
                      ("+ThinK (0.8)" + CTX, "SnapKV" + CTX), ("+SparK (0.8)" + CTX, "+ThinK (0.8)" + CTX)}


def test_claims_within_each_scope_and_across_them():
    run = _both({"snap": [100] * N, "spark": [100] * N, "think": [0] * N},
                {"snap": [100] * N, "spark": [100] * N, "think": [100] * N},
                kl={"+SparK (0.8)" + CTX: 0.1, "+SparK (0.8)" + Q: 0.2, "+ThinK (0.8)" + CTX: 0.9,
                    "+ThinK (0.8)" + Q: 0.5})
    out = claims.check(run, RULER)
    verdicts = {(r.claim, r.block, r.vs): r.verdict for r in out.itertuples()}
    above = "SparK(0.8) above ThinK(0.8)"
    assert verdicts[above, B + CTX, "ThinK (0.8)"] == "holds"       # without the question ThinK loses its needles
    assert verdicts[above, B + Q, "ThinK (0.8)"] == "fails"  # with it both find every one (Δ 0, not > 0)
    across = {(r.row, r.claim): (r.vs, r.estimate, r.verdict) for r in out.itertuples() if "question" in r.claim}
    assert across["SnapKV SparK (0.8)", "SnapKV SparK (0.8) without the question within 1 point of with it"] == (
        "SnapKV SparK (0.8) [compress_scope=question]", 0.0, "holds")
    assert across["SnapKV ThinK (0.8)", "SnapKV ThinK (0.8) without the question within 1 point of with it"] == (
        "SnapKV ThinK (0.8) [compress_scope=question]", -100.0, "fails")
    kl = "moves the distribution no further without the question (KL to full)"
    assert across["SnapKV SparK (0.8)", f"SnapKV SparK (0.8) {kl}"][1:] == (pytest.approx(-0.1), "holds")
    assert across["SnapKV ThinK (0.8)", f"SnapKV ThinK (0.8) {kl}"][1:] == (pytest.approx(0.4), "fails")
    assert {r.block for r in out.itertuples()} == {B + CTX, B + Q, "full cache" + CTX}
    assert "| SparK(0.8) above ThinK(0.8) | KV 50% [compress_scope=context] |" in claims.to_markdown(out)


def test_score_by_question_position():
    preds = pd.DataFrame([{"config": c, "task": t, "id": f"{t}-{i}/q{k}", "question": k, "score": s}
                          for c, s1, s2 in (("SparK", 100.0, 0.0), ("ThinK", 50.0, 50.0))
                          for t in ("a", "b") for i in range(3) for k, s in ((1, s1), (2, s2))])
    text = position_markdown(preds)
    assert "| Method | Q1 | Q2 |" in text
    assert "| SparK | 100.00 ± 0.00 (n=6) | 0.00 ± 0.00 (n=6) |" in text
    assert "| ThinK | 50.00 ± 0.00 (n=6) | 50.00 ± 0.00 (n=6) |" in text
    assert position_markdown(preds.assign(question=None)) == "" and position_markdown(preds.drop(
        columns="question")) == ""
    assert not np.isnan(preds.score).any()
