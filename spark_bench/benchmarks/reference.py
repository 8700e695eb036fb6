"""The reference answer of a sample as the task expects it after its answer prefix — the text whose likelihood
``answer_nll`` measures (:mod:`spark_bench.engine.fidelity`).

RULER prompts end in an answer prefix without a trailing space (``… mentioned in the provided text are``), and its
one-shot examples show the answer's form: ``cwe`` numbers its words (``1. w 2. w …``, ``common_words.py``), ``vt``
and ``fwe`` list them separated by spaces, needle tasks list the values separated by commas, ``qa`` gives one
answer; each after one space. LongBench (and any other metric): the first reference as written (its prompts end
before the answer, as its ``pred.py`` builds them).
"""

from __future__ import annotations

from spark_bench.benchmarks.base import Sample

RULER_METRICS = ("string_match_all", "string_match_part")


def reference_text(sample: Sample) -> str:
    """The answer text teacher-forced after ``sample``'s prompt ("" when the sample has no reference)."""
    answers = [str(a) for a in sample.answers]
    if not answers:
        return ""
    if sample.metric not in RULER_METRICS:
        return answers[0]
    family = sample.task.split("_")[0]
    if family == "cwe":
        return " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(answers))
    if family in ("vt", "fwe"):
        return " " + " ".join(answers)
    if family == "niah":
        return " " + ", ".join(answers) + "."
    return " " + answers[0]


def reference_ids(sample: Sample, tokenizer) -> list[int]:
    """``reference_text`` tokenized on its own (no special tokens), at most ``max_new_tokens`` of it (what decoding
    could have produced). The seam with the prompt may merge differently than in one tokenization of both."""
    text = reference_text(sample)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])[:sample.max_new_tokens] if text else []
