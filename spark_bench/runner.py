"""The straight data path: prompt → prefill (once per sample) → compress (per method config) → decode → score,
then the tables. Hydra-free so tests and scripts can call it directly; :mod:`spark_bench.cli` is the front end."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pandas as pd

from spark_bench.engine.compress import compress_prefill, prefill_for
from spark_bench.benchmarks.base import Sample
from spark_bench.benchmarks.metrics import score
from spark_bench.engine.clock import mapped_large_blocks, peak_memory, reset_peak, return_freed_memory
from spark_bench.engine.decode import DecodeRow, decode_rows, prime_rows
from spark_bench.engine.fastpaths import FastPaths
from spark_bench.engine.fidelity import Fidelity, ForcedRow, measure
from spark_bench.benchmarks.reference import reference_ids
from spark_bench.engine.prefill import Prefill
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.pipeline import sweep_labels
from spark_bench.usercode import UserCodeError
from spark_bench.models import LoadedModel
from spark_bench.samples import context_units
from spark_bench import provenance, upgrade
from spark_bench.results import TIMING_FIELDS, ResultsDir, read_complete_lines
from spark_bench.logs import Progress
from spark_bench.tables import (
    FIDELITY_COLUMNS, FIDELITY_SKIPPED, NO_FULL, per_task, render_markdown, score_table, summarize, with_fidelity,
)

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prediction:
    config: str
    method: dict
    task: str
    id: str
    prompt_length: int
    prediction: str
    tokens: list[int]
    new_tokens: int  # tokens generated (its stop token not counted)
    stopped: bool    # it ended on a stop token of its own, not at max_new_tokens
    answers: list[str]
    score: float
    kv_bytes: int
    kv_bytes_full: int
    key_ratio: float  # achieved key pruning ratio over the stored tokens (paper's "Overall Ratio")
    length: int | None  # the record's own length (LongBench words: LongBench-E's 0-4k / 4-8k / 8k+), else None
    answer_nll: float | None  # mean NLL per token of the reference answer through this config's cache (fidelity.py)
    kl_full: float | None     # mean KL(full ‖ this config) along the full cache's greedy continuation
    agree_full: float | None  # fraction of those positions whose most likely token is the full cache's
    kl_tokens: int            # the positions kl_full / agree_full average over (≤ fidelity.KL_TOKENS)
    fidelity: bool            # the fidelity pass ran (fidelity=false: it did not, and the four fields above are left
    # out of its record, so that a rerun with fidelity=true computes them)
    prefill_s: float
    compress_s: float
    decode_s: float  # this config's share of the batched decode forwards (wall time / rows in the batch, per step)
    peak_mem_bytes: int  # peak memory of its decode batch (prefill + compression + decode + the fidelity pass)
    # (CUDA: max allocated; CPU: the process's peak resident set), see :mod:`spark_bench.engine.clock`
    warmup_s: float = 0.0  # its share of the first uses of fast-path variants in its batch (compile, run-time check)
    fidelity_s: float | None = None  # its share of the fidelity pass (engine/fidelity.py; None: not run)
    question: int | None = None  # its position among its context's questions (meta.question; None: the only one)
    answer_s: float = 0.0    # end to end: its share of the sample's prefill (prefill_s over the configs it served),
    # compress_s and decode_s (not warmup_s, once per run, nor fidelity_s, which measures and answers nothing)

    def record(self) -> dict:
        """The prediction as stored (timing fields included; :class:`ResultsDir` splits them off); without the
        fidelity numbers when the pass did not run."""
        out = dict(self.__dict__)
        if not self.fidelity:
            for name in FIDELITY_FIELDS:
                del out[name]
        return out


# what a resume restores from the sample, the config and the stored prediction (upgrade.refresh); every other
# field of a prediction needs the model and the caches: a stored record without one of them is computed again
RESTORED = ("task", "answers", "length", "method", "score", "new_tokens", "stopped", "fidelity", "question")
CACHE_FIELDS = tuple(f.name for f in fields(Prediction) if f.name not in (*TIMING_FIELDS, *RESTORED))
FIDELITY_FIELDS = ("answer_nll", "kl_full", "agree_full", "kl_tokens")  # what the fidelity pass gives a prediction


def cache_fields(fidelity: bool = True) -> tuple[str, ...]:
    """The fields a stored prediction must hold not to be computed again: :data:`CACHE_FIELDS`, without the
    fidelity numbers when the run skips the pass (``fidelity=false``)."""
    return CACHE_FIELDS if fidelity else tuple(f for f in CACHE_FIELDS if f not in FIDELITY_FIELDS)


def _prefill(lm: LoadedModel, sample: Sample, pipelines: list[Pipeline]) -> Prefill:
    """One prefill of the whole prompt serves every pipeline, whatever part of the prompt it compresses."""
    return prefill_for(lm.model, sample.input_ids, pipelines,
                       [sample.scope_end(p.config.compress_scope) for p in pipelines])


def _context_key(sample: Sample, pipeline: Pipeline) -> tuple | None:
    """Where one compressed cache answers several questions: a query-agnostic config (``compress_scope=context``)
    over a sample that is one of a context's questions (``meta.context``, :func:`spark_bench.samples.group_contexts`)
    — ``(context, config)``; None for every other row (query-aware scopes compress each question on its own)."""
    context = sample.meta.get("context")
    if context is None or pipeline.config.compress_scope != "context" or not sample.context_end:
        return None
    return context, pipeline.label


def _shared(shared: dict, sample: Sample, pipeline: Pipeline):
    """The context's compressed cache this sample's question is answered from, if one was built for an earlier
    question of the same context ids: the same cache (never written: each row's question and answer go to its own
    tail), this question's ids after it; else None."""
    key = _context_key(sample, pipeline)
    context = shared.get(key) if key is not None else None
    end = sample.context_end
    if context is None or context.end != end or context.input_ids[:end] != tuple(sample.input_ids[:end]):
        return None
    ids = tuple(sample.input_ids)  # the dense size of this question's whole prompt, at the context's bytes per token
    return replace(context, input_ids=ids, dense_bytes=context.dense_bytes // len(context.input_ids) * len(ids),
                   compress_s=0.0)  # compressed once, for the context's first question (its compress_s)


