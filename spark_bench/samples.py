"""A run's samples from its composed config (the ``benchmark``, ``ruler`` and ``longbench`` sections): the tasks
(:func:`benchmark_tasks`), everything about them that can be refused before the model loads
(:func:`check_benchmark`: names, lengths, files, every LongBench record, every record of a data file) and the
samples themselves (:func:`load_samples`: generated RULER, LongBench, or ``benchmark.data_file``'s exported records;
this shard's share). The benchmark modules are imported inside the functions, after the cheap checks."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from spark_bench.checks import ConfigError, check_file, parse_shard, vocab_size
from spark_bench.models import ModelConfig


def check_benchmark(cfg: DictConfig, model: ModelConfig, sources: bool = True) -> None:
    """Refuses (:class:`~spark_bench.checks.ConfigError`, one line) a benchmark config the run would fail on:
    ``sources``: also resolve where hub data comes from (a dry run only reports it)."""
    from spark_bench.benchmarks.longbench import PROTOCOLS as LONGBENCH_PROTOCOLS
    from spark_bench.benchmarks.longbench import LONGBENCH_E_TASKS, TASKS as LONGBENCH_TASKS, hub_source, \
        read_records
    from spark_bench.benchmarks.ruler import RULER_TASKS, check_qa_sources

    b = cfg.benchmark
    if b.name not in BENCHMARKS:
        raise ConfigError(f"benchmark.name={b.name!r} is not supported; valid: {', '.join(BENCHMARKS)}")
    if b.get("data_file"):
        check_file("benchmark.data_file", b.data_file)
        data_file_samples(cfg, model)
        return
    if b.get("truncate", "refuse") != "refuse":
        raise ConfigError(f"benchmark.truncate={b.truncate} applies to benchmark.data_file's samples only (RULER "
                          f"refuses benchmark.length above the model's max_length, LongBench cuts its prompts to "
                          f"longbench.max_length); drop it or set benchmark.data_file")
    if b.name == "ruler":
        unknown = [t for t in b.tasks if t not in RULER_TASKS]
        if unknown:
            raise ConfigError(f"benchmark.tasks: unknown RULER task(s) {unknown}; valid: {', '.join(RULER_TASKS)}")
        if b.length > model.max_length:
            raise ConfigError(f"benchmark.length={b.length} exceeds model {model.name} max_length={model.max_length}")
        for key in ("essay_file", "squad_file", "hotpotqa_file"):
            check_file(f"ruler.{key}", cfg.ruler.get(key))
        source = cfg.ruler.get("source", "generate")
        if source not in ("generate", "kvpress"):
            raise ConfigError(f"ruler.source must be one of generate, kvpress; got {source!r}")
        questions = cfg.ruler.get("questions", 1)
        others = [t for t in b.tasks if not t.startswith("niah_")]
        if questions > 1 and (source != "generate" or others):
            raise ConfigError(f"ruler.questions={questions}: several questions over one haystack are asked of the "
                              "needle tasks (niah_*) generated here; " + (f"drop {', '.join(others)} from "
                              "benchmark.tasks or set ruler.questions=1" if others else
                              "ruler.source=kvpress has one question per sample; set ruler.questions=1"))
        if source == "kvpress":
            from spark_bench.benchmarks.ruler.kvpress_records import LENGTHS, kvpress_source

            if b.length not in LENGTHS:
                raise ConfigError(f"benchmark.length={b.length}: ruler.source=kvpress has lengths {LENGTHS}")
            if sources:
                kvpress_source(cfg.ruler.kvpress_path)
        elif sources:
            check_qa_sources(b.tasks, cfg.ruler.squad_file, cfg.ruler.hotpotqa_file)
    else:
        valid = LONGBENCH_E_TASKS if cfg.longbench.e else tuple(LONGBENCH_TASKS)
        unknown = [t for t in benchmark_tasks(cfg) if t not in valid]
        if unknown:
            raise ConfigError(f"benchmark.tasks: unknown LongBench task(s) {unknown}; valid: {', '.join(valid)}")
        if cfg.longbench.get("protocol", "pred") not in LONGBENCH_PROTOCOLS:
            raise ConfigError(f"longbench.protocol must be one of {', '.join(LONGBENCH_PROTOCOLS)}; "
                              f"got {cfg.longbench.protocol!r}")
        if cfg.longbench.data_dir is not None:
            if not Path(cfg.longbench.data_dir).is_dir():
                raise ConfigError(f"longbench.data_dir: {cfg.longbench.data_dir} is not a directory")
            for task in benchmark_tasks(cfg):  # every record parsed now: a malformed line is reported before the model loads
                try:
                    records = read_records(task, cfg.longbench.data_dir, cfg.longbench.e)
                except (ValueError, FileNotFoundError) as err:
                    raise ConfigError(f"longbench.data_dir: {err}") from None
                if not records:
                    raise ConfigError(f"longbench.data_dir: {task}{'_e' if cfg.longbench.e else ''}.jsonl in "
                                      f"{cfg.longbench.data_dir} holds no records")
        elif sources:
            hub_source(cfg.longbench.hub_path)


def benchmark_tasks(cfg: DictConfig) -> list[str]:
    """``benchmark.tasks``, or for LongBench left null: its 16 tasks, or LongBench-E's 13 with ``longbench.e``."""
    if cfg.benchmark.get("tasks") is not None:
        return list(cfg.benchmark.tasks)
    if cfg.benchmark.name != "longbench":
        raise ConfigError(f"benchmark.tasks must list the {cfg.benchmark.name} tasks to run")
    from spark_bench.benchmarks.longbench import LONGBENCH_E_TASKS, TASKS

    return list(LONGBENCH_E_TASKS if cfg.longbench.e else TASKS)


