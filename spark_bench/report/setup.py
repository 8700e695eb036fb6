"""Like with like: the setup behind each shipped paper table, and how a run's setup differs from it.

A ``--paper`` comparison puts the paper's number beside ours in every cell; it only means something when the run
used the paper's model, context length, budgets and protocol. :data:`PAPER_SETUP` states them per table (from the
paper's captions and §5 / Appendix C–E); :func:`differences` reads a run's own setup from its ``manifest.json``
(the model, the benchmark and every method config it ran) and returns one line per field that differs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from spark_bench.results import manifest_records, read_manifest


@dataclass(frozen=True)
class Setup:
    model: str            # conf/model/<name>
    benchmark: str        # longbench | ruler
    context: int          # tokens: LongBench's middle-truncation limit, or RULER's input length
    budgets: tuple        # KV budgets of the table's rows: tokens (>= 1) or fractions
    protocol: str = "official"


LOG = logging.getLogger(__name__)
_LB_BUDGETS = (128, 512, 1024, 2048)
PAPER_SETUP = {
    "tab_main": Setup("llama3-8b", "longbench", 7950, (128, 512)),
    "tab_main_ruler": Setup("llama3.1-8b", "ruler", 16384, (0.2,)),
    "tab_app_full_ruler": Setup("llama3.1-8b", "ruler", 16384, (0.2, 0.5)),  # and 8K: the 8K blocks (@8K)
    "tab_ab_dist": Setup("llama3-8b", "longbench", 7950, _LB_BUDGETS),
    "tab_ab_var": Setup("llama3-8b", "longbench", 7950, _LB_BUDGETS),
    "tab_app_kv_llama3-8b": Setup("llama3-8b", "longbench", 7950, _LB_BUDGETS),
    "tab_full_llama3-8b": Setup("llama3-8b", "longbench", 7950, _LB_BUDGETS),
    "tab_full_llama3.1-8b": Setup("llama3.1-8b", "longbench", 127500, _LB_BUDGETS),
    "tab_full_llama3.1-70b": Setup("llama3.1-70b", "longbench", 127500, _LB_BUDGETS),
    "tab_full_qwen3-8b": Setup("qwen3-8b", "longbench", 31500, _LB_BUDGETS),
    "tab_full_qwen3-32b": Setup("qwen3-32b", "longbench", 31500, _LB_BUDGETS),
}


# samples per task behind the paper's cells: LongBench's full test sets (THUDM/LongBench task.md, "#Sample"), RULER's
# default generation (NVIDIA/RULER scripts/run.sh NUM_SAMPLES=500, as kvpress' RULER dataset holds per task)
PAPER_SAMPLES = {"longbench": {"multifieldqa_en": 150, "lcc": 500, "repobench-p": 500}, "ruler": {}}
PAPER_DEFAULT_SAMPLES = {"longbench": 200, "ruler": 500}


def sample_note(directory, counts: dict) -> str:
    """``samples below the paper's: task n=… (paper …), …`` for a run's tasks whose fewest samples per cell
    (``counts``: task → n) are below the paper's per-task count (``all K tasks n=… (paper …)`` when every task has
    the same counts); empty when none is, or the benchmark is unknown."""
    from spark_bench.benchmarks.longbench import TASKS as LONGBENCH_TASKS
    from spark_bench.benchmarks.ruler import RULER_TASKS

    benchmark = (run_setup(directory) or {}).get("benchmark")
    if benchmark is None:  # a run without a benchmark in its manifest: its task names say which
        benchmark = ("ruler" if set(counts) <= set(RULER_TASKS) else
                     "longbench" if set(counts) <= set(LONGBENCH_TASKS) else None)
    if benchmark not in PAPER_DEFAULT_SAMPLES:
        return ""
    paper = {t: PAPER_SAMPLES[benchmark].get(t, PAPER_DEFAULT_SAMPLES[benchmark]) for t in counts}
    below = {t: (n, paper[t]) for t, n in counts.items() if n < paper[t]}
    if len(below) > 1 and len(below) == len(counts) and len(set(below.values())) == 1:  # one phrase for them all
        (n, theirs), = set(below.values())
        return f"{directory}: samples per cell below the paper's: all {len(below)} tasks n={n} (paper {theirs})"
    listed = ", ".join(f"{t} n={n} (paper {theirs})" for t, (n, theirs) in below.items())
    return f"{directory}: samples per cell below the paper's: {listed}" if below else ""


def fast_path_note(directory) -> str:
    """``<run>: decode: numbers from …``: which decode paths computed a run's predictions — the fast paths, checked
    against their reference at first use, or the reference after one differed (its manifest's ``fast_paths``, one
    record per session: :mod:`spark_bench.engine.fastpaths`); '' where the manifest does not say. A damaged
    ``fast_paths`` (not a list of records) is named in one line (a warning) and its whole records are read."""
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        return ""
    records, problem = manifest_records(read_manifest(path), "fast_paths", path)
    if problem:
        LOG.warning(f"warning: {problem}")
    said = list(dict.fromkeys(str(r.get("numbers_from", "")) for r in records if r.get("numbers_from")))
    return f"{directory}: decode: {' / '.join(said)}" if said else ""


def sessions(directory) -> list[dict]:
    """The session records of a run (its manifest's ``runs``: :mod:`spark_bench.provenance`), or of its shards
    for a merged run; ``[{}]`` (unknown) for a run written before spark-bench recorded them."""
    from spark_bench.report.kvpress_read import is_kvpress, sessions as kvpress_sessions
    from spark_bench.shards import shard_sessions

    if is_kvpress(directory):  # a kvpress evaluation output: the sessions of a spark-bench export, if it is one
        return kvpress_sessions(directory) or [{}]
    path = Path(directory) / "manifest.json"
    if path.is_file():
        records, problem = manifest_records(read_manifest(path), "runs", path)
        if problem:
            LOG.warning(f"warning: {problem}")
        return records or [{}]
    if Path(directory).is_dir():
        return [r for _, r in shard_sessions(Path(directory))] or [{}]
    return [{}]


def provenance_note(directory) -> str:
    """``<run>: made by spark-bench …; torch …; device; dtype; host, start → end`` (its sessions' distinct setups
    joined by `` | ``), or ``<run>: provenance unknown (…)`` for a run written before spark-bench recorded it."""
    from spark_bench import provenance
    from spark_bench.report.kvpress_read import describe, is_kvpress

    records = sessions(directory)
    if is_kvpress(directory):  # what kvpress' config.yaml says, and spark-bench's provenance for an export
        known = list(dict.fromkeys(provenance.summary(r) for r in records if isinstance(r.get("spark_bench"), dict)))
        return describe(directory) + (f"; exported from spark-bench, made by {' | '.join(known)}" if known else "")
    if not any(isinstance(r.get("spark_bench"), dict) for r in records):
        return f"{directory}: provenance unknown (written before spark-bench recorded its version and machine)"
    lines = list(dict.fromkeys(provenance.summary(r) for r in records))
    return f"{directory}: made by " + " | ".join(lines)


def provenance_differences(directories) -> str:
    """One line saying in what the runs' sessions differ (:data:`spark_bench.provenance.COMPARED`), '' if in
    nothing."""
    from spark_bench import provenance

    from spark_bench.report.kvpress_read import is_kvpress, sessions as kvpress_sessions

    # a kvpress output records no software (its note says so): compared only where a spark-bench export carries it
    named = [(str(d), r) for d in directories if not is_kvpress(d) or kvpress_sessions(d) for r in sessions(d)]
    differ = provenance.differences(named)
    return f"the runs' provenance differs: {'; '.join(differ)}" if differ else ""


def paper_setup(name: str) -> tuple[Setup | None, int | None]:
    """The setup of ``--paper NAME[@PART]`` (a ``@8K`` part of the RULER appendix table: 8K input)."""
    table, _, part = name.partition("@")
    setup = PAPER_SETUP.get(Path(table).name.removesuffix(".csv"))
    context = 8192 if part.upper().startswith("8K") else None
    return setup, context


def run_setup(directory) -> dict | None:
    """What a run ran (its manifest's payload): model, benchmark, context length, budgets and protocol (a kvpress
    evaluation output: what its ``config.yaml`` says, protocol ``kvpress``)."""
    from spark_bench.report.kvpress_read import is_kvpress, run_setup as kvpress_setup

    if is_kvpress(directory):
        return kvpress_setup(directory)
    path = Path(directory) / "manifest.json"
    if not path.exists():
        return None
    payload = read_manifest(path).get("payload")
    payload = payload if isinstance(payload, dict) else {}
    model = payload.get("model") or {}
    if not isinstance(model, dict):  # a library run's payload names the model only
        model = {"name": model}
    bench = payload.get("benchmark") or {}
    name = bench.get("name")
    if name == "longbench":
        context = (payload.get("longbench") or {}).get("max_length") or model.get("longbench_max_length") or \
            (model["max_length"] - 500 if model.get("max_length") else None)
    else:
        context = bench.get("length")
    configs = [c for c in payload.get("configs") or [] if isinstance(c, dict)]
    budgets = tuple(sorted({c["budget"] for c in configs if "budget" in c and _reads_budget(c)}))
    return {"model": model.get("name"), "benchmark": name, "context": context,
            "budgets": budgets, "protocol": _protocol(configs)}


def _reads_budget(method: dict) -> bool:
    """Whether a config's method reads its budget (an eviction method; ThinK / SparK alone and ``full`` do not, so
    their default budget is no budget of the run's)."""
    from spark_bench.methods.config import relevant_options

    try:
        return "budget" in relevant_options(method)
    except (TypeError, ValueError):
        return method.get("name", "full") != "full"


def _protocol(configs: list[dict]) -> str:
    """``official`` / ``paper`` / ``kvcache_factory`` when every config has that protocol's values, else
    ``custom``."""
    from spark_bench.checks import protocol_options

    for name in ("official", "paper", "kvcache_factory"):
        options = protocol_options(name)
        if configs and all(all(c.get(k) == v for k, v in options.items() if k in c) for c in configs):
            return name
    return "custom"


def _fmt(value) -> str:
    if isinstance(value, tuple):
        return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) or "none"
    return str(value)


