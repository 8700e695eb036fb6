"""Compile every fused-decode specialisation the shipped models launch, for sm_80 and sm_90, on this CPU machine
(triton's compiler and bundled ptxas): registers, spill bytes, 32-bit address multiplies, compile seconds →
results/bench/compile.json."""

import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spark_bench.storage.gpu_compile import compile_report, specialisations  # noqa: E402

# (head_dim, query heads per kv-head): SmolLM2-135M 64/3, Llama-3(.1)-8B and Qwen3-8B 128/4, 70B and Qwen3-32B 128/8
SHAPES = [(64, 3), (128, 4), (128, 8)]


def main(out: str = "results/bench/compile.json") -> None:
    rows = []
    for arch in (80, 90):
        seen = set()
        for head_dim, group in SHAPES:
            for kernel, constants in specialisations(head_dim, group):
                key = (kernel, tuple(sorted(constants.items())))
                if key in seen:
                    continue
                seen.add(key)
                rows.append(asdict(compile_report(kernel, constants, arch)))
                print(rows[-1], flush=True)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:])
