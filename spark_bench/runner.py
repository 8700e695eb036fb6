"""The straight data path: prompt → prefill (once per sample) → compress (per method config) → decode → score,
then the tables. Hydra-free so tests and scripts can call it directly; :mod:`spark_bench.cli` is the front end."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from spark_bench.benchmarks.base import Sample
from spark_bench.benchmarks.metrics import score
from spark_bench.engine.decode import greedy_decode
from spark_bench.engine.prefill import run_prefill
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.pipeline import kept_key_fraction
from spark_bench.models import LoadedModel
from spark_bench.tables import render_markdown, summarize


@dataclass(frozen=True)
class Prediction:
    config: str
    method: dict
    task: str
    id: str
    prompt_length: int
    prediction: str
    tokens: list[int]
    answers: list[str]
    score: float
    kv_bytes: int
    kv_bytes_full: int
    key_ratio: float  # achieved key pruning ratio over the stored tokens (paper's "Overall Ratio")
    prefill_s: float
    compress_s: float
    decode_s: float

    def to_json(self) -> str:
        return json.dumps(self.__dict__, ensure_ascii=False)


def run_sample(lm: LoadedModel, sample: Sample, pipelines: list[Pipeline]) -> list[Prediction]:
    """Prefill ``sample`` once, then compress + decode + score it under every pipeline."""
    window = max([p.config.window_size for p in pipelines] + [1])
    specs = {p.query_stats for p in pipelines} - {None}
    if len(specs) > 1:
        raise ValueError(f"one sweep cannot mix query-statistics settings {sorted(map(str, specs))} (n_sink)")
    input_ids = torch.tensor([sample.input_ids], device=lm.device)
    prefill = run_prefill(lm.model, input_ids, window, query_stats=next(iter(specs), None))
    full_bytes = prefill.dense_kv_bytes()
    out = []
    for pipeline in pipelines:
        cache, compress_s = pipeline.build_cache(prefill)
        kv_bytes = cache.nbytes()
        start = time.perf_counter()
        tokens = greedy_decode(lm.model, cache, prefill.first_logits, prefill.prompt_length,
                               sample.max_new_tokens, lm.stop_token_ids | set(sample.stop_token_ids),
                               sample.min_new_tokens)
        decode_s = time.perf_counter() - start
        text = lm.tokenizer.decode(tokens, skip_special_tokens=True)
        out.append(Prediction(
            config=pipeline.config.label, method=pipeline.config.to_dict(), task=sample.task, id=sample.id,
            prompt_length=prefill.prompt_length, prediction=text, tokens=tokens, answers=list(sample.answers),
            score=score(sample.metric, text, sample.answers, **sample.metric_args), kv_bytes=kv_bytes, kv_bytes_full=full_bytes,
            key_ratio=round(1 - kept_key_fraction(cache), 6),
            prefill_s=prefill.seconds, compress_s=compress_s, decode_s=decode_s))
    return out


def run_sweep(lm: LoadedModel, samples: list[Sample], configs: list[MethodConfig], out_dir: Path,
              log=print) -> pd.DataFrame:
    """Run every config on every sample, writing ``predictions.jsonl``, ``scores.csv`` and ``table.md``."""
    labels = [c.label for c in configs]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"sweep has duplicate method configs (same table row): {duplicates}")
    pipelines = [Pipeline.from_config(c) for c in configs]
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(out_dir / "predictions.jsonl", "w", encoding="utf-8") as f:
        for i, sample in enumerate(samples, 1):
            start = time.perf_counter()
            preds = run_sample(lm, sample, pipelines)
            for p in preds:
                f.write(p.to_json() + "\n")
                rows.append(p.__dict__)
            f.flush()
            log(f"[{i}/{len(samples)}] {sample.id} ({preds[0].prompt_length} tok) "
                f"{time.perf_counter() - start:.1f}s: " + ", ".join(f"{p.config}={p.score:.0f}" for p in preds))
    predictions = pd.DataFrame(rows)
    tasks = list(dict.fromkeys(s.task for s in samples))
    scores = summarize(predictions, labels, tasks)
    scores.to_csv(out_dir / "scores.csv", index=False)
    (out_dir / "table.md").write_text(render_markdown(scores, labels, tasks), encoding="utf-8")
    return predictions
