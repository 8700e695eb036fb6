"""RULER as the official SparK code reads it: the hub set ``simonjegou/ruler`` (kvpress' RULER build).

kvpress generated RULER once (NVIDIA's generator, the base template, the Llama-3.1 tokenizer, 4K / 8K / 16K, one
config per length) and split every prompt into ``context`` / ``question`` / ``answer_prefix``, with the gold strings
in ``answer`` and the task name in ``task`` (``niah_single_1`` … ``qa_2``). The fork's ``eval.py`` runs it with
``compress_questions=1``: the user turn is ``context + question`` in the model's chat template, then the answer
prefix after the assistant header; greedy decoding for the record's ``max_new_tokens``; scored with RULER's
``string_match_all`` (``string_match_part`` for qa).

``ruler.source=kvpress`` reads these records (``ruler.kvpress_path``: a local directory, its hub-cache snapshot or
the hub) instead of generating samples; the lengths are the set's (``benchmark.length`` picks the config, 4096,
8192 or 16384), the first ``benchmark.num_samples`` records of each task are used.
"""

from __future__ import annotations

from spark_bench.benchmarks.base import Sample, encode_prompt, question_start
from spark_bench.models import LoadedModel

LENGTHS = (4096, 8192, 16384)
FIELDS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")


def kvpress_source(path: str) -> str:
    """Where the set is read from: a local directory, its hub-cache snapshot, or the hub id when reachable."""
    from spark_bench import hub

    return hub.resolve(path, "dataset", "RULER records (ruler.source=kvpress)",
                       f"download the set once with `hf download {path} --repo-type dataset`, set "
                       "ruler.kvpress_path= to a local copy, or use ruler.source=generate (offline generators)")


def read_records(path: str, length: int) -> list[dict]:
    if length not in LENGTHS:
        raise ValueError(f"benchmark.length={length}: the kvpress RULER set has lengths {LENGTHS}")
    from datasets import load_dataset

    records = [dict(r) for r in load_dataset(kvpress_source(path), data_dir=str(length), split="test")]
    missing = [k for k in FIELDS if records and k not in records[0]]
    if missing:
        raise ValueError(f"ruler.kvpress_path={path}: records lack field(s) {missing} (expected {list(FIELDS)})")
    return records


def to_sample(record: dict, index: int, lm: LoadedModel, max_new_tokens: int | None = None) -> Sample:
    context, question = record["context"], record["question"]
    prompt = encode_prompt(lm.tokenizer, context + question, record["answer_prefix"], lm.config.chat_template,
                           question_at=question_start(context + question, context))
    answers = record["answer"]
    answers = [answers] if isinstance(answers, str) else list(answers)
    task = record["task"]
    return Sample(task=task, id=f"{task}-{index}", input_ids=tuple(prompt.ids), answers=tuple(map(str, answers)),
                  max_new_tokens=max_new_tokens or int(record["max_new_tokens"]),
                  metric="string_match_part" if task.startswith("qa") else "string_match_all",
                  meta={"haystack": "simonjegou/ruler"}, context_end=prompt.context_end,
                  question_end=prompt.question_end)


def load_kvpress_ruler(tasks, length: int, num_samples: int, lm: LoadedModel, path: str = "simonjegou/ruler",
                       max_new_tokens: int | None = None) -> list[Sample]:
    by_task: dict[str, list[dict]] = {}
    for record in read_records(path, length):
        by_task.setdefault(record["task"], []).append(record)
    missing = [t for t in tasks if t not in by_task]
    if missing:
        raise ValueError(f"ruler.kvpress_path={path} (length {length}) has no records of task(s) {missing}; "
                         f"it has: {', '.join(sorted(by_task))}")
    return [to_sample(r, i, lm, max_new_tokens) for task in tasks for i, r in enumerate(by_task[task][:num_samples])]
