"""`make gpu-check`: what the CUDA decode path achieves at the production shape → <out>/check.json.

The model is Llama-3-8B-shaped (32 layers, hidden 4096, 32 query / 8 kv heads of D=128, bf16) with random weights
(seeded; no hub, no download). Three workloads: Table 1's config mix (``conf/sweep/table1.yaml``, 27 configs, the
``official`` protocol) on one 7,950-token prompt (LongBench's cut for LLaMA-3), one row at 32K and one at 127.5K
(``snapkv+spark``, ratio 0.8, 20% of the prompt). For each, one section per question:

* ``<workload>.memory``: the planner's predicted peak (:func:`spark_bench.memory.predict_run`) against the peak
  measured over compressing and decoding (``torch.cuda.max_memory_allocated``, :mod:`spark_bench.engine.clock`);
* ``<workload>.fused_layer``: one decoder layer's attention of the batch (:class:`BatchedLayer`: ``update`` then
  ``attend``, as the model calls them) timed with CUDA events; the bytes it must read (each store once, the tail) ÷
  its time as a fraction of the device's published peak bandwidth (:data:`PEAK_BANDWIDTH`, "unknown" otherwise);
  the same for the same number of dense rows; its output against the per-row reference path (``materialize``);
* ``<workload>.steps``: a decode step of the whole model over the compressed rows against one over dense rows
  (``full``: the prompt's whole KV, one distinct prompt per row) — both eager, and both replayed from a CUDA graph
  (:class:`~spark_bench.engine.decode.StepGraph`), each timed with CUDA events after warm-up steps (kernels
  compiled, tables built, graph captured before timing);
* ``table1_mix.tokens``: the batched tokens against ``decode_batch=1`` and against eager steps;
* ``member_kinds``: one row of every member loop of the fused kernel (dense, structured, bare, plain and signed keys)
  at head_dim 32 and 128, at the model's query heads per kv-head (the signed rows built into tiles) and at 2 (walked),
  layer 0's output against the per-row reference.

It starts by naming the Triton it runs under and what that changes or disables (``triton`` in check.json).

Each section writes check.json as soon as it ends; a failing section records its error (and traceback) and the
rest still run; the exit status is 1 when any section failed. With two GPUs, ``two_devices``: a tiny Llama split
over both decodes the tokens it decodes on one. ``calibration`` (read by :mod:`spark_bench.plan`): the prefill and
step times of the mix and the 32K row.

``--device cpu --smoke``: the same code at tiny shapes on the CPU, the CUDA-only branches included: the compact
backend is forced to ``triton`` and the fused kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), as in
tests/test_fused_decode.py; CUDA graphs cannot be captured there, so the graphed steps record why (the engine's
:meth:`~spark_bench.engine.cache.BatchedCache.graph_blocker`). Its timings are labelled CPU smoke, not figures.
``make test`` runs it (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

if "--smoke" in sys.argv or any(a.endswith("cpu") for a in sys.argv):  # Triton picks its interpreter at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import spark_bench  # noqa: E402
from spark_bench.checks import CONF_DIR as CONF  # noqa: E402  (conf/ in a checkout, spark_bench/conf in a wheel)
from spark_bench.engine import cache as cache_module  # noqa: E402
from spark_bench.engine import clock  # noqa: E402
from spark_bench.engine.fastpaths import FastPaths  # noqa: E402
from spark_bench.engine.attention import compressed_attention_enabled  # noqa: E402
from spark_bench.engine.cache import BatchedCache, BatchedLayer  # noqa: E402
from spark_bench.engine.decode import DecodeRow, StepGraph, decode_rows  # noqa: E402
from spark_bench.storage.segments import KINDS  # noqa: E402

# Published peak memory bandwidth (bytes/s) by the name torch.cuda.get_device_name gives; first match wins.
PEAK_BANDWIDTH = [
    (r"\bH200\b", 4.8e12, "H200 (HBM3e)"),
    (r"\bH100\b.*\bNVL\b", 3.9e12, "H100 NVL"),
    (r"\bH100\b.*\bPCIe\b", 2.0e12, "H100 PCIe"),
    (r"\bH100\b", 3.35e12, "H100 SXM"),
    (r"\bA100\b.*80GB", 2.0e12, "A100 80GB"),
    (r"\bA100\b", 1.555e12, "A100 40GB"),
    (r"\bL40S\b", 0.864e12, "L40S"),
]
PRODUCTION = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=1, head_dim=16, vocab_size=1024, rope_theta=500000.0)  # 4 query heads per kv-head
LONG_ROW = {"name": "snapkv+spark", "ratio": 0.8, "budget": 0.2}


@dataclass
class Scale:
    """Lengths, budgets and repeat counts: the production ones, or the CPU smoke's tiny ones."""

    shape: dict
    mix_prompt: int
    rows: dict                       # workload name → prompt tokens of its one row
    mix_budgets: tuple = (128, 512)  # Table 1's KV budgets taken into the mix (the smoke: 128's configs)
    mix_ratios: tuple = (0.5, 0.8)   # and its +think / +spark ratios (the smoke: 0.5, one row of each method)
    budget_divisor: int = 1          # those budgets ÷ this
    options: dict = field(default_factory=dict)  # method options over the protocol's (the smoke's small windows)
    warm: int = 3
    repeats: int = 20
    new_tokens: int = 16