def _build_row(lm: LoadedModel, sample: Sample, pipeline: Pipeline, prefill: Prefill | None,
               selections: dict, shared: dict | None = None) -> tuple[DecodeRow, tuple[float, int, float]]:
    """Compress ``prefill`` under ``pipeline`` into a decode row (the library's :func:`~spark_bench.api.compress`
    step); also (compress seconds, KV bytes when decoding starts, key ratio). ``selections``: the sample's token
    selections, shared by its configs. ``shared``: the run's compressed contexts by :func:`_context_key`: a
    question of a context compressed for an earlier question is answered from that cache (no prefill needed)."""
    context = None if shared is None else _shared(shared, sample, pipeline)
    try:
        if context is None:
            context = compress_prefill(prefill, pipeline, sample.input_ids,
                                       sample.scope_end(pipeline.config.compress_scope), selections)
            if shared is not None and _context_key(sample, pipeline) is not None:
                shared[_context_key(sample, pipeline)] = context
    except UserCodeError as err:  # a method of one's own failed (methods/registry.py): which sample it was
        raise err.at(sample.id) from err.__cause__
    row = DecodeRow(context.cache, context.first_logits, context.end, sample.max_new_tokens,
                    lm.stop_token_ids | set(sample.stop_token_ids), sample.min_new_tokens, suffix=context.suffix)
    return row, (context.compress_s, context.kv_bytes, context.key_ratio)




def _forced(row: DecodeRow) -> ForcedRow:
    """A decoded row as the fidelity pass teacher-forces it (the continuation is set there)."""
    return ForcedRow(row.cache, row.first_logits, row.position, tuple(row.suffix), [], row.tail)


