"""Collect ``results/bench/*.json`` into ``results/bench/summary.md`` with the issue's goals beside each figure."""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path("results/bench")


def load(name: str):
    path = OUT / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def verdict(ok: bool) -> str:
    return "meets" if ok else "**misses**"


def decode_section(d: dict, title: str) -> list[str]:
    """Batched decoding figures of one ``scripts/bench/decode.py`` run, with the issue's goals."""
    lines = ["", f"## Batched decoding, {title} (decode_batch=1 vs every config of a sample in one batch)", "",
             f"{d['model']} on {d.get('device', 'cpu')}, RULER needles at {d['length']} tokens (8 tasks × 1 sample), "
             f"up to {d['max_new_tokens']} new tokens, {d['threads']} torch threads; every mode in one process on the "
             "same samples. Wall = the whole sweep (prefill, compression, decoding, scoring, writing)."
             + (f" Note: {d['model_note']}." if "model_note" in d else ""), "",
             "| sweep | configs | wall, decode_batch=1 (s) | wall, batched (s) | speedup (goal) | decode forwards "
             "1 → batched (s) | decode tok/s 1 → batched | + all samples in one batch: wall (s), speedup | "
             "harness share (excl. compression) | identical tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    goals = {name: goal for name, goal in (("demo", 2.5), ("fourteen", 4.0)) if name in d}
    for name, goal in goals.items():
        r = d[name]
        one, all_ = r["decode_batch_1"], r["batched"]
        joined = r.get("batched_all_samples")  # runs before the all-samples mode measured two samples per batch
        extra = (f"{joined['wall_s']}, {r['speedup_all_samples']}× ({verdict(r['speedup_all_samples'] >= goal)})"
                 if joined else f"(2 samples) {r['batched_2_samples']['wall_s']}, {r['speedup_2_samples']}×")
        lines.append(f"| {name} | {r['configs']} | {one['wall_s']} | {all_['wall_s']} | **{r['speedup']}×** "
                     f"(≥ {goal}, {verdict(r['speedup'] >= goal)}) | {one['decode_forward_s']} → "
                     f"{all_['decode_forward_s']} ({r['decode_speedup']}×) | {one['decode_tokens_per_s']} → "
                     f"{all_['decode_tokens_per_s']} | {extra} | "
                     f"{100 * all_['harness_share']:.1f}% ({100 * all_['harness_share_excl_compress']:.1f}%) | "
                     f"{r['identical_tokens']} |")
    lines.append("")
    first = next(iter(goals))
    lines.append(f"- prefill: {d[first]['batched']['prefill_s']} s of the {first} sweep's batched "
                 f"{d[first]['batched']['wall_s']} s is the 8 prompts' prefill, which batching cannot share")
    if "weights_step_ms" in d:
        w = d["weights_step_ms"]
        sizes = sorted({1, *(d[name]["configs"] for name in goals)})
        lines.append("- the most batching a sample's configs could give on this device: the default batched run with "
                     "every forward pass at the cost of a weights-only step (one-token cache, no prompt attention) at "
                     "its batch size, everything else as measured: " + "; ".join(
                         f"{name} ≤ {d[name]['speedup_bound']}× (goal {goal}, "
                         f"{'attainable' if d[name]['speedup_bound'] >= goal else '**not attainable**'})"
                         for name, goal in goals.items())
                     + ". Weights-only step: " + ", ".join(f"batch {r} {w[str(r)]} ms" for r in sizes))
    for name in goals:
        if "stacking_speedup" in d[name]:
            r = d[name]
            lines.append(f"- {name}: stacked rows (default) vs the per-row path (`decode_stack=false`), same run: wall "
                         f"{r['batched_per_row']['wall_s']} → {r['batched']['wall_s']} s (**{r['stacking_speedup']}×**"
                         f", goal ≥ 1: {verdict(r['stacking_speedup'] >= 1)}), decode forwards "
                         f"{r['batched_per_row']['decode_forward_s']} → {r['batched']['decode_forward_s']} s "
                         f"({r['stacking_decode_speedup']}×)")
    for name in goals:
        st = d[f"step_{name}"]
        lines.append(f"- one batched step, {st['batch']} rows, {st['prompt_tokens']}-token prompt: compressed "
                     f"caches {st['compressed_step_ms']} ms vs dense DynamicCache {st['dense_dynamic_cache_step_ms']}"
                     f" ms → {st['ratio']}× (goal ≤ 1.2, {verdict(st['ratio'] <= 1.2)})"
                     + (f"; the per-row path {st['per_row_step_ms']} ms ({st['ratio_per_row']}×)"
                        if "per_row_step_ms" in st else ""))
    lines.append("- harness share goal < 5%: " + ", ".join(
        f"{name} {verdict(d[name]['batched']['harness_share'] < 0.05)}" for name in goals)
        + " (prefill and the decode forwards, attention included, count as model time; compression counts as "
          "harness)")
    return lines


def instructions_section(d: dict | None, compiled: list | None = None) -> list[str]:
    """The fused decode's instruction budget from its machine code (``scripts/bench/instructions.py``), before and
    after a rework, against the goals; the compile matrix's spills (``scripts/bench/compile.py``)."""
    if not d:
        return []
    goal = d["goal"]
    lines = ["", "## The fused decode's instruction budget from its SASS (`scripts/bench/instructions.py`)", "",
             "Each launched specialisation (D=128, bf16, GQA 4, q_len=1) compiled as launched, disassembled; "
             "steady-state token loop: warp-instructions per KV byte (goal ≤ "
             f"{goal['instr_per_byte']}), modelled time max(bytes/BW, instr/issue rate, Little's law) as a fraction "
             f"of the bandwidth bound (goal ≥ {goal['fraction_of_bound']:.0%}); in flight per SM goal ≥ "
             f"{goal['in_flight_per_sm'] // 1024} KB; value loads goal {goal['value_load_bytes']} B.", "",
             "| version | arch | scenario | partials regs / spills | CTAs/SM | loop instr/B | in flight/SM | widest load | "
             "fraction of bound (limit) | layer incl. merge |", "|---|---|---|---|---|---|---|---|---|---|"]
    versions = {"before": "the kernel as issue 43 found it (its own model: every static instruction of the loops)",
                "previous": "76b8da2 (tensor-core scores, POPC ranks, 2 CTAs/SM, ThinK's structured loop, unmasked "
                            "whole blocks, ex2 weights, tensor-core tail merge; one kernel with every member loop)",
                "after": "now (the partials kernel specialised to the member kinds a launch's tables hold: each "
                         "scenario's own kernel)"}
    lines[-2:-2] = [f"Versions: {', '.join(f'**{k}** = {v}' for k, v in versions.items() if k in d)}. From "
                    "`previous` on, a block is charged what it runs: the token loop's own instructions less the "
                    "preambles of member loops its work item has no member for.", ""]
    for label in versions:
        r = d.get(label)
        if not r:
            continue
        for arch, rows in r["scenarios"].items():
            k = r["kernels"][arch]["partials"]
            m = r["kernels"][arch]["merge"]
            for name, row in rows.items():
                p = row["partials"]
                own = {x: p.get(x, k[x]) for x in ("registers", "spill_bytes", "ctas_per_sm")}  # its specialisation's
                lines.append(
                    f"| {label} | {arch} | {name} | {own['registers']} / {own['spill_bytes']} (merge {m['registers']} / "
                    f"{m['spill_bytes']}) | {own['ctas_per_sm']} | {p['instr_per_byte_loop']:.3f} "
                    f"({verdict(p['instr_per_byte_loop'] <= goal['instr_per_byte'])}) | "
                    f"{p['in_flight_per_sm'] / 1024:.1f} KB | {p['widest_load_bytes']} B | "
                    f"{p['fraction_of_bound']:.0%} ({p['limited_by']}) | {row['layer_fraction_of_bound']:.0%} |")
    layouts = load("member_layouts")
    if layouts:
        wide = layouts.get("gqa8")
        sections = [(4, layouts["real_kernel"], layouts["variants"], "four members")]
        if wide:
            sections.append((8, wide["real_kernel"], wide["variants"], "two members"))
        for group, real, variants, many in sections:
            lines += ["", f"SparK's member loop under other key layouts at GQA {group} (`scripts/bench/member_layouts.py`, "
                      "sm_90, one standalone kernel per layout, checked against float64 under the interpreter), "
                      f"charged the real token loop ({real['token_loop_instructions']} instructions per warp per block"
                      + (f" at {real['source']}" if "source" in real else "") + "):", "",
                      "| layout | registers / spills | member loop instr/warp/block | key B/token | instr/B, one row | "
                      f"instr/B, {many} | max abs error |", "|---|---|---|---|---|---|---|"]
            for name, v in variants.items():
                err = "–" if v["max_abs_err"] is None else f"{v['max_abs_err']:.1e}"
                one, several = v["instr_per_byte"].values()
                lines.append(f"| {name} | {v['registers']} / {v['spill_bytes']} | {v['member_instructions']} | "
                             f"{v['key_bytes_per_token']:g} | {one:.3f} | {several:.3f} | {err} |")
    if compiled:
        spilled = [r for r in compiled if r["spill_bytes"]]
        lines += ["", f"- `scripts/bench/compile.py`: {len(compiled)} launched specialisations (D 64/128, bf16/fp32, "
                  "decode step and 16-token suffix, sm_80/sm_90; the partials kernel with every member loop and, "
                  "for a decode step, as each method's rows alone launch it) compiled as launched: "
                  f"{len(spilled)} spill "
                  f"({verdict(not spilled)}); registers {min(r['registers'] for r in compiled)}–"
                  f"{max(r['registers'] for r in compiled)}."]
    return lines


def latency_section(d: dict | None) -> list[str]:
    """The fused decode's modelled time with its waiting counted (``scripts/bench/latency_model.py``), per version,
    arch, GQA and scenario, at both ends of the DRAM-latency range, against issue 52's goals."""
    if not d:
        return []
    goals = d.get("goals", {})
    lines = ["", "## The fused decode with its waiting counted (`scripts/bench/latency_model.py`)", "",
             "One warp run through each launched specialisation's SASS (D=128, bf16, q_len=1), block by block as "
             "each work item runs it; per block on an SM max(bytes ÷ its share of the bandwidth, issue, latency "
             "chain ÷ resident CTAs); the DRAM latency at both ends of its range (model and parameters: docs/gpu.md, "
             "\"How long a block waits\"). Instructions per byte count everything the partials kernel executes "
             "(loop only in brackets). Round trips: DRAM waits of one block of the scenario's largest work item "
             "(dependent: its data went into a later load's address). In flight: bytes outstanding per SM from the "
             f"schedule (Little's law; goal ≥ {goals.get('in_flight_per_sm', 0) // 1024} KB). Layer: with the merge "
             "kernel. Grid: with only the SMs and CTAs the launch's programs fill.", "",
             "| version | arch | GQA | scenario | regs / spills, CTAs/SM | instr/B (loop) | DRAM round trips / block "
             "(dependent) | in flight/SM | fraction of bound (limit) | goal | layer | grid |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    wanted = goals.get("fraction_of_bound", {})
    notes = []  # (the SparK-over-dense lines: after the table, not inside it)
    for label in ("before", "after"):
        r = d.get(label)
        if not r:
            continue
        ends = [f"{x * 1e6:g}us" for x in r["model"]["latencies_s"]]
        for arch, by_gqa in r["scenarios"].items():
            for gqa, rows in by_gqa.items():
                for name, row in rows.items():
                    at = [row[e] for e in ends]
                    p = [x["partials"] for x in at]
                    block = p[0]["blocks"][p[0]["heaviest"]]
                    goal = wanted.get(name)
                    ok = goal is not None and all(x["fraction_of_bound"] >= goal for x in p)
                    flight = all(x["in_flight_per_sm"] >= goals.get("in_flight_per_sm", 0) for x in p)
                    lines.append(
                        f"| {label} | {arch} | {gqa.removeprefix('gqa')} | {name} | {row['registers']} / "
                        f"{row['spill_bytes']}, {row['ctas_per_sm']} | {p[0]['instr_per_byte']:.3f} "
                        f"({p[0]['instr_per_byte_loop']:.3f}) | {block['dram_round_trips']} "
                        f"({block['dependent_round_trips']}) | "
                        + " / ".join(f"{x['in_flight_per_sm'] / 1024:.1f}" for x in p) + f" KB ({verdict(flight)}) | "
                        + " / ".join(f"{x['fraction_of_bound']:.0%}" for x in p) + f" ({p[-1]['limited_by']}) | "
                        + (f"≥ {goal:.0%} ({verdict(ok)})" if goal is not None else "–") + " | "
                        + " / ".join(f"{x['layer_fraction_of_bound']:.0%}" for x in at) + " | "
                        + " / ".join(f"{x['grid']['fraction_of_bound']:.0%}" for x in at) + " |")
        for arch, by_gqa in r.get("spark_over_dense_32k", {}).items():
            for gqa, ratio in by_gqa.items():
                limit = goals.get("spark_over_dense_32k", 0.4)
                notes.append(f"- {label}, {arch}, GQA {gqa.removeprefix('gqa')}: a SparK(0.8) row (20% of a 32K "
                             "prompt) takes " + " / ".join(f"{v:.2f}" for v in ratio.values()) + "× a dense 32K row's "
                             f"modelled layer time at {' / '.join(ratio)} (goal ≤ {limit}, "
                             f"{verdict(all(v <= limit for v in ratio.values()))})")
    return lines + [""] + notes


def fidelity_cost_section(d: dict | None) -> list[str]:
    """What the fidelity pass costs a sweep (``scripts/bench/fidelity_cost.py``), against the issue's 15% bound."""
    if not d:
        return []
    lines = ["", "## The fidelity pass's share of a sweep (`scripts/bench/fidelity_cost.py`)", "",
             "| measurement | sweep | wall off → on (s) | pass (fidelity_s, s) | pass / wall, timed | "
             "(on − off) / on | goal | identical tokens |", "|---|---|---|---|---|---|---|---|"]
    for label, e in d.items():
        sweep = f"{e['configs']} configs, {e['model']}, {e['benchmark']}, {e['device']}"
        variants = [(label, sweep, e["on"], e["pass_share_timed"], e["pass_share_wall"], e["meets_goal"])]
        if "on_per_row" in e:
            variants.append((f"{label}: one row per forward", "same", e["on_per_row"], e["pass_share_timed_per_row"],
                             e["pass_share_wall_per_row"], None))
        if "on_before" in e:
            variants.append((f"{label}: the pass before (two continuations per row)", "same", e["on_before"],
                             e["pass_share_timed_before"], e["pass_share_wall_before"],
                             e["pass_share_timed_before"] <= e["goal"]))
        for name, where, run, timed, wall, meets in variants:
            timed_cell = f"**{100 * timed:.1f}%**" if run is e["on"] else f"{100 * timed:.1f}%"
            judged = "" if meets is None else f" ({verdict(meets)})"
            lines.append(f"| {name} | {where} | {e['off']['wall_s']} → {run['wall_s']} | {run['fidelity_s']} | "
                         f"{timed_cell} | {100 * wall:.1f}% | ≤ {100 * e['goal']:.0f}%{judged} | "
                         f"{e['identical_tokens']} |")
    return lines


def main() -> None:
    lines = ["# spark-bench benchmarks", ""]
    b = load("bytes")
    if b:
        lines += ["## Bytes (every tensor counted)", "",
                  f"S = {b['seq']}, {b['kv_heads']} kv-heads. Key store / dense keys, and keys+values per token per "
                  "kv-head.", "", "| dtype | D | method | key store / dense | B/token/kv-head | achieved key ratio |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['head_dim']} | {r['method']} | {r['key_store_ratio']:.3f} | "
                  f"{r['bytes_per_token_per_kv_head']} | {r['achieved_key_ratio']} |" for r in b["rows"]]
        goals = [(r, 0.35 if "SparK(0.8)" == r["method"] else 0.22) for r in b["rows"]
                 if r["method"] in ("SparK(0.8)", "ThinK(0.8)")]
        lines += [""] + [f"- {r['method']} {r['dtype']} D={r['head_dim']}: {r['key_store_ratio']:.3f}× "
                         f"(goal ≤ {goal}) — {verdict(r['key_store_ratio'] <= goal)}" for r, goal in goals]
    a = load("attention")
    if a:
        lines += ["", "## Decode attention over one layer (median ms)", "",
                  f"kernel: {a['kernel']}; torch threads: {a['threads']}; fallbacks seen: {a['fallbacks'] or 'none'}",
                  "", "| dtype | D | variant | ms | max abs err vs float64 |", "|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['head_dim']} | {r['variant']} | {r['ms']} | {r['max_abs_err']:.1e} |"
                  for r in a["rows"]]
        lines.append("")
        for dtype in sorted({r["dtype"] for r in a["rows"]}):
            for d in sorted({r["head_dim"] for r in a["rows"]}):
                rows = {r["variant"]: r for r in a["rows"] if r["dtype"] == dtype and r["head_dim"] == d}
                dense, fast, mat = (rows[k]["ms"] for k in ("dense", "spark_official_compact",
                                                            "spark_official_materialize"))
                lines.append(f"- {dtype} D={d} S={rows['dense']['seq']}: compact/dense = {fast / dense:.2f} (goal ≤ 1.0, "
                             f"{verdict(fast <= dense)}); materialise/compact = {mat / fast:.1f}× (goal ≥ 2, "
                             f"{verdict(mat / fast >= 2)})")
    s = load("sweep")
    if s:
        lines += ["", "## Sweep cost and harness overhead", "",
                  f"{s['configs']} method configs × {s['samples']} samples at {s['length']} tokens (SmolLM2-135M): "
                  f"shared sweep {s['shared_sweep_s']} s vs separate runs {s['separate_runs_s']} s → "
                  f"**{s['speedup']}×** (goal ≥ 4, {verdict(s['speedup'] >= 4)}); identical tokens: "
                  f"{s['identical_tokens']}.",
                  f"- harness overhead (wall − model forwards) = {100 * s['harness_overhead_share']:.1f}% of wall "
                  f"(goal < 5%, {verdict(s['harness_overhead_share'] < 0.05)}); without compression "
                  f"{100 * s['harness_overhead_share_excl_compress']:.1f}%; compression {s['compress_s']} s of "
                  f"{s['shared_sweep_s']} s."]
    sc = load("sweep_compare")
    if sc:
        lines += ["", "## CPU sweep time against an earlier commit (`scripts/bench/sweep_compare.py`)", "",
                  f"{sc['what']}; {sc['repeats']} runs each, {sc['order']}: {sc['baseline']} "
                  f"{sc['seconds']['baseline']} s vs current {sc['seconds']['current']} s; medians "
                  f"{sc['median_s']['baseline']} → {sc['median_s']['current']} s: **{sc['ratio_current_over_baseline']}×** "
                  f"(goal: no worse than the runs' spread, {verdict(sc['ratio_current_over_baseline'] <= max(sc['seconds']['baseline']) / min(sc['seconds']['baseline']))}); "
                  f"same scores: {sc['same_scores']}."]
    o = load("ops")
    if o:
        lines += ["", "## Operations dispatched per decode step (the GPU kernel-launch proxy, `scripts/bench/ops.py`)",
                  "", f"{o['model']}, every config of a sample in one batch vs a dense `DynamicCache` batch of the "
                  "same size (aten ops per step, counted with `TorchDispatchMode`; views included).", "",
                  "| mix | rows | stacked (default) | per-row path (`decode_stack=false`) | dense batch | stacked / dense "
                  "(goal ≤ 1.3) | per-row / dense | CUDA path: kernels / dense kernels (goal ≤ 1) |",
                  "|---|---|---|---|---|---|---|---|"]
        for name in ("demo", "fourteen", "twentyeight"):
            if name not in o:
                continue
            m = o[name]
            fused = (f"{m['fused_cuda_path']['kernel_ops_per_step']:.0f} / {m['dense']['kernel_ops_per_step']:.0f} = "
                     f"{m['kernel_ratio_fused_cuda_path']} ({verdict(m['kernel_ratio_fused_cuda_path'] <= 1)})"
                     if "fused_cuda_path" in m else "–")
            lines.append(f"| {name} | {m['rows']} | {m['stacked']['ops_per_step']:.0f} | "
                         f"{m['per_row']['ops_per_step']:.0f} | {m['dense']['ops_per_step']:.0f} | {m['ratio']} "
                         f"({verdict(m['ratio'] <= 1.3)}) | {m['ratio_per_row']} | {fused} |")
    f = load("fused")
    if f:
        lines += ["", "## The fused CUDA decode's work per layer at the paper's scale (`scripts/bench/fused.py`)", "",
                  f"From its launch formula ({f['formula']}); layer 0, every config of a sample in one batch.", "",
                  "| table | rows | prompt | programs (old grid) | bytes read per layer (stored) | read / stored "
                  "(goal ≤ 1.1) | old fp32 score traffic |", "|---|---|---|---|---|---|---|"]
        for name, w in f["tables"].items():
            ratio = w["bytes_loaded"] / w["stored_bytes"]
            lines.append(f"| {name} | {w['rows']} | {w['prompt']} | {w['programs']} ({w['old_programs']}) | "
                         f"{w['bytes_loaded'] / 2**20:.1f} MiB ({w['stored_bytes'] / 2**20:.1f} MiB) | {ratio:.3f} "
                         f"({verdict(ratio <= 1.1)}) | {w['old_score_traffic_bytes'] / 2**20:.1f} MiB |")
    lines += instructions_section(load("instructions"), load("compile"))
    lines += latency_section(load("latency_model"))
    pp = load("planner_peaks")
    if pp:
        lines += ["", "## Planner peaks on 80 GB GPUs (79 GiB given; `scripts/bench/planner_peaks.py`)", "",
                  "| run | " + " | ".join(pp) + " |", "|---|" + "---|" * len(pp)]
        for name in next(iter(pp.values())):
            cells = [f"{v[name]['fullest_gib']} GiB, batches of {v[name]['decode_batch']}/{v[name]['rows']}"
                     for v in pp.values()]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, title in (("decode", "CPU, the embedded model"),
                        ("decode_h100", "GPU, `scripts/bench/decode.py --device cuda`")):
        d = load(name)
        if d:
            lines += decode_section(d, title)
    st = load("decode_stacking")
    if st:
        lines += ["", "## Stacked rows vs the per-row path on this CPU, repeated "
                  "(`scripts/bench/decode.py --stacking-repeats`)", "",
                  f"{st['model']}, RULER needles at {st['length']} tokens, the sweeps of the table above, the two paths "
                  "alternating in one process; medians (per-row / stacked > 1: stacking is faster).", "",
                  "| sweep | repeats | wall per-row → stacked (s, medians) | speedup | decode forwards (s) | "
                  "speedup |", "|---|---|---|---|---|---|"]
        for name in ("demo", "fourteen"):
            if name in st:
                r = st[name]
                lines.append(f"| {name} | {r['repeats']} | {r['median_wall_s']['per_row']} → "
                             f"{r['median_wall_s']['stacked']} | **{r['speedup']}×** ({verdict(r['speedup'] >= 1)}) | "
                             f"{r['median_decode_forward_s']['per_row']} → {r['median_decode_forward_s']['stacked']} | "
                             f"{r['decode_speedup']}× |")
    m = load("memory")
    if m:
        lines += ["", "## Memory planner (LLaMA-3.1-8B, 80 GiB, 8192 + 128 tokens)", "",
                  "| method | B/token/kv-head | KV GiB/sequence | max batch |", "|---|---|---|---|"]
        lines += [f"| {p['method']} | {p['bytes_per_token_per_kv_head']:.1f} | "
                  f"{p['kv_bytes_per_sequence'] / 1024 ** 3:.3f} | {p['max_batch']} |" for p in m["plans"]]
        lines += ["", "Paper (Appendix, 80 GB): full 72, SparK 0.5: 222, SparK 0.8: 241 — see the README for why "
                      "key-only SparK cannot triple the batch by itself."]
    peak = load("memory_peak")
    if peak:
        lines += ["", "## A run's peak memory: predicted before the model loads vs measured (this CPU, resident set)", "",
                  "| run | predicted MiB | measured MiB | measured / predicted | above the loaded model: predicted → "
                  "measured MiB |", "|---|---|---|---|---|"]
        for name, r in peak["cases"].items():
            lines.append(f"| {name} | {r['predicted_peak_mib']} | {r['measured_peak_mib']} | "
                         f"{r['measured_over_predicted']} ({verdict(0.8 <= r['measured_over_predicted'] <= 1.2)}) | "
                         f"{r['predicted_dynamic_mib']} → {r['measured_dynamic_mib']} |")
    lines += fidelity_cost_section(load("fidelity_cost"))
    (OUT / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
