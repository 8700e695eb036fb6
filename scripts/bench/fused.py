"""The fused CUDA decode's work per layer at the paper's scale, from its launch formula → results/bench/fused.json.

For a table's method mix at its prompt length (Table 1: llama3-8b at 8K; tab_full_llama3.1-8b: 127.5K), every config
of a sample in one batch: programs per layer of the partials kernel (``Σ`` over value tensors and batches of
``MEMBERS`` query heads reading one of ``ceil(tokens / chunk)``, :class:`~spark_bench.storage.segments.FusedTables`)
and the bytes one step reads (each config's key store, each shared value tensor once, the queries, the partial
softmax written and merged), from the stored tokens per layer and the real stores' bytes per token
(:func:`spark_bench.memory.stored_tokens`, :func:`spark_bench.memory.store_bytes`). Beside them, the design it
replaced: a grid of (segments + query heads) × ceil(longest / 32) programs and an fp32 score tensor of
``R·H_q·(S_max + t)`` written, softmaxed and read again per layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spark_bench.cli import CONF_DIR, validate  # noqa: E402
from spark_bench.memory import Arch, store_bytes, stored_tokens  # noqa: E402
from spark_bench.storage.segments import FusedTables  # noqa: E402
from spark_bench.storage.triton_decode import launch_shape  # noqa: E402

TABLES = {"table1": ("table1", 7950), "tab_full_llama3.1-8b": ("tab_full_llama3_1_8b", 127500)}


def eviction_key(cfg) -> tuple:
    """Configs with equal keys keep the same tokens: they share one value tensor."""
    if cfg.name.split("+")[0] == cfg.channel_name or cfg.name == "full":
        return ("full",)
    return (cfg.name.split("+")[0], cfg.budget, cfg.budget_rounding, cfg.window_size, cfg.kernel_size, cfg.pooling)


def layer_work(model, configs, prompt: int, layer: int = 0, tail: int = 64) -> dict:
    arch = Arch.of(model)
    h, g, d = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim
    rpm, members = launch_shape(g)
    groups: dict = {}
    key_bytes = value_bytes = 0
    segments = 0
    for cfg in configs:
        t = stored_tokens(cfg, arch, prompt)[layer]
        sb = store_bytes(cfg, arch, model.dtype)
        key_bytes += h * (sb.key_per_token * t + sb.key_const)
        groups.setdefault(eviction_key(cfg), (t, sb, []))[2].append(cfg)
        segments += h * (2 if cfg.channel_name == "think" else 1)
    programs = slots = 0
    for t, sb, members_of in groups.values():
        value_bytes += h * (sb.value_per_token * t + sb.value_const)
        chunks = -(-t // FusedTables.chunk_of(t))
        programs += h * -(-len(members_of) // members) * chunks
        slots += h * len(members_of) * chunks
    r = len(configs)
    queries = r * h * g * d * 4
    tail_bytes = 2 * r * h * tail * d * 2
    partials = 2 * slots * g * (d + 2) * 4  # written by the partials kernel, read by the merge
    longest = max(t for t, _, _ in groups.values())
    return {"rows": r, "value_tensors": len(groups), "programs": programs, "members": members,
            "bytes_loaded": int(key_bytes + value_bytes + queries + tail_bytes + partials),
            "stored_bytes": int(key_bytes + value_bytes), "queries_and_partials": queries + partials,
            "old_programs": (segments + r * h) * -(-longest // 32),
            "old_score_traffic_bytes": 3 * r * h * g * (longest + tail) * 4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("results/bench/fused.json"))
    args = parser.parse_args()
    out = {"formula": "programs = Σ_value tensors H·ceil(rows/MEMBERS)·ceil(tokens/chunk); bytes = keys + shared "
                      "values once + queries + tail + partials (written and merged)", "tables": {}}
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        for name, (experiment, prompt) in TABLES.items():
            model, configs = validate(compose("config", [f"+experiment={experiment}"]), sources=False)
            work = layer_work(model, configs, prompt)
            work.update(model=model.name, prompt=prompt, layer=0)
            out["tables"][name] = work
            print(f"{name}: {work['rows']} rows at {prompt} tokens, layer 0: {work['programs']} programs (was "
                  f"{work['old_programs']}), reads {work['bytes_loaded'] / 2**20:.1f} MiB = stored "
                  f"{work['stored_bytes'] / 2**20:.1f} MiB + queries/partials/tail (the score tensor alone was "
                  f"{work['old_score_traffic_bytes'] / 2**20:.1f} MiB of traffic)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
