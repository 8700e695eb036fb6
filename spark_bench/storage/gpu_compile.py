"""Ahead-of-time compilation of the Triton decode kernels for NVIDIA GPUs, on a machine without one.

``triton.compile`` lowers a kernel specialisation to PTX for a target (``GPUTarget("cuda", 90, 32)``) on the CPU;
triton's bundled ``ptxas`` then assembles it and reports registers and spills, and its ``nvdisasm`` turns the cubin
into SASS. :func:`launches` lists what the dispatch launches for a model shape; :func:`bind` gets the specialisation
Triton's launcher compiles for one (the dispatch's own arguments, :func:`~.triton_decode.launches`, over CPU
stand-ins: integers equal to 1 become constants, 16-byte aligned pointers and 16-divisible integers are marked);
:func:`compile_launch` compiles it and checks the generated LLVM IR for 32-bit address arithmetic (a
``getelementptr`` into global memory indexed by a 32-bit value computed by a multiply); :func:`parse_sass` finds the
loops of the machine code by their back-edge branches. Used by ``tests/test_gpu_compile.py``,
``scripts/bench/compile.py`` (every shipped model's launches → ``results/bench/compile.json``) and
``scripts/bench/instructions.py`` (the instruction budget → ``results/bench/instructions.json``).
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

from spark_bench.storage.segments import ALL_KINDS
from spark_bench.storage.walk_layout import tiled, walks

ELEMENTS = {2: "bf16", 4: "fp32"}
BIN = "backends/nvidia/bin"  # triton's bundled ptxas, cuobjdump and nvdisasm, under the triton package


@dataclass(frozen=True)
class Launch:
    """One launch of the fused decode as the dispatch makes it: ``kernel`` (``partials`` or ``merge``) for a model
    with ``head_dim`` channels and ``group`` query heads per kv-head, ``q_len`` tokens per step (1: a decode step;
    more: a suffix through the cache, its ``group · q_len`` query rows per head in one launch), stores and queries of
    ``itemsize`` bytes (2 bf16, 4 fp32)."""

    kernel: str
    head_dim: int
    group: int
    q_len: int = 1
    itemsize: int = 2
    width: int = 32  # structured (ThinK) keys' kept channels, padded (the partials kernel's TK; 0: none)
    kinds: int = ALL_KINDS  # the member kinds its tables hold (the partials kernel's KINDS; no structured bit: TK = 0)
    ragged: bool = False  # a segment whose tokens keep different counts (the partials kernel's RAGGED)
    vsparse: bool = False  # an item with value-sparse values (the partials kernel's VSPARSE)


@dataclass(frozen=True)
class Compiled:
    kernel: str
    arch: int
    constants: dict
    registers: int
    spill_bytes: int
    i32_address_multiplies: int
    seconds: float
    shared_bytes: int = 0
    num_warps: int = 0
    num_stages: int = 0
    sass: str = ""


def launches(head_dim: int, group: int, itemsize: int = 2, suffix: bool = True) -> list[Launch]:
    """What decoding a model with ``head_dim`` and ``group`` query heads per kv-head launches: a decode step
    (``q_len=1``, both kernels) and, with ``suffix``, a 16-token suffix through the cache (both kernels)."""
    return [Launch(kernel, head_dim, group, q_len, itemsize) for q_len in ((1, 16) if suffix else (1,))
            for kernel in ("partials", "merge")]


def _arguments(launch: Launch):
    """``(kernel, args, kwargs)`` of ``launch`` from :func:`~.triton_decode.launches` over CPU stand-ins with the
    dispatch's shapes, strides, dtypes and alignments (the tables: slices of one packed upload, as
    :class:`~.segments.FusedTables` views them), so binding them gives the specialisation Triton compiles when the
    dispatch launches it (integers equal to 1 are constants, 16-divisible integers and pointers are marked so)."""
    from types import SimpleNamespace

    import torch

    from spark_bench.storage import triton_decode
    from spark_bench.storage.segments import HEAD_COLS, SEG_COLS, WORK_COLS

    dtype = {2: torch.bfloat16, 4: torch.float32}[launch.itemsize]
    heads, d, n = 2, launch.head_dim, launch.group * launch.q_len
    q = torch.zeros(heads, n, d, dtype=dtype)
    tail_k, tail_v = torch.zeros(heads, 64, d, dtype=dtype), torch.zeros(heads, 64, d, dtype=dtype)
    new = torch.zeros(heads, launch.q_len, d, dtype=dtype)  # the step's keys/values (R·H, q_len, D) rows
    packed = torch.zeros(64, dtype=torch.int64)
    members = triton_decode.launch_shape(n)[1]
    a, b, c = 2 * SEG_COLS, 2 * HEAD_COLS, 2 * WORK_COLS  # two rows of each table
    tables = SimpleNamespace(seg=packed[:a], head=packed[a:a + b], work=packed[a + b:a + b + c],
                             lists=packed[a + b + c:a + b + c + 2], n_slots=4, n_work=2, members=members,
                             aligned=True, width=launch.width if launch.kinds & 2 else 0, pairs=True,
                             kinds=launch.kinds, ragged=launch.ragged, vsparse=launch.vsparse,
                             walk_tab=packed[:4] if launch.kinds & 16 and walks(d) else None,
                             tiles=bool(launch.kinds & 16) and walks(d) and tiled(members, launch.itemsize))
    aux = torch.ones(heads, d)
    for kernel, _, args, kwargs in triton_decode.launches(q, 0.088, aux, tables, tail_k, new, new, tail_k, tail_v,
                                                          torch.zeros(1, dtype=torch.int64), launch.q_len, 0,
                                                          torch.empty_like(q), launch.q_len):
        if kernel.__name__.strip("_").startswith(launch.kernel):
            return kernel, args, kwargs
    raise ValueError(f"no {launch.kernel} launch")


def bind(launch: Launch, arch: int):
    """The ``ASTSource`` and options Triton's launcher makes for ``launch`` on ``sm_<arch>`` (the steps of
    ``JITFunction.run`` before its compile: the Tritons with ``_pack_args`` (3.5 on) pack them there; Triton 3.2,
    torch 2.6's, derives the signature, the constants and an ``AttrsDescriptor`` from the bound arguments itself)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, args, kwargs = _arguments(launch)
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    if hasattr(kernel, "_pack_args"):
        bound, specialisation, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialisation, options)
        return ASTSource(kernel, signature, constexprs, attrs), options
    bound = binder(*args, **kwargs)
    if len(bound) != 5:
        import triton

        raise RuntimeError(f"the ahead-of-time compile does not know how Triton {triton.__version__} binds a launch "
                           "(it knows 3.2's and that of the Tritons with JITFunction._pack_args, 3.5 on)")
    values, sig_and_spec = tuple(bound[0].values()), bound[1]  # Triton 3.2
    names = [p.name for p in kernel.params if not p.is_constexpr]
    signature = {k: "*i8" if v == "none" else v for k, v in zip(names, sig_and_spec[:len(names)])}
    attrs = backend.get_attrs_descriptor(kernel.params, values)
    constant = attrs.get_constants()
    constants = {p.name: v for v, p in zip(values, kernel.params) if p.is_constexpr or p.num in constant or v is None}
    return ASTSource(kernel, signature, constants, attrs), backend.parse_options(kwargs)


