"""Dataflow over a kernel's SASS: which loads wait on which, and how long one warp takes through a loop body.

The waiting model behind ``scripts/bench/latency_model.py`` (docs/gpu.md, "How long a block waits"), kept apart so a
unit test can run it on a few hand-written instructions (``tests/test_sass_flow.py``).

**Instructions** (:func:`parse`): ``nvdisasm -c`` text of one instruction → its opcode, guard predicate, the
registers it writes and reads (register pairs and quads by the opcode's width: ``R4.64``, ``LDG.E.128``,
``HMMA.16816``'s 4-register accumulator), the registers of its memory address, the constant-bank slots it reads
(``c[0x0][0x220]``: a kernel parameter), and its kind (global/shared load or store, an asynchronous copy and its
waits, a barrier, MUFU, HMMA, SHFL, ALU …).

**Where a global load's data comes from** (:class:`Warp`): every register carries the kernel parameters its value
was computed from by address arithmetic (``prov``: constant-bank slots, followed through ALU instructions and
shuffles, and through shared memory — a layout conversion stores, syncs and loads: a shared load gets what the
latest store within 1 KB of its offset stored — but not through global loads: a loaded value starts afresh). A
load whose address reaches a *table* parameter (the launch's tables, the queries, the walk's per-step tables:
small, read by every block of a program) hits L1 (L2 on a program's first touch, ``first_touch``); ``l2_slots``:
parameters read from L2; any other load — an address loaded from a table (the stores are reached through the
64-bit addresses the tables hold), or a parameter that is not named — streams from DRAM: never optimistic by
omission. With ``null_off``, a load guarded by the 64-bit test that a value read straight from a table is not 0
(``ISETP.NE.U32.AND`` of its low half, ``.EX`` of its high half, and ``.AND`` combinations: AdaKV's validity bits,
whose address is 0 for rows without them) is not issued.

**Waiting** (:meth:`Warp.run`): one warp issues in program order, at most one instruction a cycle; an instruction
waits until the registers it reads (and those it overwrites that a load still has to write) are ready: fixed-latency
ALU results after ``alu`` cycles, shared loads, shuffles, MUFU and HMMA after theirs, global loads after L1, L2 or
DRAM latency by the class above. A barrier holds the warp ``bar`` cycles (the CTA's warps run the same code). An
asynchronous copy (``LDGSTS``) is waited for by ``DEPBAR.LE SB0, n``, which leaves at most ``n`` of the groups
(``LDGDEPBAR``) pending. Each stall is recorded with the load it waited on; the wait is *dependent* when that load's
data went (through address arithmetic, shuffles or shared memory) into a later load's address or predicate, a
*use* otherwise (loaded data consumed before the next array's load was issued). Running a loop body several times
in a row carries the registers' ready times across iterations, so loads issued one iteration ahead (software
pipelining, in registers or by ``LDGSTS``) are credited.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_REG = re.compile(r"^(?:U?R\d+|URZ|RZ|U?P[0-6T]|PR|SRZ|SR_\w+)$")
_CBANK = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
_GUARD = re.compile(r"^@!?(U?P[0-6T])\s+")
# instructions with no register result whose first operand is read (stores, branches, barriers, …)
_NO_DEST = ("ST", "STG", "STS", "STL", "STSM", "RED", "BRA", "BAR", "EXIT", "RET", "CALL", "DEPBAR", "LDGDEPBAR",
            "WARPSYNC", "BSYNC", "BSSY", "YIELD", "MEMBAR", "ERRBAR", "CCTL", "NOP", "JMP", "BRX", "ATOMS", "LDGSTS",
            "UTMALDG", "UTMASTG", "SYNCS", "ARRIVES", "WARPGROUP", "FENCE", "BPT", "KILL")
UNMODELLED = ("UTMALDG", "UTMASTG", "SYNCS", "HGMMA", "WARPGROUP", "ARRIVES", "LDL", "STL")


@dataclass(frozen=True)
class Op:
    """One SASS instruction, as the dataflow needs it."""

    text: str
    opcode: str                 # e.g. LDG.E.128
    base: str                   # e.g. LDG
    guard: str | None           # the predicate register of @P0 / @!P0
    guard_negated: bool         # @!P0
    dests: tuple[str, ...]
    srcs: tuple[str, ...]       # every register read (address, data, guard)
    addr: tuple[str, ...]       # the registers of a memory operand
    cbank: tuple[int, ...]      # constant-bank offsets read
    width: int                  # bytes per thread of a load or store
    kind: str                   # global_load, shared_load, global_store, shared_store, async_copy, async_commit,
    #                             async_wait, barrier, branch, mufu, mma, shfl, s2r, ldc, alu, other
    operands: tuple[str, ...] = ()
    offset: int = 0             # the immediate offset of a memory operand ([R4+0x2000] → 0x2000)


def _width(opcode: str) -> int:
    for key, size in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if key in opcode:
            return size
    return 4


def _expand(reg: str, n: int) -> list[str]:
    """``R4`` and a width of ``n`` registers → R4 … R(4+n−1); RZ/PT-like registers are not tracked."""
    if reg in ("RZ", "URZ", "PT", "UPT", "SRZ") or reg.startswith("SR_"):
        return []
    m = re.match(r"^(U?R)(\d+)$", reg)
    if not m:
        return [reg]
    return [f"{m.group(1)}{int(m.group(2)) + k}" for k in range(n)]


def _regs(operand: str) -> list[tuple[str, int]]:
    """The registers named in one operand with their widths: ``R4.64`` → (R4, 2); modifiers (``!``, ``-``, ``|x|``,
    ``.reuse``, ``.H0_H0``) dropped; memory operands' registers included."""
    out = []
    for token in re.findall(r"[!\-~|]*\b(U?R\d+|URZ|RZ|U?P[0-6T]|PR|SRZ|SR_\w+)((?:\.\w+)*)", operand):
        reg, mods = token
        out.append((reg, 2 if ".64" in mods else 1))
    return out


