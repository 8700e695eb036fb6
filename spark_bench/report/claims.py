"""The paper's claims, checked on any set of runs that has the rows they need (``spark-bench-report --claims``).

Each claim compares two rows of one block (same eviction method and budget, or the full cache) on the samples
they share, with a paired bootstrap interval (:mod:`.stats`), and gets a verdict: ``holds`` (the whole interval
is on the claimed side of the threshold), ``fails`` (wholly on the other side) or ``inconclusive`` (it crosses).

1. SparK(0.5) within 1 point of its base: Δ Avg. ≥ −1 (§5.2: "nearly lossless at λ=0.5").
2. SparK(0.8) keeps ≥ 95% of its base's Avg. (abstract: "less than 5% degradation" at 80% pruning).
3. SparK(0.8) above ThinK(0.8): Δ Avg. > 0 (Tables 1–2).
4. Recovered SparK(0.8) above unrecovered SparK(0.8) (``recovery=none``): Δ Avg. > 0 (Observation 2).
5. SparK(0.8) holds ≥ 30% fewer KV bytes than its base: mean bytes ratio ≤ 0.70 (measured bytes, metadata
   included).

The same claims read on the fidelity numbers (:mod:`spark_bench.engine.fidelity`; far less noisy per sample than a
0/100 score, so they decide at sample counts where the score cannot; they say how far the cache moves the model,
the score whether the task still gets solved):

6. SparK(0.8) moves the distribution less than ThinK(0.8): Δ ``kl_full`` < 0 (the low-noise reading of 3).
7. SparK(0.8) keeps ≥ 95% of its base's agreement with the full cache: ``agree_full`` ratio ≥ 0.95 (of 2).
8. SparK(0.8) keeps the reference answer likelier than ThinK(0.8): Δ ``answer_nll`` < 0 (of 3, on the answer).

When the runs hold rows under several ``compress_scope`` values (labels ``[compress_scope=…]``), every claim is
checked within each scope (its block names the scope), and every row compressed without the question in view
(``compress_scope=context``) is set beside itself with it (``question`` / ``prompt``; kvpress warns that seeing the
question favours SnapKV-like methods):

9. ``X`` without the question within 1 point of ``X`` with it: Δ Avg. ≥ −1 (query-agnostic − query-aware).
10. ``X`` moves the distribution no further without the question: Δ ``kl_full`` ≤ 0.

A verdict is ``holds`` / ``fails`` only when every task involved has at least :data:`MIN_PAIRED` paired samples;
otherwise it reads ``too few samples (n=…)``. Twenty because a percentile bootstrap of a mean covers well below its
nominal 95% on fewer pairs (with 2 pairs an interval has at most 3 distinct values and is often zero-width), and
because the paper's RULER cells (the smallest) average at least 20 samples per task. At or above it a zero-width
interval is a real result (every pair of every task gave the same difference) and is decided.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from spark_bench.report import stats
from spark_bench.report.compare import Row, _bare, _tags, aligned, columns_of, rows_of, scope_pairs
from spark_bench.report.layouts import Layout


MIN_PAIRED = 20  # paired samples per task a verdict needs (see the module docstring)


@dataclass(frozen=True)
class Claim:
    name: str
    row: str          # channel row (without the eviction prefix), e.g. "SparK (0.8)"
    other: str        # "base" or another channel row
    statistic: str    # delta | ratio | bytes
    threshold: float
    above: bool
    strict: bool = False
    value: str = "score"  # the per-sample number compared: score | answer_nll | kl_full | agree_full


CLAIMS = (
    Claim("SparK(0.5) within 1 point of its base", "SparK (0.5)", "base", "delta", -1.0, above=True),
    Claim("SparK(0.8) keeps >= 95% of its base", "SparK (0.8)", "base", "ratio", 0.95, above=True),
    Claim("SparK(0.8) above ThinK(0.8)", "SparK (0.8)", "ThinK (0.8)", "delta", 0.0, above=True, strict=True),
    Claim("recovered SparK(0.8) above unrecovered (recovery=none)", "SparK (0.8)", "SparK (0.8) [none]", "delta",
          0.0, above=True, strict=True),
    Claim("SparK(0.8) KV bytes >= 30% below its base", "SparK (0.8)", "base", "bytes", 0.70, above=False),
    Claim("SparK(0.8) moves the distribution less than ThinK(0.8) (KL to full)", "SparK (0.8)", "ThinK (0.8)",
          "delta", 0.0, above=False, strict=True, value="kl_full"),
    Claim("SparK(0.8) keeps >= 95% of its base's agreement with full", "SparK (0.8)", "base", "ratio", 0.95,
          above=True, value="agree_full"),
    Claim("SparK(0.8) answer NLL below ThinK(0.8)", "SparK (0.8)", "ThinK (0.8)", "delta", 0.0, above=False,
          strict=True, value="answer_nll"),
)


# a row set beside itself under the other scope (:func:`~spark_bench.report.compare.scope_pairs`): its own claims
SCOPE_CLAIMS = (
    Claim("{row} without the question within 1 point of with it", "", "scope", "delta", -1.0, above=True),
    Claim("{row} moves the distribution no further without the question (KL to full)", "", "scope", "delta", 0.0,
          above=False, value="kl_full"),
)


def _row(block: str, group: str, channel: str, present: set[Row], tags: set[str] = frozenset()) -> Row | None:
    """The row of ``channel`` (e.g. ``SparK (0.8)``) in a block: ``+SparK (0.8)`` under an eviction method,
    ``SparK (0.8)`` on the full cache; with exactly the base row's ``key=value`` options (``tags``: a scope)."""
    for name in (f"+{channel}", channel):
        for row in present:
            if row[:2] == (block, group) and _bare(row[2]) == name and _options(row[2]) == tags:
                return row
    return None


