"""The fused decode kernels compiled ahead of time for NVIDIA GPUs on this CPU machine (triton's compiler and its
bundled ptxas; no GPU): they compile for sm_80 and sm_90, index global memory with 64-bit offsets only, and their
register use and spills are stated. The full matrix of the shipped models' specialisations is compiled by
``make bench`` (``scripts/bench/compile.py`` → ``results/bench/compile.json``)."""

import pytest

from spark_bench.storage.gpu_compile import compile_report, i32_address_multiplies, specialisations

pytest.importorskip("triton")

# the decode step of Llama-3-8B / Qwen3-8B (head_dim 128, 4 query heads per kv-head, bf16), both kernels
CASES = [(kernel, constants, arch) for arch in (90, 80) for kernel, constants in specialisations(128, 4, suffix=False)]


@pytest.mark.parametrize("kernel,constants,arch", CASES, ids=lambda x: str(x) if not isinstance(x, dict) else "")
def test_kernel_compiles_for_the_gpu(kernel, constants, arch):
    report = compile_report(kernel, constants, arch)
    assert report.i32_address_multiplies == 0
    assert report.registers <= 255
    assert report.spill_bytes == 0, report  # measured: partials 221–242 registers, merge 80–98 (results/bench)


def test_the_address_check_sees_32_bit_offsets():
    llir = ("%7 = mul i32 %5, %6\n%8 = getelementptr bfloat, ptr addrspace(1) %0, i32 %7\n"
            "%9 = getelementptr bfloat, ptr addrspace(1) %0, i64 %4\n")
    assert i32_address_multiplies(llir) == 1