def i32_address_multiplies(llir: str) -> int:
    """Global-memory ``getelementptr``s whose index is a 32-bit value produced by a ``mul`` (an offset that can
    overflow past 2³¹ elements)."""
    products = set(re.findall(r"(%\w+) = mul (?:nsw |nuw )*i32 ", llir))
    count = 0
    for index in re.findall(r"getelementptr (?:inbounds )?\w+, ptr addrspace\(1\) %\w+, i32 (%\w+)", llir):
        count += index in products
    return count


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), BIN, name)


def compile_launch(launch: Launch, arch: int, sass: bool = False) -> Compiled:
    """Compile ``launch`` for ``sm_<arch>`` as the launcher would (:func:`bind`), assemble it with ptxas (registers,
    spills) and, with ``sass``, disassemble the cubin (nvdisasm). In a process running Triton's interpreter
    (``TRITON_INTERPRET=1``, the tests) kernels cannot be compiled, so this runs in a child process without it."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        args = json.dumps([asdict(launch), arch, sass])
        out = subprocess.run([sys.executable, "-m", "spark_bench.storage.gpu_compile", args], env=env,
                             capture_output=True, text=True, check=True).stdout
        return Compiled(**json.loads(out.strip().splitlines()[-1]))
    import triton

    start = time.perf_counter()
    source, options = bind(launch, arch)
    compiled = triton.compile(source, target=_target(arch), options=options.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        report = subprocess.run([_ptxas(arch), "-v", f"--gpu-name={gpu}", ptx, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
        text = ""
        if sass:
            cubin = os.path.join(tmp, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(compiled.asm["cubin"])
            text = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True,
                                  check=True).stdout
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    constants = {k if isinstance(k, str) else source.fn.arg_names[k[0]]: v for k, v in source.constants.items()}
    return Compiled(launch.kernel, arch, constants, registers, spills, i32_address_multiplies(compiled.asm["llir"]),
                    round(time.perf_counter() - start, 1), compiled.metadata.shared, options.num_warps,
                    options.num_stages, text)


def _ptxas(arch: int) -> str:
    """The ptxas Triton compiles with: ``get_ptxas(arch)`` (3.9), ``get_ptxas()`` (one for every arch, before), or
    ``_path_to_binary`` (3.2)."""
    from triton.backends.nvidia import compiler

    if not hasattr(compiler, "get_ptxas"):
        return compiler._path_to_binary("ptxas")[0]
    try:
        return compiler.get_ptxas(arch).path
    except TypeError:
        return compiler.get_ptxas().path


def _target(arch: int):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


@dataclass(frozen=True)
class Loop:
    """A loop of a kernel's SASS (a backward branch and its target): its instructions, in program order, and the
    loops nested inside it."""

    start: int  # index of its first instruction
    end: int    # index of its back-edge branch
    inner: tuple = ()

    def own(self, instructions: list[str]) -> list[str]:
        """Its instructions outside the loops nested in it (one iteration's, beside ``inner``'s)."""
        skip = {i for loop in self.inner for i in range(loop.start, loop.end + 1)}
        return [instructions[i] for i in range(self.start, self.end + 1) if i not in skip]


def parse_sass(sass: str, labels: dict | None = None) -> tuple[list[str], list[Loop]]:
    """``nvdisasm -c`` text → (instructions in address order, outermost loops): a loop is the range from a branch
    target to a ``BRA`` back to it (a one-instruction self-loop, the end-of-kernel trap, is not one); loops inside
    another are its ``inner``. ``labels``, when given, receives each branch label's instruction index."""
    instructions, branches = [], []
    labels = {} if labels is None else labels
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;?\s*$", line)
        if m and not m.group(2).startswith("NOP"):
            text = m.group(2).rstrip(" ;")
            target = re.search(r"BRA `?\(?(\.L_x_\d+)", text)
            if target:
                branches.append((len(instructions), target.group(1)))
            instructions.append(text)
    spans = sorted({(labels[t], i) for i, t in branches if t in labels and labels[t] < i},
                   key=lambda s: (s[0], -s[1]))

    def nest(ranges):
        out = []
        while ranges:
            start, end = ranges.pop(0)
            inside = [r for r in ranges if start <= r[0] and r[1] <= end]
            ranges = [r for r in ranges if r not in inside]
            out.append(Loop(start, end, tuple(nest(inside))))
        return out

    return instructions, nest(spans)


