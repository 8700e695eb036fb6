"""Bootstrap intervals, paired comparisons and the paper's claims, against hand computations on hand-built runs."""

import numpy as np
import pandas as pd
import pytest

from spark_bench.report import claims, stats
from spark_bench.report.compare import length_frame, paired_frame
from spark_bench.report.frame import SAMPLE_COLUMNS
from spark_bench.report.layouts import RULER


def test_interval_of_a_two_point_set_is_known_exactly():
    # the bootstrap mean of {0, 100} is 0, 50 or 100 with probabilities 1/4, 1/2, 1/4: the 2.5% and 97.5%
    # percentiles are 0 and 100 whatever the draws (1000 replicates)
    (cell,), avg = stats.mean_intervals([np.array([0.0, 100.0])])
    assert (cell.estimate, cell.low, cell.high, cell.half_width, cell.n) == (50.0, 0.0, 100.0, 50.0, 2)
    (flat,), _ = stats.mean_intervals([np.full(7, 42.0)])
    assert (flat.low, flat.high) == (42.0, 42.0)


def test_seeded_interval_equals_a_hand_computation():
    a, b = np.array([10.0, 20.0, 30.0, 60.0]), np.array([0.0, 100.0, 100.0])
    (ia, ib), avg = stats.mean_intervals([a, b], resamples=200, seed=3)
    rng = np.random.default_rng(3)  # the same draws, by hand: task a first, then task b
    draws_a = [[int(v) for v in row] for row in rng.integers(0, 4, size=(200, 4))]
    draws_b = [[int(v) for v in row] for row in rng.integers(0, 3, size=(200, 3))]
    means_a = [sum(a[i] for i in row) / 4 for row in draws_a]
    means_b = [sum(b[i] for i in row) / 3 for row in draws_b]
    averages = [(x + y) / 2 for x, y in zip(means_a, means_b)]
    assert (ia.low, ia.high) == pytest.approx(tuple(np.percentile(means_a, [2.5, 97.5])))
    assert (ib.low, ib.high) == pytest.approx(tuple(np.percentile(means_b, [2.5, 97.5])))
    assert avg.estimate == pytest.approx((30.0 + 200 / 3) / 2)
    assert (avg.low, avg.high) == pytest.approx(tuple(np.percentile(averages, [2.5, 97.5])))
    assert avg.n == 7 and str(ia) == f"30.00 ± {(ia.high - ia.low) / 2:.2f}"


def _samples(rows: dict, tasks=("niah_single_1",), kv=None) -> pd.DataFrame:
    """A hand-built run: ``{(block, group, method): [scores per sample]}`` (same samples for every row)."""
    out = []
    for (block, group, method), scores in rows.items():
        for task in tasks:
            for i, s in enumerate(scores):
                bytes_ = (kv or {}).get(method, 1000)
                out.append((block, group, method, RULER.task_names[task], f"{task}-{i}", float(s), bytes_, 1000, 0.0,
                            None))
    return pd.DataFrame(out, columns=SAMPLE_COLUMNS)


B = "KV-size 128"


def test_paired_delta_and_win_tie_loss_by_hand():
    run = _samples({("", "Vanilla", "Vanilla"): [100, 100, 100, 100, 0],
                    (B, "SnapKV", "SnapKV"): [100, 0, 100, 0, 0],
                    (B, "SnapKV", "+SparK (0.8)"): [100, 100, 0, 0, 100]})
    paired = paired_frame(run, RULER).set_index("method")
    spark = paired.loc["+SparK (0.8)"]
    assert spark.base == "SnapKV" and spark.n == 5
    assert spark.delta == pytest.approx(60 - 40) and (spark.wins, spark.ties, spark.losses) == (2, 2, 1)
    snap = paired.loc["SnapKV"]
    assert snap.base == "Vanilla" and snap.delta == pytest.approx(40 - 80) and (snap.wins, snap.ties, snap.losses) == (0, 3, 2)
    # the paired interval resamples the differences: by hand with the same draws
    rng = np.random.default_rng(0)
    diffs = np.array([0, 100, -100, 0, 100])
    reps = diffs[rng.integers(0, 5, size=(1000, 5))].mean(axis=1)
    assert (spark.low, spark.high) == pytest.approx(tuple(np.percentile(reps, [2.5, 97.5])))


def _claims(run):
    out = claims.check(run, RULER)
    return {(r.claim, r.block): r for r in out.itertuples(index=False)}


N = 40


