"""What a run costs, said before a GPU is booked (``dry_run=true``): samples, configs, decode forwards, KV memory per
sample and an estimate of GPU hours per device, every assumption printed beside its number.

The work of a run (``runner.run_samples``): one prefill per sample, then every method config of the sample decodes
in one batch (one model forward per step, at most the task's ``max_new_tokens`` steps). The estimate is a roofline
against each device's published peaks at a stated utilisation (:data:`UTILISATION`):

* prefill: ``Σ_samples (2·P·S + 2·L·S²·H·D)`` FLOPs (:func:`prefill_flops`: ``P`` parameters; ``S`` the prompt,
  the longest a task allows, a bound; the second term is causal attention, ``L`` layers of ``H`` query heads of
  ``D`` channels, which dominates at long prompts) at ``UTILISATION["prefill"]`` of the dense bf16 peak;
* decode: at most ``Σ_samples max_new_tokens`` forwards; a step reads the weights and every config's compressed
  cache once (the stacked batch; shared tensors once, :func:`spark_bench.memory.predict_run`), at
  ``UTILISATION["decode"]`` of the memory bandwidth — or, when larger, what the step dispatches (operations per step,
  ``scripts/bench/ops.py``, scaled by the layer count, × the time per operation measured on an H100:
  ``results/bench/decode_h100.json``);
* the fidelity pass (``fidelity=true``, :mod:`spark_bench.engine.fidelity`), when on: per sample
  :func:`fidelity_forwards` teacher-forced forwards, each over at most two continuations of ``max_new_tokens`` tokens
  (the reference answer, the full cache's greedy tokens) through one config's cache: reading the weights and that
  cache once at the decode utilisation, or computing ``2·P`` FLOPs per token (and attention over the cache) at the
  prefill's, or dispatching a step's operations, whichever is slowest; ``fidelity=false`` counts none;
* memory: the prefill's dense KV at ``S`` plus every config's compressed cache of one sample.

Once ``make gpu-check`` has run on a device, its measured figures (``results/bench/gpu/check.json``) are printed
beside the estimate. The utilisations are assumptions (typical of bf16 flash-attention prefill and of a
bandwidth-bound decode step), not measurements; :func:`estimate` prints them with every figure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from spark_bench.engine.fidelity import KL_TOKENS
from spark_bench.memory import GIB, Arch, predict_run
from spark_bench.methods import MethodConfig
from spark_bench.models import ModelConfig

# LongBench v1 records per task (the official data/<task>.jsonl files; 3,750 for the 16 English tasks)
LONGBENCH_RECORDS = {
    "narrativeqa": 200, "qasper": 200, "multifieldqa_en": 150, "hotpotqa": 200, "2wikimqa": 200, "musique": 200,
    "gov_report": 200, "qmsum": 200, "multi_news": 200, "trec": 200, "triviaqa": 200, "samsum": 200,
    "passage_count": 200, "passage_retrieval_en": 200, "lcc": 500, "repobench-p": 500,
}
# RULER's tokens_to_generate per task
RULER_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
SMOLLM2_LAYERS = 30  # the model the operation counts were measured on


def prefill_flops(num_params: float, num_layers: int, num_heads: int, head_dim: int, tokens: int) -> float:
    """FLOPs of one prefill: the linear layers (2·P per token) and causal attention (QKᵀ and PV over half the S²
    pairs, 2·2·½ FLOPs per pair, channel and query head)."""
    return 2 * num_params * tokens + 2 * num_layers * tokens ** 2 * num_heads * head_dim


@dataclass(frozen=True)
class Device:
    """A device's published peaks, and the time per dispatched operation where one was measured."""

    name: str
    peak_flops: float         # dense bf16 tensor-core FLOP/s (spec sheet)
    bandwidth: float          # device memory bytes/s (spec sheet)
    us_per_op: float | None   # measured time per dispatched operation in a small decode batch (None: not measured)


UTILISATION = {"prefill": 0.40, "decode": 0.70}  # assumed fractions of the peaks (printed with every estimate)
OPS_PER_LAYER_STEP = 2020.25 / SMOLLM2_LAYERS  # ops.json fourteen.stacked.ops_per_step (SmolLM2, 30 layers)
H100_US_PER_OP = 1000 * 23.3 / 1677  # decode_h100.json step_fourteen.dense_dynamic_cache_step_ms / ops.json dense