def run_samples(lm: LoadedModel, work: list[tuple[Sample, list[Pipeline]]],
                decode_batch: int | None = None, decode_stack: bool = True,
                decode_graph: bool = True, full: Pipeline | None = None,
                full_tokens: dict | None = None, checks: FastPaths | None = None,
                fidelity: bool = True, configs: int | None = None) -> list[list[Prediction]]:
    """Prefill each sample once, compress it under each of its pipelines and decode all the compressed caches
    together — ``decode_batch`` rows per batch (None: every row of ``work`` in one batch; 1: one at a time) — then
    score, and measure each row's fidelity (``answer_nll``, ``kl_full``, ``agree_full``) teacher-forced through its
    cache right after its batch decodes (:func:`~spark_bench.engine.fidelity.measure`: forwards of a fixed number of
    rows, :func:`~spark_bench.engine.decode.group_size` of the sweep's ``configs`` (default: the most any sample has),
    over the tokens each compares, from the suffix each ran before the batch decoded,
    :func:`~spark_bench.engine.decode.prime_rows`), after which its cache is released. One list of predictions
    per sample, in pipeline order; neither the tokens nor the fidelity numbers depend on the batching (the numbers
    byte for byte: every forward of the pass has one shape, :func:`~spark_bench.engine.decode.fixed_groups`).

    A sample is prefilled when its first row is built and its prefill is dropped once its last row is built, so
    joining several samples in one batch holds their compressed caches, not their prefills (a ``full`` row's cache
    is the prefill's own keys and values). A sample's full-cache row (``full``: the sweep's full pipeline; None:
    the one among the samples' pipelines, if any) is planned first among its rows, so the full cache's
    distributions along its greedy tokens — the ``(positions, vocabulary)`` log-probabilities each row's
    ``kl_full`` compares with — are known before any other row's pass; they are kept until the sample's last row.
    A sample resumed with its full row already done builds the full cache again for its first pass (not decoded):
    ``full_tokens`` (sample id → the done full row's tokens) gives its continuation. ``decode_stack``: stack rows
    of the kinds a compact kernel serves; the tokens do not depend on it. ``checks``: the run's record of its fast
    paths (:mod:`~spark_bench.engine.fastpaths`; default: a new one), each checked at its first use by the decode
    batches and fidelity passes alike. ``fidelity=False``: no pass (the predictions' ``fidelity`` is False, their
    numbers None); each row's ``fidelity_s`` is its share of the pass, ``answer_s`` its own end-to-end seconds."""
    checks = FastPaths() if checks is None else checks
    configs = configs or max((len(pipelines) for _, pipelines in work), default=1)
    if full is None:  # a library call: the full pipeline among the samples' own, if any
        full = next((p for _, pipelines in work for p in pipelines if p.config.name == "full"), None)
    first_full = (lambda p: p is not full) if full is not None else (lambda p: False)
    plan = [(i, pipeline) for i, (_, pipelines) in enumerate(work) for pipeline in sorted(pipelines, key=first_full)]
    last = {i: k for k, (i, _) in enumerate(plan)}  # the plan index of each sample's last row
    # a context's questions (meta.context) answer from one compressed cache per query-agnostic config: kept from its
    # first question's row to its last question's (the plan index of the context's last row)
    last_of = {work[i][0].meta["context"]: k for k, (i, _) in enumerate(plan) if work[i][0].meta.get("context")}
    shared: dict = {}  # (context, config label) → the CompressedContext its questions answer from
    size = decode_batch or len(plan)
    prefills: dict[int, Prefill] = {}  # sample index → its prefill, while some of its rows are still to be built
    selections: dict = {}  # sample index → {compressed prefix: token selections shared by its configs}
    facts: dict = {}       # sample index → (prompt length, dense KV bytes, prefill seconds)
    rebuilt: dict = {}     # sample index → its full row built again (resumed with the full row done), for its pass
    compared: dict = {}    # sample index → (the full row's greedy tokens, their log-probabilities), [] / None if none
    done_rows: dict = {}   # sample index → [(pipeline, measured, row, peak, fidelity)] so far
    out: list[list[Prediction]] = [[] for _ in work]
    for first in range(0, len(plan), size):
        chunk = plan[first:first + size]
        rows, built = [], []
        reset_peak(lm.devices)
        with mapped_large_blocks():  # CPU: large temporaries go back to the system when freed (clock.py)
            for k, (i, pipeline) in enumerate(chunk, first):
                sample = work[i][0]
                if i not in facts:
                    again = fidelity and full is not None and full not in work[i][1]
                    # a question whose every config answers from its context's cache, compressed for an earlier
                    # question (compress_scope=context), needs no prefill of its own
                    own = [p for p in work[i][1] + [full] * again if _shared(shared, sample, p) is None]
                    if own:
                        prefills[i] = _prefill(lm, sample, own)
                        facts[i] = (prefills[i].prompt_length, prefills[i].dense_kv_bytes(), prefills[i].seconds)
                    else:
                        cached = _shared(shared, sample, pipeline)
                        facts[i] = (len(sample.input_ids), cached.dense_bytes, 0.0)
                    if again:
                        rebuilt[i] = _build_row(lm, sample, full, prefills.get(i), selections.setdefault(i, {}),
                                                shared)[0]
                row, measured = _build_row(lm, sample, pipeline, prefills.get(i), selections.setdefault(i, {}),
                                           shared)
                rows.append(row)
                built.append(measured)
                if k == last[i]:
                    prefills.pop(i, None)
                    selections.pop(i, None)
                if k == last_of.get(sample.meta.get("context")):  # the context's last question: its caches go
                    shared = {key: c for key, c in shared.items() if key[0] != sample.meta.get("context")}
        return_freed_memory()  # what compression freed, before decoding allocates its tail
        with mapped_large_blocks():  # the suffixes' and the passes' large temporaries too: only the steps use the heap
            for i in dict.fromkeys(i for i, _ in chunk) if fidelity else ():  # each sample's suffixes, in fixed groups:
                prime_rows(lm.model, [rows[k] for k, (j, _) in enumerate(chunk) if j == i], decode_stack, checks,
                           configs, facts[i][0])  # its pass continues from them, whatever the batch (prime_rows)
        decode_rows(lm.model, rows, stack=decode_stack, release=False, graph=decode_graph, checks=checks)
        passed = [] if fidelity else [(k, Fidelity(None, None, None, 0)) for k in range(len(chunk))]
        with mapped_large_blocks():
            for i in dict.fromkeys(i for i, _ in chunk) if fidelity else ():  # per sample in this batch, its rows' pass
                mine = [(k, p) for k, (j, p) in enumerate(chunk) if j == i]
                forced = [_forced(rows[k]) for k, _ in mine]
                sample, at = work[i][0], None
                if i not in compared and full is not None:  # the sample's first pass: the full row is its first
                    at = 0 if mine[0][1] is full else len(forced)
                    if at:
                        again = rebuilt.pop(i)
                        prime_rows(lm.model, [again], decode_stack, checks, configs, facts[i][0])
                        forced.append(_forced(again))
                    compared[i] = (rows[mine[0][0]].tokens if not at else full_tokens[sample.id], None)
                greedy, log_probs = compared.get(i, ([], None))
                numbers, log_probs = measure(lm.model, forced, reference_ids(sample, lm.tokenizer), greedy, full=at,
                                             full_log_probs=log_probs, stack=decode_stack, checks=checks,
                                             configs=configs, width=facts[i][0])
                compared[i] = (greedy, log_probs)
                passed += [(k, f) for (k, _), f in zip(mine, numbers)]
        per_row = [f for _, f in sorted(passed, key=lambda x: x[0])]
        for row in rows:
            row.cache = row.tail = None  # the batch's caches go once its passes are done
        peak = peak_memory(lm.devices)  # the batch's prefills, compression, decoding and teacher-forced passes
        for k, ((i, pipeline), measured, row, f) in enumerate(zip(chunk, built, rows, per_row), first):
            done_rows.setdefault(i, []).append((pipeline, measured, row, peak, f))
            if k != last[i]:
                continue
            sample, (length, dense_bytes, prefill_s) = work[i][0], facts.pop(i)
            compared.pop(i, None)
            order = {p.label: n for n, p in enumerate(work[i][1])}
            for pipeline, (compress_s, kv_bytes, key_ratio), row, peak, f in sorted(
                    done_rows.pop(i), key=lambda x: order[x[0].label]):
                text = lm.tokenizer.decode(row.tokens, skip_special_tokens=True)
                share = prefill_s / len(work[i][1])  # the sample's one prefill served each of its configs
                out[i].append(Prediction(
                    config=pipeline.label, method=pipeline.config.to_dict(), task=sample.task, id=sample.id,
                    prompt_length=length, prediction=text, tokens=row.tokens, new_tokens=len(row.tokens),
                    stopped=len(row.tokens) < row.max_new_tokens, answers=list(sample.answers),
                    score=score(sample.metric, text, sample.answers, **sample.metric_args), kv_bytes=kv_bytes,
                    kv_bytes_full=dense_bytes, key_ratio=key_ratio, length=sample.meta.get("length"),
                    question=sample.meta.get("question"),
                    answer_nll=_stored(f.answer_nll), kl_full=_stored(f.kl_full), agree_full=_stored(f.agree_full),
                    kl_tokens=f.kl_tokens, fidelity=fidelity, prefill_s=prefill_s, compress_s=compress_s,
                    decode_s=row.forward_s, peak_mem_bytes=peak, warmup_s=row.warmup_s,
                    fidelity_s=f.seconds if fidelity else None,
                    answer_s=share + compress_s + row.forward_s))
    return out


