"""The waiting model behind ``scripts/bench/latency_model.py`` (``scripts/bench/sass_flow.py``), checked on a few
hand-written SASS instructions: which registers an instruction reads and writes, where a load's address comes from
(a table parameter: L1; a pointer read from a table: DRAM), a dependent chain against independent loads, data used
before the next load is issued, loads issued a block ahead (in registers, or by ``LDGSTS`` and ``DEPBAR``), and a
load guarded by a null test of a table's pointer."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("sass_flow", ROOT / "scripts" / "bench" / "sass_flow.py")
flow = importlib.util.module_from_spec(spec)
sys.modules["sass_flow"] = flow  # (its dataclasses look their module up)
spec.loader.exec_module(flow)

DRAM = 1000
LAT = flow.Latencies(dram=DRAM)
TABLE, STREAM = 0x210, 0x218   # a table parameter and a stream parameter (constant-bank slots)
PROLOGUE = ["LDC.64 R2, c[0x0][0x210]", "LDC.64 R4, c[0x0][0x218]", "ULDC.64 UR4, c[0x0][0x208]"]


def run(body, repeats=1, **kwargs):
    """``PROLOGUE`` then ``body`` ``repeats`` times; the last pass and the cycles a pass takes (with repeats: on
    average over all but the first two, as latency_model.py takes a block's)."""
    warp = flow.Warp(LAT, {TABLE, TABLE + 4}, **kwargs)
    warp.run([flow.parse(x) for x in PROLOGUE])
    warp.t = max(warp.ready.values())  # (the parameters in registers before the body starts)
    ops = [flow.parse(x) for x in body]
    runs = [warp.run(ops) for _ in range(repeats)]
    if repeats == 1:
        return runs[-1], runs[-1].end - runs[-1].start
    run.passes = runs
    return runs[-1], (runs[-1].end - runs[1].end) / (repeats - 2)


def dram_waits(r):
    return [w for w in r.waits if w.source == "dram"]


def test_registers_read_and_written():
    op = flow.parse("@!P4 LDG.E.128 R52, desc[UR8][R18.64+0x10] ;")
    assert op.kind == "global_load" and op.width == 16 and op.guard == "P4" and op.guard_negated
    assert op.dests == ("R52", "R53", "R54", "R55") and op.addr == ("UR8", "R18", "R19")
    assert set(op.srcs) == {"P4", "UR8", "R18", "R19"}
    hmma = flow.parse("HMMA.16816.F32.BF16 R64, R108.reuse, R88, R64")
    assert hmma.kind == "mma" and hmma.dests == ("R64", "R65", "R66", "R67")
    assert set(hmma.srcs) == {f"R{i}" for i in (108, 109, 110, 111, 88, 89, 64, 65, 66, 67)}
    assert flow.parse("IADD3 R8, P1, R6, R9, RZ").dests == ("R8", "P1")
    assert flow.parse("IADD3.X R26, R115, RZ, R28, P3, P2").dests == ("R26",)
    assert flow.parse("SHFL.BFLY PT, R17, R30, 0x8, 0x1f").dests == ("R17",)
    assert flow.parse("ISETP.GE.AND.EX P2, PT, R115, R26, PT, P2").dests == ("P2",)
    sts = flow.parse("STS.128 [R39+UR6+0x800], R56")
    assert sts.kind == "shared_store" and not sts.dests and {"R56", "R59", "R39"} <= set(sts.srcs)
    copy = flow.parse("LDGSTS.E.BYPASS.128 [R3+0x100], desc[UR4][R4.64]")
    assert copy.kind == "async_copy" and copy.addr == ("UR4", "R4", "R5")
    assert flow.parse("IMAD.WIDE R4, R3, 0x8, c[0x0][0x220]").cbank == (0x220,)


def test_a_dependent_chain_is_two_round_trips_independent_loads_one():
    # a table row (L1) holds a pointer; the store it points to is read at it (DRAM), then a second array at an
    # address computed from the first array's data: each load waits for the one before
    chain = ["LDG.E.64 R6, desc[UR4][R2.64]",          # the table's pointer: L1
             "LDG.E R8, desc[UR4][R6.64]",             # waits on it (a dependent L1 trip), reads DRAM
             "IMAD.WIDE R10, R8, 0x4, R4",             # an address from the data
             "LDG.E R12, desc[UR4][R10.64]",           # waits on R8: a dependent DRAM round trip
             "FADD R13, R12, R12"]
    r, cycles = run(chain)
    waits = dram_waits(r)
    assert [(w.dependent, w.on.split()[0]) for w in waits] == [(True, "LDG.E"), (False, "LDG.E")]
    assert [w.cycles for w in r.waits if w.source == "table"] == [pytest.approx(LAT.l1 - 1)]
    assert 2 * DRAM <= cycles <= 2 * DRAM + LAT.l1 + LAT.alu + 4
    assert [cls for _, cls, _ in r.loads] == ["table", "dram", "dram"]
    # the same two arrays at independent addresses, both issued before either is used: one round trip
    independent = ["LDG.E R8, desc[UR4][R4.64]", "LDG.E R12, desc[UR4][R4.64+0x1000]", "FADD R13, R8, R12"]
    r, cycles = run(independent)
    assert len(dram_waits(r)) == 1 and DRAM <= cycles <= DRAM + 10


def test_data_used_before_the_next_load_issues_costs_a_round_trip():
    used_first = ["LDG.E R8, desc[UR4][R4.64]", "STS [R0], R8", "LDG.E R12, desc[UR4][R4.64+0x1000]",
                  "FADD R13, R12, R12"]
    r, cycles = run(used_first)
    assert [(w.dependent, w.at.split()[0]) for w in dram_waits(r)] == [(False, "STS"), (False, "FADD")]
    assert cycles >= 2 * DRAM
    hoisted = ["LDG.E R8, desc[UR4][R4.64]", "LDG.E R12, desc[UR4][R4.64+0x1000]", "STS [R0], R8",
               "FADD R13, R12, R12"]
    r, cycles = run(hoisted)
    assert len(dram_waits(r)) == 1 and cycles < 1.1 * DRAM


def test_loads_issued_a_block_ahead_hide_the_latency():
    """Two arrays per block: loaded and used in the same block (two round trips a block, then the block's work), or
    the next block's loads issued before this block's work (registers: one latency a block, the work hidden in it),
    or copied a block ahead (``LDGSTS``, one group a block; ``DEPBAR.LE SB0, 0x1`` waits for all but the newest):
    two blocks in flight, half a latency a block."""
    work = [f"FFMA R{20 + i % 4}, R{20 + i % 4}, R{20 + i % 4}, R{20 + i % 4}" for i in range(200)]
    step = ["IADD3 R4, P0, R4, 0x80, RZ", "IADD3.X R5, RZ, R5, RZ, P0, !PT"]
    serial = ["LDG.E R8, desc[UR4][R4.64]", "FADD R13, R8, R8", "LDG.E R12, desc[UR4][R4.64+0x1000]",
              "FADD R14, R12, R13", *work, *step]
    r, serial_cycles = run(serial, repeats=6)
    assert len(dram_waits(r)) == 2 and 2 * DRAM + 200 <= serial_cycles <= 2 * DRAM + 250
    ahead = ["FADD R13, R8, R8", "FADD R14, R12, R13", *step, "LDG.E R8, desc[UR4][R4.64]",
             "LDG.E R12, desc[UR4][R4.64+0x1000]", *work]
    r, ahead_cycles = run(ahead, repeats=6)
    assert DRAM <= ahead_cycles <= DRAM + 20
    assert len(dram_waits(r)) == 1 and dram_waits(r)[0].cycles <= DRAM - 190  # (the work hidden)
    staged = ["DEPBAR.LE SB0, 0x1", "BAR.SYNC.DEFER_BLOCKING 0x0", "LDS R8, [R0]",
              "LDGSTS.E.BYPASS.128 [R0+0x100], desc[UR4][R4.64]", "LDGDEPBAR", *step, "FADD R13, R8, R8", *work]
    r, staged_cycles = run(staged, repeats=6)
    assert DRAM / 2 <= staged_cycles <= DRAM / 2 + LAT.bar
    waits = [w for p in run.passes[-2:] for w in dram_waits(p)]  # (two blocks in flight: waits alternate)
    assert waits and all(w.at.startswith("DEPBAR") for w in waits)
    assert sum(w.cycles for w in waits) <= 2 * (DRAM / 2 - 200 + LAT.bar)


def test_a_load_guarded_by_a_null_test_of_a_table_pointer():
    """AdaKV's validity bits: a row without them carries a null address, and the load that reads them is guarded by
    the 64-bit test that the address read from the table is not 0; for work items without such rows it is not
    issued (``null_off``), otherwise it is a round trip like any other."""
    body = ["LDG.E.64 R6, desc[UR4][R2.64+0x18]", "IMAD.MOV.U32 R9, RZ, RZ, 0xff",
            "ISETP.NE.U32.AND P3, PT, R6, RZ, PT", "ISETP.NE.U32.AND.EX P2, PT, R7, RZ, PT, P3",
            "@P2 LDG.E.U8 R9, desc[UR4][R6.64]", "LOP3.LUT R9, R9, 0xff, RZ, 0xc0, !PT"]
    with_bits, cycles_on = run(body)
    assert len(dram_waits(with_bits)) == 1 and cycles_on >= DRAM
    without, cycles_off = run(body, null_off=True)
    assert not dram_waits(without) and cycles_off < LAT.l1 + 20
    # a guard that is not such a test (a count read from the table, 32-bit) is never skipped
    count = ["LDG.E R6, desc[UR4][R2.64+0x8]", "ISETP.NE.AND P2, PT, R6, RZ, PT",
             "@P2 LDG.E.U8 R9, desc[UR4][R4.64]", "LOP3.LUT R9, R9, 0xff, RZ, 0xc0, !PT"]
    r, _ = run(count, null_off=True)
    assert len(dram_waits(r)) == 1


def test_an_address_keeps_where_it_came_from_through_shared_memory_and_shuffles():
    """A layout conversion (STS, BAR, LDS at the same offset) or a shuffle moves a pointer between lanes: a table's
    address stays a table's (L1), an address read from a table stays a store's (DRAM)."""
    table = ["IADD3 R10, P0, R2, 0x40, RZ", "IADD3.X R11, RZ, R3, RZ, P0, !PT", "STS.64 [R0+0x2000], R10",
             "BAR.SYNC.DEFER_BLOCKING 0x0", "LDS.64 R12, [R1+0x2000]", "LDG.E R14, desc[UR4][R12.64]",
             "SHFL.IDX PT, R16, R10, R0, 0x1f", "SHFL.IDX PT, R17, R11, R0, 0x1f", "LDG.E R18, desc[UR4][R16.64]"]
    r, _ = run(table)
    assert [cls for _, cls, _ in r.loads] == ["table", "table"]
    stored = ["LDG.E.64 R10, desc[UR4][R2.64]", "STS.64 [R0+0x2000], R10", "BAR.SYNC.DEFER_BLOCKING 0x0",
              "LDS.64 R12, [R1+0x2000]", "LDG.E R14, desc[UR4][R12.64]", "FADD R15, R14, R14"]
    r, _ = run(stored)
    assert [cls for _, cls, _ in r.loads] == ["table", "dram"]
    # the table load's data went, through shared memory, into the DRAM load's address: a dependent wait
    assert [(w.source, w.dependent) for w in r.waits if w.source == "table"] == [("table", True)]


def test_a_prefetch_of_the_next_block_leaves_the_l2_latency_or_what_is_left():
    """``prefetch.global.L2`` (``CCTL.E.PF2``) of the next block's lines of an array: that array's load in the next
    block — its address computed from the same table entries — waits for what is left of the DRAM latency since the
    prefetch issued, at least the L2's; a prefetch of another array (another table entry) credits nothing."""
    assert flow.parse("@P5 CCTL.E.PF2 [R90]").kind == "prefetch"
    work = [f"FFMA R{30 + i % 4}, R{30 + i % 4}, R{30 + i % 4}, R{30 + i % 4}" for i in range(200)]

    def block(prefetch_from):
        return ["LDG.E.64 R6, desc[UR4][R2.64]", "LDG.E.64 R16, desc[UR4][R2.64+0x8]",  # (two arrays' addresses)
                "IMAD.WIDE.U32 R8, R20, 0x80, R6", "LDG.E R10, desc[UR4][R8.64]",
                f"IMAD.WIDE.U32 R12, R20, 0x80, {prefetch_from}", "IADD3 R12, P0, R12, 0x80, RZ",
                *(["CCTL.E.PF2 [R12]"] if prefetch_from else []), "FADD R14, R10, R10", *work,
                "IADD3 R20, R20, 0x1, RZ"]

    plain, plain_cycles = run(block(""), repeats=6)
    ahead, ahead_cycles = run(block("R6"), repeats=6)
    passes = run.passes
    other, other_cycles = run(block("R16"), repeats=6)
    assert [w.source for w in plain.waits if w.cycles > 100] == ["dram"]
    assert DRAM + 200 <= plain_cycles <= DRAM + 260 and other_cycles == plain_cycles
    waits = [w for p in passes[-2:] for w in p.waits if w.cycles > 100]
    assert [w.source for w in waits] == ["prefetched", "prefetched"]
    # each wait is what the block before left of the latency (blocks alternate short and long: a short block leaves
    # more for the next), on average DRAM − a block; never less than the L2's
    mean = sum(w.cycles for w in waits) / 2
    assert abs(mean - (DRAM - ahead_cycles)) <= 20 and min(w.cycles for w in waits) >= LAT.l2 - 20
    assert ahead_cycles < 0.65 * plain_cycles


def test_a_gather_inside_the_prefetched_rows_is_credited_but_not_another_arrays_load():
    """A load whose address is the prefetched array's (the same table entries) plus an offset computed from this
    block's loaded data (a kept entry by its rank, a sign word by the kept channels before it:
    ``storage/triton_tiles.py``) — and from a *position* entry (a work item's chunk bounds: where the block is, not
    where an array is) — reads lines the prefetch asked for: credited as prefetched. A load whose address also takes
    another table entry (another array's base) is not, whatever data it adds."""
    POS = 0x220  # (a table parameter whose entries are positions: the partials kernel's work items)
    work = [f"FFMA R{30 + i % 4}, R{30 + i % 4}, R{30 + i % 4}, R{30 + i % 4}" for i in range(200)]

    def waits(gather_base, extra):
        warp = flow.Warp(LAT, {TABLE, TABLE + 4, POS, POS + 4}, position_slots={POS, POS + 4})
        warp.run([flow.parse(x) for x in PROLOGUE + ["LDC.64 R24, c[0x0][0x220]"]])
        warp.t = max(warp.ready.values())
        body = ["LDG.E.64 R6, desc[UR4][R2.64]", "LDG.E.64 R16, desc[UR4][R2.64+0x8]",  # (two arrays' addresses)
                "LDG.E R26, desc[UR4][R24.64]", "LDG.E R27, desc[UR4][R2.64+0x10]",  # (a position, a table scalar)
                "IMAD.WIDE.U32 R8, R20, 0x80, R6", "LDG.E R10, desc[UR4][R8.64]",  # a mask word
                "IMAD.WIDE.U32 R12, R20, 0x80, R6", "IADD3 R12, P0, R12, 0x80, RZ", "CCTL.E.PF2 [R12]",
                "POPC R11, R10", f"IMAD.WIDE.U32 R14, R20, 0x80, {gather_base}",  # its rank: an offset from data
                *([f"IMAD.WIDE R14, {extra}, 0x4, R14"] if extra else []),
                "IMAD.WIDE R14, R11, 0x2, R14", "LDG.E.U16 R18, desc[UR4][R14.64]", "FADD R19, R18, R18", *work,
                "IADD3 R20, R20, 0x1, RZ"]
        passes = [warp.run([flow.parse(x) for x in body]) for _ in range(6)]
        return [w.source for p in passes[-2:] for w in p.waits if w.cycles > 100 and "U16" in w.on]

    assert waits("R6", None) == waits("R6", "R26") == ["prefetched", "prefetched"]  # (data; data and a position)
    assert waits("R16", None) == waits("R6", "R27") == ["dram", "dram"]  # (another array's base; a table scalar)