def _options(label: str) -> set[str]:
    """The ``key=value`` options a row label carries (``+SparK (0.8) [none] [compress_scope=context]`` →
    ``{compress_scope=context}``; ``[none]`` is part of the row's name)."""
    return _tags(label) if _bare(label) != label else set()


def _block(block: str, tags: set[str]) -> str:
    """A claim's block as the table names it: the budget (``full cache`` without eviction), and the options its
    rows share (``[compress_scope=context]``)."""
    return (block or "full cache") + (f" [{', '.join(sorted(tags))}]" if tags else "")


def _verdict(claim: Claim, samples, row: Row, other: Row, columns, resamples: int, seed: int) -> dict | None:
    """One claim on two rows (``row`` against ``other``), or None when a number it reads was not measured."""
    value = "kv_bytes" if claim.statistic == "bytes" else claim.value
    xs, ys = aligned(samples, row, other, columns, value)
    if not xs or any(np.isnan(x).any() or np.isnan(y).any() for x, y in zip(xs, ys)):
        return None  # a fidelity number not measured (a run before it, or kl_full without a full config)
    fewest = min(len(x) for x in xs)  # paired samples of the task with the fewest
    if claim.statistic == "bytes":
        ratios = [x / y for x, y in zip(xs, ys)]
        _, interval = stats.mean_intervals(ratios, resamples, seed)
    else:
        paired = stats.paired(xs, ys, resamples, seed)
        interval = paired.delta if claim.statistic == "delta" else paired.ratio
    return {"n": interval.n, "estimate": interval.estimate, "low": interval.low, "high": interval.high,
            "threshold": f"{'>' if claim.strict else '>='} {claim.threshold:g}" if claim.above
            else f"<= {claim.threshold:g}", "n_per_task": fewest,
            "verdict": stats.verdict(interval, claim.threshold, claim.above, claim.strict)
            if fewest >= MIN_PAIRED else f"too few samples (n={fewest} per task, need {MIN_PAIRED})"}


def check(samples: pd.DataFrame, layout: Layout, resamples: int = stats.RESAMPLES,
          seed: int = stats.SEED) -> pd.DataFrame:
    """Every claim in every block (eviction method × budget, and the full cache; within each ``compress_scope``
    when rows carry one) that has the rows it needs; then every query-agnostic row beside itself query-aware
    (:data:`SCOPE_CLAIMS`)."""
    present = set(rows_of(samples))
    columns = columns_of(samples, layout)
    bases = [r for r in rows_of(samples) if not r[2].startswith("+") and _bare(r[2]) == r[1]]
    out = []

    def name(group: str, row: Row) -> str:
        label = _bare(row[2]).lstrip("+")
        return " ".join(filter(None, (group if group not in ("Vanilla", label) else "", label)))

    for base in bases:
        (block, group, _), tags = base, _options(base[2])
        for claim in CLAIMS:
            row = _row(block, group, claim.row, present, tags)
            other = base if claim.other == "base" else _row(block, group, claim.other, present, tags)
            if row is None or other is None:
                continue
            found = _verdict(claim, samples, row, other, columns, resamples, seed)
            if found is not None:
                out.append({"claim": claim.name, "block": _block(block, tags), "row": name(group, row),
                            "vs": _bare(other[2]).lstrip("+"), **found})
    for row in rows_of(samples):
        for other in scope_pairs(row, present):
            block, group, _ = row
            aware = " ".join(sorted(_options(other[2]) - _options(row[2])))
            for claim in SCOPE_CLAIMS:
                found = _verdict(claim, samples, row, other, columns, resamples, seed)
                if found is not None:
                    out.append({"claim": claim.name.format(row=name(group, row)), "block": _block(
                        block, _options(row[2])), "row": name(group, row), "vs": f"{name(group, other)} [{aware}]",
                        **found})
    return pd.DataFrame(out, columns=["claim", "block", "row", "vs", "n", "n_per_task", "estimate", "low", "high",
                                      "threshold", "verdict"])


def to_markdown(claims: pd.DataFrame) -> str:
    if claims.empty:
        return "No claim could be checked: the runs lack the rows the claims compare.\n"
    lines = [f"Verdicts need at least {MIN_PAIRED} paired samples in every task (fewest per task: n per task).", "",
             "| Claim | Block | Row | vs | n | estimate [95% CI] | threshold | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in claims.itertuples(index=False):
        lines.append(f"| {r.claim} | {r.block} | {r.row} | {r.vs} | {r.n} ({r.n_per_task} per task) | "
                     f"{r.estimate:.3f} [{r.low:.3f}, "
                     f"{r.high:.3f}] | {r.threshold} | **{r.verdict}** |")
    return "\n".join(lines) + "\n"