def _stored(value: float | None) -> float | None:
    """A fidelity number as stored: 6 decimals (far below any difference a report reads), None when undefined."""
    return None if value is None else round(value, 6)


def default_payload(lm: LoadedModel, samples: list[Sample], configs: list[MethodConfig]) -> dict:
    """What a results directory is a function of: the method configs, the model and the exact samples."""
    scoped = any(c.compress_scope != "prompt" for c in configs)  # then the part boundaries matter too
    data = hashlib.sha256(json.dumps([[s.id, list(s.input_ids), list(s.answers), s.max_new_tokens]
                                      + ([s.context_end, s.question_end] if scoped else [])
                                      for s in samples]).encode()).hexdigest()[:16]
    return {"configs": [c.to_dict() for c in configs], "model": lm.config.name, "samples": data}


def run_sweep(lm: LoadedModel, samples: list[Sample], configs: list[MethodConfig], out_dir: Path,
              payload: dict | None = None, progress: bool = True, decode_batch: int | None = None,
              decode_samples: int = 1, decode_stack: bool = True,
              decode_graph: bool = True, checks: FastPaths | None = None, fidelity: bool = True) -> pd.DataFrame:
    """Run every config on every sample into ``out_dir`` (``predictions.jsonl``, ``timings.jsonl``, ``scores.csv``,
    ``table.md``). Finished (sample, config) pairs already in ``out_dir`` are kept, not recomputed. Progress and
    status go to this module's logger (:class:`~spark_bench.logs.Progress`; ``progress=False``: none).
    ``decode_samples`` samples at a time decode their method configs together, ``decode_batch`` rows per batch
    (None = all of them); the tokens depend on neither. ``checks``: the run's fast-path record (default: every variant
    checked at its first use); which path produced the numbers goes to ``manifest.json`` (``fast_paths``) and the
    log. ``fidelity=False`` (the ``fidelity`` option) skips the fidelity pass: stored predictions are kept without
    its numbers, and a later run with it on computes those predictions again."""
    if decode_batch is not None and (not isinstance(decode_batch, int) or decode_batch < 1):
        raise ValueError(f"decode_batch must be a positive integer or null (all configs), got {decode_batch!r}")
    if not isinstance(decode_samples, int) or decode_samples < 1:
        raise ValueError(f"decode_samples must be a positive integer, got {decode_samples!r}")
    labels = sweep_labels(configs)
    ids = [s.id for s in samples]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate sample ids: {sorted({i for i in ids if ids.count(i) > 1})[:5]}")
    pipelines = [Pipeline.from_config(c, label) for c, label in zip(configs, labels)]
    results = ResultsDir(out_dir, payload or default_payload(lm, samples, configs), upgrade.same_study)
    session = provenance.session(str(lm.device) if lm.model is not None else None, lm.model)
    done = {(r["id"], r["config"]): r for r in results.open({"samples": [[s.id, s.task] for s in samples],
                                                              "configs": labels}, session)}
    try:
        predictions = _sweep(lm, samples, pipelines, labels, results, done, progress, decode_batch, decode_samples,
                             decode_stack, decode_graph, checks, fidelity)
    except BaseException as err:  # the session's record says how it stopped (a SIGKILL leaves it "running")
        said = str(err).splitlines()[0] if str(err) else ""
        results.end_session(f"stopped: {type(err).__name__}: {said}"[:300], strict=False)
        raise
    results.end_session("finished")
    return predictions


