"""What the fidelity pass costs a sweep (issue 54 item 6): the answer NLL and KL to the full cache
(:mod:`spark_bench.engine.fidelity`) teacher-forced after every decode batch, against the same sweep with
``fidelity=false``.

The sweep is the issue's: the full cache and five budgets × SnapKV, TOVA, StreamingLLM, ExpectedAttention and
SnapKV+ThinK(0.5) (26 configs) under ``protocol=official``, on SmolLM2-135M (the embedded model, this CPU) over RULER
needles at 2K tokens. Both runs go through :func:`spark_bench.runner.run_sweep` in one process on the same samples
(fresh directories), the pass off first, then on, ``--repeats`` times alternating. "On" is the sweep's own pass:
each row's suffix runs before its batch decodes (:func:`spark_bench.engine.decode.prime_rows`, decode time) and the
pass continues from its keys and values over the compared tokens only, both in forwards of a fixed number of rows
(:func:`spark_bench.engine.decode.group_size`: one shape, so the numbers do not depend on the batching);
``--per-row`` also runs them one row per forward.
The pass's share of the sweep is
read two ways: its own seconds (``fidelity_s`` in timings.jsonl, summed) over the wall time with it on, and the
difference of the two wall times over the wall time with it on. The tokens of both runs must be identical.

Writes ``results/bench/fidelity_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from spark_bench.benchmarks.ruler import load_ruler
from spark_bench.checks import CONF_DIR, protocol_options
from spark_bench.methods import MethodConfig
from spark_bench.models import ModelConfig, load_model
from spark_bench.runner import run_sweep

NEEDLES = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
           "niah_multikey_3", "niah_multivalue", "niah_multiquery"]
BUDGETS = (0.1, 0.2, 0.3, 0.5, 0.7)
METHODS = ({"name": "snapkv"}, {"name": "tova"}, {"name": "streamingllm"}, {"name": "expected_attention"},
           {"name": "snapkv+think", "ratio": 0.5})
GOAL = 0.15  # the bound on the pass's share of the sweep's wall time


def sweep(protocol: str = "official") -> list[MethodConfig]:
    """The issue's 26 configs under ``protocol``'s options."""
    options = protocol_options(protocol)
    return [MethodConfig(name="full", **options)] + [
        MethodConfig(**{**options, **method, "budget": budget}) for method in METHODS for budget in BUDGETS]


def one_run(lm, samples, configs, out: Path, fidelity: bool, per_row: bool = False) -> dict:
    """One sweep into a fresh ``out`` with the sweep's own pass (each row's suffix run before the batch decodes,
    :func:`spark_bench.engine.decode.prime_rows`, then the compared tokens from it, both in forwards of a fixed number
    of rows, :func:`spark_bench.engine.decode.group_size`); ``per_row``: one row per forward instead."""
    from spark_bench.engine import decode

    shutil.rmtree(out, ignore_errors=True)  # fresh: a results directory would otherwise resume, computing nothing
    aim = decode.FORWARD_TOKENS
    decode.FORWARD_TOKENS = 1 if per_row else aim  # (group_size 1: one row per forward)
    start = time.perf_counter()
    try:
        preds = run_sweep(lm, samples, configs, out, progress=False, fidelity=fidelity)
    finally:
        decode.FORWARD_TOKENS = aim
    wall = time.perf_counter() - start
    timings = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    prefill = {t["id"]: t["prefill_s"] for t in timings}
    return {"wall_s": round(wall, 2), "prefill_s": round(sum(prefill.values()), 2),
            "compress_s": round(sum(t["compress_s"] for t in timings), 2),
            "decode_s": round(sum(t["decode_s"] for t in timings), 2),
            "warmup_s": round(sum(t["warmup_s"] for t in timings), 2),
            "fidelity_s": round(sum(t["fidelity_s"] or 0.0 for t in timings), 2),
            "tokens": {f"{r.id}/{r.config}": list(r.tokens) for r in preds.itertuples()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--tasks", default=",".join(NEEDLES), help="RULER tasks, comma-separated (the 8 needles)")
    parser.add_argument("--samples", type=int, default=2, help="samples per task")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="as conf/benchmark/ruler.yaml (the demo's)")
    parser.add_argument("--repeats", type=int, default=1, help="off/on pairs, alternating (medians reported)")
    parser.add_argument("--label", default="after", help="the entry of the JSON file this measurement fills")
    parser.add_argument("--per-row", action="store_true",
                        help="also run the pass one row per forward (group size 1), same process")
    parser.add_argument("--out", type=Path, default=Path("results/bench/fidelity_cost.json"))
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[2]
    model_cfg = ModelConfig.from_dict(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml")))
    lm = load_model(model_cfg, "cpu")
    tasks = args.tasks.split(",")
    samples = load_ruler(tasks, args.length, args.samples, 42, lm, args.max_new_tokens)
    configs = sweep()
    scratch = root / "results" / "bench" / "fidelity_cost_runs"
    modes = ("off", "on") + ("on_per_row",) * args.per_row
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode in modes:
            runs[mode].append(one_run(lm, samples, configs, scratch / mode, mode != "off",
                                      mode == "on_per_row"))
    shutil.rmtree(scratch, ignore_errors=True)
    identical = all(r["tokens"] == runs["off"][0]["tokens"] for rs in runs.values() for r in rs)
    median = {mode: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0] if k != "tokens"}
              for mode, rs in runs.items()}
    on, off = median["on"], median["off"]
    entry = {
        "device": f"cpu (this machine, 2 shared cores, {torch.get_num_threads()} torch threads)",
        "model": model_cfg.name, "benchmark": f"RULER {args.length} tokens, {len(tasks)} tasks × {args.samples} "
                                              f"samples = {len(samples)}", "protocol": "official",
        "max_new_tokens": args.max_new_tokens,
        "configs": len(configs), "repeats": args.repeats, "off": off, "on": on,
        **({"on_per_row": median["on_per_row"],
            "pass_share_timed_per_row": round(median["on_per_row"]["fidelity_s"] / median["on_per_row"]["wall_s"], 4),
            "pass_share_wall_per_row": round((median["on_per_row"]["wall_s"] - off["wall_s"])
                                             / median["on_per_row"]["wall_s"], 4)} if args.per_row else {}),
        "runs": {mode: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for mode, rs in runs.items()},
        "pass_share_timed": round(on["fidelity_s"] / on["wall_s"], 4),
        "pass_share_wall": round((on["wall_s"] - off["wall_s"]) / on["wall_s"], 4),
        "timed_share_on": round((on["prefill_s"] + on["compress_s"] + on["decode_s"] + on["warmup_s"]
                                 + on["fidelity_s"]) / on["wall_s"], 4),
        "goal": GOAL, "identical_tokens": identical}
    entry["meets_goal"] = max(entry["pass_share_timed"], entry["pass_share_wall"]) <= GOAL  # (its seconds and the
    # walls' difference both: the pass's forwards, and what priming the suffixes adds to decoding)
    data = json.loads(args.out.read_text()) if args.out.is_file() else {}
    data[args.label] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in entry.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