DEVICES = {
    "h100": Device("NVIDIA H100 SXM", 989e12, 3.35e12, H100_US_PER_OP),
    "h200": Device("NVIDIA H200", 989e12, 4.8e12, H100_US_PER_OP),  # the H100's compute; dispatch as measured there
    "a100": Device("NVIDIA A100 80GB SXM", 312e12, 2.039e12, None),
}
SOURCES = ("peaks: NVIDIA's data sheets; time per operation: results/bench/decode_h100.json (an H100, 135M model) "
           "and results/bench/ops.json")


@dataclass(frozen=True)
class TaskWork:
    task: str
    samples: int
    new_tokens: int
    source: str  # "data" (counted in the data) or "published" (the benchmark's own count)


def longbench_work(cfg) -> list[TaskWork]:
    from spark_bench.benchmarks.longbench import KVPRESS_EXTRA_TOKENS, TASKS

    tasks = list(cfg.benchmark.get("tasks") or TASKS)
    cap = cfg.benchmark.get("num_samples")
    extra = KVPRESS_EXTRA_TOKENS if cfg.longbench.get("protocol") == "kvpress" else 0
    data_dir = cfg.longbench.get("data_dir")
    out = []
    for task in tasks:
        path = Path(data_dir) / f"{task}.jsonl" if data_dir else None
        if path is not None and path.is_file():
            count, source = sum(1 for line in path.open(encoding="utf-8") if line.strip()), "data"
        else:
            count, source = LONGBENCH_RECORDS[task], "published"
        out.append(TaskWork(task, min(count, cap) if cap else count, TASKS[task].max_new_tokens + extra, source))
    return out


def ruler_work(cfg, tasks: list[str]) -> list[TaskWork]:
    n = cfg.benchmark.get("num_samples") or 1
    fixed = cfg.benchmark.get("max_new_tokens")
    return [TaskWork(task, n, fixed or RULER_NEW_TOKENS[task.split("_")[0]], "configured") for task in tasks]


TEMPLATE_TOKENS = 64    # a bound on what a chat template adds around a truncated prompt (Llama-3.1's header: ~30)
QUESTION_TOKENS = 512   # compress_scope=context: an assumed bound on a question run through the cache (not measured)


class Bounds(NamedTuple):
    """What a run's memory prediction is made from (:func:`bounds`)."""

    prompt: int   # the longest prompt
    through: int  # the most tokens run through a compressed cache: decoded tokens plus the suffix
    suffix: int   # the most tokens a sample runs through its cache in one forward before decoding
    answer: int   # the most reference-answer tokens the fidelity pass feeds a sample's caches


def bounds(cfg, model: ModelConfig, tasks: list[str], scopes: set[str], samples=None) -> Bounds:
    """A run's :class:`Bounds`, measured on ``samples`` (or on exported samples, ``benchmark.data_file``) where
    given. Before any data is tokenized: RULER's prompts are at most ``benchmark.length`` and LongBench's at most its
    truncation limit plus :data:`TEMPLATE_TOKENS`; the suffix is the turn end under ``question``
    (:data:`TEMPLATE_TOKENS`), also the question under ``context`` (:data:`QUESTION_TOKENS`), 0 under ``prompt``
    (``scopes``: the configs' ``compress_scope``); a reference answer at most the tokens a sample decodes. On samples,
    a reference answer's tokens are bounded by its UTF-8 bytes (a token covers at least one byte), capped at its
    ``max_new_tokens`` as :func:`~spark_bench.benchmarks.reference.reference_ids` caps it."""
    prompt, new, suffix, answer = _bounds(cfg, model, tasks, scopes, samples)
    return Bounds(prompt, new + suffix, suffix, answer)


def run_bounds(cfg, model: ModelConfig, tasks: list[str], scopes: set[str], samples=None) -> tuple[int, int]:
    """(longest prompt, most tokens run through a compressed cache) of a run (:func:`bounds`)."""
    return bounds(cfg, model, tasks, scopes, samples)[:2]


