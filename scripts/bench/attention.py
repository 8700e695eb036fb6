"""Decode-step attention over one layer's cache: dense vs compact SparK (kernel) vs materialise-then-attend.

Each variant runs ``StoredLayer.attend`` for one new token (G query heads per kv-head) over S prompt tokens; the
only difference is the key store and the attention mode. Writes ``results/bench/attention.json`` with the median
of ``--repeats`` timings (after warm-up) and the max abs difference to the dense reference computed in float64.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spark_bench.engine.cache import StoredLayer
from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.channel.spark import SparK
from spark_bench.methods.channel.think import ThinK
from spark_bench.storage.dispatch import fallback_reasons
from spark_bench.storage.fast_logits import load_kernel
from spark_bench.storage.stores import DenseStore


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run(seq: int, head_dim: int, heads: int, group: int, ratio: float, dtype: torch.dtype, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, heads, seq, head_dim, generator=g).to(dtype)
    values = torch.randn(1, heads, seq, head_dim, generator=g).to(dtype)
    window = torch.randn(1, heads * group, 32, head_dim, generator=g).to(dtype)
    layer = LayerPrefill(keys, values, window)
    query = torch.randn(1, heads * group, 1, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    stores = {
        "dense": (DenseStore(keys), "compact"),
        "spark_official_compact": (SparK(ratio=ratio).compress_keys(keys, layer), "compact"),
        "spark_official_materialize": (SparK(ratio=ratio).compress_keys(keys, layer), "materialize"),
        "spark_paper_compact": (SparK(ratio=ratio, saliency="paper").compress_keys(keys, layer), "compact"),
        "think_compact": (ThinK(ratio=ratio, keep_window=True).compress_keys(keys, layer), "compact"),
    }
    rows = []
    for name, (store, mode) in stores.items():
        cached = StoredLayer(store, DenseStore(values))
        tail_k = torch.randn(1, heads, 1, head_dim, generator=g).to(dtype)
        cached.update(tail_k, tail_k)
        out = cached.attend(query, scale, mode)
        # float64 reference over the same (recovered) keys
        k_ref, v_ref = (t.double() for t in cached.materialized())
        q64 = query.double().view(1, heads, group, head_dim)
        w = (q64 @ k_ref.transpose(-1, -2) * scale).softmax(-1)
        ref = (w @ v_ref).view(1, heads * group, 1, head_dim).transpose(1, 2)
        rows.append({"variant": name, "mode": mode, "seq": seq, "head_dim": head_dim, "kv_heads": heads,
                     "group": group, "ratio": ratio, "dtype": str(dtype).replace("torch.", ""),
                     "ms": round(median_ms(lambda: cached.attend(query, scale, mode), repeats), 3),
                     "max_abs_err": float((out.double() - ref).abs().max()),
                     "key_bytes": store.nbytes(), "dense_key_bytes": keys.numel() * keys.element_size()})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", type=Path, default=Path("results/bench/attention.json"))
    args = parser.parse_args()
    kernel = load_kernel()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim in (64, 128):
            rows += run(args.seq, head_dim, args.heads, args.group, args.ratio, dtype, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"kernel": "ok" if not isinstance(kernel, str) else kernel,
                                    "threads": torch.get_num_threads(), "fallbacks": sorted(fallback_reasons()),
                                    "rows": rows}, indent=1))
    for r in rows:
        print(f"{r['dtype']:8s} D={r['head_dim']:3d} {r['variant']:28s} {r['ms']:8.3f} ms  err {r['max_abs_err']:.2e}")


if __name__ == "__main__":
    main()
