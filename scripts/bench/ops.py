"""Aten operations dispatched by one batched decode step: compressed rows vs a dense ``DynamicCache`` batch.

On a GPU a small decode batch is bound by the kernels it launches, not by arithmetic; the number of aten operations
a step dispatches (counted with ``torch.utils._python_dispatch.TorchDispatchMode``, no GPU needed) is the proxy: on
an H100 the step-time ratios tracked these op-count ratios. For the demo mix (6 configs) and the fourteen mix (14
configs) of ``scripts/bench/decode.py`` on SmolLM2-135M with a 400-token RULER prompt, one step of every config
decoded together (``decode_rows``), and the fourteen mix twice (28 rows), is counted against one step of a dense ``DynamicCache`` batch of the same size
(the full prompt in every row, transformers' own sdpa attention, its greedy loop: argmax, one host read). The
per-row path (``decode_stack=false``: each row's prompt attention over its own stores) and the CUDA path (the
fused Triton decode's surrounding ops, its launches counted, not run) are counted in the same run.
Host reads per step are one by construction (``engine/decode.py`` ``choose_all``: every row's token chosen on the
device, one ``tolist``), as in the dense loop.

Writes ``results/bench/ops.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from spark_bench.benchmarks.ruler import load_ruler
from spark_bench.cli import CONF_DIR
from spark_bench.engine.clock import OpCounter
from spark_bench.engine.decode import DecodeRow, decode_rows
from spark_bench.engine.fastpaths import FastPaths
from spark_bench.engine.prefill import run_prefill
from spark_bench.methods import Pipeline
from spark_bench.models import ModelConfig, load_model

ROOT = Path(__file__).resolve().parents[2]


def count_steps(fn, steps: list[int], launches=None) -> dict:
    """Ops of ``fn(n)`` (n decode steps) for two step counts; the difference / steps is the per-step figure, free of
    what runs once (the first token, building the batch). ``launches``: a one-element list a kernel stub counts its
    launches in (each one op, as a GPU kernel launch)."""
    counts, made = {}, {}
    for n in steps:
        if launches is not None:
            launches[0] = 0
        with OpCounter() as counter:
            fn(n)
        counts[n], made[n] = counter, launches[0] if launches is not None else 0
    a, b = steps
    per_step = (counts[b].total - counts[a].total + made[b] - made[a]) / (b - a)
    kernels = (counts[b].kernels - counts[a].kernels + made[b] - made[a]) / (b - a)
    top = counts[b].ops - counts[a].ops
    return {"ops_per_step": per_step, "kernel_ops_per_step": kernels, "launches_per_step": (made[b] - made[a]) / (b - a),
            "top_ops_per_step": {k: v / (b - a) for k, v in top.most_common(12)}}


@torch.inference_mode()
def measure(lm, sample, configs, checks: FastPaths) -> dict:
    """``checks``: the script's fast-path record (each variant checked once, at its first use in the script)."""
    model = lm.model
    device = model.device
    prefill = run_prefill(model, torch.tensor([sample.input_ids], device=device), 32)

    def compressed(n: int, stack: bool = True, record: FastPaths = checks):
        selections = {}
        rows = [DecodeRow(Pipeline.from_config(c).build_cache(prefill, selections=selections)[0],
                          prefill.first_logits, prefill.prompt_length, n + 1, frozenset()) for c in configs]
        decode_rows(model, rows, stack=stack, checks=record)

    r = len(configs)
    base = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([sample.input_ids], device=device), past_key_values=base, use_cache=True,
          logits_to_keep=1)
    keys = [(layer.keys.expand(r, -1, -1, -1).contiguous(), layer.values.expand(r, -1, -1, -1).contiguous())
            for layer in base.layers]

    def dense(n: int):  # the same loop a plain greedy decode runs: forward, argmax, next ids and positions
        cache = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(keys):
            cache.update(k.clone(), v.clone(), i)
        token = torch.full((r, 1), prefill.first_token, device=device)
        position = torch.full((r, 1), prefill.prompt_length, device=device)
        for _ in range(n):
            logits = model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            token.tolist()
            position = position + 1

    out_c = count_steps(compressed, [4, 12])
    out_u = count_steps(lambda n: compressed(n, stack=False), [4, 12])
    out_d = count_steps(dense, [4, 12])
    # the CUDA path's ops around its kernels, each launch counted as one op; its kernels are recorded, not run, so
    # there is nothing to check against the reference (a first-use check would compare uninitialised buffers, fall
    # back to the reference path and count that path's ops instead, and leave the kernels off for the rest)
    with fused_path() as launches:
        out_f = count_steps(lambda n: compressed(n, record=FastPaths(enabled=False)), [4, 12], launches)
    return {"rows": r, "prompt_tokens": prefill.prompt_length, "stacked": out_c, "per_row": out_u, "dense": out_d,
            "fused_cuda_path": out_f,
            "ratio": round(out_c["ops_per_step"] / out_d["ops_per_step"], 3),
            "ratio_per_row": round(out_u["ops_per_step"] / out_d["ops_per_step"], 3),
            "ratio_fused_cuda_path": round(out_f["ops_per_step"] / out_d["ops_per_step"], 3),
            "kernel_ratio_fused_cuda_path": round(out_f["kernel_ops_per_step"] / out_d["kernel_ops_per_step"], 3)}


@contextlib.contextmanager
def fused_path():
    """The backend forced to ``triton`` on CPU tensors, the two kernels' launches counted, not run (their outputs
    are uninitialised buffers: the ops counted are the path's, its tokens meaningless). Yields the launch counter."""
    from spark_bench.engine import cache
    from spark_bench.storage import triton_decode

    launches = [0]

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[0] += 1
            return launch

    saved = cache.compact_backend, triton_decode._partials_kernel, triton_decode._merge_kernel
    cache.compact_backend = lambda device: "triton"
    triton_decode._partials_kernel = triton_decode._merge_kernel = Recorded()
    try:
        yield launches
    finally:
        cache.compact_backend, triton_decode._partials_kernel, triton_decode._merge_kernel = saved


MIXES = ("demo", "fourteen", "twentyeight")  # 6, 14 and 28 rows


def mix(name: str):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode import sweep_configs  # scripts/bench/decode.py: the demo and fourteen mixes

    return sweep_configs("fourteen") * 2 if name == "twentyeight" else sweep_configs(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=400)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=Path("results/bench/ops.json"))
    args = parser.parse_args()
    model_cfg = ModelConfig.from_dict(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml")))
    lm = load_model(model_cfg, "cpu")
    sample = load_ruler(["niah_single_1"], args.length, 1, 42, lm, 16)[0]
    checks = FastPaths()
    result = {"model": model_cfg.name, "device": "cpu",
              **{name: measure(lm, sample, mix(name), checks) for name in MIXES}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name in MIXES:
        m = result[name]
        print(f"{name} ({m['rows']} rows): stacked {m['stacked']['ops_per_step']:.0f} ops/step, per-row "
              f"{m['per_row']['ops_per_step']:.0f}, dense {m['dense']['ops_per_step']:.0f}: {m['ratio']}× "
              f"(per-row {m['ratio_per_row']}×; the fused CUDA path {m['ratio_fused_cuda_path']}×, of them "
              f"{m['fused_cuda_path']['kernel_ops_per_step']:.0f} kernels against dense "
              f"{m['dense']['kernel_ops_per_step']:.0f}: {m['kernel_ratio_fused_cuda_path']}×)")


if __name__ == "__main__":
    main()