def parse(text: str) -> Op:
    """One ``nvdisasm -c`` instruction (its text without the address comment and trailing ``;``)."""
    text = text.strip().rstrip(" ;")
    guard, negated = None, False
    g = _GUARD.match(text)
    body = text
    if g:
        guard = g.group(1) if g.group(1) not in ("PT", "UPT") else None
        negated = text.startswith("@!")
        body = text[g.end():]
    opcode, _, rest = body.partition(" ")
    base = opcode.split(".")[0]
    operands = [x.strip() for x in rest.split(",")] if rest.strip() else []
    cbank = tuple(int(x, 16) for x in _CBANK.findall(rest))
    width = _width(opcode)
    dests: list[str] = []
    srcs: list[str] = [guard] if guard else []
    addr: list[str] = []
    memory = [i for i, x in enumerate(operands) if "[" in x and not x.startswith("c[")]
    for i in (memory[-1:] if base == "LDGSTS" else memory):  # (an async copy's global source, not its shared target)
        for reg, n in _regs(operands[i]):
            addr += _expand(reg, n)
    if base in ("LDG", "LD", "LDS", "LDSM", "LDC", "ULDC", "LDL", "LDGSTS", "ATOMS", "ATOMG", "ATOM"):
        kind = {"LDG": "global_load", "LD": "global_load", "LDS": "shared_load", "LDSM": "shared_load",
                "LDC": "ldc", "ULDC": "ldc", "LDL": "global_load", "LDGSTS": "async_copy"}.get(base, "global_load")
        if base == "LDSM":
            n = 4 if opcode.endswith(".4") else 2 if opcode.endswith(".2") else 1
        else:
            n = max(1, width // 4)
        if base != "LDGSTS" and operands:
            dests += _expand(_regs(operands[0])[0][0], n) if _regs(operands[0]) else []
        srcs += [r for i in memory for reg, n in _regs(operands[i]) for r in _expand(reg, n)]
    elif base in _NO_DEST:
        kind = {"STG": "global_store", "ST": "global_store", "STS": "shared_store", "STSM": "shared_store",
                "BRA": "branch", "BAR": "barrier", "LDGDEPBAR": "async_commit", "DEPBAR": "async_wait",
                "EXIT": "branch", "RED": "global_store"}.get(base, "other")
        if base == "CCTL" and ".PF" in opcode:  # prefetch.global.L1/L2: a line requested, nothing returned
            kind = "prefetch"
        data_n = max(1, width // 4)
        if base == "STSM":
            data_n = 4 if opcode.endswith(".4") else 2 if opcode.endswith(".2") else 1
        for i, operand in enumerate(operands):
            for reg, n in _regs(operand):
                srcs += _expand(reg, n if i in memory else (data_n if kind.endswith("store") else n))
    else:
        kind = {"MUFU": "mufu", "HMMA": "mma", "IMMA": "mma", "SHFL": "shfl", "S2R": "s2r", "S2UR": "s2r",
                "HGMMA": "mma"}.get(base, "alu")
        n_dest = 1
        if base in ("HMMA", "IMMA"):
            n_dest = 4 if ".F32" in opcode else 2
        elif (base in ("IMAD", "UIMAD") and ".WIDE" in opcode) or (base == "CS2R" and ".32" not in opcode) \
                or base in ("DADD", "DMUL", "DFMA", "MOV64", "IADD64"):
            n_dest = 2
        n_lead = 2 if base in ("SHFL", "PLOP3") or base.endswith("SETP") or base.endswith("SETP2") else 1
        lead = operands[:n_lead]
        if n_lead == 1:  # a register result and the carry/predicate outputs right after it (IADD3 R8, P1, …)
            for x in operands[1:]:
                if re.fullmatch(r"U?P[0-6T]", x):
                    lead.append(x)
                else:
                    break
        for x in lead:
            for reg, n in _regs(x):
                dests += _expand(reg, n_dest if re.match(r"U?R", reg) else 1)
        sources = operands[len(lead):]
        for i, operand in enumerate(sources):
            for reg, n in _regs(operand):
                if base in ("HMMA", "IMMA"):  # A, B, C: 4, 2, 4 registers (m16n8k16 f32)
                    n = (4, 2, n_dest, 1)[min(i, 3)] if ".16816" in opcode else (2, 1, n_dest, 1)[min(i, 3)]
                elif base in ("IMAD", "UIMAD") and ".WIDE" in opcode and i == 2:
                    n = 2
                if reg == "PR":
                    srcs += [f"P{k}" for k in range(7)]
                else:
                    srcs += _expand(reg, n)
        if base == "R2P":
            dests = [f"P{k}" for k in range(7)]
    offset = 0
    if memory:
        m = re.search(r"([+-])\s*(0x[0-9a-f]+)\]\s*$", operands[memory[-1]])
        offset = int(m.group(2), 16) * (-1 if m.group(1) == "-" else 1) if m else 0
    return Op(text, opcode, base, guard, negated, tuple(dict.fromkeys(dests)), tuple(dict.fromkeys(srcs)),
              tuple(dict.fromkeys(addr)), cbank, width, kind, tuple(operands), offset)


@dataclass(frozen=True)
class Latencies:
    """Cycles from issue until a result can be used (one warp), by kind; ``dram`` for a load streaming from DRAM
    (the caller converts its latency in seconds at the SM clock)."""

    dram: float
    alu: float = 4            # fixed-latency pipes (FMA, INT, logic, conversions): dependent issue
    mufu: float = 18
    mma: float = 32           # HMMA.16816 (mma.sync) accumulator
    shfl: float = 24
    shared: float = 30        # LDS / LDSM
    l1: float = 40            # a table re-read by every block: an L1 hit
    l2: float = 260           # a table's first touch by a program (the prologue): an L2 hit
    s2r: float = 20
    ldc: float = 20
    bar: float = 20           # a barrier the CTA's warps reach together


@dataclass
class Wait:
    """One stall of the warp: ``cycles`` spent waiting at instruction ``at`` (trace position ``pos``) for a value
    a ``source`` (kind: dram, table, l2, shared, …) instruction ``on`` produces; ``dependent``: that value (a
    load's data) goes, through address arithmetic, into a later load's address or predicate."""

    pos: int
    at: str
    on: str
    source: str
    cycles: float
    dependent: bool
    on_id: int = -1


@dataclass
class Run:
    """What one pass over a trace did: its first and last issue cycles, the stalls, and the global loads issued
    (``(trace position, class, bytes per warp)``)."""

    start: float
    end: float
    waits: list = field(default_factory=list)
    loads: list = field(default_factory=list)
    unmodelled: set = field(default_factory=set)


class Warp:
    """One warp's in-order issue over SASS instructions (see the module docstring): register ready times, the
    producing kind of every pending result, each register's parameter provenance."""

    def __init__(self, lat: Latencies, table_slots: set[int], l2_slots: set[int] = frozenset(),
                 first_touch: bool = False, null_off: bool = False, position_slots: set[int] = frozenset()):
        self.lat, self.table, self.l2slots = lat, set(table_slots), set(l2_slots)
        # table parameters whose entries say where a block is (a work item's chunk bounds), not where an array is
        self.position = set(position_slots)
        self.first_touch = first_touch   # tables at L2 latency (a program's prologue), else L1
        self.null_off = null_off         # loads guarded by "a pointer read from a table is not null" do not issue
        self.tabled: set[str] = set()    # registers holding a value read straight from a table
        self.half: set[str] = set()      # predicates: the low half of such a value is not 0
        self.nonnull: set[str] = set()   # predicates implying such a 64-bit value is not 0
        self.ready: dict[str, float] = {}
        self.source: dict[str, tuple] = {}  # register → (kind or load class, producing instruction, variable?)
        self.prov: dict[str, frozenset] = {}
        self.t = 0.0
        self.hold = 0.0          # a barrier: nothing issues before this cycle
        self.feeds: dict[str, frozenset] = {}  # register → the loads (ids) whose data it was computed from
        self.addressed: set[int] = set()        # loads whose data went into a later load's address or predicate
        self.issued = 0                         # load ids
        self.cells: dict[int, tuple] = {}       # shared memory: immediate offset → (provenance, feeds, cycle) stored
        self.texts: dict[int, str] = {}         # load id → its instruction
        self.prefetched: dict[frozenset, float] = {}  # a prefetch's address roots → when it was issued
        self.classes: dict[str, str] = {}  # a load's instruction → its class (table, l2, dram, prefetched)
        self.groups: list = []   # committed LDGSTS groups: (completion cycle, class, instruction), oldest first
        self.open: list = []     # LDGSTS issued since the last commit

    def load_class(self, op: Op) -> str:
        """``dram``, ``l2`` or ``table`` (L1, or L2 on a program's first touch) for a global load or async copy."""
        slots = frozenset().union(*(self.prov.get(r, frozenset()) for r in op.addr)) | set(op.cbank)
        if slots & self.table:
            return "table"
        if slots & self.l2slots:
            return "l2"
        return "dram"

    def roots(self, op: Op) -> frozenset:
        """The loads (by instruction) whose data ``op``'s address was computed from: the table entries holding an
        array's address, its row offset, its stride — the same for a load and the prefetch of the same array's
        next block, whichever block issued them."""
        ids = frozenset().union(*(self.feeds.get(r, frozenset()) for r in op.addr))
        return frozenset(self.texts[i] for i in ids if i in self.texts)

    def latency(self, op: Op, cls: str | None) -> float:
        lat = self.lat
        if cls is not None:
            return {"dram": lat.dram, "l2": lat.l2, "table": lat.l2 if self.first_touch else lat.l1}[cls]
        return {"shared_load": lat.shared, "mufu": lat.mufu, "mma": lat.mma, "shfl": lat.shfl, "s2r": lat.s2r,
                "ldc": lat.ldc}.get(op.kind, lat.alu)

    def _predicates(self, op: Op) -> None:
        """Track predicates that imply a pointer read from a table is not null: ``ISETP.NE.U32.AND P, PT, lo, RZ``
        then ``ISETP.NE.U32.AND.EX P', PT, hi, RZ, …, P`` (the 64-bit test), and ``.AND`` combinations of them."""
        preds = [d for d in op.dests if re.fullmatch(r"U?P[0-6]", d)]
        if not preds:
            return
        half = full = False
        if op.base == "ISETP" and ".AND" in op.opcode:
            compared = [x.split(".")[0] for x in op.operands[2:4]]
            trailing = [x for x in op.operands[4:] if re.fullmatch(r"U?P[0-6]", x)]  # (non-negated only)
            tests = ".NE" in op.opcode and "RZ" in compared and any(x in self.tabled for x in compared)
            if ".EX" in op.opcode:
                full = tests and any(x in self.half for x in trailing)
            else:
                half = tests
            full = full or any(x in self.nonnull for x in trailing)
        for d in preds:
            for flag, group in ((half, self.half), (full, self.nonnull)):
                (group.add if flag else group.discard)(d)

    def run(self, ops: list[Op]) -> Run:
        """Issue ``ops`` (a trace: instructions in execution order) after what ran before; returns the pass."""
        out = Run(self.t, self.t)
        for pos, op in enumerate(ops):
            if op.base in UNMODELLED:
                out.unmodelled.add(op.base)
            earliest = max(self.t + 1, self.hold)
            if (self.null_off and op.kind == "global_load" and op.guard in self.nonnull
                    and not op.guard_negated):  # not issued: it waits for its predicate only
                self.t = max(earliest, self.ready.get(op.guard, 0.0))
                continue
            need, on = earliest, None
            # what it reads, and what it overwrites that a variable-latency instruction still has to write
            for r in op.srcs + tuple(d for d in op.dests if self.source.get(d, ("", "", False, -1))[2]):
                if self.ready.get(r, 0.0) > need:
                    need, on = self.ready[r], self.source[r][:2] + (self.source[r][3],)
            if op.kind == "async_wait":  # DEPBAR.LE SB0, n: all but the newest n committed groups complete
                m = re.search(r"SB\d+,\s*(0x[0-9a-f]+|\d+)", op.text)
                keep = int(m.group(1), 0) if m else 0
                done, self.groups = self.groups[:max(0, len(self.groups) - keep)], self.groups[
                    max(0, len(self.groups) - keep):]
                for ready, cls, text in done:
                    if ready > need:
                        need, on = ready, (cls, text, -1)
            if on is not None and need > earliest:
                out.waits.append(Wait(pos, op.text, on[1], on[0], need - earliest, False, on[2]))
            if op.kind in ("global_load", "async_copy"):  # its address or predicate computed from loaded data
                self.addressed |= frozenset().union(*(self.feeds.get(r, frozenset())
                                                      for r in op.addr + ((op.guard,) if op.guard else ())))
            issue = need
            cls = self.load_class(op) if op.kind in ("global_load", "async_copy") else None
            lat = self.latency(op, cls)
            if op.kind == "prefetch":
                roots = self.roots(op)
                if roots:
                    self.prefetched[roots] = issue
            elif cls == "dram" and self.prefetched:
                # lines an earlier prefetch of the same array requested (e.g. the block before, for this one): in
                # L2 once the DRAM latency has passed since, else after what is left of it. The same array: its
                # address from the same table entries — and, for a gather inside the block's rows (a kept entry
                # by its rank, a sign word by the kept channels before it), also from this block's loaded data:
                # the prefetch asked for every line of the next block's rows (the latest such prefetch)
                roots = self.roots(op)
                asked = self.prefetched.get(roots)
                if asked is None:  # (the other roots: the stores' data or a position entry, no array's address)
                    within = [t for r, t in self.prefetched.items()
                              if r < roots and all(self.classes.get(x, "table") != "table" for x in roots - r)]
                    asked = max(within) if within else None
                if asked is not None:
                    lat = max(self.lat.l2, self.lat.dram - (issue - asked))
                    cls = "prefetched"
            if op.kind == "barrier":
                self.hold = issue + self.lat.bar
            elif op.kind == "async_copy":
                self.open.append((issue + lat, cls, op.text))
                out.loads.append((pos, cls, op.width * 32))
            elif op.kind == "async_commit":
                if self.open:
                    self.groups.append(max(self.open))
                self.open = []
            elif op.kind == "global_load":
                out.loads.append((pos, cls, op.width * 32))
                tables = (frozenset().union(*(self.prov.get(r, frozenset()) for r in op.addr)) | set(op.cbank)) \
                    & self.table  # (a table entry of a position table only: "position")
                self.classes[op.text] = "position" if cls == "table" and tables <= self.position else cls
            # provenance: ALU results carry their sources' parameters; global loads start afresh (LDC: its slot);
            # shared memory passes on what the latest store within 1 KB of the load's immediate offset stored (a
            # layout conversion: STS, BAR, LDS into the same scratch)
            data = [r for r in op.srcs if r not in op.addr and r != op.guard]
            if op.kind == "shared_store":
                self.cells[op.offset] = (frozenset().union(*(self.prov.get(r, frozenset()) for r in data)),
                                         frozenset().union(*(self.feeds.get(r, frozenset()) for r in data)), issue)
            cell = (frozenset(), frozenset(), 0)
            if op.kind == "shared_load":
                near = [c for o, c in self.cells.items() if abs(o - op.offset) <= 0x400]
                cell = max(near, key=lambda c: c[2]) if near else cell
            if op.kind == "global_load":
                new = frozenset()
            elif op.kind == "shared_load":
                new = cell[0]
            elif op.kind == "ldc":
                new = frozenset(op.cbank)
            else:
                new = frozenset().union(*(self.prov.get(r, frozenset()) for r in op.srcs)) | set(op.cbank)
            variable = cls is not None or op.kind in ("shared_load", "mufu", "mma", "shfl", "s2r", "ldc")
            self._predicates(op)
            if op.kind == "global_load":
                self.issued += 1
                feeds = frozenset({self.issued})
                self.texts[self.issued] = op.text
            elif op.kind == "shared_load":
                feeds = cell[1]
            else:
                feeds = frozenset().union(*(self.feeds.get(r, frozenset()) for r in op.srcs))
                if len(feeds) > 32:  # (accumulators: only recent loads can still be waited for)
                    feeds = frozenset(sorted(feeds)[-32:])
            for d in op.dests:
                self.feeds[d] = (feeds | self.feeds.get(d, frozenset())) if op.guard else feeds
                if cls == "table":
                    self.tabled.add(d)
                else:
                    self.tabled.discard(d)
                self.prov[d] = (new | self.prov.get(d, frozenset())) if op.guard else new
                self.ready[d] = issue + lat
                self.source[d] = (cls or op.kind, op.text, variable, self.issued if cls is not None else -1)
            self.t = issue
        for w in out.waits:
            w.dependent = w.on_id in self.addressed
        out.end = self.t
        return out
