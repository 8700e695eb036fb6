"""Batched decoding on the embedded model (SmolLM2-135M, offline RULER needles): ``decode_batch=1`` vs the default
(every method config of a sample in one batch) vs every sample's configs in one batch (``decode_samples`` = all),
measured in one run and one process.

* End to end: ``run_sweep`` wall time for the demo sweep (6 configs) and a 14-config sweep shaped like
  ``paper-shape``, every mode on the same samples; the tokens must be identical.
* Decode tokens/s, and the share of wall time outside the model's forward passes (prefill + decode steps, attention
  included), with and without compression.
* The most batching a sample's configs could give on this device: the default batched run with every forward
  pass at the cost of a weights-only step (a one-token cache) at its batch size, everything else as measured.
* One batched decode step over the demo's compressed caches vs the same step with a plain dense transformers
  ``DynamicCache`` holding the full prompt for every row (the reference limit), at the same batch size.

Writes ``results/bench/decode.json``. ``--model``/``--device`` measure another model config (a name under
``conf/model`` or a YAML path) on another device, e.g. a random SmolLM2-shaped model on a GPU (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from spark_bench.benchmarks.ruler import load_ruler
from spark_bench.cli import CONF_DIR
from spark_bench.engine.decode import DecodeRow, decode_rows
from spark_bench.engine.fastpaths import FastPaths
from spark_bench.engine.prefill import run_prefill
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.models import ModelConfig, load_model
from spark_bench.runner import run_sweep

ROOT = Path(__file__).resolve().parents[2]
NEEDLES = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
           "niah_multikey_3", "niah_multivalue", "niah_multiquery"]


# the 14-config sweep (Table 2's SnapKV rows at 20% and 50% + the λ sweep of Fig. 5a with and without recovery)
FOURTEEN = [dict(name="full"), dict(name="snapkv", budget=0.2), dict(name="snapkv", budget=0.5)] + [
    dict(name=f"snapkv+{m}", budget=0.2, ratio=r) for m in ("think", "spark") for r in (0.3, 0.5, 0.8)] + [
    dict(name="snapkv+spark", budget=0.2, ratio=r, recovery="none") for r in (0.3, 0.5, 0.8)] + [
    dict(name="snapkv+think", budget=0.5, ratio=0.8), dict(name="snapkv+spark", budget=0.5, ratio=0.8)]


def sweep_configs(name: str) -> list[MethodConfig]:
    if name == "fourteen":
        return [MethodConfig(**entry) for entry in FOURTEEN]
    entries = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "sweep" / f"{name}.yaml"))["configs"]
    return [MethodConfig(**entry) for entry in entries]


def forwards(tokens: list[int], max_new_tokens: int) -> int:
    """Forward passes a row took part in (prompt scope, no suffix): tokens 2 … n each need one, and a row stopped
    by a stop token (n < max_new_tokens) needed one more to produce it; the first token comes from the prefill."""
    return len(tokens) if len(tokens) < max_new_tokens else len(tokens) - 1


def timed_sweep(lm, samples, configs, out: Path, decode_batch, decode_samples: int = 1,
                decode_stack: bool = True) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # fresh: an existing results dir would resume and compute nothing
    start = time.perf_counter()
    preds = run_sweep(lm, samples, configs, out, decode_batch=decode_batch,
                      decode_samples=decode_samples, decode_stack=decode_stack)
    wall = time.perf_counter() - start
    prefill = float(preds.groupby("id").prefill_s.first().sum())
    decode, compress = float(preds.decode_s.sum()), float(preds.compress_s.sum())
    tokens = int(preds.tokens.map(len).sum())
    cap = {s.id: s.max_new_tokens for s in samples}
    rows = {i: [forwards(t, cap[i]) for t in group.tokens] for i, group in preds.groupby("id", sort=False)}
    return {"wall_s": round(wall, 2), "prefill_s": round(prefill, 2), "compress_s": round(compress, 2),
            "decode_forward_s": round(decode, 2), "decode_tokens": tokens,
            "decode_tokens_per_s": round(tokens / max(decode, 1e-9), 1),
            "harness_share": round((wall - prefill - decode) / wall, 4),
            "harness_share_excl_compress": round((wall - prefill - decode - compress) / wall, 4),
            "tokens": [list(t) for t in preds.tokens], "row_forwards": [rows[s.id] for s in samples]}


def weights_floor_s(row_forwards: list[list[int]], step_ms: dict[int, float]) -> float:
    """Seconds the default batched run's forward passes take at least: each pass of a sample's batch costs the
    weights-only step at the number of that sample's rows still live in it."""
    return sum(step_ms[sum(n >= k for n in rows)] for rows in row_forwards
               for k in range(1, max(rows, default=0) + 1)) / 1000


