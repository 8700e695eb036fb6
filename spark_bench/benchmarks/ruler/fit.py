"""Fitting a RULER haystack to a target length with the model's own tokenizer (RULER's binary searches)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from spark_bench.benchmarks.base import Prompt, Sample


def largest_fitting(fits: Callable[[int], bool], limit: int = 1 << 20, least: int = 1) -> int:
    """Largest ``n`` in ``least … limit`` with ``fits(n)`` (``fits`` monotone: true up to some point), or
    ``least − 1`` when none fits. Exponential growth then binary search, as RULER's generators search their
    haystack sizes; ``least`` is the smallest haystack a task can be built with."""
    offset = least - 1
    lo, hi = 0, 1
    while hi <= limit - offset and fits(offset + hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit - offset + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(offset + mid) else (lo, mid)
    return offset + lo

def shrink_to_fit(encode: Callable[[int], tuple[Prompt, list[str]]], count: int, step: int, budget: int,
                  least: int = 1) -> tuple[Prompt, list[str], int]:
    """RULER's per-sample loop: ``encode(count)`` and drop one increment of haystack while the prompt is longer than
    ``budget``, never going below ``least`` units; ``(ids, answers, count used)``."""
    while True:
        ids, answers = encode(count)
        if len(ids) <= budget or count - step < least:
            return ids, answers, count
        count -= step


def make_sample(task: str, index: int, prompt: Prompt, answers, tokens_to_generate: int,
                max_new_tokens: int | None, metric: str, **meta) -> Sample:
    from spark_bench.benchmarks.base import Sample

    return Sample(task=task, id=f"{task}-{index}", input_ids=tuple(prompt.ids), answers=tuple(answers),
                  max_new_tokens=max_new_tokens or tokens_to_generate, metric=metric, meta=meta,
                  context_end=prompt.context_end, question_end=prompt.question_end)


def too_short(task: str, length: int, smallest: int, generate: int) -> ValueError:
    """The refusal of a length a task cannot fit: its smallest prompt (``smallest`` tokens) plus the tokens kept
    for the answer (``generate``), naming the key that fixes it."""
    return ValueError(f"benchmark.length={length} is too short for RULER {task}: its smallest prompt takes "
                      f"{smallest} tokens and {generate} are kept for the answer; use benchmark.length >= "
                      f"{smallest + generate}")
