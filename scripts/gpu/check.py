"""`make gpu-check`: the figures of the CUDA decode path on the machine it runs on → <out>/check.json.

On SmolLM2-135M (bf16): decode-step time of a compressed batch (the Table 1 method mix at 20% of the prompt, cycled
to 6, 14 and 28 rows), with and without the CUDA graph (``decode_graph``), against a dense ``DynamicCache`` batch of
the same rows; the fused kernel's achieved bandwidth on one layer (bytes it must read ÷ time) against the device's
peak; decode throughput against input length at KV 128 (Fig. 5b's shape); the planner's predicted peak against
``torch.cuda.max_memory_allocated`` for a compress-and-decode of the mix; the batched tokens against
``decode_batch=1``; with two GPUs, a tiny Llama split over both decoding the tokens it decodes on one. Then, to
calibrate ``dry_run``'s plan at the paper's scale without a hub: prefill TFLOP/s and the decode step of the Table 1
mix on a randomly initialised Llama-3.1-8B-shaped model in bf16 at 8K and 32K tokens (``calibration``, read by
:mod:`spark_bench.plan`). ``--device cpu`` with small ``--lengths``/``--calibrate`` runs the same code on the CPU
(the C++ path), as a smoke test of this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import spark_bench  # noqa: E402
from spark_bench.engine.cache import BatchedCache  # noqa: E402
from spark_bench.engine.decode import DecodeRow, decode_rows  # noqa: E402

from spark_bench.checks import CONF_DIR as CONF  # noqa: E402  (conf/ in a checkout, spark_bench/conf in a wheel)

PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # bytes/s (SXM parts, published)
MIX = [("snapkv", {}), ("snapkv+think", {"ratio": 0.5}), ("snapkv+spark", {"ratio": 0.5}),
       ("snapkv+spark", {"ratio": 0.8}), ("pyramidkv+spark", {"ratio": 0.8}), ("adasnapkv+spark", {"ratio": 0.8}),
       ("snapkv+spark", {"ratio": 0.8, "recovery": "zero"})]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mix(budget):
    return [spark_bench.method(name, budget=budget, compress_scope="prompt", **opts) for name, opts in MIX]


def contexts(model, ids, budget, rows):
    made = spark_bench.compress(model, ids, mix(budget))
    return [made[i % len(made)] for i in range(rows)]


def decode_step_s(model, ctxs, new_tokens=(4, 20), stack=True, graph=True):
    """Seconds per decode step of the rows together (the difference of two runs cancels the batch set-up)."""
    device = model.get_input_embeddings().weight.device
    times = []
    for n in new_tokens:
        rows = [DecodeRow(c.cache, c.first_logits, len(c.input_ids), n, frozenset()) for c in ctxs]
        sync(device)
        start = time.perf_counter()
        decode_rows(model, rows, stack=stack, graph=graph)
        sync(device)
        times.append(time.perf_counter() - start)
    return (times[1] - times[0]) / (new_tokens[1] - new_tokens[0]), [r.tokens for r in rows]


@torch.inference_mode()
def dense_step_s(model, ids, rows, steps=16):
    from transformers import DynamicCache

    device = model.get_input_embeddings().weight.device
    batch = torch.tensor([ids] * rows, device=device)
    cache = DynamicCache()
    out = model(input_ids=batch, past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_bandwidth(ctxs, device, repeats=20):
    """One layer of the batch: bytes the fused step must read (stores, shared tensors once, and the tail) ÷ time."""
    batch = BatchedCache([c.cache for c in ctxs], capacity=8)
    layer = batch.layers[0]
    h, d = layer.tail_keys.shape[1], layer.tail_keys.shape[-1]
    hq = ctxs[0].cache.layers[0].value_store.shape[1] * 3  # SmolLM2: 9 query heads over 3 kv-heads
    keys = torch.randn(len(ctxs), h, 1, d, device=device, dtype=layer.tail_keys.dtype)
    layer.update(keys, keys)
    query = torch.randn(len(ctxs), hq, 1, d, device=device, dtype=layer.tail_keys.dtype)
    seen, stored = set(), 0
    for c in ctxs:
        for store in (c.cache.layers[0].key_store, c.cache.layers[0].value_store):
            if id(store) not in seen:
                seen.add(id(store))
                stored += store.nbytes()
    layer.attend(query, 0.125)
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        layer.attend(query, 0.125)
        sync(device)
        times.append(time.perf_counter() - start)
    return stored, statistics.median(times)


def predicted_vs_measured(lm, ids, device, new_tokens=16):
    """The planner's peak for compressing the mix and decoding it together, against the device's measured peak."""
    from spark_bench.memory import predict_run

    configs = mix(0.2)
    predicted = predict_run(lm.config, configs, len(ids), new_tokens, None, 1).devices[0].peak
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    ctxs = contexts(lm.model, ids, 0.2, len(configs))
    decode_step_s(lm.model, ctxs, new_tokens=(new_tokens, new_tokens))
    measured = torch.cuda.max_memory_allocated(device)
    return {"prompt": len(ids), "rows": len(configs), "predicted_bytes": predicted, "measured_bytes": measured,
            "predicted_over_measured": predicted / measured}


def two_devices(ids):
    """A tiny Llama split over cuda:0 and cuda:1 (Accelerate's hooks move activations between them; every layer's
    cache and kernels on its own device) decodes the tokens it decodes on one device."""
    from accelerate import dispatch_model

    lm = spark_bench.load("tiny-llama", device="cuda:0")
    ctxs = contexts(lm.model, ids, 0.2, len(MIX))
    _, one = decode_step_s(lm.model, ctxs)
    layers = len(lm.model.model.layers)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1,
                  **{f"model.layers.{i}": 0 if i < layers // 2 else 1 for i in range(layers)}}
    split = dispatch_model(lm.model, device_map)
    ctxs = contexts(split, ids, 0.2, len(MIX))
    _, two = decode_step_s(split, ctxs)
    return {"layers": layers, "tokens_equal_one_device": one == two}


def calibration(device, lengths, shape):
    """Prefill TFLOP/s and the decode step of the Table 1 mix on a randomly initialised model of ``shape``'s
    ``arch:`` block (bf16): what :mod:`spark_bench.plan` prints beside its estimate."""
    from transformers import AutoModelForCausalLM

    from spark_bench.memory import Arch
    from spark_bench.models import ModelConfig
    from spark_bench.plan import prefill_flops

    cfg = ModelConfig.from_dict(OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{shape}.yaml")))
    arch = Arch.of(cfg)
    config = arch.empty_model("bfloat16").config
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    out = []
    for tokens in lengths:
        ids = torch.randint(100, arch.vocab_size, (tokens,), generator=g).tolist()
        sync(device)
        start = time.perf_counter()
        ctxs = contexts(model, ids, 0.2, len(MIX))
        sync(device)
        prefill_s = time.perf_counter() - start  # prefill and compression of every config (one prefill)
        step, _ = decode_step_s(model, ctxs, new_tokens=(2, 6))
        flops = prefill_flops(arch.num_params, arch.num_layers, arch.num_heads, arch.head_dim, tokens)
        out.append({"model": f"{shape} (random weights)", "tokens": tokens, "prefill_and_compress_s": prefill_s,
                    "prefill_tflops": flops / prefill_s / 1e12, "step_ms": step * 1e3, "rows": len(ctxs)})
        print(out[-1], flush=True)
        del ctxs
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/bench/gpu")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--rows", default="6,14,28")
    parser.add_argument("--lengths", default="2048,8192,16384")
    parser.add_argument("--calibrate", default="8192,32768", help="token counts for the 8B-shaped model ('' = skip)")
    parser.add_argument("--calibrate-shape", default="llama3.1-8b")
    args = parser.parse_args()
    device = torch.device(args.device)
    lm = spark_bench.load("smollm2-135m", device=args.device, dtype="bfloat16")
    model = lm.model
    g = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "steps": []}
    ids = torch.randint(100, 40000, (args.prompt,), generator=g).tolist()
    for rows in (int(x) for x in args.rows.split(",")):
        ctxs = contexts(model, ids, 0.2, rows)
        step, tokens = decode_step_s(model, ctxs)
        eager, eager_tokens = decode_step_s(model, ctxs, graph=False)
        dense = dense_step_s(model, ids, rows)
        report["steps"].append({"rows": rows, "prompt": len(ids), "compressed_step_s": step,
                                "compressed_step_s_no_graph": eager, "dense_step_s": dense,
                                "compressed_over_dense": step / dense, "graph_tokens_equal": tokens == eager_tokens,
                                "kv_bytes_ratio": sum(c.nbytes for c in ctxs) / sum(c.dense_nbytes for c in ctxs)})
        print(report["steps"][-1], flush=True)
    ctxs = contexts(model, ids, 0.2, len(MIX))
    _, batched = decode_step_s(model, ctxs)
    alone = [decode_step_s(model, [c])[1][0] for c in ctxs]
    report["tokens_equal_decode_batch_1"] = batched == alone
    stored, seconds = kernel_bandwidth(ctxs, device)
    peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in report["device"]), None)
    report["kernel"] = {"bytes": stored, "seconds": seconds, "bytes_per_s": stored / seconds,
                        "fraction_of_peak": stored / seconds / peak if peak else None}
    del ctxs
    report["throughput_vs_length"] = []
    for length in (int(x) for x in args.lengths.split(",")):
        long_ids = torch.randint(100, 40000, (length,), generator=g).tolist()
        ctxs = contexts(model, long_ids, 128, len(MIX))
        step, _ = decode_step_s(model, ctxs)
        report["throughput_vs_length"].append({"length": length, "budget": 128, "rows": len(ctxs),
                                               "tokens_per_s": len(ctxs) / step})
        print(report["throughput_vs_length"][-1], flush=True)
        del ctxs
    if device.type == "cuda":
        report["memory"] = predicted_vs_measured(lm, ids, device)
        print(report["memory"], flush=True)
        if torch.cuda.device_count() >= 2:
            report["two_devices"] = two_devices(ids[:256])
    del lm, model
    if args.calibrate:
        report["calibration"] = calibration(device, [int(x) for x in args.calibrate.split(",")],
                                            args.calibrate_shape)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "check.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