FULL = Scale(PRODUCTION, 7950, {"row_32k": 32768, "row_127.5k": 127500})
TINY = Scale(SMOKE, 32, {"row_32k": 64, "row_127.5k": 128}, mix_budgets=(128,), mix_ratios=(0.5,),
             budget_divisor=16, options={"window_size": 4, "channel_window": 4}, warm=0, repeats=1, new_tokens=2)


# The largest normalised error (max |fused − reference| / max |reference|) accepted for a layer's output: four
# roundings of its dtype (the fused kernel rounds its float32 result once), 1e-4 in float32 (summation order only)
TOLERANCE = {torch.bfloat16: 4 * 2 ** -8, torch.float16: 4 * 2 ** -11, torch.float32: 1e-4}


class SectionFailed(Exception):
    """A section that measured, but whose result fails a check: both go into check.json."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


class Report:
    """check.json, rewritten after every section (a crash later loses nothing before it)."""

    def __init__(self, out: Path, head: dict):
        self.path = out / "check.json"
        out.mkdir(parents=True, exist_ok=True)
        self.data = {**head, "sections": {}, "errors": {}}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str), encoding="utf-8")
        tmp.replace(self.path)

    def run(self, name: str, fn, *args):
        """Run one section: its result (or its error and traceback) goes into check.json at once."""
        start = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 — a failing section is recorded and the rest still run
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"
            measured = exc.result if isinstance(exc, SectionFailed) else {}
            self.data["sections"][name] = {**measured, "ok": False, "error": self.data["errors"][name],
                                           "traceback": traceback.format_exc(),
                                           "seconds": time.perf_counter() - start}
            print(f"gpu-check: {name}: FAILED: {self.data['errors'][name]}", file=sys.stderr, flush=True)
            result = None
        else:
            self.data["sections"][name] = {"ok": True, **result, "seconds": time.perf_counter() - start}
            print(f"gpu-check: {name}: {json.dumps(result, default=str)}", flush=True)
        self.write()
        return result


def peak_bandwidth(name: str) -> tuple[float | None, str]:
    for pattern, peak, part in PEAK_BANDWIDTH:
        if re.search(pattern, name):
            return peak, part
    return None, f"unknown (no published peak for {name!r} in scripts/gpu/check.py)"


class Timer:
    """Seconds of ``fn()``: CUDA events on a CUDA device (the device's own time, no host sync inside), else the
    wall clock (CPU smoke)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.how = "CUDA events" if self.cuda else "wall clock (CPU smoke: not a figure)"

    def median(self, fn, warm: int, repeats: int) -> float:
        for _ in range(warm):
            fn()
        times = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
        return statistics.median(times)


@contextlib.contextmanager
def cuda_path_on_cpu(device: torch.device):
    """On the CPU (smoke): the compact backend answers ``triton``, so every CUDA-only branch of the decode path (the
    fused kernel under the interpreter, the graph blocker) runs on CPU tensors; restored on exit."""
    if device.type != "cpu":
        yield
        return
    saved = cache_module.compact_backend
    cache_module.compact_backend = lambda device, *args, **kwargs: "triton"
    try:
        yield
    finally:
        cache_module.compact_backend = saved


class Bench:
    """The random-weight model of ``scale.shape`` on ``device`` and the contexts of each workload (built once, by
    the first section that needs them)."""

    def __init__(self, device: torch.device, scale: Scale, dtype: torch.dtype):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.device, self.scale, self.dtype = device, scale, dtype
        self.timer = Timer(device)
        self.config = AutoConfig.for_model("llama", max_position_embeddings=131072, **scale.shape)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
            torch.manual_seed(0)  # seeded weights; the caller's random state is left as it was
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=dtype).eval()
        self.generator = torch.Generator().manual_seed(0)
        self.peak = peak_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else (
            None, "none (CPU smoke)")
        self.contexts: dict[str, list] = {}
        self.compress_s: dict[str, float] = {}
        # the check is a run of its own: one record of its fast paths (engine/fastpaths.py) for every section's
        # batches, each variant checked at its first use
        self.checks = FastPaths()

    def model_config(self):
        """The planner's view of this model (:class:`~spark_bench.models.ModelConfig` with its ``arch:`` block)."""
        from spark_bench.models import ModelConfig

        s = self.scale.shape
        params = sum(p.numel() for p in self.model.parameters())
        arch = dict(num_layers=s["num_hidden_layers"], num_heads=s["num_attention_heads"],
                    num_kv_heads=s["num_key_value_heads"], head_dim=s["head_dim"], num_params=float(params),
                    hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                    vocab_size=s["vocab_size"])
        return ModelConfig.from_dict({"name": "llama3-8b-shape", "source": "random", "architecture": "llama",
                                      "dtype": str(self.dtype).removeprefix("torch."), "arch": arch,
                                      "config": dict(s)})

    def configs(self, workload: str) -> list:
        if workload != "table1_mix":
            return [spark_bench.method(**LONG_ROW, **self.scale.options)]
        sweep = OmegaConf.to_container(OmegaConf.load(CONF / "sweep" / "table1.yaml"))["configs"]
        out = []
        for c in sweep:
            c = dict(c)
            if (c.get("budget", self.scale.mix_budgets[0]) not in self.scale.mix_budgets
                    or c.get("ratio", self.scale.mix_ratios[0]) not in self.scale.mix_ratios):
                continue
            if "budget" in c:
                c["budget"] = c["budget"] // self.scale.budget_divisor
            out.append(spark_bench.method(**c, **self.scale.options))
        return out

    def prompt_tokens(self, workload: str) -> int:
        return self.scale.mix_prompt if workload == "table1_mix" else self.scale.rows[workload]

    def ids(self, tokens: int) -> list[int]:
        return torch.randint(100, self.config.vocab_size, (tokens,), generator=self.generator).tolist()

    def sync(self) -> None:
        clock.synchronize(self.device)

    def build(self, workload: str) -> list:
        """Compress one prompt under the workload's configs (one prefill)."""
        if workload not in self.contexts:
            ids = self.ids(self.prompt_tokens(workload))
            self.sync()
            start = time.perf_counter()
            self.contexts[workload] = spark_bench.compress(self.model, ids, self.configs(workload))
            self.sync()
            self.compress_s[workload] = time.perf_counter() - start
        return self.contexts[workload]

    def dense(self, workload: str, rows: int) -> list:
        """``rows`` dense contexts (``full``: the whole prompt's KV), each of its own prompt (one prefill each)."""
        full = spark_bench.method("full", **self.scale.options)
        tokens = self.prompt_tokens(workload)
        return spark_bench.compress(self.model, [self.ids(tokens) for _ in range(rows)], full)

    def drop(self, workload: str) -> None:
        self.contexts.pop(workload, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def memory(bench: Bench, workload: str) -> dict:
    """The planner's peak for compressing the workload and decoding its rows together, against the measured one."""
    from spark_bench.memory import Device, predict_run

    configs = bench.configs(workload)
    prompt, new = bench.prompt_tokens(workload), bench.scale.new_tokens
    weights = sum(p.numel() * p.element_size() for p in bench.model.parameters())
    bench.drop(workload)
    clock.reset_peak(bench.device)
    baseline = clock.resident_now() - weights if bench.device.type == "cpu" else 0
    ctxs = bench.build(workload)
    rows = [DecodeRow(c.cache, c.first_logits, len(c.input_ids), new, frozenset()) for c in ctxs]
    decode_rows(bench.model, rows, checks=bench.checks)
    bench.sync()
    measured = clock.peak_memory(bench.device)
    device = Device(str(bench.device), weights, bench.scale.shape["num_hidden_layers"])
    predicted = predict_run(bench.model_config(), configs, prompt, new, None, 1, [device], max(baseline, 0)).peak
    return {"prompt": prompt, "rows": len(ctxs), "new_tokens": new, "predicted_bytes": predicted,
            "measured_bytes": measured, "predicted_over_measured": predicted / measured,
            "measured_by": "torch.cuda.max_memory_allocated" if bench.device.type == "cuda"
            else "peak resident set (CPU smoke: not a figure)", "compress_s": bench.compress_s[workload]}


def _layer_bytes(rows: list, length: int) -> int:
    """Bytes one fused step of layer 0 must read: each key and value store once (rows share stores), the validity
    bits, and the tail's ``length`` decoded tokens of every row."""
    seen, total = set(), 0
    for layer in rows:
        for store in (layer.key_store, layer.value_store):
            if id(store) not in seen:
                seen.add(id(store))
                total += store.nbytes()
        if layer.valid_bits is not None:
            total += layer.valid_bits.numel()
    b, h, _, d = rows[0].value_store.shape
    return total + 2 * len(rows) * b * h * length * d * rows[0].value_store.dtype.itemsize


def _fused_layer(bench: Bench, ctxs: list, heads: int | None = None) -> dict:
    """Layer 0 of the rows as one :class:`BatchedLayer`: each timed call is one ``update`` (the step's own key and
    value) and one ``attend``, as a decode step calls them; first, one call against the reference path. ``heads``:
    the rows' query heads (default: the bench model's). Also which member loops of the fused kernel its tables hold
    (``kinds``, :data:`~spark_bench.storage.segments.KINDS`) and how a decode step served the signed ones
    (``signed``: ``walk``, :mod:`~spark_bench.storage.triton_walk`; ``tiles``,
    :mod:`~spark_bench.storage.triton_tiles`; None: neither, the compact loop)."""
    scale = bench.scale
    rows = [c.cache.layers[0] for c in ctxs]
    capacity = 2 + scale.warm + scale.repeats
    layer = BatchedLayer(rows, capacity, fast_paths=bench.checks)
    reference = BatchedLayer(rows, capacity, mode="materialize", fast_paths=bench.checks)
    b, h, _, d = rows[0].value_store.shape
    hq, n = heads or bench.scale.shape["num_attention_heads"], len(rows) * b
    g = torch.Generator(device=bench.device).manual_seed(1)
    keys, values, query = (torch.randn(n, k, 1, d, generator=g, device=bench.device, dtype=bench.dtype)
                           for k in (h, h, hq))
    scaling = d ** -0.5
    layer.update(keys, values)
    out = layer.attend(query, scaling)
    reference.update(keys, values)
    expected = reference.attend(query, scaling)
    error = ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()

    def step():
        layer.update(keys, values)
        layer.attend(query, scaling)

    seconds = bench.timer.median(step, scale.warm, scale.repeats)
    length = 1 + scale.warm + (scale.repeats + 1) // 2  # the tail at the median call
    nbytes = _layer_bytes(rows, length)
    peak = bench.peak[0]
    kernels = _attend_kernels(bench, layer, query, scaling)
    if "seconds" in kernels:  # (the tail as the graph reads it: every call's token appended)
        kernels["bytes"] = _layer_bytes(rows, 1 + scale.warm + scale.repeats)
        kernels["fraction_of_peak"] = kernels["bytes"] / kernels["seconds"] / peak if peak else None
    tables = [t for unit in getattr(layer, "units", []) for t in unit.get("tables", {}).values()]
    held = 0
    for t in tables:
        held |= t.kinds
    return {"rows": len(rows), "backend": layer.backend, "fused_rows": len(layer.stacked),
            "loose_rows": len(layer.loose), "bytes": nbytes, "seconds": seconds, "bytes_per_s": nbytes / seconds,
            "fraction_of_peak": nbytes / seconds / peak if peak else None, "error_vs_reference": error,
            "tolerance": TOLERANCE[bench.dtype], "kinds": [k for i, k in enumerate(KINDS) if held >> i & 1],
            "signed": "tiles" if any(getattr(t, "tiles", False) for t in tables) else "walk" if any(
                getattr(t, "walk_tab", None) is not None for t in tables) else None,
            "ragged": any(getattr(t, "ragged", False) for t in tables),
            "vsparse": any(getattr(t, "vsparse", False) for t in tables), "attend_kernels": kernels}


def _attend_kernels(bench: Bench, layer, query, scaling: float) -> dict:
    """The layer's ``attend`` alone (after its last ``update``: a repeated attend reads the same step), replayed from
    a CUDA graph: the kernels' own time, none of the host's launch work between them — what the latency model
    (scripts/bench/latency_model.py) predicts, where ``seconds`` above also holds the host's gaps. With it, each
    kernel's time from the profiler (``per_kernel``; where CUPTI answers). On the CPU (smoke) nothing is captured:
    ``graph`` says why."""
    if bench.device.type != "cuda":
        return {"graph": "not captured: CUDA graphs need a CUDA device"}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm on a side stream, as capture asks)
        for _ in range(3):
            layer.attend(query, scaling)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            layer.attend(query, scaling)
    except Exception as e:  # (a host sync inside attend: say so, the section's other figures stand)
        return {"graph": f"not captured: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    out = {"graph": "captured", "seconds": bench.timer.median(graph.replay, bench.scale.warm, bench.scale.repeats)}
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        per = {}
        for ev in prof.key_averages():
            if getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type) and ev.count:
                name = re.sub(r"_kernel.*", "_kernel", ev.key)[:60]
                total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                per[name] = per.get(name, 0.0) + total / 1e6 / 5  # (µs over five replays → seconds per replay)
        out["per_kernel"] = per or "no kernels reported (CUPTI)"
    except Exception as e:
        out["per_kernel"] = f"not profiled: {type(e).__name__}: {e}"
    return out


