"""Generated samples as JSONL, so a RULER set (or any benchmark's tokenized prompts) can be shared and rerun
exactly: ``spark-bench-export benchmark=ruler_all model=... export_path=ruler.jsonl`` writes it, and
``benchmark.data_file=ruler.jsonl`` runs from it instead of generating."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

from spark_bench.benchmarks.base import Sample, read_jsonl

FIELDS = tuple(f.name for f in fields(Sample))
TUPLE_FIELDS = ("input_ids", "answers", "stop_token_ids")
REQUIRED = ("task", "id", "input_ids", "answers", "max_new_tokens", "metric")


def write_samples(samples: list[Sample], path: Path, tokenizer=None) -> None:
    """One JSON object per sample (all :class:`Sample` fields, plus the prompt text when a tokenizer is given).
    Written to a temporary file first, so an interrupted export never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for s in samples:
            record = asdict(s)
            if tokenizer is not None:
                record["prompt"] = tokenizer.decode(s.input_ids)
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_samples(path: str | Path) -> list[Sample]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"benchmark.data_file: {path} does not exist")
    samples = []
    for record in read_jsonl(file, REQUIRED, "sample"):
        values = {k: record[k] for k in FIELDS if k in record}
        values.update({k: tuple(values[k]) for k in TUPLE_FIELDS if k in values})
        samples.append(Sample(**values))
    return samples
