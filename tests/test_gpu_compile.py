"""The fused decode kernels compiled ahead of time for NVIDIA GPUs on this CPU machine (triton's compiler and its
bundled ptxas/nvdisasm; no GPU), as the dispatch launches them (the arguments bound the way Triton's launcher binds
them: ``q_len=1`` a constant, 16-byte aligned pointers marked): they compile for sm_80 and sm_90, index global memory
with 64-bit offsets only, spill nothing, and the instruction-budget script reads their machine code. The full matrix
(every shipped shape, bf16 and fp32, decode step and suffix) is compiled by ``make bench``
(``scripts/bench/compile.py`` → ``results/bench/compile.json``; ``scripts/bench/instructions.py`` →
``results/bench/instructions.json``)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from spark_bench.storage.gpu_compile import Launch, compile_launch, guarded, i32_address_multiplies, parse_sass

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
# the production decode step: head_dim 128, 4 query heads per kv-head, bf16, q_len=1 (Llama-3-8B, Qwen3-8B); the
# partials kernel with every member loop and as a ThinK row alone launches it (structured and bare keys: kinds 6);
# at 2 query heads per kv-head the signed rows alone (kinds 16), walked (storage/triton_walk.py).
# sm_90 in every run; sm_80 too where SPARK_BENCH_ALL_ARCHS is set: `make test-compat` (scripts/compat.py) compiles
# both under the lowest and the newest Triton, so `make test` does not compile sm_80 a third time
ARCHS = (90, 80) if os.environ.get("SPARK_BENCH_ALL_ARCHS") else (90,)
CASES = [(Launch(kernel, 128, 4), arch) for arch in ARCHS for kernel in ("partials", "merge")] + [
    (Launch("partials", 128, 4, kinds=6), 90), (Launch("partials", 128, 2, kinds=16), 90)]


@pytest.mark.parametrize("launch,arch", CASES,
                         ids=lambda x: f"sm_{x}" if isinstance(x, int) else f"{x.kernel}-{x.kinds}")
def test_kernel_compiles_for_the_gpu_as_launched(launch, arch):
    report = compile_launch(launch, arch)
    assert report.i32_address_multiplies == 0
    assert report.registers <= 255
    assert report.spill_bytes == 0, report
    if launch.kernel == "merge":
        assert report.constants["q_len"] == 1  # the launcher's specialisation of a decode step
    if launch.kernel == "partials":  # a kernel specialised to the kinds its tables hold
        assert report.constants["KINDS"] == launch.kinds
        assert (report.constants["TK"] > 0) == bool(launch.kinds & 2)


def test_the_address_check_sees_32_bit_offsets():
    llir = ("%7 = mul i32 %5, %6\n%8 = getelementptr bfloat, ptr addrspace(1) %0, i32 %7\n"
            "%9 = getelementptr bfloat, ptr addrspace(1) %0, i64 %4\n")
    assert i32_address_multiplies(llir) == 1


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0018*/               @P2 BRA `(.L_x_3) ;
        /*0019*/                   MOV R8, RZ ;
.L_x_0:
        /*0020*/                   FFMA R8, R4, R5, R8 ;
        /*0030*/                   LDG.E.U16 R9, desc[UR4][R2.64] ;
        /*0040*/               @P0 BRA `(.L_x_0) ;
.L_x_3:
        /*0050*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0060*/               @P1 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2);
        /*0090*/                   NOP;
"""


def test_loops_are_found_by_their_back_edges():
    """A loop nested in another, the end-of-kernel self-loop not a loop, NOPs not counted; the instructions that
    run only when the inner loop runs (after the branch that skips it) are its guarded preamble."""
    labels = {}
    instructions, loops = parse_sass(SASS, labels)
    assert len(instructions) == 11 and len(loops) == 1
    outer = loops[0]
    assert (outer.start, outer.end) == (1, 8) and len(outer.inner) == 1
    assert outer.own(instructions) == ["LDG.E.128 R4, desc[UR4][R2.64]", "@P2 BRA `(.L_x_3)", "MOV R8, RZ",
                                       "IADD3 R2, R2, 0x10, RZ", "@P1 BRA `(.L_x_1)"]
    assert len(outer.inner[0].own(instructions)) == 3
    assert [instructions[i] for i in guarded(instructions, labels, outer, outer.inner[0])] == ["MOV R8, RZ"]


