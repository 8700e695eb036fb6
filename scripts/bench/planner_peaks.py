"""The memory planner's predicted peak for the paper's largest runs on 80 GB GPUs → results/bench/planner_peaks.json.

Table 1 (llama3-8b, 8K, 27 configs) and tab_full_llama3.1-8b (127.5K, 56 configs) on one GPU, the 70B table on four
(``model.max_memory`` 75 GiB each) or two H200s (66 GiB of weights each, 139 GiB), tab_full_qwen3-32b on two GPUs (40
GiB each) or one, every 80 GB device given 79 GiB (``memory.limit_gib``): the largest decode batch whose
peak plus margin (graph pool, workspaces, fragmentation: ``Footprint.needed``) fits, and the fullest device's peak,
margin and total. ``--label`` names the code version measured (run it from another checkout's
root with ``PYTHONPATH`` pointing there to measure that version's planner).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path.cwd()))

from spark_bench import memory  # noqa: E402
from spark_bench.cli import CONF_DIR, memory_prediction, validate  # noqa: E402

ONE_GPU = "model.device_map={model.embed_tokens:0,model.layers:0,model.norm:0,model.rotary_emb:0,lm_head:0}"
RUNS = {"table1": ["+experiment=table1", ONE_GPU],
        "tab_full_llama3.1-8b": ["+experiment=tab_full_llama3_1_8b", ONE_GPU],
        "tab_full_llama3.1-70b": ["+experiment=tab_full_llama3_1_70b",
                                  "model.max_memory={0:75GiB,1:75GiB,2:75GiB,3:75GiB}"],
        "tab_full_llama3.1-70b 2xH200": ["+experiment=tab_full_llama3_1_70b", "model.max_memory={0:66GiB,1:66GiB}",
                                         "memory.limit_gib=139"],
        "tab_full_qwen3-32b 2xH100": ["+experiment=tab_full_qwen3_32b", "model.max_memory={0:40GiB,1:40GiB}"],
        "tab_full_qwen3-32b 1xH100": ["+experiment=tab_full_qwen3_32b", ONE_GPU]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", default="current")
    parser.add_argument("--out", type=Path, default=Path("results/bench/planner_peaks.json"))
    args = parser.parse_args()
    found = {}
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        for name, overrides in RUNS.items():
            limit = [] if any(o.startswith("memory.limit_gib") for o in overrides) else ["memory.limit_gib=79"]
            cfg = compose("config", overrides + limit)
            model, configs = validate(cfg, sources=False)
            prediction = memory_prediction(cfg, model, configs)
            fullest = max(prediction.devices, key=lambda d: d.needed)
            found[name] = {"rows": len(configs), "decode_batch": prediction.decode_batch,
                           "fullest_gib": round(fullest.peak / memory.GIB, 2),
                           "margin_gib": round(fullest.margin / memory.GIB, 2),
                           "needed_gib": round(fullest.needed / memory.GIB, 2), "line": fullest.line()}
            print(f"{args.label} {name}: decode batches of {prediction.decode_batch} of {len(configs)} rows, "
                  f"{fullest.line()}")
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    old[args.label] = found
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(old, indent=1))


if __name__ == "__main__":
    main()
