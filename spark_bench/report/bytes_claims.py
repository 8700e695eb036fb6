"""Claims between channel-pruning methods at equal KV bytes (``spark-bench-report --claims --at-bytes …``).

:mod:`.at_bytes` sets method families side by side at common byte fractions, each number interpolated along its own
curve. A claim ("SparK below Mustafar in KL at equal bytes") needs more than two intervals side by side: the two
families answer the *same* samples, so the difference is paired, as :mod:`.claims`' are.

**The per-sample reading at a byte fraction x.** A family's configs sit at their measured byte fractions (the mean
over samples of ``kv_bytes / kv_bytes_full``, :func:`~spark_bench.report.at_bytes.points`). Strictly between the
two nearest, ``f_a < x < f_b``, the weight ``w = (x − f_a) / (f_b − f_a)`` is one number for the family, so every
sample has its own interpolated value ``y_i(x) = (1 − w)·y_{a,i} + w·y_{b,i}`` (at a config's own fraction its own
value). The mean over samples of ``y_i(x)`` is exactly the at-bytes table's estimate. Two families' per-sample values
at the same x are paired by task and sample id, and the claim's statistic is the paired mean difference (row − other)
with the stratified paired bootstrap of :func:`~spark_bench.report.stats.paired` — the same interval and verdict
rule as :mod:`.claims` (``holds`` / ``fails`` / ``inconclusive``, at least :data:`~spark_bench.report.claims.
MIN_PAIRED` paired samples in every task). A fraction outside either family's measured range is not checked
(never extrapolated).

**Which families.** Each claim names two channel methods (display names: ``SparK``, ``ThinK``, ``Mustafar``,
``LeanK``). Every family whose label has the first as its channel part — ``SparK`` alone, ``SnapKV+SparK @0.5``
over an eviction method, with any options it carries — is set against the family whose label is the same with the
second method's name in its place. Checked at every fraction given to ``--at-bytes`` that both ranges reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from spark_bench.report import stats
from spark_bench.report.at_bytes import points
from spark_bench.report.claims import MIN_PAIRED


@dataclass(frozen=True)
class BytesClaim:
    row: str       # the channel method whose family is the row, e.g. "SparK"
    other: str     # the one it is set against, e.g. "Mustafar"
    value: str     # score | kl_full | answer_nll
    above: bool    # the row's value above the other's (score) or below it (kl_full, answer_nll: above=False)

    @property
    def name(self) -> str:
        what = {"score": "scores above", "kl_full": "moves the distribution less than",
                "answer_nll": "keeps the answer likelier than"}[self.value]
        return f"{self.row} {what} {self.other} at equal KV bytes" + (" (KL to full)" if self.value == "kl_full"
                                                                       else "")


# the question issue 53 asks: query-aware SparK against the query-agnostic (Mustafar), the per-prompt (ThinK) and the
# learned static (LeanK) channel sets, at the same bytes; and the static learned set against ThinK's per-prompt one
BYTES_CLAIMS = (
    BytesClaim("SparK", "Mustafar", "kl_full", above=False),
    BytesClaim("SparK", "Mustafar", "score", above=True),
    BytesClaim("SparK", "ThinK", "kl_full", above=False),
    BytesClaim("SparK", "ThinK", "score", above=True),
    BytesClaim("SparK", "LeanK", "kl_full", above=False),
    BytesClaim("SparK", "LeanK", "score", above=True),
    BytesClaim("LeanK", "ThinK", "kl_full", above=False),
    BytesClaim("Mustafar", "ThinK", "kl_full", above=False),
)


def _channel(label: str) -> str:
    """The channel part of a family label: ``SnapKV+SparK @0.5 [recovery=none]`` → ``SparK``."""
    return label.split(" ")[0].split("+")[-1]


def per_sample(preds: pd.DataFrame, curve: pd.DataFrame, x: float, value: str) -> pd.Series | None:
    """One family's per-sample ``value`` at byte fraction ``x`` (index: task, id), by the module's rule; None
    outside its measured range or where a sample lacks the value. ``curve``: the family's
    :func:`~spark_bench.report.at_bytes.points` rows."""
    curve = curve.dropna(subset=["fraction"])
    if curve.empty:
        return None
    series = {}
    for (run, config), f in zip(zip(curve.run, curve.config), curve.fraction.round(9)):
        rows = preds[(preds.run == run) & (preds.config == config)]
        one = pd.to_numeric(rows.set_index(["task", "id"])[value], errors="coerce")
        series.setdefault(float(f), []).append(one)
    merged = {f: pd.concat(parts, axis=1).mean(axis=1, skipna=False) for f, parts in series.items()}
    f = np.array(sorted(merged))
    if x < f[0] - 1e-9 or x > f[-1] + 1e-9:
        return None
    near = np.isclose(f, x, rtol=0, atol=1e-9)
    if near.any():
        out = merged[float(f[near.argmax()])]
    else:
        b = int(np.searchsorted(f, x))
        w = (x - f[b - 1]) / (f[b] - f[b - 1])
        ya, yb = merged[float(f[b - 1])].align(merged[float(f[b])], join="inner")
        out = (1 - w) * ya + w * yb
    return None if out.empty or out.isna().any() else out


def check(preds: pd.DataFrame, fractions, resamples: int = stats.RESAMPLES, seed: int = stats.SEED,
          claims=BYTES_CLAIMS) -> pd.DataFrame:
    """Every claim of ``claims`` between every pair of families it names, at every fraction both reach; the
    columns of :func:`spark_bench.report.claims.check` (``block``: the byte fraction)."""
    pts = points(preds, resamples, seed)
    curves = {family: curve for family, curve in pts.groupby("family", sort=False)}
    out = []
    for claim in claims:
        for family, curve in curves.items():
            if _channel(family) != claim.row:
                continue
            head, _, tail = family.partition(" ")
            other_family = " ".join(filter(None, (head[: len(head) - len(claim.row)] + claim.other, tail)))
            if other_family not in curves:
                continue
            for x in fractions:
                mine = per_sample(preds, curve, x, claim.value)
                theirs = per_sample(preds, curves[other_family], x, claim.value)
                if mine is None or theirs is None:
                    continue
                mine, theirs = mine.align(theirs, join="inner")
                tasks = list(dict.fromkeys(mine.index.get_level_values(0)))
                xs = [mine.loc[t].sort_index().to_numpy(float) for t in tasks]
                ys = [theirs.loc[t].sort_index().to_numpy(float) for t in tasks]
                if not xs or min(map(len, xs)) == 0:
                    continue
                interval = stats.paired(xs, ys, resamples, seed).delta
                fewest = min(map(len, xs))
                out.append({"claim": claim.name, "block": f"{100 * x:g}% KV bytes", "row": family,
                            "vs": other_family, "n": interval.n, "n_per_task": fewest, "estimate": interval.estimate,
                            "low": interval.low, "high": interval.high,
                            "threshold": "> 0" if claim.above else "< 0",
                            "verdict": stats.verdict(interval, 0.0, claim.above, strict=True)
                            if fewest >= MIN_PAIRED else f"too few samples (n={fewest} per task, need {MIN_PAIRED})"})
    return pd.DataFrame(out, columns=["claim", "block", "row", "vs", "n", "n_per_task", "estimate", "low", "high",
                                      "threshold", "verdict"])
