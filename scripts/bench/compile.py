"""Compile every fused-decode launch the shipped models make, for sm_80 and sm_90, on this CPU machine (triton's
compiler and bundled ptxas), bound as Triton's launcher binds the dispatch's arguments (``q_len=1`` a constant,
aligned pointers marked; :func:`spark_bench.storage.gpu_compile.compile_launch`): registers, spill bytes, 32-bit
address multiplies, compile seconds, for bf16 and fp32, a decode step and a 16-token suffix →
results/bench/compile.json. The partials kernel is specialised to the member kinds its tables hold (``KINDS``): every
launch compiles with all of them (a batch of mixed configs), and a decode step's also with each set one method's rows
alone launch (:data:`ALONE`), and with ``RAGGED`` (a store whose tokens keep different counts: every kind, with and
without ``VSPARSE``: value-sparse values, and Mustafar's bare keys alone, with and without it)."""

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spark_bench.storage.gpu_compile import compile_launch, launches  # noqa: E402
from spark_bench.storage.segments import KINDS  # noqa: E402

# (head_dim, query heads per kv-head): SmolLM2-135M 64/3, Llama-3(.1)-8B and Qwen3-8B 128/4, 70B and Qwen3-32B 128/8
SHAPES = [(64, 3), (128, 4), (128, 8)]
# the partials kernel's KINDS when one method's rows decode alone: full or eviction (dense keys), ThinK (structured
# keys, bare where an item holds its recent tokens), SparK zero/none or AdaKV (bare), paper/constant recoveries
# (plain), the official recovery (signed); and a batch of those without a recovery (triton_decode.LEAN_REGISTERS;
# dense and structured keys alone: DENSE_REGISTERS)
ALONE = {name: sum(1 << KINDS.index(k) for k in kinds) for name, kinds in (
    ("dense", ["dense"]), ("think", ["structured", "bare"]), ("bare", ["bare"]), ("plain", ["plain"]),
    ("signed", ["signed"]), ("no_recovery", ["dense", "structured", "bare"]))}


def main(out: str = "results/bench/compile.json") -> None:
    rows = []
    for arch in (80, 90):
        for itemsize in (2, 4):
            for head_dim, group in SHAPES:
                every = launches(head_dim, group, itemsize)
                alone = [replace(x, kinds=k) for x in every if x.kernel == "partials" and x.q_len == 1
                         for k in ALONE.values()]
                ragged = [replace(x, ragged=True) for x in every if x.kernel == "partials"] + [
                    replace(x, kinds=ALONE["bare"], ragged=True, vsparse=vs) for x in every
                    if x.kernel == "partials" and x.q_len == 1 for vs in (False, True)] + [
                    replace(x, ragged=True, vsparse=True) for x in every if x.kernel == "partials"
                    and x.q_len == 1]  # (Mustafar's tied keys, SparK-p/-g; with its value-sparse values; beside
                # every other kind)
                for launch in every + alone + ragged:
                    row = asdict(compile_launch(launch, arch))
                    row.pop("sass")
                    row.update(head_dim=head_dim, group=group, q_len=launch.q_len, dtype={2: "bf16", 4: "fp32"}[
                        itemsize], kinds=launch.kinds, ragged=launch.ragged, vsparse=launch.vsparse)
                    rows.append(row)
                    print(row, flush=True)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    spills = [r for r in rows if r["spill_bytes"]]
    print(f"{len(rows)} launches compiled, {len(spills)} spill")


if __name__ == "__main__":
    main(*sys.argv[1:])
