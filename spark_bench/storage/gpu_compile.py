"""Ahead-of-time compilation of the Triton decode kernels for NVIDIA GPUs, on a machine without one.

``triton.compile`` lowers a kernel specialisation to PTX for a target (``GPUTarget("cuda", 90, 32)``) on the CPU;
triton's bundled ``ptxas`` then assembles it and reports registers and spills. :func:`specialisations` lists what the
dispatch can launch for a model shape; :func:`compile_report` compiles one and checks the generated LLVM IR for
32-bit address arithmetic (a ``getelementptr`` into global memory indexed by a 32-bit value computed by a multiply).
Used by ``tests/test_gpu_compile.py`` (one specialisation per kernel and architecture) and
``scripts/bench/compile.py`` (every shipped model's, into ``results/bench/compile.json``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

ELEMENTS = {2: "bf16", 4: "fp32"}


@dataclass(frozen=True)
class Compiled:
    kernel: str
    arch: int
    constants: dict
    registers: int
    spill_bytes: int
    i32_address_multiplies: int
    seconds: float


def specialisations(head_dim: int, group: int, itemsize: int = 2, suffix: bool = True) -> list[tuple[str, dict]]:
    """The kernel specialisations decoding a model with ``head_dim`` and ``group`` query heads per kv-head launches:
    a decode step (``group`` query rows per head) and, with ``suffix``, a suffix through the cache (16 rows)."""
    import triton

    from spark_bench.storage.triton_decode import BLOCK, ROWS, launch_shape

    d_pad = triton.next_power_of_2(head_dim)
    out = []
    for rows in sorted({group, ROWS} if suffix else {group}):
        rpm, members = launch_shape(rows)
        out.append(("partials", dict(D=head_dim, D_PAD=d_pad, RPM=rpm, MEMBERS=members, BLOCK_=BLOCK,
                                     ESIZE=itemsize)))
    out.append(("merge", dict(D=head_dim, D_PAD=d_pad, RM=ROWS, BLOCK_=BLOCK)))
    return out


def _signature(kernel: str, itemsize: int) -> dict:
    """Argument types as launched: queries, outputs, stores and the step's new tokens in the model's dtype."""
    elem = "*" + ELEMENTS[itemsize]
    if kernel == "partials":
        return dict(q_ptr=elem, aux_ptr="*fp32", seg_ptr="*i64", head_ptr="*i64", work_ptr="*i64",
                    list_ptr="*i64", acc_ptr="*fp32", ml_ptr="*fp32", elem_ptr=elem, len_ptr="*i64", n_rows="i32",
                    q_stride="i32", scale="fp32", n_work="i32", advance="i32")
    return dict(q_ptr=elem, head_ptr="*i64", acc_ptr="*fp32", ml_ptr="*fp32", tail_k_ptr=elem, tail_v_ptr=elem,
                new_k_ptr=elem, new_v_ptr=elem, len_ptr="*i64", out_ptr=elem, n_rows="i32", q_stride="i32",
                tail_cap="i32", q_len="i32", g0="i32", scale="fp32", new_k_sh="i32", new_k_st="i32",
                new_v_sh="i32", new_v_st="i32")


def i32_address_multiplies(llir: str) -> int:
    """Global-memory ``getelementptr``s whose index is a 32-bit value produced by a ``mul`` (an offset that can
    overflow past 2³¹ elements)."""
    products = set(re.findall(r"(%\w+) = mul (?:nsw |nuw )*i32 ", llir))
    count = 0
    for index in re.findall(r"getelementptr (?:inbounds )?\w+, ptr addrspace\(1\) %\w+, i32 (%\w+)", llir):
        count += index in products
    return count


def compile_report(kernel: str, constants: dict, arch: int, itemsize: int = 2) -> Compiled:
    """Compile one specialisation for ``sm_<arch>`` (8 warps, 1 stage, as launched) and assemble it with ptxas. In a
    process running Triton's interpreter (``TRITON_INTERPRET=1``, the tests) kernels cannot be compiled, so this runs
    in a child process without it."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        args = json.dumps([kernel, constants, arch, itemsize])
        out = subprocess.run([sys.executable, "-m", "spark_bench.storage.gpu_compile", args], env=env,
                             capture_output=True, text=True, check=True).stdout
        return Compiled(**json.loads(out.strip().splitlines()[-1]))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from spark_bench.storage import triton_decode

    fn = triton_decode._partials_kernel if kernel == "partials" else triton_decode._merge_kernel
    start = time.perf_counter()
    source = ASTSource(fn=fn, signature={**_signature(kernel, itemsize), **{k: "constexpr" for k in constants}},
                       constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=triton_decode.NUM_WARPS, num_stages=1))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        report = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", ptx.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return Compiled(kernel, arch, constants, registers, spills, i32_address_multiplies(compiled.asm["llir"]),
                    round(time.perf_counter() - start, 1))


if __name__ == "__main__":  # one specialisation, as JSON (compile_report's child process)
    print(json.dumps(asdict(compile_report(*json.loads(sys.argv[1])))))
