"""Official per-task metrics, one entry point :func:`score`.

RULER: ``string_match_all`` / ``string_match_part`` (RULER ``eval/synthetic``) over all references at once, after
RULER's ``postprocess_pred`` (strip, control characters to newlines). LongBench: per-reference metrics, max over
the references (:mod:`spark_bench.benchmarks.longbench.metrics`)."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: list[str] | tuple[str, ...]) -> float:
    """Percentage of reference strings found (case-insensitive) in the prediction."""
    pred = ruler_postprocess(prediction).lower()
    return 100.0 * sum(ref.lower() in pred for ref in answers) / len(answers)


def string_match_part(prediction: str, answers: list[str] | tuple[str, ...]) -> float:
    """100 if any reference string is found (case-insensitive) in the prediction, else 0."""
    pred = ruler_postprocess(prediction).lower()
    return 100.0 * max(ref.lower() in pred for ref in answers)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(metric: str, prediction: str, answers, **metric_args) -> float:
    """A sample's score on a 0–100 scale."""
    from spark_bench.benchmarks.longbench.metrics import ANSWER_METRICS, longbench_score

    if metric in METRICS:
        return METRICS[metric](prediction, answers)
    if metric in ANSWER_METRICS:
        return longbench_score(metric, prediction, answers, **metric_args)
    raise ValueError(f"unknown metric {metric!r}; valid: {sorted(METRICS) + sorted(ANSWER_METRICS)}")