def _bounds(cfg, model: ModelConfig, tasks: list[str], scopes: set[str],
            samples=None) -> tuple[int, int, int, int]:
    from spark_bench.benchmarks.longbench import truncation_limit

    if samples is None and cfg.benchmark.get("data_file"):
        from spark_bench.samples import data_file_samples

        samples = data_file_samples(cfg, model)  # as the run loads them (benchmark.truncate applied)
    if samples is not None:
        from spark_bench.benchmarks.reference import reference_text

        if not samples:
            return 1, 1, 0, 0
        suffix = max([0] + [len(s.input_ids) - s.scope_end(scope) for s in samples for scope in scopes
                            if scope == "prompt" or getattr(s, f"{scope}_end") is not None])
        answer = max(min(s.max_new_tokens, len(reference_text(s).encode())) for s in samples)
        return max(len(s.input_ids) for s in samples), max(s.max_new_tokens for s in samples), suffix, answer
    if cfg.benchmark.name == "longbench":
        work = longbench_work(cfg)
        prompt = truncation_limit(model, cfg.longbench.get("max_length")) + TEMPLATE_TOKENS
    else:
        work = ruler_work(cfg, tasks)
        prompt = int(cfg.benchmark.length)
    suffix = (TEMPLATE_TOKENS + QUESTION_TOKENS if "context" in scopes else
              TEMPLATE_TOKENS if "question" in scopes else 0)
    new = max(w.new_tokens for w in work)
    return prompt, new, suffix, new


@dataclass(frozen=True)
class Cost:
    samples: int
    configs: int
    prompt_tokens: int
    decode_forwards: int
    kv_gib_per_sample: float
    weights_gib: float
    prefill_tflop: float                    # per sample
    step_gb: float                          # bytes a decode step reads (weights + every config's cache)
    hours: dict[str, tuple[float, float]]   # device → (prefill hours, decode hours)
    bound: dict[str, str]                   # device → what bounds its decode step
    measured: list[str]                     # make gpu-check's figures, where it has run
    fidelity_forwards: int = 0              # the fidelity pass's forwards (0: fidelity=false)
    fidelity_hours: dict[str, float] = field(default_factory=dict)  # device → hours of the pass ({}: off)

    def lines(self) -> list[str]:
        out = [f"plan: {self.samples} samples × {self.configs} configs; prompts ≤ {self.prompt_tokens} tokens; "
               f"≤ {self.decode_forwards} decode forwards (every config of a sample in one batch)",
               f"plan: KV per sample ≤ {self.kv_gib_per_sample:.2f} GiB (prefill + every config's compressed cache, "
               f"shared tensors once), weights {self.weights_gib:.1f} GiB",
               f"plan: assumed: prefill at {UTILISATION['prefill']:.0%} of the dense bf16 peak "
               f"({self.prefill_tflop:.1f} TFLOP per sample), decode steps reading {self.step_gb:.2f} GB at "
               f"{UTILISATION['decode']:.0%} of the memory bandwidth or dispatch-bound, whichever is slower "
               f"({SOURCES})"]
        out.append(f"plan: fidelity pass: ≤ {self.fidelity_forwards} teacher-forced forwards (one per config "
                   f"and sample, the full cache's continuation once more; fidelity=false skips it)"
                   if self.fidelity_forwards else "plan: fidelity=false: no fidelity pass")
        for key, (prefill, decode) in self.hours.items():
            device = DEVICES[key]
            forced = self.fidelity_hours.get(key, 0.0)
            out.append(f"plan: ≤ {prefill + decode + forced:.0f} GPU-hours on one {device.name} "
                       f"({device.peak_flops / 1e12:.0f} TFLOP/s, {device.bandwidth / 1e12:.2f} TB/s): "
                       f"prefill ≤ {prefill:.1f} h (every prompt at the bound), decode ≤ {decode:.1f} h "
                       f"({self.bound[key]})" + (f", fidelity pass ≤ {forced:.1f} h" if key in self.fidelity_hours
                                                 else ""))
        out += [f"plan: measured by make gpu-check: {line}" for line in self.measured] or [
            "plan: no make gpu-check figures yet (results/bench/gpu/check.json): these are estimates"]
        return out