def _sweep(lm, samples, pipelines, labels, results, done, progress, decode_batch, decode_samples, decode_stack,
           decode_graph, checks, fidelity=True) -> pd.DataFrame:
    """:func:`run_sweep` once its directory is open: resume, compute what is missing, write the tables."""
    out_dir = results.path
    stored = set(done)
    for line in upgrade.refresh(done, samples, pipelines, cache_fields(fidelity))[2]:
        LOG.warning(line)
    if stored - set(done):  # computed again: their old timing lines go (a report would count them twice)
        results.drop_timings(stored - set(done))
    timing = {(r["id"], r["config"]): r for r in read_complete_lines(results.timings)}
    resumed = sum((s.id, label) in done for s in samples for label in labels)
    if resumed:
        LOG.info(f"resuming {out_dir}: {resumed} of {len(samples) * len(labels)} predictions already done")
    work = [(s, [p for p in pipelines if (s.id, p.label) not in done]) for s in samples]
    work = [(s, todo) for s, todo in work if todo]
    bar = Progress(len(samples), out_dir.name, initial=len(samples) - len(work), logger=LOG, enabled=progress)
    new_tokens, decode_seconds = 0, 0.0
    checks = FastPaths() if checks is None else checks  # the run's record: its decode batches and scoring passes
    # check each variant once (passed down to each, engine/fastpaths.py)
    full = next((p for p in pipelines if p.config.name == "full"), None)
    if not fidelity:
        LOG.info(f"fidelity=false: {FIDELITY_SKIPPED}")
    elif full is None:  # an ordinary single-method run, not a fault: said at INFO (``-q`` silent), and in the table
        LOG.info(NO_FULL)
    full_tokens = {s.id: done[s.id, full.label]["tokens"] for s, _ in work if full and (s.id, full.label) in done}
    # a context's questions decode together (one compressed cache per query-agnostic config)
    units = context_units(work, lambda w: w[0])
    for group in ([w for unit in units[i:i + decode_samples] for w in unit]
                  for i in range(0, len(units), decode_samples)):
        for sample_records in run_samples(lm, group, decode_batch, decode_stack, decode_graph, full, full_tokens,
                                          checks, fidelity, len(pipelines)):
            records = [p.record() for p in sample_records]
            results.append(records)  # one durable append per sample
            for r in records:
                done[r["id"], r["config"]] = timing[r["id"], r["config"]] = r
            new_tokens += sum(len(r["tokens"]) for r in records)
            decode_seconds += sum(r["decode_s"] for r in records)
            bar.update(1, f"{new_tokens / max(decode_seconds, 1e-9):.1f} tok/s")
            if LOG.isEnabledFor(logging.DEBUG):
                LOG.debug(f"{records[0]['id']} ({records[0]['prompt_length']} tok): "
                    + ", ".join(f"{r['config']}={r['score']:.0f}" for r in records))
    bar.close()
    if work:  # which paths computed this session's numbers (a resumed run keeps each session's record)
        results.note_fast_paths(checks.record())
        LOG.info(f"decode: {checks.summary()}; first uses (compile and check) {checks.seconds:.2f} s, not in the "
                 "decode tok/s")
    ordered = [done[s.id, label] for s in samples for label in labels]
    predictions = pd.DataFrame([{**r, **{k: timing.get((r["id"], r["config"]), {}).get(k, float("nan"))
                                         for k in TIMING_FIELDS}} for r in ordered])
    tasks = list(dict.fromkeys(s.task for s in samples))
    scores = summarize(predictions, labels, tasks)
    results.finalize(ordered, {"scores.csv": scores.to_csv(index=False),
                               "table.md": render_markdown(scores, labels, tasks, predictions)})
    for line in summary_lines(predictions, scores, labels, tasks, full is not None):
        LOG.info(line)
    return predictions


def summary_lines(predictions: pd.DataFrame, scores: pd.DataFrame, labels: list[str], tasks: list[str],
                  has_full: bool = True) -> list[str]:
    """One line per config with the numbers ``table.md`` prints (:func:`~spark_bench.tables.score_table`: the
    score's Avg over tasks, KV %, decode tok/s; the fidelity means over tasks, "–" where the table has none because
    some sample lacks the number), in the table's digits."""
    wide = score_table(scores, labels, tasks)
    measured = with_fidelity(predictions)
    lines = []
    for label in labels:
        cells = {}
        for column, name in FIDELITY_COLUMNS.items():
            values = per_task(measured, label, tasks, column)
            missing = not values or any(v.isna().any() for v in values)
            cells[name] = "–" if missing else f"{sum(v.mean() for v in values) / len(values):.3f}"
        row = wide.loc[label]
        number = (lambda v, d: "–" if pd.isna(v) else f"{v:.{d}f}")
        kl = f", KL to full {cells['KL full']}" if has_full else ""
        lines.append(f"{label}: score {number(row['Avg'], 2)}, answer NLL {cells['NLL']}{kl}, KV "
                     f"{number(row['KV %'], 2)}%, decode {number(row['Decode tok/s'], 1)} tok/s")
    return lines
