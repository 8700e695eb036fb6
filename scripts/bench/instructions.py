"""The fused decode's instruction budget, read from its own machine code → results/bench/instructions.json.

Every kernel specialisation the dispatch launches for a decode step at the production shape (D=128, bf16, 4 query
heads per kv-head, ``q_len=1``) is compiled for sm_80 and sm_90 as Triton's launcher would
(:func:`spark_bench.storage.gpu_compile.compile_launch`), disassembled (triton's bundled nvdisasm) and its loops found
by their back-edge branches. The steady-state token loop's static instruction count × warps, per ``BLOCK`` tokens,
over the bytes those tokens' keys and values occupy, is the kernel's **warp-instructions per KV byte**; a member
loop nested in it (one query head sharing the value tensor per trip) counts once per member.

The budget: a kernel reading its bytes at the bandwidth limit can issue at most SMs × clock × IPC ÷ bandwidth
warp-instructions per byte (H100: 132 × 1.755 GHz × 2 ÷ 3.35 TB/s ≈ 0.14). Per work item the modelled time is
``max(bytes ÷ bandwidth, instructions ÷ issue rate, bytes ÷ (bytes in flight × SMs ÷ latency))`` (Little's law for
the last); the fraction of the bandwidth bound is ``(bytes ÷ bandwidth) ÷ modelled time``. Work items come from the
dispatch's own grouping (:class:`~spark_bench.storage.segments.FusedTables`: rows sharing an eviction selection read
its values once, ``MEMBERS`` query heads per program, ``chunk_of`` tokens per program) with each config's real
bytes per token (:func:`spark_bench.memory.store_bytes`).

``--label before`` / ``after`` stores the figures under that key, keeping the other (the kernel before and after a
rework, one file).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spark_bench.storage.gpu_compile import Launch, compile_launch, guarded, load_widths, parse_sass  # noqa: E402
from spark_bench.storage.segments import ALL_KINDS, KINDS  # noqa: E402  (the kernel's member loops, in its order)
from spark_bench.storage.triton_walk import SLOTS  # noqa: E402  (the signed walk's kept ranks per slot-loop trip)


@dataclass(frozen=True)
class Device:
    name: str
    sms: int
    clock_hz: float
    bandwidth: float       # bytes/s
    latency_s: float       # DRAM round trip under load
    shared_per_sm: int     # bytes
    ipc: float = 2.0       # warp-instructions issued per cycle per SM (a realistic rate; 4 schedulers at most)
    registers_per_sm: int = 65536
    warps_per_sm: int = 64
    ctas_per_sm: int = 32

    @property
    def issue_rate(self) -> float:
        return self.sms * self.clock_hz * self.ipc

    @property
    def budget(self) -> float:
        """Warp-instructions per byte at which issue keeps up with the bandwidth."""
        return self.issue_rate / self.bandwidth


DEVICES = {90: Device("H100 SXM", 132, 1.755e9, 3.35e12, 700e-9, 228 * 1024),
           80: Device("A100 SXM 80GB", 108, 1.41e9, 2.039e12, 700e-9, 164 * 1024)}
BUDGET = 0.14          # the issue's target (H100)
IN_FLIGHT_GOAL = 18 * 1024
PROMPT = 7950          # Table 1's prompt (llama3-8b at 8K)
LONG = 127500          # tab_full_llama3.1-8b's
TAIL = 64              # decoded tokens in the tail (the merge kernel reads them)


def ctas_per_sm(registers: int, warps: int, shared: int, device: Device) -> int:
    """Resident CTAs per SM from registers (allocated per warp in units of 256), warps, shared memory (1 KB reserved
    per CTA) and the CTA limit."""
    per_warp = math.ceil(registers * 32 / 256) * 256
    by_regs = (device.registers_per_sm // per_warp) // warps
    by_smem = device.shared_per_sm // (shared + 1024) if shared else device.ctas_per_sm
    return max(0, min(by_regs, by_smem, device.warps_per_sm // warps, device.ctas_per_sm))


def kernel_figures(launch: Launch, arch: int, compiled=None) -> dict:
    """Registers, spills, occupancy and the loops' static instruction counts of one launched specialisation
    (``compiled``: its :func:`compile_launch` with SASS, when the caller has it; each loop's ``span``: its first and
    last instruction's index, for ``scripts/bench/latency_model.py``)."""
    c = compiled if compiled is not None else compile_launch(launch, arch, sass=True)
    labels: dict = {}
    instructions, loops = parse_sass(c.sass, labels)

    def describe(loop, outer=None) -> dict:
        own = loop.own(instructions)
        inner = [describe(x, loop) for x in loop.inner]
        return {"instructions": len(own), "global_loads": load_widths(own),
                "shared_loads": sum(" LDS" in f" {x}" for x in own), "shuffles": sum("SHFL" in x for x in own),
                "barriers": sum("BAR" in x for x in own), "ffma": sum(x.split()[0].lstrip("@!P0123456789T ")
                                                                     .startswith("FFMA") for x in own),
                "tensor_core": sum(any(k in x for k in ("HMMA", "HGMMA")) for x in own),
                # of the enclosing loop's own instructions, those that run only when this loop runs (skipped with
                # it when it has no trip to make); the rest of a loop's own instructions run every iteration
                "guard": len(guarded(instructions, labels, outer, loop)) if outer is not None else 0,
                "common": len(own) - sum(x["guard"] for x in inner), "inner": inner, "span": [loop.start, loop.end]}

    in_loops = sum(loop.end - loop.start + 1 for loop in loops)
    return {"kernel": launch.kernel, "arch": arch, "kinds": [k for i, k in enumerate(KINDS) if launch.kinds >> i & 1],
            "constants": c.constants, "registers": c.registers,
            "spill_bytes": c.spill_bytes, "shared_bytes": c.shared_bytes, "num_warps": c.num_warps,
            "num_stages": c.num_stages, "ctas_per_sm": ctas_per_sm(c.registers, c.num_warps, c.shared_bytes,
                                                                   DEVICES[arch]),
            "instructions": len(instructions), "outside_loops": len(instructions) - in_loops,
            "loops": [describe(loop) for loop in loops]}


# ---------------------------------------------------------------------------------------------- work items


def _configs(experiment: str):
    from hydra import compose, initialize_config_dir

    from spark_bench.cli import CONF_DIR, validate

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return validate(compose("config", [f"+experiment={experiment}"]), sources=False)


def eviction_key(cfg) -> tuple:
    """Configs with equal keys keep the same tokens: they share one value tensor (scripts/bench/fused.py)."""
    if cfg.name.split("+")[0] == cfg.channel_name or cfg.name == "full":
        return ("full",)
    return (cfg.name.split("+")[0], cfg.budget, cfg.budget_rounding, cfg.window_size, cfg.kernel_size, cfg.pooling)




def member_kind(cfg, arch, dtype: str) -> tuple[str, int, int]:
    """Which of the partials kernel's member loops serves ``cfg``'s keys (the order
    :class:`~spark_bench.storage.segments.FusedTables` sorts a work item's heads in): ``dense`` (eviction only, a
    full row), ``structured`` (ThinK's channel subset, in work items before its recent tokens), ``bare`` (pruned
    entries read as 0, no recovery term: SparK's zero/none recoveries, AdaKV rows, ThinK's item holding its recent
    tokens), ``plain`` (a recovery without signs: SparK's paper/constant recoveries), ``signed`` (SparK's official
    recovery); the recent tokens a structured store keeps dense (0 otherwise); and the trips per block of the
    signed walk's slot loop (:mod:`spark_bench.storage.triton_walk`: ``⌈⌈T/4⌉ / SLOTS⌉`` for T kept channels; 0
    otherwise)."""
    from spark_bench.memory import _synthetic_layer
    from spark_bench.methods.pipeline import Pipeline
    from spark_bench.storage.stores import DenseStore, StructuredKeyStore, UnstructuredStore

    layer = _synthetic_layer(cfg, arch, getattr(__import__("torch"), dtype), 64)
    store = layer.key_store
    if isinstance(store, DenseStore):
        ada = getattr(layer, "valid_bits", None) is not None or cfg.name.startswith("ada")
        return ("bare" if ada else "dense"), 0, 0
    if isinstance(store, UnstructuredStore):
        terms = store.recovery.kernel_terms()
        mode, fill = getattr(terms, "mode", None), getattr(terms, "fill", None)
        if mode == "signed":
            per_lane = -(-store.row_kept // 4)  # (kept ranks per lane: four lanes a token)
            return "signed", 0, -(-per_lane // SLOTS.value)
        return ("bare" if mode == "constant" and fill == 0 else "plain"), 0, 0
    if isinstance(store, StructuredKeyStore) and not cfg.name.startswith("ada"):
        channel = Pipeline.from_config(cfg).channel  # (ThinK: its last window_size tokens keep every channel)
        return "structured", channel.window_size if getattr(channel, "keep_window", False) else 0, 0
    return "bare", 0, 0


def work_items(model, configs, prompt: int, members: int, layer: int = 0) -> list[dict]:
    """One layer's work items of the partials kernel (per kv-head, × heads), as
    :meth:`~spark_bench.storage.segments.FusedTables.layout` makes them: the query heads sharing a value tensor, over
    ``chunk_of(tokens)``-token chunks, each chunk's heads sorted by their kind in it (a structured store's chunks
    holding recent tokens read it as ``bare``) in batches of ``members``; per item (chunks alike merged: ``tokens``
    over ``programs`` chunks of ``chunk``) its members' kinds, their member loops' inner trips per block (the signed
    walk's) and key bytes per token (each config's stores), whether they carry AdaKV validity bits (``valid``), and
    the values' bytes per token (read once for the batch)."""
    from spark_bench.memory import Arch, store_bytes, stored_tokens
    from spark_bench.storage.segments import FusedTables

    arch = Arch.of(model)
    groups: dict = {}
    for cfg in configs:
        t = stored_tokens(cfg, arch, prompt)[layer]
        sb = store_bytes(cfg, arch, model.dtype)
        groups.setdefault(eviction_key(cfg), (t, sb.value_per_token, []))[2].append(
            (*member_kind(cfg, arch, model.dtype), (sb.key_per_token, cfg.name.startswith("ada"))))
    merged: dict = {}
    for t, value_bytes, keys in groups.values():
        chunk = FusedTables.chunk_of(t)
        for t0 in range(0, t, chunk):
            t1 = min(t0 + chunk, t)
            kinds = [("bare" if kind == "structured" and t1 > t - recent else kind, trips, b)
                     for kind, recent, trips, b in keys]
            kinds.sort(key=lambda x: KINDS.index(x[0]))
            for i in range(0, len(kinds), members):
                batch = tuple(kinds[i:i + members])
                item = merged.setdefault((batch, t1 - t0, value_bytes), {
                    "members": len(batch), "kinds": [k for k, _, _ in batch], "trips": [n for _, n, _ in batch],
                    "tokens": 0, "chunk": t1 - t0, "programs": 0, "heads": arch.num_kv_heads,
                    "bytes_per_token": value_bytes + sum(b for _, _, (b, _) in batch),
                    "key_bytes_per_token": [b for _, _, (b, _) in batch],
                    "valid": [v for _, _, (_, v) in batch], "value_bytes_per_token": value_bytes})
                item["tokens"] += t1 - t0
                item["programs"] += arch.num_kv_heads
    return list(merged.values())


def scenarios() -> dict:
    """name → (description, work items, query heads (rows × kv-heads) the merge serves, chunks per head)."""
    from spark_bench.memory import Arch
    from spark_bench.storage.triton_decode import launch_shape

    model, table1 = _configs("table1")
    arch = Arch.of(model)
    g = arch.num_heads // arch.num_kv_heads
    members = launch_shape(g)[1]

    def pick(name, budget=None, ratio=None):
        return [c for c in table1 if c.name == name and (budget is None or c.budget == budget)
                and (ratio is None or c.ratio == ratio)][:1]

    out = {}
    singles = {"spark_0.8": ("SparK 0.8 (snapkv+spark, KV 512) alone", pick("snapkv+spark", 512, 0.8)),
               "think_0.8": ("ThinK 0.8 (snapkv+think, KV 512) alone", pick("snapkv+think", 512, 0.8)),
               "eviction": ("plain eviction (snapkv, KV 512)", pick("snapkv", 512)),
               "dense": (f"a dense row (full, {PROMPT} tokens)", pick("full"))}
    for name, (text, cfgs) in singles.items():
        out[name] = (text, work_items(model, cfgs, PROMPT, members))
    out["table1"] = (f"Table 1's mix ({len(table1)} configs, {model.name}, {PROMPT} tokens)",
                     work_items(model, table1, PROMPT, members))
    long_model, long_cfgs = _configs("tab_full_llama3_1_8b")
    out["row_127.5k"] = (f"tab_full_llama3.1-8b's mix at {LONG} tokens ({len(long_cfgs)} configs)",
                         work_items(long_model, long_cfgs, LONG, members))
    out["dense_127.5k"] = (f"a dense row at {LONG} tokens", work_items(long_model, pick("full"), LONG, members))
    for name, (text, items) in out.items():
        heads = sum(it["members"] * it["heads"] for it in items)
        slots = sum(it["members"] * it["programs"] for it in items)
        out[name] = {"text": text, "items": items, "query_heads": heads, "slots": slots}
    return out


def token_loop(k: dict, masked: bool = False) -> tuple[dict, dict]:
    """The partials kernel's steady-state loop (the first top-level loop holding member loops: whole blocks, no
    token masks; with ``masked``, the second, a chunk's last partial block; else the largest loop) and its member
    loop per kind: five member loops are, in program order, :data:`KINDS` (the kernel's source order), four the
    same without ``structured``; otherwise they are told apart by their byte loads (the mask and sign bytes): none →
    ``dense``, the most → ``signed``, between → ``plain`` (and ``bare``); a single member loop serves every kind."""
    loops = k["loops"]
    holding = [x for x in loops if x["inner"]]
    token = holding[min(int(masked), len(holding) - 1)] if holding else max(loops, key=lambda x: x["instructions"])
    compiled = k.get("kinds", KINDS)  # a specialisation's loops: its kinds', in source order
    if len(token["inner"]) == len(compiled):
        return token, {kind: token["inner"][compiled.index(kind)] if kind in compiled else None for kind in KINDS}
    if len(token["inner"]) == 4:
        loops4 = dict(zip(("dense", "bare", "plain", "signed"), token["inner"]))
        return token, {**loops4, "structured": loops4["bare"]}
    inner = sorted(token["inner"], key=lambda x: x["global_loads"].get(1, 0))
    if len(inner) <= 1:
        return token, {kind: inner[0] if inner else None for kind in KINDS}
    kinds = {"dense": inner[0] if not inner[0]["global_loads"].get(1) else None, "signed": inner[-1]}
    kinds["plain"] = kinds["bare"] = kinds["structured"] = inner[1] if len(inner) > 2 else inner[-1]
    if kinds["dense"] is None:
        kinds["dense"] = kinds["plain"]
    return token, kinds


def block_instructions(loop: dict, loops: dict, member_kinds: list[str], trips: list[int] | None = None) -> int:
    """What one block of the token ``loop`` runs for a work item whose members have ``member_kinds``: the loop's
    instructions that run every block, each member's loop (its own instructions and, ``trips`` times, the loops
    nested in it: the signed walk's slot loop), and a kind's guarded preamble once if the item has a member of that
    kind."""
    own = loop.get("common", loop["instructions"])
    present = {kind for kind in member_kinds if loops[kind] is not None}
    trips = trips or [0] * len(member_kinds)
    return own + sum(loops[kind].get("guard", 0) for kind in present) + sum(
        loops[kind]["instructions"] + n * sum(x["instructions"] for x in loops[kind]["inner"])
        for kind, n in zip(member_kinds, trips) if loops[kind] is not None)


def model_partials(k: dict, items: list[dict], device: Device) -> dict:
    """Instructions, bytes and modelled time of the partials kernel over ``items``."""
    block, warps = k["constants"]["BLOCK_"], k["num_warps"]
    token, kinds = token_loop(k)
    last, last_kinds = token_loop(k, masked=True)
    instr = byte = 0.0
    loop_instr = in_flight = 0.0
    widest = max(token["global_loads"], default=0)
    for it in items:
        full, rest = divmod(it["tokens"], it["chunk"])
        whole = it["heads"] * (full * (it["chunk"] // block) + rest // block)  # blocks of the steady-state loop
        partial = it["heads"] * (full * bool(it["chunk"] % block) + bool(rest % block))  # a chunk's last, masked
        member_kinds = it.get("kinds") or ["signed"] * it["members"]
        in_loops = (whole * block_instructions(token, kinds, member_kinds, it.get("trips"))
                    + partial * block_instructions(last, last_kinds, member_kinds, it.get("trips")))
        loop_instr += warps * in_loops
        instr += warps * (in_loops + it["programs"] * k["outside_loops"])
        byte += it["tokens"] * it["heads"] * it["bytes_per_token"]
        # bytes one CTA has requested at once: the values, issued first, and one member's keys (the member loops run
        # one member at a time); a flat pipelined loop, num_stages − 1 iterations ahead
        keys = sum(it["key_bytes_per_token"]) / it["members"] if token["inner"] else sum(it["key_bytes_per_token"])
        flat_stages = max(1, k["num_stages"] - 1) if not token["inner"] else 1
        in_flight = max(in_flight, block * (it["value_bytes_per_token"] + keys) * flat_stages)
    per_sm = in_flight * k["ctas_per_sm"]
    t_bw = byte / device.bandwidth
    t_issue = instr / device.issue_rate
    t_latency = byte / (per_sm * device.sms / device.latency_s) if per_sm else float("inf")
    modelled = max(t_bw, t_issue, t_latency)
    return {"bytes": int(byte), "warp_instructions": int(instr),
            "instr_per_byte_loop": round(loop_instr / byte, 4), "instr_per_byte": round(instr / byte, 4),
            "in_flight_per_sm": int(per_sm), "widest_load_bytes": widest,
            "modelled_us": round(modelled * 1e6, 1), "modelled_s": modelled, "bandwidth_bound_us": round(t_bw * 1e6, 1),
            "fraction_of_bound": round(t_bw / modelled, 3),
            "limited_by": max((t_bw, "bandwidth"), (t_issue, "issue"), (t_latency, "latency"))[1]}


def model_merge(k: dict, scenario: dict, device: Device) -> dict:
    """The merge kernel of one step: per query head its partials (one slot per chunk) and the ``TAIL`` tokens."""
    warps, block = k["num_warps"], k["constants"]["BLOCK_"]
    slot_loop, tail_loop = (k["loops"] + [None, None])[:2]  # in program order: the partials, the tail
    heads, slots = scenario["query_heads"], scenario["slots"]
    rows, d = 4, 128
    instr = warps * (heads * k["outside_loops"] + slots * slot_loop["instructions"]
                     + heads * -(-TAIL // block) * tail_loop["instructions"])
    byte = slots * rows * (d + 2) * 4 + heads * TAIL * d * 2 * 2
    return {"bytes": int(byte), "warp_instructions": int(instr), "instr_per_byte": round(instr / byte, 4),
            "tail_loop_instr_per_byte": round(warps * tail_loop["instructions"] / (block * d * 2 * 2), 4),
            "modelled_us": round(max(byte / device.bandwidth, instr / device.issue_rate) * 1e6, 1),
            "modelled_s": max(byte / device.bandwidth, instr / device.issue_rate)}


def kinds_of(items: list[dict]) -> int:
    """The partials kernel's ``KINDS`` for a launch of ``items`` (:meth:`FusedTables.layout`'s bit per kind held)."""
    return sum({1 << KINDS.index(kind) for it in items for kind in it.get("kinds") or ["signed"]})


def measure(archs=(90, 80), only: str | None = None) -> dict:
    """Every kernel specialisation the scenarios launch (the partials kernel's by the kinds its tables hold; the
    superset, every member loop, as ``partials``), on each arch, and each scenario modelled on its own."""
    out = {"kernels": {}, "scenarios": {}}
    cases = scenarios() if only is None else {}
    for arch in archs:
        device = DEVICES[arch]
        kernels = {x.kernel: kernel_figures(x, arch) for x in (Launch("partials", 128, 4), Launch("merge", 128, 4))
                   if only in (None, x.kernel)}
        by_kinds = {ALL_KINDS: kernels["partials"]} if "partials" in kernels else {}
        rows = {}
        for name, case in cases.items():
            mask = kinds_of(case["items"])
            if mask not in by_kinds:
                by_kinds[mask] = kernel_figures(Launch("partials", 128, 4, kinds=mask), arch)
            p = model_partials(by_kinds[mask], case["items"], device)
            p["kinds"], p["registers"] = by_kinds[mask]["kinds"], by_kinds[mask]["registers"]
            p["spill_bytes"], p["ctas_per_sm"] = by_kinds[mask]["spill_bytes"], by_kinds[mask]["ctas_per_sm"]
            m = model_merge(kernels["merge"], case, device)
            total_bytes, total_instr = p["bytes"] + m["bytes"], p["warp_instructions"] + m["warp_instructions"]
            modelled = (p.pop("modelled_s") + m.pop("modelled_s")) * 1e6  # (unrounded: the fraction below)
            rows[name] = {"text": case["text"], "work_items": len(case["items"]),
                          "members": sorted({it["members"] for it in case["items"]}), "partials": p, "merge": m,
                          "layer_instr_per_byte": round(total_instr / total_bytes, 4),
                          "layer_modelled_us": round(modelled, 1),
                          "layer_fraction_of_bound": round(total_bytes / device.bandwidth * 1e6 / modelled, 3)}
        kernels.update({f"partials[{'+'.join(k['kinds'])}]": k for mask, k in by_kinds.items()
                        if k is not None and mask != ALL_KINDS})
        out["kernels"][f"sm_{arch}"] = kernels
        out["scenarios"][f"sm_{arch}"] = rows
    out["devices"] = {f"sm_{a}": {"name": d.name, "sms": d.sms, "clock_hz": d.clock_hz, "bandwidth": d.bandwidth,
                                  "latency_s": d.latency_s, "ipc": d.ipc, "budget_instr_per_byte": round(d.budget, 3)}
                      for a, d in DEVICES.items() if a in archs}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench/instructions.json"))
    parser.add_argument("--label", default="after", help="before | after: the key the figures are stored under")
    args = parser.parse_args()
    result = measure()
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    old[args.label] = result
    old["goal"] = {"instr_per_byte": BUDGET, "spill_bytes": 0, "in_flight_per_sm": IN_FLIGHT_GOAL,
                   "value_load_bytes": 16, "fraction_of_bound": 0.7}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(old, indent=1))
    for arch, rows in result["scenarios"].items():
        k = result["kernels"][arch]
        print(f"{arch}: partials {k['partials']['registers']} regs, {k['partials']['spill_bytes']} B spilled, "
              f"{k['partials']['ctas_per_sm']} CTAs/SM; merge {k['merge']['registers']} regs, "
              f"{k['merge']['spill_bytes']} B spilled")
        for name, r in rows.items():
            p = r["partials"]
            print(f"  {name:13s} partials {p['instr_per_byte_loop']:.3f} instr/B (loop), {p['in_flight_per_sm']} B in "
                  f"flight/SM, {p['fraction_of_bound']:.0%} of bound ({p['limited_by']}); layer "
                  f"{r['layer_fraction_of_bound']:.0%}")


if __name__ == "__main__":
    main()
