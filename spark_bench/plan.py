"""What a run costs, said before a GPU is booked (``dry_run=true``): samples, configs, decode forwards, KV memory per
sample and an estimate of hours, from a cost model whose constants were measured by ``make bench``.

The work of a run (``runner.run_samples``): one prefill per sample, then every method config of the sample decodes
in one batch (one model forward per step, at most the task's ``max_new_tokens`` steps). So

* prefill: ``Σ_samples (2·P·S + 2·L·S²·H·D)`` FLOPs (:func:`prefill_flops`: ``P`` parameters; ``S`` the prompt,
  the longest a task allows, a bound; the second term is causal attention, ``L`` layers of ``H`` query heads of
  ``D`` channels, which dominates at long prompts);
* decode: at most ``Σ_samples max_new_tokens`` forwards; a forward over compressed caches dispatches a number of
  operations that does not depend on the number of configs (stacked rows, ``scripts/bench/ops.py``), and a small
  decode batch on a GPU is bound by what it dispatches: step time = ops per step × time per op, the ops scaled by
  the model's layer count from the measured SmolLM2 count (30 layers);
* memory: the prefill's dense KV at ``S`` plus every config's compressed cache of one sample, tensors the configs
  share counted once (:func:`spark_bench.memory.predict_run`, the real stores' bytes; the run's peak is printed
  with it).

The constants (:data:`DEVICES`) are copies of measured figures, each with the file and field it came from; a test
checks them against the tracked files. They are bounds and estimates, not promises: the H100 figures were measured
on a 135M-parameter model, so the prefill throughput is far below what an 8B model reaches (an upper bound on
prefill hours), and a larger model's step may be bound by reading its weights (``P·bytes / bandwidth``, the
bandwidth a spec-sheet figure, used only when it exceeds the dispatch bound).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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


SMOLLM2_PREFILL = prefill_flops(134.5e6, SMOLLM2_LAYERS, 9, 64, 1912)  # one 1912-token prompt of the H100 bench


@dataclass(frozen=True)
class Device:
    """Measured cost constants of one device (``source`` names where each came from)."""

    name: str
    us_per_op: float            # time per dispatched operation in a small decode batch (launch / dispatch bound)
    ops_per_layer_step: float   # operations a stacked decode step dispatches, per decoder layer
    prefill_flops: float        # effective prefill FLOP/s
    bandwidth: float | None     # bytes/s of device memory (weights read per step), if known
    source: str


DEVICES = {
    "h100": Device(
        "NVIDIA H100 80GB (measured on a 135M model, fp32)",
        us_per_op=1000 * 23.3 / 1677,  # decode_h100.json step_fourteen.dense_dynamic_cache_step_ms / ops.json dense
        ops_per_layer_step=1990.25 / SMOLLM2_LAYERS,  # ops.json fourteen.stacked.ops_per_step (SmolLM2, 30 layers)
        prefill_flops=SMOLLM2_PREFILL * 8 / 0.24,  # decode_h100.json fourteen.batched.prefill_s: 8 × 1912 tokens
        bandwidth=3.35e12,  # H100 SXM HBM3 spec sheet (not measured here)
        source="results/bench/decode_h100.json (H100) and results/bench/ops.json (operation counts)"),
    "cpu": Device(
        "this 2-core CPU (SmolLM2-135M, fp32)",
        us_per_op=1000 * 54.59 / 1677,  # decode.json weights_step_ms["1"] (one-token cache) / ops.json dense
        ops_per_layer_step=1990.25 / SMOLLM2_LAYERS,
        prefill_flops=125e9,  # README/decode.json: this CPU's matrix multiplies at 125 GFLOP/s (the prefill's linears)
        bandwidth=4 * 134.5e6 / 0.05459,  # decode.json weights_step_ms["1"]: SmolLM2's fp32 weights read per step
        source="results/bench/decode.json (this CPU) and results/bench/ops.json"),
}


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


def run_bounds(cfg, model: ModelConfig, tasks: list[str], scopes: set[str]) -> tuple[int, int]:
    """(longest prompt, most tokens run through a compressed cache) of a run, before any data is tokenized:
    exported samples are measured; RULER's prompts are at most ``benchmark.length``; LongBench's at most its
    truncation limit plus :data:`TEMPLATE_TOKENS`. The second number bounds the decoded tokens plus the suffix
    the ``scopes`` (the configs' ``compress_scope``) run through the cache: the turn end under ``question``
    (:data:`TEMPLATE_TOKENS`), also the question under ``context`` (:data:`QUESTION_TOKENS`)."""
    from spark_bench.benchmarks.longbench import truncation_limit

    if cfg.benchmark.get("data_file"):
        from spark_bench.benchmarks.export import read_samples

        samples = read_samples(cfg.benchmark.data_file)
        if not samples:
            return 1, 1
        suffix = max([0] + [len(s.input_ids) - s.scope_end(scope) for s in samples for scope in scopes
                            if scope == "prompt" or getattr(s, f"{scope}_end") is not None])
        return max(len(s.input_ids) for s in samples), max(s.max_new_tokens for s in samples) + suffix
    if cfg.benchmark.name == "longbench":
        work = longbench_work(cfg)
        prompt = truncation_limit(model, cfg.longbench.get("max_length")) + TEMPLATE_TOKENS
    else:
        work = ruler_work(cfg, tasks)
        prompt = int(cfg.benchmark.length)
    suffix = (TEMPLATE_TOKENS + QUESTION_TOKENS if "context" in scopes else
              TEMPLATE_TOKENS if "question" in scopes else 0)
    return prompt, max(w.new_tokens for w in work) + suffix


@dataclass(frozen=True)
class Cost:
    samples: int
    configs: int
    prompt_tokens: int
    decode_forwards: int
    kv_gib_per_sample: float
    weights_gib: float
    hours: dict[str, tuple[float, float]]  # device → (prefill hours, decode hours)

    def lines(self) -> list[str]:
        out = [f"plan: {self.samples} samples × {self.configs} configs; prompts ≤ {self.prompt_tokens} tokens; "
               f"≤ {self.decode_forwards} decode forwards (every config of a sample in one batch)",
               f"plan: KV per sample ≤ {self.kv_gib_per_sample:.2f} GiB (prefill + every config's compressed cache, "
               f"shared tensors once), "
               f"weights {self.weights_gib:.1f} GiB"]
        for key, (prefill, decode) in self.hours.items():
            device = DEVICES[key]
            out.append(f"plan: ≈ {prefill + decode:.1f} h on {device.name}: prefill ≤ {prefill:.1f} h, decode "
                       f"≈ {decode:.1f} h (constants: {device.source})")
        return out


def estimate(model: ModelConfig, configs: list[MethodConfig], work: list[TaskWork], prompt_tokens: int) -> Cost:
    """The cost of running ``configs`` on ``work`` with prompts of at most ``prompt_tokens``."""
    arch = Arch.of(model)
    samples = sum(w.samples for w in work)
    forwards = sum(w.samples * w.new_tokens for w in work)
    gen = max((w.new_tokens for w in work), default=0)
    one = predict_run(model, configs, prompt_tokens, gen, None, 1).devices[0]  # every config's rows in one batch
    kv = one.prefill_kv + one.caches  # shared tensors once, as the pipeline shares them
    weights = one.weights
    hours = {}
    for key, device in DEVICES.items():
        flops = prefill_flops(arch.num_params, arch.num_layers, arch.num_heads, arch.head_dim, prompt_tokens)
        prefill_s = samples * flops / device.prefill_flops
        step_s = device.us_per_op * 1e-6 * device.ops_per_layer_step * arch.num_layers
        if device.bandwidth:
            step_s = max(step_s, weights / device.bandwidth)
        hours[key] = (prefill_s / 3600, forwards * step_s / 3600)
    return Cost(samples, len(configs), prompt_tokens, forwards, kv / GIB, weights / GIB, hours)


def measured_sources(root: Path) -> dict:
    """The tracked figures the constants were copied from (for the test that keeps them in sync)."""
    bench = root / "results" / "bench"
    return {name: json.loads((bench / f"{name}.json").read_text()) for name in ("decode_h100", "decode", "ops")
            if (bench / f"{name}.json").is_file()}
