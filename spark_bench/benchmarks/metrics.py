"""Official per-task metrics. RULER: ``string_match_all`` / ``string_match_part`` (RULER ``eval/synthetic``),
applied after RULER's ``postprocess_pred`` (strip, control characters to newlines)."""

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


def score(metric: str, prediction: str, answers) -> float:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid: {sorted(METRICS)}")
    return METRICS[metric](prediction, answers)