def differences(directory, paper_name: str) -> dict[str, str]:
    """``{field: line}`` for each field in which the run at ``directory`` differs from the paper table's setup
    (empty when they match, or when either side's setup is unknown)."""
    setup, part_context = paper_setup(paper_name)
    ours = run_setup(directory)
    if setup is None or ours is None:
        return {}
    theirs = {"model": setup.model, "benchmark": setup.benchmark, "context": part_context or setup.context,
              "budgets": setup.budgets, "protocol": setup.protocol}
    lines = {}
    for field in ("model", "benchmark", "context", "budgets", "protocol"):
        if field == "budgets" and set(ours["budgets"]) <= set(theirs["budgets"]) and ours["budgets"]:
            continue  # a subset of the paper's columns is a like-with-like comparison
        if ours[field] is not None and ours[field] != theirs[field]:
            lines[field] = (f"{Path(directory)} vs {paper_name}: {field} {_fmt(ours[field])} (paper: "
                            f"{_fmt(theirs[field])})")
    return lines


def describe(directory, paper_name: str) -> str:
    """``Run X: model, context, budgets, protocol; paper T: …`` (empty when either side is unknown)."""
    setup, part_context = paper_setup(paper_name)
    ours = run_setup(directory)
    if setup is None or ours is None:
        return ""
    return (f"Run {directory}: {ours['model']}, {ours['benchmark']} at {ours['context']} tokens, budgets "
            f"{_fmt(ours['budgets'])}, protocol {ours['protocol']}; paper {paper_name}: {setup.model}, "
            f"{setup.benchmark} at {part_context or setup.context} tokens, budgets {_fmt(setup.budgets)}, protocol "
            f"{setup.protocol}.")
