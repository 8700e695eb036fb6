"""`make gpu-check`: the figures of the CUDA decode path on the machine it runs on → <out>/check.json.

On SmolLM2-135M (bf16): decode-step time of a compressed batch (the Table 1 method mix at 20% of the prompt, cycled
to 6, 14 and 28 rows) against a dense ``DynamicCache`` batch of the same rows; the fused kernel's achieved bandwidth
on one layer (bytes it must read ÷ time) against the device's peak; decode throughput against input length at KV 128
(Fig. 5b's shape); the peak ``torch.cuda.max_memory_allocated``; and the batched tokens against ``decode_batch=1``.
``--device cpu`` runs the same measurements on the CPU (the C++ path), as a smoke test of this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import spark_bench  # noqa: E402
from spark_bench.engine.cache import BatchedCache  # noqa: E402
from spark_bench.engine.decode import DecodeRow, decode_rows  # noqa: E402

PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # bytes/s (SXM parts, published)
MIX = [("snapkv", {}), ("snapkv+think", {"ratio": 0.5}), ("snapkv+spark", {"ratio": 0.5}),
       ("snapkv+spark", {"ratio": 0.8}), ("pyramidkv+spark", {"ratio": 0.8}), ("adasnapkv+spark", {"ratio": 0.8}),
       ("snapkv+spark", {"ratio": 0.8, "recovery": "zero"})]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def contexts(lm, ids, budget, rows):
    configs = [spark_bench.method(name, budget=budget, compress_scope="prompt", **opts) for name, opts in MIX]
    made = spark_bench.compress(lm.model, ids, configs)
    return [made[i % len(made)] for i in range(rows)]


def decode_step_s(lm, ctxs, new_tokens=(4, 20), stack=True):
    """Seconds per decode step of the rows together (the difference of two runs cancels the batch set-up)."""
    device = lm.model.get_input_embeddings().weight.device
    times = []
    for n in new_tokens:
        rows = [DecodeRow(c.cache, c.first_logits, len(c.input_ids), n, frozenset()) for c in ctxs]
        sync(device)
        start = time.perf_counter()
        decode_rows(lm.model, rows, stack=stack)
        sync(device)
        times.append(time.perf_counter() - start)
    return (times[1] - times[0]) / (new_tokens[1] - new_tokens[0]), [r.tokens for r in rows]


@torch.inference_mode()
def dense_step_s(lm, ids, rows, steps=16):
    from transformers import DynamicCache

    model = lm.model
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/bench/gpu")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="2048,8192,16384")
    args = parser.parse_args()
    device = torch.device(args.device)
    lm = spark_bench.load("smollm2-135m", device=args.device, dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "steps": []}
    ids = torch.randint(100, 40000, (2048,), generator=g).tolist()
    for rows in (6, 14, 28):
        ctxs = contexts(lm, ids, 0.2, rows)
        step, tokens = decode_step_s(lm, ctxs)
        report["steps"].append({"rows": rows, "prompt": len(ids), "compressed_step_s": step,
                                "dense_step_s": dense_step_s(lm, ids, rows),
                                "kv_bytes_ratio": sum(c.nbytes for c in ctxs) / sum(c.dense_nbytes for c in ctxs)})
        report["steps"][-1]["compressed_over_dense"] = step / report["steps"][-1]["dense_step_s"]
        print(report["steps"][-1], flush=True)
    ctxs = contexts(lm, ids, 0.2, len(MIX))
    _, batched = decode_step_s(lm, ctxs)
    alone = [decode_step_s(lm, [c])[1][0] for c in ctxs]
    report["tokens_equal_decode_batch_1"] = batched == alone
    stored, seconds = kernel_bandwidth(ctxs, device)
    peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in report["device"]), None)
    report["kernel"] = {"bytes": stored, "seconds": seconds, "bytes_per_s": stored / seconds,
                        "fraction_of_peak": stored / seconds / peak if peak else None}
    report["throughput_vs_length"] = []
    for length in (int(x) for x in args.lengths.split(",")):
        long_ids = torch.randint(100, 40000, (length,), generator=g).tolist()
        ctxs = contexts(lm, long_ids, 128, len(MIX))
        step, _ = decode_step_s(lm, ctxs)
        report["throughput_vs_length"].append({"length": length, "budget": 128, "rows": len(ctxs),
                                               "tokens_per_s": len(ctxs) / step})
        print(report["throughput_vs_length"][-1], flush=True)
    if device.type == "cuda":
        report["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "check.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
