"""Key-store bytes of every channel method vs the dense key cache, and bytes per token per kv-head (keys+values).

S = 4096 tokens, 8 kv-heads, bf16 and fp32, head_dim 64 and 128; every tensor a store holds is counted (kept
values, masks, sign bits, per-token statistics, per-head query statistics). Writes ``results/bench/bytes.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from spark_bench.engine.prefill import LayerPrefill, Prefill
from spark_bench.methods import MethodConfig, Pipeline

CONFIGS = [MethodConfig(name="full"), MethodConfig(name="think", ratio=0.5), MethodConfig(name="think", ratio=0.8),
           MethodConfig(name="spark", ratio=0.5), MethodConfig(name="spark", ratio=0.8),
           MethodConfig(name="spark", ratio=0.8, saliency="paper"),
           MethodConfig(name="spark", ratio=0.8, recovery="zero"),
           MethodConfig(name="spark", ratio=0.8, recovery="gaussian"),
           MethodConfig(name="spark", variant="top_p"), MethodConfig(name="spark", variant="group", groups=4),
           MethodConfig(name="spark", ratio=0.5, value_ratio=0.5)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("results/bench/bytes.json"))
    args = parser.parse_args()
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for d in (64, 128):
            g = torch.Generator().manual_seed(d)
            keys = torch.randn(1, args.heads, args.seq, d, generator=g).to(dtype)
            values = torch.randn(1, args.heads, args.seq, d, generator=g).to(dtype)
            window = torch.randn(1, 4 * args.heads, 32, d, generator=g).to(dtype)
            prefill = Prefill((LayerPrefill(keys, values, window),), args.seq, torch.zeros(1), 0.0)
            dense_keys = keys.numel() * keys.element_size()
            for cfg in CONFIGS:
                cache, _ = Pipeline.from_config(cfg).build_cache(prefill)
                layer = cache.layers[0]
                rows.append({"method": cfg.label, "dtype": str(dtype).replace("torch.", ""), "head_dim": d,
                             "key_store_ratio": round(layer.key_store.nbytes() / dense_keys, 4),
                             "bytes_per_token_per_kv_head": round(layer.nbytes() / (args.seq * args.heads), 2),
                             "key_bytes_per_token_per_kv_head": round(layer.key_store.nbytes()
                                                                      / (args.seq * args.heads), 2),
                             "achieved_key_ratio": round(1 - layer.key_store.kept_fraction(), 4)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seq": args.seq, "kv_heads": args.heads, "rows": rows}, indent=1))
    for r in rows:
        print(f"{r['dtype']:8s} D={r['head_dim']:3d} {r['method']:24s} keys {r['key_store_ratio']:.3f}x "
              f"{r['bytes_per_token_per_kv_head']:7.2f} B/token/kv-head")


if __name__ == "__main__":
    main()
