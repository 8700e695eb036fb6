"""The fused decode's time per block with its waiting counted, read from its own machine code →
results/bench/latency_model.json (``make bench``; the model and its parameters: docs/gpu.md, "How long a block
waits").

Every partials and merge specialisation the scenarios launch (D=128, bf16, ``q_len=1``, GQA 4 and 8; the partials
kernel specialised to the member kinds its tables hold) is compiled for sm_90 and sm_80 as Triton's launcher compiles
it (:func:`~spark_bench.storage.gpu_compile.compile_launch`) and disassembled. For each work item of a scenario
(:func:`instructions.work_items`: the dispatch's grouping, each config's real bytes per token) the block it runs is
laid out instruction by instruction — the token loop's own instructions, each member's loop (the signed walk's slot
loop ``trips`` times), a kind's guarded preamble only when the item has a member of it — and one warp is run through
it (:mod:`sass_flow`: in-order issue, register ready times, loads classed by where their address comes from: the
tables at L1 latency, the stores at the DRAM latency), six blocks in a row, the last four's cycles averaged (``T``:
loads issued a block or two ahead are credited).
What a program runs outside its loops (the prologue — its table rows, queries and the walk's per-step tables — and
the epilogue's partial-softmax stores) is run once per program, its tables at L2 latency.

Per block on one SM::

    time = max(bytes ÷ (bandwidth ÷ SMs),                       the SM's share of the HBM bandwidth
               warps × instructions ÷ (IPC × clock),             issue
               T ÷ clock ÷ CTAs per SM)                          the latency chain, overlapped by the resident CTAs

summed over a scenario's blocks and programs ÷ SMs; the fraction of the HBM bound is (KV bytes ÷ bandwidth) ÷ that,
at both ends of the DRAM-latency range (:data:`LATENCIES_S`). CTAs per SM: registers, warps and shared memory
(:func:`instructions.ctas_per_sm`). Bytes outstanding per SM from the schedule (Little's law): the steady blocks'
bytes per SM per second under the latency term alone × the latency. Instructions per byte count everything the
partials kernel executes (blocks, prologue, epilogue, the walk's table stores) over the KV bytes; the layer's
figures add the merge kernel (its partials and a 64-token decoded tail).

Also written: ``check``, the model's prediction for each workload ``scripts/gpu/check.py`` measures (per device name
of its peak-bandwidth table: the fused layer's fraction of the bound and time, compressed and dense), so the first
GPU run sets the measured figure beside the modelled one.

``--label before`` / ``after`` stores the scenario figures under that key, keeping the other (the kernel before and
after a rework, one file); ``check`` always holds the latest run's prediction.

    python scripts/bench/latency_model.py [--label after] [--out results/bench/latency_model.json] [--archs 90,80]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import instructions as ins  # noqa: E402  (scripts/bench/instructions.py: work items, loops, occupancy)
from sass_flow import Latencies, Warp, parse  # noqa: E402

from spark_bench.storage.gpu_compile import Launch, bind, compile_launch, guarded, parse_sass  # noqa: E402
from spark_bench.storage.segments import KINDS  # noqa: E402


@dataclass(frozen=True)
class Device:
    """A GPU as the model sees it; ``name``: the part name of ``scripts/gpu/check.py``'s peak-bandwidth table."""

    name: str
    arch: int
    sms: int
    clock_hz: float      # sustained SM clock under load
    bandwidth: float     # HBM bytes/s (published peak)
    ipc: float = 2.0     # warp-instructions issued per cycle per SM (4 schedulers; 2 is what issue-heavy code keeps)

    @property
    def issue_rate(self) -> float:
        return self.sms * self.clock_hz * self.ipc


DEVICES = {"H100 SXM": Device("H100 SXM", 90, 132, 1.755e9, 3.35e12),
           "A100 80GB": Device("A100 80GB", 80, 108, 1.41e9, 2.039e12),
           "H200 (HBM3e)": Device("H200 (HBM3e)", 90, 132, 1.755e9, 4.8e12)}
