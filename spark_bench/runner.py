"""The straight data path: prompt → prefill (once per sample) → compress (per method config) → decode → score,
then the tables. Hydra-free so tests and scripts can call it directly; :mod:`spark_bench.cli` is the front end."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from spark_bench.benchmarks.base import Sample
from spark_bench.benchmarks.metrics import score
from spark_bench.engine.decode import DecodeRow, decode_rows
from spark_bench.engine.prefill import run_prefill
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.pipeline import kept_key_fraction
from spark_bench.models import LoadedModel
from spark_bench.results import TIMING_FIELDS, ResultsDir, read_complete_lines
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
    decode_s: float  # this config's share of the batched decode forwards (wall time / rows in the batch, per step)


def run_sample(lm: LoadedModel, sample: Sample, pipelines: list[Pipeline],
               decode_batch: int | None = None) -> list[Prediction]:
    """Prefill ``sample`` once, then compress it under every pipeline and decode the compressed caches together,
    ``decode_batch`` rows per batch (None: all pipelines in one batch; 1: one at a time), then score."""
    window = max([p.config.window_size for p in pipelines] + [1])
    specs = {p.query_stats for p in pipelines} - {None}
    if len(specs) > 1:
        raise ValueError(f"one sweep cannot mix query-statistics settings {sorted(map(str, specs))} (n_sink)")
    input_ids = torch.tensor([sample.input_ids], device=lm.device)
    prefill = run_prefill(lm.model, input_ids, window, query_stats=next(iter(specs), None))
    full_bytes = prefill.dense_kv_bytes()
    stops = lm.stop_token_ids | set(sample.stop_token_ids)
    size = decode_batch or len(pipelines)
    out, selections = [], {}
    for chunk in (pipelines[i:i + size] for i in range(0, len(pipelines), size)):
        built = [pipeline.build_cache(prefill, selections=selections) for pipeline in chunk]
        rows = [DecodeRow(cache, prefill.first_logits, prefill.prompt_length, sample.max_new_tokens, stops,
                          sample.min_new_tokens) for cache, _ in built]
        measured = [(cache.nbytes(), round(1 - kept_key_fraction(cache), 6)) for cache, _ in built]
        decode_rows(lm.model, rows)
        for pipeline, (_, compress_s), row, (kv_bytes, key_ratio) in zip(chunk, built, rows, measured):
            text = lm.tokenizer.decode(row.tokens, skip_special_tokens=True)
            out.append(Prediction(
                config=pipeline.config.label, method=pipeline.config.to_dict(), task=sample.task, id=sample.id,
                prompt_length=prefill.prompt_length, prediction=text, tokens=row.tokens, answers=list(sample.answers),
                score=score(sample.metric, text, sample.answers, **sample.metric_args), kv_bytes=kv_bytes,
                kv_bytes_full=full_bytes, key_ratio=key_ratio, prefill_s=prefill.seconds, compress_s=compress_s,
                decode_s=row.forward_s))
    return out


def default_payload(lm: LoadedModel, samples: list[Sample], configs: list[MethodConfig]) -> dict:
    """What a results directory is a function of: the method configs, the model and the exact samples."""
    data = hashlib.sha256(json.dumps([[s.id, list(s.input_ids), list(s.answers), s.max_new_tokens]
                                      for s in samples]).encode()).hexdigest()[:16]
    return {"configs": [c.to_dict() for c in configs], "model": lm.config.name, "samples": data}


def run_sweep(lm: LoadedModel, samples: list[Sample], configs: list[MethodConfig], out_dir: Path,
              log=print, payload: dict | None = None, progress: bool = False,
              decode_batch: int | None = None) -> pd.DataFrame:
    """Run every config on every sample into ``out_dir`` (``predictions.jsonl``, ``timings.jsonl``, ``scores.csv``,
    ``table.md``). Finished (sample, config) pairs already in ``out_dir`` are kept, not recomputed.
    ``decode_batch``: method configs decoded together per sample (None = all; the tokens do not depend on it)."""
    if decode_batch is not None and (not isinstance(decode_batch, int) or decode_batch < 1):
        raise ValueError(f"decode_batch must be a positive integer or null (all configs), got {decode_batch!r}")
    labels = [c.label for c in configs]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"sweep has duplicate method configs (same table row): {duplicates}")
    ids = [s.id for s in samples]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate sample ids: {sorted({i for i in ids if ids.count(i) > 1})[:5]}")
    pipelines = [Pipeline.from_config(c) for c in configs]
    results = ResultsDir(out_dir, payload or default_payload(lm, samples, configs))
    done = {(r["id"], r["config"]): r for r in results.open()}
    timing = {(r["id"], r["config"]): r for r in read_complete_lines(results.timings)}
    resumed = sum((s.id, label) in done for s in samples for label in labels)
    if resumed:
        log(f"resuming {out_dir}: {resumed} of {len(samples) * len(labels)} predictions already done")
    bar = tqdm(samples, desc=out_dir.name, unit="sample", disable=not progress, dynamic_ncols=True)
    new_tokens, decode_seconds = 0, 0.0
    for sample in bar:
        todo = [p for p in pipelines if (sample.id, p.config.label) not in done]
        if not todo:
            continue
        records = [p.__dict__ for p in run_sample(lm, sample, todo, decode_batch)]
        results.append(records)
        for r in records:
            done[r["id"], r["config"]] = timing[r["id"], r["config"]] = r
        new_tokens += sum(len(r["tokens"]) for r in records)
        decode_seconds += sum(r["decode_s"] for r in records)
        bar.set_postfix(tok_s=f"{new_tokens / max(decode_seconds, 1e-9):.1f}")
        if not progress:
            log(f"{sample.id} ({records[0]['prompt_length']} tok): "
                + ", ".join(f"{r['config']}={r['score']:.0f}" for r in records))
    ordered = [done[s.id, label] for s in samples for label in labels]
    predictions = pd.DataFrame([{**r, **{k: timing.get((r["id"], r["config"]), {}).get(k, float("nan"))
                                         for k in TIMING_FIELDS}} for r in ordered])
    tasks = list(dict.fromkeys(s.task for s in samples))
    scores = summarize(predictions, labels, tasks)
    results.finalize(ordered, {"scores.csv": scores.to_csv(index=False),
                               "table.md": render_markdown(scores, labels, tasks)})
    for label, group in predictions.groupby("config", sort=False):
        rate = group.tokens.map(len).sum() / max(group.decode_s.sum(), 1e-9)
        log(f"{label}: score {group.score.mean():.2f}, KV {100 * (group.kv_bytes / group.kv_bytes_full).mean():.1f}%"
            f", decode {rate:.1f} tok/s")
    return predictions