@torch.inference_mode()
def weights_step_ms(lm, sizes: range, steps: int = 10) -> dict[int, float]:
    """Fastest of ``steps`` decode steps at batch ``r`` over a one-token dense cache: the model's weights with next
    to no attention, what any decode step at that batch size costs at least on this device (the minimum, not the
    median: a floor should not carry this machine's noise)."""
    model = lm.model
    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    for r in sizes:
        cache = DynamicCache(config=model.config)
        token = torch.zeros((r, 1), dtype=torch.long, device=device)
        model(input_ids=token, position_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        times = []
        for i in range(steps):
            sync()
            start = time.perf_counter()
            model(input_ids=token, position_ids=torch.full_like(token, i + 1), past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
            sync()
            times.append(time.perf_counter() - start)
        out[r] = round(1000 * min(times), 2)
    return out


def compare(lm, samples, configs, scratch: Path, name: str, step_ms: dict[int, float]) -> dict:
    """decode_batch=1 vs the default (all configs of a sample) vs every sample's configs in one batch
    (``decode_samples`` = the number of samples), and the most the default could give: the batched run with its
    forward passes at the weights-only floor (attention free)."""
    one = timed_sweep(lm, samples, configs, scratch / f"{name}_1", 1)
    batched = timed_sweep(lm, samples, configs, scratch / f"{name}_all", None)
    per_row = timed_sweep(lm, samples, configs, scratch / f"{name}_per_row", None, decode_stack=False)
    joined = timed_sweep(lm, samples, configs, scratch / f"{name}_joined", None, decode_samples=len(samples))
    same = one.pop("tokens") == batched.pop("tokens") == joined.pop("tokens") == per_row.pop("tokens")
    batched["weights_floor_s"] = round(weights_floor_s(batched["row_forwards"], step_ms), 2)
    bound = one["wall_s"] / (batched["wall_s"] - batched["decode_forward_s"] + batched["weights_floor_s"])
    return {"configs": len(configs), "samples": len(samples), "decode_batch_1": one, "batched": batched,
            "batched_per_row": per_row, "batched_all_samples": joined,
            "stacking_speedup": round(per_row["wall_s"] / batched["wall_s"], 3),
            "stacking_decode_speedup": round(per_row["decode_forward_s"] / batched["decode_forward_s"], 3), "speedup": round(one["wall_s"] / batched["wall_s"], 2),
            "speedup_all_samples": round(one["wall_s"] / joined["wall_s"], 2),
            "decode_speedup": round(one["decode_forward_s"] / batched["decode_forward_s"], 2),
            "speedup_bound": round(bound, 2), "identical_tokens": same}


@torch.inference_mode()
def step_ms(lm, sample, configs, steps: int, repeats: int, checks: FastPaths) -> dict:
    """Median ms of one decode step for all ``configs`` batched (stacked, and the per-row path), and for a dense
    DynamicCache batch of that size. ``checks``: the script's fast-path record (engine/fastpaths.py), so each variant
    is checked against its reference once, at its first use in the script, not in every timed decode."""
    model = lm.model
    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prefill = run_prefill(model, torch.tensor([sample.input_ids], device=device), 32)
    per_step, per_row = [], []
    for _ in range(repeats):
        for stack, times in ((True, per_step), (False, per_row)):
            selections = {}
            rows = [DecodeRow(Pipeline.from_config(c).build_cache(prefill, selections=selections)[0],
                              prefill.first_logits, prefill.prompt_length, steps + 1, frozenset()) for c in configs]
            sync()
            start = time.perf_counter()
            decode_rows(model, rows, stack=stack, checks=checks)
            sync()
            times.append((time.perf_counter() - start) / steps)
    r = len(configs)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([sample.input_ids], device=device), past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    for layer in cache.layers:
        layer.keys = layer.keys.expand(r, -1, -1, -1).contiguous()
        layer.values = layer.values.expand(r, -1, -1, -1).contiguous()
    token = torch.full((r, 1), prefill.first_token, device=device)
    dense = []
    for i in range(steps):
        position = torch.full((r, 1), prefill.prompt_length + i, device=device)
        sync()
        start = time.perf_counter()
        model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True, logits_to_keep=1)
        sync()
        dense.append(time.perf_counter() - start)
    compressed, dense_ms = 1000 * statistics.median(per_step), 1000 * statistics.median(dense)
    unstacked = 1000 * statistics.median(per_row)
    return {"batch": r, "prompt_tokens": prefill.prompt_length, "compressed_step_ms": round(compressed, 1),
            "per_row_step_ms": round(unstacked, 1), "dense_dynamic_cache_step_ms": round(dense_ms, 1),
            "ratio": round(compressed / dense_ms, 3), "ratio_per_row": round(unstacked / dense_ms, 3)}


def stacking_repeats(lm, samples, configs, scratch: Path, name: str, repeats: int) -> dict:
    """Stacked rows (the default) against the per-row path (``decode_stack=false``), alternating ``repeats`` times in
    one process on the same samples: the median wall and decode-forward seconds of each and their ratio (per-row /
    stacked, > 1 = stacking is faster)."""
    walls = {"stacked": [], "per_row": []}
    forwards = {"stacked": [], "per_row": []}
    for i in range(repeats):
        for key, stack in (("per_row", False), ("stacked", True)) if i % 2 else (("stacked", True), ("per_row", False)):
            r = timed_sweep(lm, samples, configs, scratch / f"{name}_{key}_{i}", None, decode_stack=stack)
            walls[key].append(r["wall_s"])
            forwards[key].append(r["decode_forward_s"])
    med = {k: statistics.median(v) for k, v in walls.items()}
    med_f = {k: statistics.median(v) for k, v in forwards.items()}
    return {"configs": len(configs), "samples": len(samples), "repeats": repeats, "wall_s": walls,
            "decode_forward_s": forwards, "median_wall_s": med, "median_decode_forward_s": med_f,
            "speedup": round(med["per_row"] / med["stacked"], 3),
            "decode_speedup": round(med_f["per_row"] / med_f["stacked"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=1, help="samples per needle task (8 tasks)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("results/bench/decode.json"))
    parser.add_argument("--model", default="smollm2-135m", help="a name under conf/model, or a model YAML path")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sweeps", default="demo,fourteen", help="comma-separated: demo, fourteen")
    parser.add_argument("--steps-only", action="store_true", help="only (re)measure the single-step comparison")
    parser.add_argument("--stacking-repeats", type=int, default=0,
                        help="only compare stacked rows with the per-row path, alternating this many times per sweep")
    args = parser.parse_args()
    sweeps = args.sweeps.split(",")
    if not set(sweeps) <= {"demo", "fourteen"}:
        parser.error(f"--sweeps {args.sweeps}: valid names are demo, fourteen")
    model_file = Path(args.model) if args.model.endswith(".yaml") else CONF_DIR / "model" / f"{args.model}.yaml"
    model_cfg = ModelConfig.from_dict(OmegaConf.to_container(OmegaConf.load(model_file)))
    lm = load_model(model_cfg, args.device)
    samples = load_ruler(NEEDLES, args.length, args.samples, 42, lm, args.max_new_tokens)
    scratch = args.out.parent / "decode_runs"
    if args.stacking_repeats:
        result = {"model": model_cfg.name, "length": args.length, "max_new_tokens": args.max_new_tokens,
                  "threads": torch.get_num_threads(), **{name: stacking_repeats(
                      lm, samples, sweep_configs(name), scratch, name, args.stacking_repeats) for name in sweeps}}
        shutil.rmtree(scratch, ignore_errors=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return
    if args.steps_only:
        result = json.loads(args.out.read_text())
    else:
        most = max(len(sweep_configs(name)) for name in sweeps)
        floor = weights_step_ms(lm, range(1, most + 1))
        result = {"model": model_cfg.name, "length": args.length, "max_new_tokens": args.max_new_tokens,
                  "threads": torch.get_num_threads(),
                  "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  "weights_step_ms": floor,
                  **{name: compare(lm, samples, sweep_configs(name), scratch, name, floor) for name in sweeps}}
    checks = FastPaths()
    for name in sweeps:
        result[f"step_{name}"] = step_ms(lm, samples[0], sweep_configs(name), steps=12, repeats=3, checks=checks)
    shutil.rmtree(scratch, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