def _ruler(cfg: DictConfig, lm):
    from spark_bench.benchmarks.ruler import load_ruler

    b, src = cfg.benchmark, cfg.ruler
    if src.get("source", "generate") == "kvpress":
        from spark_bench.benchmarks.ruler.kvpress_records import load_kvpress_ruler

        return load_kvpress_ruler(list(b.tasks), b.length, b.num_samples, lm, src.kvpress_path, b.get("max_new_tokens"))
    return load_ruler(list(b.tasks), b.length, b.num_samples, b.seed, lm, b.get("max_new_tokens"),
                      essay_file=src.essay_file, squad_file=src.squad_file, hotpotqa_file=src.hotpotqa_file,
                      system_prompt=src.get("system_prompt", True), questions=src.get("questions", 1))


def _longbench(cfg: DictConfig, lm):
    from spark_bench.benchmarks.longbench import load_longbench

    src = cfg.longbench
    samples = load_longbench(benchmark_tasks(cfg), lm, data_dir=src.data_dir, num_samples=cfg.benchmark.num_samples,
                             e=src.e, max_length=src.max_length, hub_path=src.hub_path,
                             rouge_backend=src.rouge_backend, protocol=src.get("protocol", "pred"))
    cap = cfg.benchmark.get("max_new_tokens")  # benchmark.max_new_tokens: instead of each task's own, as for RULER
    if cap is None:
        return samples
    from dataclasses import replace

    return [replace(s, max_new_tokens=cap, min_new_tokens=min(s.min_new_tokens, cap)) for s in samples]


BENCHMARKS = {"ruler": _ruler, "longbench": _longbench}


def data_file_samples(cfg: DictConfig, model: ModelConfig) -> list:
    """``benchmark.data_file``'s samples, every record checked against the schema and the model
    (:mod:`spark_bench.benchmarks.records`: types, ranges, unique ids, vocabulary, context with
    ``benchmark.truncate``, the boundaries the configs' ``compress_scope`` needs); a bad or empty file is a
    :class:`ConfigError` counting every problem in one line. The file is parsed once per run: the start-up check's
    samples are the ones the run loads."""
    from spark_bench.benchmarks.records import DataFileError, Limits, read_samples
    from spark_bench.sweep import method_configs

    scopes = frozenset(c.compress_scope for c in method_configs(cfg))
    limits = Limits(model.name, model.max_length, vocab_size(model), cfg.benchmark.get("truncate", "refuse"), scopes)
    try:
        samples = read_samples(cfg.benchmark.data_file, limits)
    except DataFileError as err:
        raise ConfigError(f"benchmark.data_file: {err}") from None
    if not samples:
        raise ConfigError(f"benchmark.data_file: {cfg.benchmark.data_file} holds no samples")
    return samples


def group_contexts(samples: list) -> list:
    """Several questions over one context: samples of one task whose prompts hold the same non-empty context — the
    same ids up to the same ``context_end`` — are that context's questions (a data file's ``questions``, RULER's
    ``ruler.questions``, LongBench records that share their context). Each such group is put together where its
    first question was and its samples get ``meta.context`` (the id the group's samples already share in
    ``meta.context``, else its first question's id) and ``meta.question`` (the position, from 1); a sample whose
    context no other sample holds is left as it is. Under ``compress_scope=context`` the runner then compresses
    each context once per config and answers all its questions from that cache (:func:`~spark_bench.runner.
    run_samples`; the tokens are those of compressing each question's prompt on its own)."""
    from dataclasses import replace

    groups: dict = {}
    for sample in samples:
        key = (sample.task, sample.input_ids[:sample.context_end]) if sample.context_end else ("", sample.id)
        groups.setdefault(key, []).append(sample)
    out = []
    for members in groups.values():
        if len(members) == 1:
            out += members
            continue
        given = {m.meta.get("context") for m in members}
        name = given.pop() if len(given) == 1 and None not in given else members[0].id
        out += [replace(m, meta={**m.meta, "context": name, "question": k}) for k, m in enumerate(members, 1)]
    return out


def context_units(items: list, sample=lambda item: item) -> list[list]:
    """The items (samples, or what ``sample(item)`` gives a sample of) as consecutive units: one context's questions
    together (``meta.context``, :func:`group_contexts`), every other sample alone. A run shards whole units and
    decodes each unit's rows together (:func:`spark_bench.runner.run_sweep`)."""
    units: list[list] = []
    for item in items:
        context = sample(item).meta.get("context")
        if units and context is not None and sample(units[-1][0]).meta.get("context") == context:
            units[-1].append(item)
        else:
            units.append([item])
    return units


def load_samples(cfg: DictConfig, lm):
    if cfg.benchmark.get("data_file"):  # samples exported by spark-bench-export: rerun exactly
        samples = data_file_samples(cfg, lm.config)
    else:
        samples = BENCHMARKS[cfg.benchmark.name](cfg, lm)
    samples = group_contexts(samples)
    shard = parse_shard(cfg.get("shard"))  # whole contexts per shard: each compressed once, in one shard
    return samples if shard is None else [s for u in context_units(samples)[shard[0]::shard[1]] for s in u]