def fidelity_forwards(configs: int, full: bool = True) -> int:
    """The fidelity pass's forwards per sample (:func:`spark_bench.engine.fidelity.measure`): one per config (its
    two continuations together), and the full cache's greedy continuation alone first when the sweep has ``full``."""
    return configs + int(full)


def estimate(model: ModelConfig, configs: list[MethodConfig], work: list[TaskWork], prompt_tokens: int,
             root: Path | None = None, fidelity: bool = True) -> Cost:
    """The cost of running ``configs`` on ``work`` with prompts of at most ``prompt_tokens``; ``root``: where to look
    for ``results/bench/gpu/check.json`` (the measured figures printed beside the estimate); ``fidelity``: whether
    the run measures the fidelity pass (counted apart from ``hours``, which hold prefill and decode)."""
    arch = Arch.of(model)
    samples = sum(w.samples for w in work)
    forwards = sum(w.samples * w.new_tokens for w in work)
    gen = max((w.new_tokens for w in work), default=0)
    one = predict_run(model, configs, prompt_tokens, gen, None, 1).devices[0]  # every config's rows in one batch
    kv = one.prefill_kv + one.caches  # shared tensors once, as the pipeline shares them
    step_bytes = one.weights + one.caches
    flops = prefill_flops(arch.num_params, arch.num_layers, arch.num_heads, arch.head_dim, prompt_tokens)
    hours, bound = {}, {}
    for key, device in DEVICES.items():
        prefill_s = samples * flops / (device.peak_flops * UTILISATION["prefill"])
        read_s = step_bytes / (device.bandwidth * UTILISATION["decode"])
        dispatch_s = (device.us_per_op or 0.0) * 1e-6 * OPS_PER_LAYER_STEP * arch.num_layers
        step_s = max(read_s, dispatch_s)
        bound[key] = (f"{step_s * 1e3:.1f} ms a step, " +
                      ("memory-bound" if read_s >= dispatch_s else "dispatch-bound, as measured") +
                      ("" if device.us_per_op else "; dispatch not measured on it"))
        hours[key] = (prefill_s / 3600, forwards * step_s / 3600)
    passes, forced = 0, {}
    if fidelity and configs:
        full = any(c.name == "full" for c in configs)
        passes = sum(w.samples for w in work) * fidelity_forwards(len(configs), full)
        rows = len(configs) + int(full)
        for key, device in DEVICES.items():
            seconds = 0.0
            for w in work:  # each forward: two continuations of at most max(new tokens, KL_TOKENS) positions
                tokens = 2 * max(w.new_tokens, KL_TOKENS)
                compute = tokens * (2 * arch.num_params + 4 * arch.num_layers * arch.num_heads * arch.head_dim
                                    * prompt_tokens) / (device.peak_flops * UTILISATION["prefill"])
                read = (one.weights + one.caches / max(len(configs), 1)) / (device.bandwidth * UTILISATION["decode"])
                dispatch = (device.us_per_op or 0.0) * 1e-6 * OPS_PER_LAYER_STEP * arch.num_layers
                seconds += w.samples * rows * max(compute, read, dispatch)
            forced[key] = seconds / 3600
    return Cost(samples, len(configs), prompt_tokens, forwards, kv / GIB, one.weights / GIB, flops / 1e12,
                step_bytes / 1e9, hours, bound, gpu_check_lines(root or Path.cwd()), passes, forced)


def gpu_check_lines(root: Path) -> list[str]:
    """The figures of ``make gpu-check`` (``scripts/gpu/check.py``) that calibrate the plan, where it has run."""
    path = root / "results" / "bench" / "gpu" / "check.json"
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"{path} unreadable ({exc})"]
    out = []
    for row in data.get("calibration", []):
        out.append(f"{data.get('device', '?')}: {row['model']} at {row['tokens']} tokens: prefill "
                   f"{row['prefill_tflops']:.0f} TFLOP/s, decode step {row['step_ms']:.1f} ms "
                   f"({row['rows']} rows)")
    return out


def measured_sources(root: Path) -> dict:
    """The tracked figures the constants were copied from (for the test that keeps them in sync)."""
    bench = root / "results" / "bench"
    return {name: json.loads((bench / f"{name}.json").read_text()) for name in ("decode_h100", "decode", "ops")
            if (bench / f"{name}.json").is_file()}
