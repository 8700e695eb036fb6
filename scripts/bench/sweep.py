"""Sweep cost and harness overhead on the embedded model (SmolLM2-135M, RULER needles, offline).

* Sweep speedup: 8 method configs in one sweep (one prefill per sample, shared) vs the same 8 configs as 8
  separate single-config runs (each regenerating its samples and prefilling every sample). The model is loaded
  once for both, so the figure is about the data path, not process start-up.
* Harness overhead: in the shared sweep, wall time minus the model's forward passes (prefill + decode steps),
  as a share of wall time; compression is reported separately.

Writes ``results/bench/sweep.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from spark_bench.benchmarks.ruler import load_ruler
from spark_bench.methods import MethodConfig
from spark_bench.models import ModelConfig, load_model
from spark_bench.runner import run_sweep

CONFIGS = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=0.5),
           MethodConfig(name="snapkv+think", budget=0.5, ratio=0.5),
           MethodConfig(name="snapkv+think", budget=0.5, ratio=0.8),
           MethodConfig(name="snapkv+spark", budget=0.5, ratio=0.5),
           MethodConfig(name="snapkv+spark", budget=0.5, ratio=0.8),
           MethodConfig(name="pyramidkv+spark", budget=0.5, ratio=0.8),
           MethodConfig(name="streamingllm+spark", budget=0.5, ratio=0.8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("results/bench/sweep.json"))
    args = parser.parse_args()
    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parents[2]
    model_cfg = ModelConfig.from_dict(OmegaConf.to_container(OmegaConf.load(root / "conf/model/smollm2-135m.yaml")))
    lm = load_model(model_cfg, "cpu")
    tasks = ["niah_single_1", "niah_multikey_1"]
    scratch = args.out.parent / "sweep_runs"
    shutil.rmtree(scratch, ignore_errors=True)  # fresh: a results dir would otherwise resume, computing nothing

    def samples():
        return load_ruler(tasks, args.length, args.samples, 42, lm, args.max_new_tokens)

    start = time.perf_counter()
    shared_preds = run_sweep(lm, samples(), CONFIGS, scratch / "shared")
    shared_s = time.perf_counter() - start

    separate_s, separate_tokens = 0.0, {}
    for i, cfg in enumerate(CONFIGS):
        start = time.perf_counter()
        preds = run_sweep(lm, samples(), [cfg], scratch / f"separate_{i}")
        separate_s += time.perf_counter() - start
        separate_tokens[cfg.label] = list(preds.tokens)

    same = all(list(shared_preds[shared_preds.config == label].tokens) == toks
               for label, toks in separate_tokens.items())
    per_sample = shared_preds.groupby("id").first()
    forward_s = float(per_sample.prefill_s.sum() + shared_preds.decode_s.sum())
    compress_s = float(shared_preds.compress_s.sum())
    result = {"configs": len(CONFIGS), "samples": len(per_sample), "length": args.length,
              "shared_sweep_s": round(shared_s, 2), "separate_runs_s": round(separate_s, 2),
              "speedup": round(separate_s / shared_s, 2), "identical_tokens": same,
              "model_forward_s": round(forward_s, 2), "compress_s": round(compress_s, 2),
              "harness_overhead_share": round((shared_s - forward_s) / shared_s, 4),
              "harness_overhead_share_excl_compress": round((shared_s - forward_s - compress_s) / shared_s, 4),
              "prefill_s_mean": round(float(per_sample.prefill_s.mean()), 2),
              "decode_s_mean": round(float(shared_preds.decode_s.mean()), 2)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
