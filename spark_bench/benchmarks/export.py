"""Generated samples as JSONL, so a RULER set (or any benchmark's tokenized prompts) can be shared and rerun
exactly: ``spark-bench-export benchmark=ruler_all model=... export_path=ruler.jsonl`` writes it, and
``benchmark.data_file=ruler.jsonl`` runs from it instead of generating. The records' schema, and the checks every
record passes before a run's model loads, are :mod:`spark_bench.benchmarks.records`'s."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from spark_bench.benchmarks.base import Sample
from spark_bench.benchmarks.records import read_samples  # noqa: F401 — the reading side: every record checked


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