def test_claims_that_hold():
    run = _samples({(B, "SnapKV", "SnapKV"): [100] * N, (B, "SnapKV", "+SparK (0.5)"): [100] * N,
                    (B, "SnapKV", "+SparK (0.8)"): [100] * N, (B, "SnapKV", "+ThinK (0.8)"): [0] * N,
                    (B, "SnapKV", "+SparK (0.8) [none]"): [0] * N},
                   kv={"SnapKV": 1000, "+SparK (0.8)": 640})
    verdicts = {k[0]: v.verdict for k, v in _claims(run).items()}
    assert verdicts == {c.name: "holds" for c in claims.CLAIMS if c.value == "score"}  # fidelity: not measured


def test_claims_that_fail():
    run = _samples({(B, "SnapKV", "SnapKV"): [100] * N, (B, "SnapKV", "+SparK (0.5)"): [0] * N,
                    (B, "SnapKV", "+SparK (0.8)"): [0] * N, (B, "SnapKV", "+ThinK (0.8)"): [100] * N,
                    (B, "SnapKV", "+SparK (0.8) [none]"): [100] * N},
                   kv={"SnapKV": 1000, "+SparK (0.8)": 900})
    got = _claims(run)
    assert {k[0]: v.verdict for k, v in got.items()} == {c.name: "fails" for c in claims.CLAIMS if c.value == "score"}
    ratio = got["SparK(0.8) keeps >= 95% of its base", B]
    assert (ratio.estimate, ratio.low, ratio.high) == (0.0, 0.0, 0.0)


def test_claims_that_are_inconclusive():
    # half the samples win, half lose: every interval straddles its threshold
    mixed = [100, 0] * (N // 2)
    run = _samples({(B, "SnapKV", "SnapKV"): [100, 0] * (N // 2), (B, "SnapKV", "+SparK (0.5)"): mixed[::-1],
                    (B, "SnapKV", "+SparK (0.8)"): [0, 100] * (N // 2), (B, "SnapKV", "+ThinK (0.8)"): mixed,
                    (B, "SnapKV", "+SparK (0.8) [none]"): mixed})
    verdicts = {k[0]: v.verdict for k, v in _claims(run).items()}
    for name in ("SparK(0.5) within 1 point of its base", "SparK(0.8) keeps >= 95% of its base",
                 "SparK(0.8) above ThinK(0.8)", "recovered SparK(0.8) above unrecovered (recovery=none)"):
        assert verdicts[name] == "inconclusive", name


def test_claims_on_too_few_samples_decide_nothing():
    """The same clear-cut rows at 2 samples per task read 'too few samples'; at 25 (≥ MIN_PAIRED) they hold."""
    def run(n):
        return _samples({(B, "SnapKV", "SnapKV"): [100] * n, (B, "SnapKV", "+SparK (0.5)"): [100] * n,
                         (B, "SnapKV", "+SparK (0.8)"): [100] * n, (B, "SnapKV", "+ThinK (0.8)"): [0] * n,
                         (B, "SnapKV", "+SparK (0.8) [none]"): [0] * n}, kv={"SnapKV": 1000, "+SparK (0.8)": 640})

    assert {v.verdict for v in _claims(run(2)).values()} == {"too few samples (n=2 per task, need 20)"}
    assert {v.verdict for v in _claims(run(25)).values()} == {"holds"}
    assert "at least 20 paired samples" in claims.to_markdown(claims.check(run(2), RULER))


def test_claims_on_the_full_cache_and_missing_rows():
    run = _samples({("", "Vanilla", "Vanilla"): [100] * N, ("", "Vanilla", "SparK (0.8)"): [100] * N},
                   kv={"Vanilla": 1000, "SparK (0.8)": 1000})
    keeps, bytes_ = claims.check(run, RULER).itertuples(index=False)
    assert (keeps.block, keeps.row, keeps.vs, keeps.verdict) == ("full cache", "SparK (0.8)", "Vanilla", "holds")
    assert (bytes_.estimate, bytes_.verdict) == (1.0, "fails")  # no bytes saved
    assert claims.to_markdown(claims.check(_samples({("", "Vanilla", "Vanilla"): [1]}), RULER)).startswith("No claim")


def test_longbench_e_length_buckets():
    rows = []
    for task, scores, lengths in (("hotpotqa", [100, 0, 50], [1000, 5000, 9000]),
                                  ("trec", [100, 100], [3000, 12000])):
        for i, (s, n) in enumerate(zip(scores, lengths)):
            rows.append(("", "Vanilla", "Vanilla", task, f"{task}-{i}", float(s), 1, 1, 0.0, n))
    frame = length_frame(pd.DataFrame(rows, columns=SAMPLE_COLUMNS)).set_index("column").value
    assert frame["0-4k"] == 100 and frame["4-8k"] == 0 and frame["8k+"] == (50 + 100) / 2
    assert frame["All"] == pytest.approx((50 + 100) / 2)
