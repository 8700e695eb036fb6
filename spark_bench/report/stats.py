"""Intervals and paired comparisons for tables built from per-sample scores.

A table cell is the mean score of one method config over a task's samples, and ``Avg.`` the mean over tasks of
those means. Every interval here is a seeded percentile bootstrap that resamples *samples within each task*
(stratified, so every replicate has each task's own sample count): :func:`draws` fixes the resampled indices once,
and every statistic — a task mean, the average, a paired difference, a ratio of two rows — is computed on the same
draws. Methods run on the same samples, so comparisons are *paired*: both rows are resampled with the same indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RESAMPLES = 1000
SEED = 0
LEVEL = 0.95


def draws(sizes: list[int], resamples: int = RESAMPLES, seed: int = SEED) -> list[np.ndarray]:
    """Resampled indices ``(resamples, n_t)`` per task, from one seeded generator, tasks in the given order."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n, size=(resamples, n)) for n in sizes]


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    n: int  # samples behind the estimate

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def __str__(self) -> str:
        return f"{self.estimate:.2f} ± {self.half_width:.2f}"


def percentile(estimate: float, replicates: np.ndarray, n: int, level: float = LEVEL) -> Interval:
    tail = 100 * (1 - level) / 2
    low, high = np.nanpercentile(replicates, [tail, 100 - tail])  # NaN: a replicate whose ratio is undefined
    return Interval(float(estimate), float(low), float(high), n)


def task_means(tasks: list[np.ndarray], idx: list[np.ndarray]) -> np.ndarray:
    """``(resamples, n_tasks)``: each task's mean on each replicate."""
    return np.stack([x[i].mean(axis=1) for x, i in zip(tasks, idx)], axis=1)


def mean_intervals(tasks: list[np.ndarray], resamples: int = RESAMPLES, seed: int = SEED,
                   level: float = LEVEL) -> tuple[list[Interval], Interval]:
    """Per-task mean intervals and the interval of their average (the table's ``Avg.``)."""
    idx = draws([len(x) for x in tasks], resamples, seed)
    reps = task_means(tasks, idx)
    per_task = [percentile(x.mean(), reps[:, j], len(x), level) for j, x in enumerate(tasks)]
    average = percentile(np.mean([x.mean() for x in tasks]), reps.mean(axis=1), sum(map(len, tasks)), level)
    return per_task, average


@dataclass(frozen=True)
class Paired:
    """A row against its base row on the same samples."""

    delta: Interval          # mean over tasks of the mean per-sample difference (row − base)
    ratio: Interval          # Avg(row) / Avg(base)
    wins: int
    ties: int
    losses: int


def paired(row: list[np.ndarray], base: list[np.ndarray], resamples: int = RESAMPLES, seed: int = SEED,
           level: float = LEVEL) -> Paired:
    """``row`` and ``base``: per task, scores aligned sample by sample (same ids, same order)."""
    for a, b in zip(row, base):
        if a.shape != b.shape:
            raise ValueError("paired comparison needs the same samples in both rows")
    idx = draws([len(x) for x in row], resamples, seed)
    r, b = task_means(row, idx).mean(axis=1), task_means(base, idx).mean(axis=1)
    avg_r, avg_b = np.mean([x.mean() for x in row]), np.mean([x.mean() for x in base])
    n = sum(map(len, row))
    if avg_b:
        ratio = percentile(avg_r / avg_b, np.divide(r, b, out=np.full_like(r, np.nan), where=b != 0), n, level)
    else:
        ratio = Interval(float("nan"), float("nan"), float("nan"), n)
    diffs = np.concatenate([a - c for a, c in zip(row, base)])
    return Paired(percentile(avg_r - avg_b, r - b, n, level), ratio, int((diffs > 0).sum()),
                  int((diffs == 0).sum()), int((diffs < 0).sum()))


def verdict(interval: Interval, threshold: float, above: bool, strict: bool = False) -> str:
    """``holds`` when the whole interval is on the claimed side of ``threshold`` (``above``: ≥, or > when
    ``strict``; else ≤), ``fails`` when it is wholly on the other side, ``inconclusive`` when it crosses it."""
    lo, hi = interval.low, interval.high
    if np.isnan(lo) or np.isnan(hi):
        return "inconclusive"
    if above:
        ok = lo > threshold if strict else lo >= threshold
        bad = hi <= threshold if strict else hi < threshold
    else:
        ok = hi < threshold if strict else hi <= threshold
        bad = lo >= threshold if strict else lo > threshold
    return "holds" if ok else "fails" if bad else "inconclusive"