TABLE_DEVICES = {90: "H100 SXM", 80: "A100 80GB"}   # the scenario tables' device per arch
LATENCIES_S = (0.5e-6, 0.7e-6)                      # loaded DRAM round trip, both ends of the range
GQA = (4, 8)
# kernel parameters whose loads read tables (L1 after a program's first touch); the merge's partial softmaxes were
# just written by the partials kernel (L2); anything else — the stores, reached through the addresses the tables
# hold, the decoded tail — streams from DRAM
TABLES = {"partials": ("q_ptr", "aux_ptr", "seg_ptr", "head_ptr", "work_ptr", "list_ptr", "len_ptr", "walk_ptr",
                       "tab_ptr"),
          "merge": ("q_ptr", "head_ptr", "len_ptr")}
L2_PARAMS = {"partials": (), "merge": ("acc_ptr", "ml_ptr")}
# tables whose entries place a block (a work item: its chunk's tokens, its value tensor), not another array's rows:
# a gather's address may also take them and still read the rows a prefetch asked for (sass_flow.Warp)
POSITION = {"partials": ("work_ptr",), "merge": ()}
PARAM_BASE = {90: 0x210, 80: 0x160}                 # the constant bank's first kernel parameter
REPEATS = 6                                          # blocks run in a row; the last four averaged
TAIL = ins.TAIL
GOALS = {"fraction_of_bound": {"table1": 0.80, "row_127.5k": 0.80, "spark_0.8": 0.75, "think_0.8": 0.75,
                               "dense": 0.95, "eviction": 0.95},
         "in_flight_per_sm": 18 * 1024, "spill_bytes": 0, "spark_over_dense_32k": 0.40}