def guarded(instructions: list[str], labels: dict, outer: Loop, inner: Loop) -> list[int]:
    """The instructions of ``outer`` that run only when ``inner`` runs: those between the conditional branch that
    jumps past ``inner`` (a loop with no trip to make is skipped) and ``inner``'s first instruction."""
    floor = max([x.end for x in outer.inner if x.end < inner.start], default=outer.start)
    for i in range(inner.start - 1, floor, -1):
        target = re.search(r"^@!?U?P\d+ BRA `?\(?(\.L_x_\d+)", instructions[i])
        if target and labels.get(target.group(1), -1) > inner.end:
            return list(range(i + 1, inner.start))
    return []


def load_widths(instructions: list[str]) -> dict[int, int]:
    """Bytes per thread of each global load (``LDG``) → how many there are."""
    widths: dict[int, int] = {}
    for text in instructions:
        m = re.search(r"\bLDG\.E((?:\.\w+)*)", text)
        if m:
            mods = m.group(1)
            size = next((b for key, b in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1),
                                          (".S8", 1)) if key in mods), 4)
            widths[size] = widths.get(size, 0) + 1
    return dict(sorted(widths.items()))


if __name__ == "__main__":  # one launch, as JSON (compile_launch's child process)
    _launch, _arch, _sass = json.loads(sys.argv[1])
    print(json.dumps(asdict(compile_launch(Launch(**_launch), _arch, _sass))))
