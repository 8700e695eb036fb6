"""RULER (Hsieh et al., 2024) tasks generated offline for any tokenizer and target length."""

from __future__ import annotations

from spark_bench.benchmarks.base import Sample
from spark_bench.benchmarks.ruler.niah import NIAH_TASKS, generate_niah
from spark_bench.models import LoadedModel

RULER_TASKS = tuple(NIAH_TASKS)


def load_ruler(tasks, length: int, num_samples: int, seed: int, lm: LoadedModel,
               max_new_tokens: int | None = None) -> list[Sample]:
    unknown = [t for t in tasks if t not in RULER_TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {unknown}; valid: {', '.join(RULER_TASKS)}")
    if length > lm.config.max_length:
        raise ValueError(f"benchmark.length={length} exceeds model {lm.config.name} max_length={lm.config.max_length}")
    samples: list[Sample] = []
    for task in tasks:
        samples += generate_niah(task, lm.tokenizer, length, num_samples, seed,
                                 chat_template=lm.config.chat_template, max_new_tokens=max_new_tokens)
    return samples