def param_slots(launch: Launch, arch: int) -> dict[str, set[int]]:
    """Kernel parameter → the constant-bank offsets it occupies, in the order Triton passes them (constexprs and
    arguments specialised to constants are not passed), each aligned to its size."""
    source, _ = bind(launch, arch)
    constants = {k if isinstance(k, str) else source.fn.arg_names[k[0]] for k in source.constants}
    offset, out = PARAM_BASE[arch], {}
    for name, ty in source.signature.items():
        if ty == "constexpr" or name in constants:
            continue
        size = 8 if ty.startswith("*") or ty in ("i64", "u64", "fp64") else 4
        offset = -(-offset // size) * size
        out[name] = set(range(offset, offset + size, 4))
        offset += size
    return out


class Kernel:
    """One compiled specialisation: its SASS parsed, its loops, its parameters' classes."""

    def __init__(self, launch: Launch, arch: int):
        c = compile_launch(launch, arch, sass=True)
        self.launch, self.arch = launch, arch
        self.figures = ins.kernel_figures(launch, arch, compiled=c)
        self.labels: dict = {}
        self.text, self.loops = parse_sass(c.sass, self.labels)
        self.ops = [parse(x) for x in self.text]
        slots = param_slots(launch, arch)
        known = set().union(*slots.values())
        # (a parameter slot the SASS reads that the signature does not explain: Triton's calling convention moved)
        self.unmapped = sorted({o for op in self.ops for o in op.cbank if o >= PARAM_BASE[arch]} - known)
        self.table_slots = set().union(*(slots[n] for n in TABLES[launch.kernel] if n in slots))
        self.l2_slots = set().union(*(slots[n] for n in L2_PARAMS[launch.kernel] if n in slots))
        self.position_slots = set().union(*(slots[n] for n in POSITION[launch.kernel] if n in slots))
        inside = {i for loop in self.loops for i in range(loop.start, loop.end + 1)}
        self.outside = [i for i in range(len(self.text)) if i not in inside]
        self.warps = self.figures["num_warps"]
        self._cache: dict = {}

    def loop(self, span) -> object:
        todo = list(self.loops)
        while todo:
            x = todo.pop()
            if [x.start, x.end] == list(span):
                return x
            todo += x.inner
        raise KeyError(span)

    def before(self, loop) -> list[int]:
        return [i for i in self.outside if i < loop.start]

    def member_trace(self, loop, trips: int) -> list[int]:
        """One trip of a member loop: its own instructions, its inner loops ``trips`` times (a loop with no trip
        skipped with its guarded preamble)."""
        inner = {x.start: x for x in loop.inner}
        skip = {i for x in loop.inner if trips == 0 for i in guarded(self.text, self.labels, loop, x)}
        out, i = [], loop.start
        while i <= loop.end:
            if i in inner:
                x = inner[i]
                for _ in range(trips):
                    out += self.member_trace(x, 0)
                i = x.end + 1
                continue
            if i not in skip:
                out.append(i)
            i += 1
        return out

    def block_trace(self, masked: bool, kinds: tuple, trips: tuple) -> tuple[object, list[int]]:
        """The token loop (whole blocks, or with ``masked`` a chunk's last partial block) and one block of it for a
        work item whose members have ``kinds`` (and the signed walk's ``trips``)."""
        token_fig, kind_figs = ins.token_loop(self.figures, masked)
        token = self.loop(token_fig["span"])
        members: dict = {}
        for kind, n in zip(kinds, trips):
            fig = kind_figs.get(kind)
            if fig is not None:
                members.setdefault(tuple(fig["span"]), []).append(n)
        inner = {x.start: x for x in token.inner}
        skip = {i for x in token.inner if (x.start, x.end) not in members
                for i in guarded(self.text, self.labels, token, x)}
        out, i = [], token.start
        while i <= token.end:
            if i in inner:
                x = inner[i]
                for n in members.get((x.start, x.end), []):
                    out += self.member_trace(x, n)
                i = x.end + 1
                continue
            if i not in skip:
                out.append(i)
            i += 1
        return token, out

    def steady(self, prologue: list[int], body: list[int], lat: Latencies, null_off: bool = False) -> dict:
        """One warp through ``body`` ``REPEATS`` times after ``prologue``: the cycles of a pass (the last four's
        average), the last pass's stalls and loads (``null_off``: no member has AdaKV validity bits, so the loads
        guarded by their null address do not issue)."""
        key = (tuple(body), lat, null_off)
        if key not in self._cache:
            warp = Warp(lat, self.table_slots, self.l2_slots, null_off=null_off, position_slots=self.position_slots)
            warp.run([self.ops[i] for i in prologue])
            ops = [self.ops[i] for i in body]
            runs = [warp.run(ops) for _ in range(REPEATS)]
            self._cache[key] = summarise(runs[-1], (runs[-1].end - runs[1].end) / (REPEATS - 2), lat, len(body))
        return self._cache[key]

    def program(self, lat: Latencies) -> dict:
        """What a program runs outside its loops, once, its tables at L2 latency (first touch)."""
        key = ("program", lat)
        if key not in self._cache:
            warp = Warp(lat, self.table_slots, self.l2_slots, first_touch=True)
            run = warp.run([self.ops[i] for i in self.outside])
            self._cache[key] = summarise(run, run.end - run.start, lat, len(self.outside))
        return self._cache[key]


def summarise(run, cycles: float, lat: Latencies, instructions: int) -> dict:
    """A pass's cycles and instructions; its stalls by what they waited on; its DRAM round trips (stalls of at
    least a quarter of the DRAM latency on a load from DRAM: ``dependent`` when the waiting instruction is itself a
    load, ``use`` when loaded data was consumed before the next load issued); bytes per warp of its loads by class."""
    stalls: dict = {}
    for w in run.waits:
        stalls[w.source] = stalls.get(w.source, 0.0) + w.cycles
    trips = [w for w in run.waits if w.source in ("dram", "prefetched") and w.cycles >= lat.dram / 4]
    loads: dict = {}
    for _, cls, b in run.loads:  # (a prefetched load's bytes still come from DRAM, by its prefetch)
        cls = "dram" if cls == "prefetched" else cls
        loads[cls] = loads.get(cls, 0) + b
    return {"cycles": cycles, "instructions": instructions, "stall_cycles": {k: round(v) for k, v in stalls.items()},
            "dram_round_trips": len(trips), "dependent_round_trips": sum(w.dependent for w in trips),
            "chain": [{"waits": "dependent" if w.dependent else "use", "at": w.at.split()[0], "on": w.on,
                       "cycles": round(w.cycles)} for w in trips],
            "load_bytes_per_warp": loads, "unmodelled": sorted(run.unmodelled)}


def latencies(device: Device, dram_s: float) -> Latencies:
    return Latencies(dram=dram_s * device.clock_hz)


# ------------------------------------------------------------------------------------------------ scenarios


def _method(**options):
    import spark_bench

    return spark_bench.method(**options)


def scenarios(members: int) -> dict:
    """name → (description, work items): ``instructions.py``'s scenarios, and the workloads of
    ``scripts/gpu/check.py`` (Table 1's mix against as many dense rows of distinct prompts; one SparK(0.8) row with
    20% of the prompt at 32K and 127.5K against a dense row)."""
    model, table1 = ins._configs("table1")
    long_model, long_cfgs = ins._configs("tab_full_llama3_1_8b")

    def pick(name, budget=None, ratio=None):
        return [c for c in table1 if c.name == name and (budget is None or c.budget == budget)
                and (ratio is None or c.ratio == ratio)][:1]

    def items(cfgs, prompt, m=model, copies=1):
        out = ins.work_items(m, cfgs, prompt, members)
        for it in out:  # (rows of distinct prompts: as many copies of the items, no values shared)
            it["tokens"] *= copies
            it["programs"] *= copies
        return out

    spark_row = _method(name="snapkv+spark", ratio=0.8, budget=0.2)
    full = pick("full")
    out = {
        "dense": (f"a dense row (full, {ins.PROMPT} tokens)", items(full, ins.PROMPT)),
        "eviction": ("plain eviction (snapkv, KV 512)", items(pick("snapkv", 512), ins.PROMPT)),
        "think_0.8": ("ThinK 0.8 (snapkv+think, KV 512) alone", items(pick("snapkv+think", 512, 0.8), ins.PROMPT)),
        "spark_0.8": ("SparK 0.8 (snapkv+spark, KV 512, official recovery) alone",
                      items(pick("snapkv+spark", 512, 0.8), ins.PROMPT)),
        "table1": (f"Table 1's mix ({len(table1)} configs, {model.name}, {ins.PROMPT} tokens)",
                   items(table1, ins.PROMPT)),
        "table1_dense": (f"{len(table1)} dense rows of distinct {ins.PROMPT}-token prompts (gpu-check's dense side)",
                         items(full, ins.PROMPT, copies=len(table1))),
        "row_127.5k": (f"tab_full_llama3.1-8b's mix at {ins.LONG} tokens ({len(long_cfgs)} configs)",
                       items(long_cfgs, ins.LONG, long_model)),
        "dense_127.5k": (f"a dense row at {ins.LONG} tokens", items(full, ins.LONG)),
        "spark_row_32k": ("one SparK(0.8) row, official recovery, 20% of a 32,768-token prompt (gpu-check's row_32k)",
                          items([spark_row], 32768)),
        "dense_32k": ("a dense row at 32,768 tokens", items(full, 32768)),
        "spark_row_127.5k": (f"one SparK(0.8) row, 20% of a {ins.LONG}-token prompt (gpu-check's row_127.5k)",
                             items([spark_row], ins.LONG)),
    }
    result = {}
    for name, (text, its) in out.items():
        heads = sum(it["members"] * it["heads"] for it in its)
        slots = sum(it["members"] * it["programs"] for it in its)
        result[name] = {"text": text, "items": its, "query_heads": heads, "slots": slots}
    return result


CHECK = {"table1_mix": ("table1", "table1_dense"), "row_32k": ("spark_row_32k", "dense_32k"),
         "row_127.5k": ("spark_row_127.5k", "dense_127.5k")}


# ---------------------------------------------------------------------------------------------------- model


def _terms(nbytes: float, instructions: float, cycles: float, k: Kernel, ctas: float, device: Device,
           sms: float) -> tuple[float, float, float]:
    """Seconds of one SM for one block (or one program's overhead): bandwidth share, issue, latency ÷ CTAs."""
    return (nbytes / (device.bandwidth / sms), k.warps * instructions / (device.ipc * device.clock_hz),
            cycles / device.clock_hz / max(ctas, 1e-9))


def model_partials(k: Kernel, items: list[dict], device: Device, dram_s: float, grid: bool = False) -> dict:
    """The partials kernel over ``items`` at DRAM latency ``dram_s``; ``grid``: as many SMs and resident CTAs as the
    launch's programs can fill (else the CTAs per SM that fit, every SM busy)."""
    from spark_bench.storage.walk_layout import head_floats

    lat = latencies(device, dram_s)
    block = k.figures["constants"]["BLOCK_"]
    rpm = k.figures["constants"]["RPM"]
    d = k.figures["constants"]["D"]
    fit = k.figures["ctas_per_sm"]
    programs = sum(it["programs"] for it in items)
    sms, ctas = device.sms, fit
    if grid:
        sms = min(device.sms, programs)
        ctas = min(fit, programs / sms)
    total = {"bandwidth": 0.0, "issue": 0.0, "latency": 0.0}
    seconds = kv = instr = loop_instr = extra = 0.0
    steady_bytes = steady_latency_s = 0.0
    heaviest, chains = None, {}
    prog = k.program(lat)
    for it in items:
        kinds = tuple(it.get("kinds") or ["signed"] * it["members"])
        trips = tuple(it.get("trips") or [0] * it["members"])
        full, rest = divmod(it["tokens"], it["chunk"])
        whole = it["heads"] * (full * (it["chunk"] // block) + rest // block)
        partial = it["heads"] * (full * bool(it["chunk"] % block) + bool(rest % block))
        nbytes = it["tokens"] * it["heads"] * it["bytes_per_token"]
        kv += nbytes
        null_off = not any(it.get("valid") or [])
        token, trace = k.block_trace(False, kinds, trips)
        blk = k.steady(k.before(token), trace, lat, null_off)
        last, trace_p = k.block_trace(True, kinds, trips)
        blk_p = k.steady(k.before(last), trace_p, lat, null_off)
        whole_bytes = whole * block * it["bytes_per_token"]
        signed = sum(x == "signed" for x in kinds)
        over_bytes = it["members"] * rpm * (d + 2) * 4 + (signed * head_floats(d, rpm) * 4
                                                           if k.figures["constants"].get("WALK") else 0)
        parts = [(whole, whole_bytes / max(whole, 1), blk), (partial, (nbytes - whole_bytes) / max(partial, 1), blk_p),
                 (it["programs"], over_bytes, prog)]
        for count, b, sim in parts:
            if not count:
                continue
            terms = _terms(b, sim["instructions"], sim["cycles"], k, ctas, device, sms)
            seconds += count * max(terms)
            for name, v in zip(total, terms):
                total[name] += count * v
            instr += count * k.warps * sim["instructions"]
        loop_instr += k.warps * (whole * blk["instructions"] + partial * blk_p["instructions"])
        extra += it["programs"] * over_bytes
        steady_bytes += whole_bytes
        steady_latency_s += whole * blk["cycles"] / device.clock_hz / max(ctas, 1e-9)
        key = "+".join(kinds)
        chains[key] = {"kinds": list(kinds), "trips": list(trips), "cycles": round(blk["cycles"]),
                       "instructions": blk["instructions"], "dram_round_trips": blk["dram_round_trips"],
                       "dependent_round_trips": blk["dependent_round_trips"], "chain": blk["chain"],
                       "stall_cycles": blk["stall_cycles"], "bytes": block * it["bytes_per_token"],
                       "sass_dram_bytes": blk["load_bytes_per_warp"].get("dram", 0) * k.warps,
                       "unmodelled": blk["unmodelled"]}
        if heaviest is None or nbytes > heaviest[0]:
            heaviest = (nbytes, key)
    modelled = seconds / sms
    bound = kv / device.bandwidth
    per_sm = steady_bytes / max(steady_latency_s, 1e-30)  # bytes/s of one SM, the latency term alone
    return {"kv_bytes": int(kv), "extra_bytes": int(extra), "warp_instructions": int(instr),
            "instr_per_byte": round(instr / kv, 4), "instr_per_byte_loop": round(loop_instr / kv, 4),
            "modelled_us": round(modelled * 1e6, 2), "modelled_s": modelled, "bound_us": round(bound * 1e6, 2),
            "fraction_of_bound": round(bound / modelled, 3),
            "limited_by": max(total, key=total.get), "ctas_per_sm": round(ctas, 2), "sms": sms,
            "in_flight_per_sm": int(per_sm * dram_s),  # Little's law: outstanding = throughput × latency
            "blocks": chains, "heaviest": heaviest[1] if heaviest else None, "programs": programs}


def model_merge(k: Kernel, case: dict, rows: int, device: Device, dram_s: float) -> dict:
    """The merge of one step: per query head its chunks' partials (``rows`` query rows) and the ``TAIL`` tokens."""
    lat = latencies(device, dram_s)
    slot_loop, tail_loop = k.loops[:2]  # in program order: the partials, the tail
    block = k.figures["constants"]["BLOCK_"]
    d = k.figures["constants"]["D"]
    heads, slots = case["query_heads"], case["slots"]
    s = k.steady(k.before(slot_loop), k.member_trace(slot_loop, 0), lat)
    t = k.steady(k.before(tail_loop), k.member_trace(tail_loop, 0), lat)
    o = k.program(lat)
    per_head_slots, tail_blocks = slots / heads, -(-TAIL // block)
    nbytes = per_head_slots * rows * (d + 2) * 4 + TAIL * d * 2 * 2
    instr = o["instructions"] + per_head_slots * s["instructions"] + tail_blocks * t["instructions"]
    cycles = o["cycles"] + per_head_slots * s["cycles"] + tail_blocks * t["cycles"]
    terms = _terms(nbytes, instr, cycles, k, k.figures["ctas_per_sm"], device, device.sms)
    modelled = heads * max(terms) / device.sms
    return {"bytes": int(heads * nbytes), "tail_bytes": int(heads * TAIL * d * 2 * 2),
            "warp_instructions": int(heads * k.warps * instr), "modelled_us": round(modelled * 1e6, 2),
            "modelled_s": modelled, "limited_by": ("bandwidth", "issue", "latency")[terms.index(max(terms))]}


def model_scenario(partials: Kernel, merge: Kernel, case: dict, rows: int, device: Device, dram_s: float) -> dict:
    p = model_partials(partials, case["items"], device, dram_s)
    g = model_partials(partials, case["items"], device, dram_s, grid=True)
    m = model_merge(merge, case, rows, device, dram_s)
    layer_bytes = p["kv_bytes"] + m["tail_bytes"]
    layer_s = p.pop("modelled_s") + m.pop("modelled_s")
    return {"partials": p, "merge": m, "grid": {k: g[k] for k in ("fraction_of_bound", "modelled_us", "ctas_per_sm",
                                                                   "sms", "programs")},
            "layer_bytes": layer_bytes, "layer_modelled_us": round(layer_s * 1e6, 2), "layer_modelled_s": layer_s,
            "layer_fraction_of_bound": round(layer_bytes / device.bandwidth / layer_s, 3),
            "layer_instr_per_byte": round((p["warp_instructions"] + m["warp_instructions"]) / layer_bytes, 4)}


def measure(archs=(90, 80), gqas=GQA) -> dict:
    out = {"model": {"latencies_s": list(LATENCIES_S), "repeats": REPEATS, "tail_tokens": TAIL,
                     "cycles": {k: v for k, v in asdict(Latencies(dram=0)).items() if k != "dram"},
                     "tables": TABLES, "l2": L2_PARAMS},
           "devices": {name: {**asdict(d), "issue_rate": d.issue_rate, "budget_instr_per_byte":
                              round(d.issue_rate / d.bandwidth, 3)} for name, d in DEVICES.items()},
           "kernels": {}, "scenarios": {}, "spark_over_dense_32k": {}, "check": {}}
    for gqa in gqas:
        from spark_bench.storage.triton_decode import launch_shape

        rpm, members = launch_shape(gqa)
        cases = scenarios(members)
        for arch in archs:
            device = DEVICES[TABLE_DEVICES[arch]]
            kernels: dict = {}

            def partials_for(items):
                mask = ins.kinds_of(items)
                if mask not in kernels:
                    kernels[mask] = Kernel(Launch("partials", 128, gqa, kinds=mask), arch)
                return kernels[mask]

            merge = Kernel(Launch("merge", 128, gqa), arch)
            rows, results = {}, {}
            for name, case in cases.items():
                k = partials_for(case["items"])
                row = {"text": case["text"], "kinds": k.figures["kinds"], "registers": k.figures["registers"],
                       "spill_bytes": k.figures["spill_bytes"], "ctas_per_sm": k.figures["ctas_per_sm"]}
                for dram_s in LATENCIES_S:
                    r = model_scenario(k, merge, case, rpm, device, dram_s)
                    row[f"{dram_s * 1e6:g}us"] = r
                    results[(name, dram_s)] = r
                rows[name] = row
                print(f"sm_{arch} GQA {gqa} {name}: " + ", ".join(
                    f"{row[f'{x * 1e6:g}us']['partials']['fraction_of_bound']:.0%} at {x * 1e6:g} µs" for x in
                    LATENCIES_S), flush=True)
            tag = f"sm_{arch}"
            out["scenarios"].setdefault(tag, {})[f"gqa{gqa}"] = rows
            out["kernels"].setdefault(tag, {})[f"gqa{gqa}"] = {
                f"partials[{'+'.join(k.figures['kinds'])}]": _kernel_row(k) for k in kernels.values()} | {
                "merge": _kernel_row(merge)}
            out["spark_over_dense_32k"].setdefault(tag, {})[f"gqa{gqa}"] = {
                f"{x * 1e6:g}us": round(results[("spark_row_32k", x)]["layer_modelled_s"]
                                        / results[("dense_32k", x)]["layer_modelled_s"], 3) for x in LATENCIES_S}
            if gqa == 4:  # gpu-check's model is Llama-3-8B-shaped (GQA 4): its devices of this arch
                for dev_name, dev in DEVICES.items():
                    if dev.arch != arch:
                        continue
                    check = {}
                    for workload, (compressed, dense) in CHECK.items():
                        entry = {}
                        for side, name in (("compressed", compressed), ("dense", dense)):
                            rs = [model_scenario(partials_for(cases[name]["items"]), merge, cases[name], rpm, dev, x)
                                  for x in LATENCIES_S]
                            entry[side] = {"scenario": name, "layer_bytes": rs[0]["layer_bytes"],
                                           "fraction_of_bound": [r["layer_fraction_of_bound"] for r in rs],
                                           "modelled_us": [r["layer_modelled_us"] for r in rs],
                                           "grid_fraction_of_bound": [r["grid"]["fraction_of_bound"] for r in rs]}
                        check[workload] = entry
                    out["check"][dev_name] = {"arch": tag, "latencies_s": list(LATENCIES_S), "workloads": check}
    return out


def _kernel_row(k: Kernel) -> dict:
    f = k.figures
    return {"kinds": f["kinds"], "registers": f["registers"], "spill_bytes": f["spill_bytes"],
            "shared_bytes": f["shared_bytes"], "num_warps": f["num_warps"], "num_stages": f["num_stages"],
            "ctas_per_sm": f["ctas_per_sm"], "instructions": f["instructions"], "outside_loops": f["outside_loops"],
            "unmapped_param_slots": [hex(x) for x in k.unmapped]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench/latency_model.json"))
    parser.add_argument("--label", default="after", help="before | after: the key the figures are stored under")
    parser.add_argument("--archs", default="90,80")
    parser.add_argument("--gqa", default="4,8")
    args = parser.parse_args()
    result = measure(tuple(int(x) for x in args.archs.split(",")), tuple(int(x) for x in args.gqa.split(",")))
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    check = result.pop("check")
    old[args.label] = result
    old["check"] = {"label": args.label, "what": "the fused layer (partials + merge) of each scripts/gpu/check.py "
                    "workload as modelled: fraction of the HBM bound and microseconds at each DRAM latency of "
                    "latencies_s (grid_fraction_of_bound: with the SMs and CTAs the launch's programs fill)",
                    "devices": check}
    old["goals"] = GOALS
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(old, indent=1, default=_plain), encoding="utf-8")
    print(f"wrote {args.out}")


def _plain(x):
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    if isinstance(x, float) and math.isinf(x):
        return None
    raise TypeError(type(x))


if __name__ == "__main__":
    main()