# One row of each member loop of the fused kernel (storage/segments.py KINDS) at a head_dim of one 32-bit mask word
# and at the production's (four words), at the bench's query heads per kv-head (4: a bfloat16 step builds the signed
# rows into tiles) and at 2 (they are walked)
KIND_ROWS = ({"name": "snapkv"},                                           # dense keys
             {"name": "snapkv+think", "ratio": 0.5},                       # structured keys (ThinK's channels)
             {"name": "snapkv+spark", "ratio": 0.5, "recovery": "zero"},   # pruned entries read as 0
             {"name": "snapkv+spark", "ratio": 0.5, "saliency": "paper"},  # a recovery without signs
             {"name": "snapkv+spark", "ratio": 0.8},                       # the official recovery: signs
             {"name": "adasnapkv+spark", "ratio": 0.5},                    # AdaKV's validity bits on a signed row
             {"name": "snapkv+mustafar", "ratio": 0.5, "value_ratio": 0.5})  # bare keys (bf16 ties: ragged), sparse
# values (VSPARSE)
KIND_SHAPES = ((32, None), (128, None), (32, 2), (128, 2))  # (head_dim, query heads per kv-head; None: the bench's)


def kind_key(head_dim: int, group: int | None) -> str:
    """The ``member_kinds`` section's key of a shape of :data:`KIND_SHAPES`."""
    return f"head_dim_{head_dim}" + (f"_gqa{group}" if group else "")