def test_the_instruction_budget_script_reads_a_launched_kernel():
    """scripts/bench/instructions.py on one specialisation (the sm_90 partials kernel of the decode step): its
    token loop and a member loop per kind found (the one without a recovery term issues no recovery dot), and the
    model's instructions per byte = warps × (token loop + the members' loops) ÷ (BLOCK × bytes per token)."""
    spec = importlib.util.spec_from_file_location("instructions", ROOT / "scripts/bench/instructions.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["instructions"] = bench  # (its dataclasses look their module up)
    spec.loader.exec_module(bench)
    k = bench.kernel_figures(Launch("partials", 128, 4), 90)
    assert k["spill_bytes"] == 0 and k["ctas_per_sm"] >= 1 and k["loops"]
    token, kinds = bench.token_loop(k)
    assert kinds["dense"]["instructions"] < kinds["bare"]["instructions"] < kinds["plain"]["instructions"]
    # the official recovery at a bfloat16 decode step of 4 rows a member: its tiles built a nibble at a time, scored
    # by the compact loop's dots (the recovery's three split-term dots and one), no loop nested in it; walked (no
    # tensor-core dot, a slot loop nested in it) under a Triton before 3.6 (triton_versions.TILES)
    from spark_bench.storage.triton_versions import TILES

    if TILES:
        assert kinds["signed"]["tensor_core"] == kinds["plain"]["tensor_core"] and not kinds["signed"]["inner"]
    else:
        assert kinds["signed"]["tensor_core"] == 0 and len(kinds["signed"]["inner"]) == 1
    # ThinK's structured keys: a dot as deep as the kept channels (TK), no mask read
    assert kinds["structured"]["instructions"] < kinds["bare"]["instructions"]
    assert kinds["structured"]["tensor_core"] < kinds["dense"]["tensor_core"]
    # bfloat16 queries: one dot against them unscaled (exact in one term) for dense keys and for compact keys
    # whose pruned entries read as 0 (no recovery dot); a recovery adds its three split-term dots
    assert kinds["bare"]["tensor_core"] == kinds["dense"]["tensor_core"] < kinds["plain"]["tensor_core"]
    assert kinds["plain"]["tensor_core"] == 4 * kinds["dense"]["tensor_core"]
    assert kinds["dense"]["global_loads"].get(1, 0) == 0 and token["global_loads"].get(16)  # 16-byte value loads
    # a launch's KINDS: a bit per kind its work items hold, in the kernel's order
    assert bench.kinds_of([{"kinds": ["structured", "structured"]}, {"kinds": ["bare"]}]) == 0b110
    assert bench.kinds_of([{"kinds": ["dense", "signed"]}]) == 0b10001
    item = {"members": 2, "kinds": ["dense", "signed"], "trips": [0, 2], "tokens": 1024, "chunk": 1024,
            "programs": 1, "heads": 1,
            "bytes_per_token": 600, "key_bytes_per_token": [256, 88], "value_bytes_per_token": 256}
    p = bench.model_partials(k, [item], bench.DEVICES[90])
    # the token loop's own instructions: those every block runs, and each member loop's guarded preamble (skipped
    # with its loop when the item has no member of that kind)
    assert token["common"] + sum(kinds[x]["guard"] for x in kinds) == token["instructions"]
    assert all(kinds[x]["guard"] > 0 for x in kinds)
    # a walk's slot loop, nested in its member loop, runs `trips` times a block (the tiles have none)
    per_block = token["common"] + sum(kinds[x]["guard"] + kinds[x]["instructions"] for x in ("dense", "signed")) \
        + 2 * sum(x["instructions"] for x in kinds["signed"]["inner"])
    block = k["constants"]["BLOCK_"]
    assert p["bytes"] == 1024 * 600
    assert p["instr_per_byte_loop"] == pytest.approx(k["num_warps"] * per_block / (block * 600), abs=1e-4)
    assert 0 < p["fraction_of_bound"] <= 1