def signed_path(group: int, dtype: torch.dtype) -> str:
    """How a decode step serves SparK's official-recovery rows at ``group`` query heads per kv-head: built into tiles
    (:func:`~spark_bench.storage.walk_layout.tiled`: bfloat16, 4 rows a member or more) or walked."""
    from spark_bench.storage.triton_decode import launch_shape
    from spark_bench.storage.walk_layout import tiled

    return "tiles" if tiled(launch_shape(group)[1], dtype.itemsize) else "walk"


def member_kinds(bench: Bench) -> dict:
    """For each shape of :data:`KIND_SHAPES` (head_dim, query heads per kv-head), a one-layer model (random weights,
    seeded) compresses one prompt under :data:`KIND_ROWS`; layer 0's fused attention of the rows
    (:func:`_fused_layer`) holds every member kind, serves the signed rows as :func:`signed_path` says (walked, or in
    tiles), and agrees with the per-row reference."""
    from transformers import AutoConfig, AutoModelForCausalLM

    s, out, wrong = bench.scale.shape, {}, []
    tokens = bench.scale.mix_prompt * 2
    budget = max(8, tokens // 4)
    for d, group in KIND_SHAPES:
        heads = s["num_key_value_heads"] * group if group else s["num_attention_heads"]
        config = AutoConfig.for_model("llama", hidden_size=heads * d, head_dim=d,
                                      intermediate_size=2 * d, num_hidden_layers=1,
                                      num_attention_heads=heads,
                                      num_key_value_heads=s["num_key_value_heads"], vocab_size=1024,
                                      max_position_embeddings=4096, rope_theta=500000.0)
        with torch.random.fork_rng(devices=[bench.device] if bench.device.type == "cuda" else []), \
                torch.device(bench.device):
            torch.manual_seed(d)
            model = AutoModelForCausalLM.from_config(config, dtype=bench.dtype).eval()
        ids = torch.randint(100, 1024, (tokens,), generator=bench.generator).tolist()
        configs = [spark_bench.method(**row, budget=budget, **bench.scale.options) for row in KIND_ROWS]
        result = _fused_layer(bench, spark_bench.compress(model, ids, configs), heads)
        out[kind_key(d, group)] = result
        missing = [k for k in KINDS if k not in result["kinds"]]
        path = signed_path(heads // s["num_key_value_heads"], bench.dtype)
        if result["backend"] != "triton" or result["loose_rows"] or missing or result["signed"] != path \
                or not result["error_vs_reference"] <= result["tolerance"]:
            wrong.append(f"{kind_key(d, group)}: backend {result['backend']}, {result['loose_rows']} loose rows, "
                         f"kinds missing {missing or 'none'}, signed rows {result['signed']} (not {path}), error "
                         f"{result['error_vs_reference']:.2e} (tolerance {result['tolerance']:.1e})")
        del model
    if wrong:
        raise SectionFailed("not every member kind ran the fused kernel and agreed with the reference: "
                            + "; ".join(wrong), out)
    return {"rows": [dict(r) for r in KIND_ROWS], "prompt": tokens, "budget": budget, **out}


def _compressed_and_dense(bench: Bench, workload: str, measure) -> tuple[int, dict, dict]:
    """``measure(bench, contexts)`` on the workload's compressed contexts, then on as many dense (``full``) ones
    (built after, and dropped before the next section): the row count and both results."""
    ctxs = bench.build(workload)
    compressed = measure(bench, ctxs)
    dense_ctxs = bench.dense(workload, len(ctxs))
    dense = measure(bench, dense_ctxs)
    return len(ctxs), compressed, dense


LATENCY_MODEL = Path(__file__).resolve().parents[2] / "results" / "bench" / "latency_model.json"


def model_prediction(device: str, workload: str) -> dict | None:
    """What scripts/bench/latency_model.py predicts for ``workload``'s fused layer on ``device`` (its ``check``
    section, keyed by the peak-bandwidth table's device name): ``latencies_s`` and the ``compressed`` / ``dense``
    figures; None for a device or workload it has no figures for. A single 32K row launches fewer programs than
    the GPU has SMs: compare it with the model's ``grid_fraction_of_bound``."""
    if not LATENCY_MODEL.is_file():
        return None
    devices = json.loads(LATENCY_MODEL.read_text()).get("check", {}).get("devices", {})
    found = devices.get(device)
    if found is None or workload not in found.get("workloads", {}):
        return None
    return {"latencies_s": found["latencies_s"], **found["workloads"][workload]}


def fused_layer(bench: Bench, workload: str) -> dict:
    _, compressed, dense = _compressed_and_dense(bench, workload, _fused_layer)
    out = {"timed_by": bench.timer.how, "peak_bandwidth": bench.peak[1], "compressed": compressed, "dense": dense,
           "kv_bytes_ratio": compressed["bytes"] / dense["bytes"]}
    predicted = model_prediction(bench.peak[1], workload)
    if predicted is not None:  # the latency model's prediction beside the measured figure (docs/gpu.md)
        for side in ("compressed", "dense"):
            out[side]["model"] = {"latencies_s": predicted["latencies_s"], **predicted[side]}
    wrong = [f"{kind}: " + (f"{r['loose_rows']} of {r['rows']} rows not on the fused kernel ({r['backend']})"
                            if r["backend"] != "triton" or r["loose_rows"] else
                            f"error {r['error_vs_reference']:.2e} of the output's scale > {r['tolerance']:.1e}")
             for kind, r in (("compressed", compressed), ("dense", dense))
             if r["backend"] != "triton" or r["loose_rows"] or not r["error_vs_reference"] <= r["tolerance"]]
    if wrong:
        raise SectionFailed("the fused kernel is not what ran or differs from the reference path: " + "; ".join(wrong),
                            out)
    return out


@torch.inference_mode()
def _step_times(bench: Bench, ctxs: list) -> dict:
    """One decode step of the model over the rows (a :class:`BatchedCache`), eager and replayed from a captured
    graph: after the first step (tables built, kernels compiled) and ``warm`` more, ``repeats`` timed steps each."""
    scale, model, device = bench.scale, bench.model, bench.device
    r = len(ctxs)
    cache = BatchedCache([c.cache for c in ctxs], 2 + 2 * (scale.warm + scale.repeats) + 1, fast_paths=bench.checks)
    ids = torch.randint(100, bench.config.vocab_size, (r, 1), generator=bench.generator).to(device)
    positions = torch.tensor([[len(c.input_ids)] for c in ctxs], device=device)

    def eager():
        model(input_ids=ids, position_ids=positions, past_key_values=cache, compressed_cache=cache, use_cache=True,
              logits_to_keep=1)
        positions.add_(1)

    with compressed_attention_enabled(model):
        eager()
        out = {"eager_s": bench.timer.median(eager, scale.warm, scale.repeats)}
        blocker = cache.graph_blocker()
        out["graph"] = "captured" if blocker is None else f"not captured: {blocker}"
        if blocker is None:
            graph = StepGraph(model, cache, ids, positions)

            def replay():
                graph(cache, ids, positions)
                positions.add_(1)

            out["graphed_s"] = bench.timer.median(replay, scale.warm, scale.repeats)
    return out


def steps(bench: Bench, workload: str) -> dict:
    rows, compressed, dense = _compressed_and_dense(bench, workload, _step_times)
    out = {"rows": rows, "timed_by": bench.timer.how, "compressed": compressed, "dense": dense,
           "eager_compressed_over_dense": compressed["eager_s"] / dense["eager_s"]}
    if "graphed_s" in compressed and "graphed_s" in dense:
        out["graphed_compressed_over_dense"] = compressed["graphed_s"] / dense["graphed_s"]
    return out


def tokens(bench: Bench, workload: str) -> dict:
    """Greedy tokens of the rows decoded together (graph where the batch allows), eagerly, and one at a time."""
    new = bench.scale.new_tokens

    def decode(ctxs, graph=True):
        rows = [DecodeRow(c.cache, c.first_logits, len(c.input_ids), new, frozenset()) for c in ctxs]
        return [row.tokens for row in decode_rows(bench.model, rows, graph=graph, checks=bench.checks)]

    ctxs = bench.build(workload)
    batched = decode(ctxs)
    eager = decode(ctxs, graph=False)
    alone = [decode([c])[0] for c in ctxs]
    differ = [i for i, (a, b) in enumerate(zip(batched, alone)) if a != b]
    return {"rows": len(ctxs), "new_tokens": new, "graph_tokens_equal_eager": batched == eager,
            "tokens_equal_decode_batch_1": not differ, "rows_differing_from_decode_batch_1": differ}


def calibration(bench: Bench, report: Report) -> dict:
    """What :mod:`spark_bench.plan` prints beside its estimate: prefill (and compression) TFLOP/s and the step of
    the mix and of the 32K row, from the sections above."""
    from spark_bench.memory import Arch
    from spark_bench.plan import prefill_flops

    arch = Arch.of(bench.model_config())
    rows = []
    for workload in ("table1_mix", "row_32k"):
        mem, step = (report.data["sections"].get(f"{workload}.{s}", {}) for s in ("memory", "steps"))
        if not (mem.get("ok") and step.get("ok")):
            continue
        tokens_ = bench.prompt_tokens(workload)
        flops = prefill_flops(arch.num_params, arch.num_layers, arch.num_heads, arch.head_dim, tokens_)
        seconds = step["compressed"].get("graphed_s", step["compressed"]["eager_s"])
        rows.append({"model": "llama3-8b-shaped (random weights)", "tokens": tokens_,
                     "prefill_and_compress_s": mem["compress_s"], "prefill_tflops": flops / mem["compress_s"] / 1e12,
                     "step_ms": seconds * 1e3, "rows": step["rows"]})
    if not rows:
        raise RuntimeError("no workload has both its memory and steps sections")
    if bench.device.type == "cuda":
        report.data["calibration"] = rows  # the key spark_bench.plan reads
    return {"rows": rows}


def two_devices(bench: Bench) -> dict:
    """A tiny Llama split over cuda:0 and cuda:1 (Accelerate's hooks move activations between them; every layer's
    cache and kernels on its own device) decodes the tokens it decodes on one."""
    from accelerate import dispatch_model

    lm = spark_bench.load("tiny-llama", device="cuda:0")
    ids = bench.ids(256)
    configs = bench.configs("table1_mix")

    def decode(model):
        ctxs = spark_bench.compress(model, ids, configs)
        rows = [DecodeRow(c.cache, c.first_logits, len(c.input_ids), 8, frozenset()) for c in ctxs]
        return [row.tokens for row in decode_rows(model, rows, checks=bench.checks)]

    one = decode(lm.model)
    layers = len(lm.model.model.layers)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1,
                  **{f"model.layers.{i}": 0 if i < layers // 2 else 1 for i in range(layers)}}
    two = decode(dispatch_model(lm.model, device_map))
    return {"layers": layers, "tokens_equal_one_device": one == two}


def triton_state() -> dict:
    """The Triton the fused kernels run under: its version, what differs from the kernels as tuned (for 3.9:
    :data:`~spark_bench.storage.triton_versions.TRITON_NOTES`) and what it disables (nothing from 3.2, torch 2.6's, on:
    docs/development.md#tested-versions); without an importable triton, the CUDA path itself."""
    try:
        from spark_bench.storage import triton_decode, triton_versions  # noqa: F401 (the kernels must import)
    except Exception as exc:  # noqa: BLE001 — no (usable) triton: the fused kernel is what it disables
        return {"version": "none", "notes": [f"{type(exc).__name__}: {exc}"],
                "disabled": ["the fused CUDA kernel (compact rows attend by rebuilt keys)"]}
    import triton

    return {"version": triton.__version__, "notes": list(triton_versions.TRITON_NOTES), "disabled": []}


WORKLOADS = ("table1_mix", "row_32k", "row_127.5k")
SECTIONS = {"memory": memory, "fused_layer": fused_layer, "steps": steps}


def section_names() -> list[str]:
    names = [f"{w}.{s}" for w in WORKLOADS for s in SECTIONS]  # steps last: it drops the workload's contexts
    return names[:2] + ["table1_mix.tokens"] + names[2:] + ["member_kinds", "calibration", "two_devices"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/bench/gpu", help="directory of check.json")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU smoke test of this script)")
    parser.add_argument("--sections", default="", help="comma-separated section names to run (default: all of "
                        f"{', '.join(section_names())})")
    args = parser.parse_args(argv)
    wanted = [s for s in args.sections.split(",") if s] or section_names()
    unknown = sorted(set(wanted) - set(section_names()))
    if unknown:
        print(f"gpu-check: --sections: unknown {', '.join(unknown)}; valid: {', '.join(section_names())}",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cpu":  # the interpreter's numpy warns at masked-off lanes (√μ at μ = 0, selected away)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False); `--device cpu --smoke` runs the "
              "CPU smoke", file=sys.stderr)
        return 2
    scale = TINY if args.smoke else FULL
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_bandwidth(name) if device.type == "cuda" else (None, "none (CPU smoke)")
    triton = triton_state()
    print(f"gpu-check: triton {triton['version']}: {'; '.join(triton['notes']) or 'the fused kernels as tuned'}"
          f" (disabled: {', '.join(triton['disabled']) or 'nothing'})", flush=True)
    report = Report(Path(args.out), {
        "device": name, "mode": "CPU smoke (tiny shapes; timings are not figures)" if device.type == "cpu"
        else "GPU", "torch": torch.__version__, "triton": triton, "shape": scale.shape, "dtype": "bfloat16",
        "peak_bandwidth_bytes_per_s": peak[0], "peak_bandwidth": peak[1]})
    with cuda_path_on_cpu(device):
        bench = Bench(device, scale, torch.bfloat16)
        for section in section_names():
            if section not in wanted:
                continue
            if section == "calibration":
                report.run(section, calibration, bench, report)
            elif section == "member_kinds":
                report.run(section, member_kinds, bench)
            elif section == "two_devices":
                if device.type == "cuda" and torch.cuda.device_count() >= 2:
                    report.run(section, two_devices, bench)
            else:
                workload, what = section.rsplit(".", 1)
                report.run(section, tokens if what == "tokens" else SECTIONS[what], bench, workload)
                if what == "steps":
                    bench.drop(workload)
    failed = sorted(report.data["errors"])
    print(f"gpu-check: wrote {report.path}" + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
