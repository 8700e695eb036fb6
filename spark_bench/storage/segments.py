"""Many compact key stores read by one kernel call: the *segment table* behind batched compact attention.

A decode batch holds one compressed cache per method config. To make a step's cost independent of how many rows it
has, the compact key stores of every row of a layer (SparK fixed-T stores in the recoveries that fold into per-token
work, ThinK's structured stores) are described once, when the batch is formed, by a table with one *segment* per
(row, kv-head, layout): which query head reads it, where its tokens land in the
output, how many channels each token keeps, where its kept entries, mask bits, recovery statistic and sign bits
start (in the rows' own tensors), and its mode. Nothing is copied or padded; only the C++ path's ``(R, H, G, S_max)``
output is padded (the caller masks the padding).

Modes (the kernel header ``engine/kernels/spark_logits.cpp`` has the formulas): 0 constant fill (``zero``, ``none``,
``constant``; ThinK's pruned channels read as 0), 1 paper degenerate (``saliency=paper``), 2 official degenerate
(signs + ``sqrt(μ/‖q‖)``), 3 dense (every channel kept: ThinK's recent tokens, Mustafar's window).

A store in two parts gives a head two segments, the second landing after the first's tokens: ThinK's structured
store (its kept channels, then its dense recent tokens) and :class:`~.windowed.WindowedStore` (Mustafar's pruned
tokens, an unstructured zero-fill store, then its dense window).

Two kernels read these layouts (:mod:`.dispatch` picks by device): the C++ kernels on CPU tensors read the stacks'
*parts* (the rows' own tensors) through part indices and offsets; the fused Triton decode on CUDA tensors reads the
same parts through 64-bit addresses (:class:`FusedTables`). Neither copies the rows' compressed data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from spark_bench.storage.bits import pack_bits, tensor_bytes
from spark_bench.storage.sparse_values import value_parts
from spark_bench.storage.stores import DenseStore, StructuredKeyStore, UnstructuredStore, channel_index_dtype
from spark_bench.storage.walk_layout import TILE_TABLE_BYTES, WALK_TABLE_BYTES, tile_table, tiled, walk_table, walks
from spark_bench.storage.windowed import WindowedStore

# the C++ kernel's table: each array read from one of several parts (the rows' own tensors) at an offset in it
PART_COLUMNS = ("qh", "out_off", "n_tokens", "t_kept", "kept_part", "kept_off", "mask_part", "mask_off", "mask_stride",
                "mu_part", "mu_off", "sign_part", "sign_off", "mode", "start_part", "start_off")
# a ragged segment (tokens keeping different numbers of channels: t_kept −1) has a table of where each GRANULE
# tokens' kept entries start; both kernels find a token's from its granule's start and the popcounts of the
# granule's tokens before it (the kernels' token blocks start on granules)
GRANULE = 16
MODES = {"constant": 0, "aligned": 1, "signed": 2, "dense": 3}
# the fused kernel's tables (FusedTables), their row widths and columns
SEG_COLS = 11   # out_off, t_kept, kept_addr, mask_addr, mask_stride, mu_addr, sign_addr, sign_bitoff, mode, fill,
#                 starts_addr (a ragged segment's granule starts; else 0: a structured one's kept channels are read
#                 from the tables' copy, through its members' gather rows below)
HEAD_COLS = 7   # seg_a, seg_b, split, valid_addr, slot_base, n_slots, n_tokens
WORK_COLS = 15  # list_start, count, t_start, t_end, val_addr, chunk, then the ends of its kinds' runs of members:
#                 n_dense, n_struct, n_bare, n_plain (the rest, to count, are signed); then a value-sparse item's
#                 mask address (0: dense values), first kept entry's address, granule starts' address and compact
#                 tokens (val_addr: its dense window); then where its members' gather rows start (from the lists)
# a structured member's gather row, two int64 per member of an item's list: its kept count and where its kept
# channels' indices start (in index elements from the packed tables' start: the indices are copied into the
# tables, so the prologue's gather reads them at a table's latency, every member's at once)
# the fused kernel's member loops, in its order: a work item's member of kind k (FusedTables.layout) runs loop k, and
# a launch's tables hold a set of kinds, a bit each (FusedTables.kinds, the kernel's KINDS)
KINDS = ("dense", "structured", "bare", "plain", "signed")
ALL_KINDS = (1 << len(KINDS)) - 1


@dataclass(frozen=True)
class KernelTerms:
    """What a recovery contributes to the compact kernel, independent of the queries: the mode, the per-channel
    scale ``a = q · aux_scale`` (``1/q̄`` paper, ``1/sqrt(‖q‖)`` official; ``None`` = ones), the constant fill,
    the per-token statistic ``μ`` (model dtype) and the pruned entries' sign bits (official)."""

    mode: str
    aux_scale: torch.Tensor | None = None  # (B, H, D) float32
    fill: float = 0.0
    mu: torch.Tensor | None = None         # (B, H, S)
    sign_bits: torch.Tensor | None = None  # flat packed bits, one per pruned entry (row-major)
    n_signs: int = 0


def store_blocker(store) -> str | None:
    """Why ``store`` cannot join a segment stack (None: it can)."""
    if isinstance(store, DenseStore):
        return None if store.shape[-1] % 8 == 0 else f"head_dim {store.shape[-1]} is not a multiple of 8"
    if isinstance(store, StructuredKeyStore):
        return None if store.head_dim % 8 == 0 else f"head_dim {store.head_dim} is not a multiple of 8"
    if isinstance(store, WindowedStore):  # its compact part's segments, then its dense window's
        return store_blocker(store.old) if isinstance(store.old, UnstructuredStore) else \
            f"a window after a {type(store.old).__name__} is not a compact key layout"
    if not isinstance(store, UnstructuredStore):
        return f"{type(store).__name__} is not a compact key store"
    if store.head_dim % 8:
        return f"head_dim {store.head_dim} is not a multiple of 8"
    terms = store.recovery.kernel_terms()
    return terms if isinstance(terms, str) else None


def granule_starts(store: UnstructuredStore) -> tuple[torch.Tensor, list[int]]:
    """A ragged store's tables (tokens keeping different numbers of channels): ``(B·H, ceil(S / GRANULE))`` int32,
    where each :data:`GRANULE` tokens' kept entries start relative to their head's first, and each head's first
    entry in ``kept``. Built once per stack from the masks' popcounts (a decode reads one start per token block)."""
    b, h, s, d = store.shape
    counts = store.kept_mask().sum(-1, dtype=torch.int64).reshape(b * h, s)
    within = counts.cumsum(-1) - counts  # entries before each token, in its head
    heads = (counts.sum(-1).cumsum(0) - counts.sum(-1)).tolist()
    return within[:, ::GRANULE].to(torch.int32).contiguous(), heads


def _device_of(store) -> torch.device:
    """The device of a store's tensors."""
    for name in ("data", "kept", "recent"):
        if hasattr(store, name):
            return getattr(store, name).device
    raise TypeError(f"unknown store type {type(store).__name__}")


def _join(parts: list[torch.Tensor], empty: torch.Tensor | None) -> torch.Tensor:
    """One flat array from the parts: the part itself when there is one (no copy: a single store's stack is a view
    of it), else their concatenation."""
    if not parts:
        return empty
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class SegmentStack:
    """The compact key stores of several rows (each ``(B, H, S_r, D)``) with their segment table.

    Each store's tensors are *parts* the kernels read in place (the table says which part and where): nothing is
    copied on the CPU. The Triton kernel takes one flat array per kind; for it the parts are concatenated once, on
    first use (a device copy, cheap on a GPU). :meth:`logits` takes the rows' queries ``(ΣB, H, G, D)`` in the
    order the stores were given and returns ``(ΣB, H, G, S_max)`` float32 logits (−inf past a row's length)."""

    def __init__(self, stores: list, s_max: int | None = None):
        first = stores[0]
        self.heads, self.head_dim = first.shape[1], first.shape[-1]
        self.s_max = s_max if s_max is not None else max(s.length for s in stores)
        device = _device_of(first)
        d = self.head_dim
        self.kept_parts, self.mask_parts, self.mu_parts, self.sign_parts = [], [], [], []
        self.chan_parts, self._chans = [], []  # a structured segment's kept channels (the fused kernel's gather)
        self.start_parts = []  # ragged segments' granule starts (int32)
        rows, fills, scales, own, qh = [], [], [], [], 0

        def part(parts: list, tensor: torch.Tensor) -> int:
            parts.append(tensor)
            return len(parts) - 1

        def segment(qh, out_off, n, t, kept, mask, mu, sign, mode, fill=0.0, chan=(-1, 0), starts=(-1, 0)):
            """``kept``, ``mu``, ``sign``, ``chan``, ``starts``: (part, offset); ``mask``: (part, offset, stride);
            absent: (-1, 0[, 0])."""
            rows.append((qh, out_off, n, t, *kept, *mask, *mu, *sign, MODES[mode], *starts))
            fills.append(fill)
            self._chans.append(chan)

        def head_offsets(x: torch.Tensor):
            """``x (B, H, S, D)`` as a part read in place — a view, e.g. a prompt prefix of the prefill's keys, as
            long as each head's tokens are rows of D contiguous entries — and each head's offset in it."""
            b, h, s_, d_ = x.shape
            if x.stride(-1) != 1 or (s_ > 1 and x.stride(-2) != d_):
                x = x.contiguous()
            return x, [(i // h) * x.stride(0) + (i % h) * x.stride(1) for i in range(b * h)]

        none, no_mask = (-1, 0), (-1, 0, 0)
        for store in stores:
            reason = store_blocker(store)
            if reason is not None:
                raise ValueError(f"store cannot be stacked: {reason}")
            b, h, s, _ = store.shape
            if h != self.heads or store.shape[-1] != d:
                raise ValueError(f"stores of one stack need {self.heads} heads of {d} channels, got {store.shape}")
            if isinstance(store, DenseStore):
                data, offsets = head_offsets(store.data)
                k = part(self.kept_parts, data)
                for i in range(b * h):
                    segment(qh + i, 0, s, d, (k, offsets[i]), no_mask, none, none, "dense")
                scales.append(torch.ones(b * h, d, device=device))
            elif isinstance(store, StructuredKeyStore):
                s_old, t = store.kept.shape[-2], store.kept.shape[-1]
                n_recent = store.recent.shape[-2]
                channel_mask = torch.zeros(b, h, d, dtype=torch.bool, device=device)
                channel_mask.scatter_(-1, store.channels.long(), True)
                own.append(pack_bits(channel_mask).reshape(-1, d // 8))
                m = part(self.mask_parts, own[-1])
                k_old = part(self.kept_parts, store.kept.contiguous())
                ch = part(self.chan_parts, store.channels.to(channel_index_dtype(d)).contiguous())
                recent, recent_offsets = head_offsets(store.recent)
                k_recent = part(self.kept_parts, recent) if n_recent else -1
                for i in range(b * h):
                    segment(qh + i, 0, s_old, t, (k_old, i * s_old * t), (m, i, 0), none, none,
                            "constant", chan=(ch, i * t))
                    if n_recent:
                        segment(qh + i, s_old, n_recent, d, (k_recent, recent_offsets[i]), no_mask,
                                none, none, "dense")
                scales.append(torch.ones(b * h, d, device=device))
            else:
                windowed = isinstance(store, WindowedStore)
                recent = store.recent if windowed else None
                store = store.old if windowed else store
                s = store.length
                terms = store.recovery.kernel_terms()
                t, p = store.row_kept, d - (store.row_kept or 0)
                k = part(self.kept_parts, store.kept)
                if t is None:  # ragged: each head's entries start at its tokens' counts so far, per granule
                    starts_table, heads_at = granule_starts(store)
                    own.append(starts_table)
                    st = part(self.start_parts, starts_table)
                    t = -1
                m = part(self.mask_parts, store.mask_bits.reshape(-1, d // 8))
                mu = part(self.mu_parts, terms.mu.to(store.kept.dtype).reshape(-1)) if terms.mu is not None else -1
                sg = part(self.sign_parts, terms.sign_bits.reshape(-1)) if terms.sign_bits is not None else -1
                if windowed:
                    recent, recent_offsets = head_offsets(recent)
                    k_recent = part(self.kept_parts, recent)
                for i in range(b * h):
                    if t < 0:  # the head's entries from its first; its granule starts relative to them
                        at, signs_at, starts = heads_at[i], i * s * d - heads_at[i], (st, i * starts_table.shape[1])
                    else:
                        at, signs_at, starts = i * s * t, i * s * p, none
                    segment(qh + i, 0, s, t, (k, at), (m, i * s, 1), (mu, i * s) if mu >= 0 else none,
                            (sg, signs_at) if sg >= 0 else none, terms.mode, terms.fill, starts=starts)
                    if windowed:
                        segment(qh + i, s, recent.shape[-2], d, (k_recent, recent_offsets[i]), no_mask, none, none,
                                "dense")
                scale = terms.aux_scale if terms.aux_scale is not None else torch.ones(b, h, d, device=device)
                scales.append(scale.float().reshape(b * h, d))
            qh += b * h
        self.row_heads = first.shape[0] * first.shape[1]  # query-head blocks per row (B·H)
        self.dtype = first.dtype
        self.device = device
        self.aux_scale = _join(scales, None).contiguous()
        self._own = own  # tensors the stack made (ThinK's per-head channel masks, ragged stores' granule starts)
        self._set_rows(rows, fills)

    def _set_rows(self, rows: list[tuple], fills: list[float]) -> None:
        self._rows, self._fills = rows, fills
        self.max_tokens = max((r[2] for r in rows), default=0)

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """The C++ kernel's segment table (made on first use: the fused CUDA decode reads :class:`FusedTables`)."""
        return torch.tensor(self._rows, dtype=torch.int64, device=self.device).reshape(-1, len(PART_COLUMNS))

    @functools.cached_property
    def fills(self) -> torch.Tensor:
        return torch.tensor(self._fills, dtype=torch.float32, device=self.device)

    def nbytes(self) -> int:
        """Bytes the stack adds to its rows' stores (table, per-head scales, ThinK's per-head masks)."""
        return 8 * len(self._rows) * len(PART_COLUMNS) + 4 * len(self._fills) + tensor_bytes(self.aux_scale, *self._own)


class ValueStack:
    """The value stores of several rows, with one value segment per (row, kv-head, layout): dense tensors, each read
    once however many rows share it (configs sharing an eviction selection share its values), and value-sparse stores
    (``value_ratio`` > 0: kept entries + a D-bit mask per token, pruned entries 0, and Mustafar's dense window after
    them as a second, dense segment of the head). The C++ ``pv_segments`` computes ``weights · values`` for every row
    in one call; the fused Triton decode reads each shared dense tensor once per work item and gives a value-sparse
    head items of its own, rebuilding its blocks of values (``VSPARSE``). The tensors are parts read in place, never
    copied."""

    def __init__(self, stores: list, width: int):
        self.heads, self.head_dim, self.width = stores[0].shape[1], stores[0].shape[-1], width
        self.dtype = stores[0].dtype
        unique: dict[int, int] = {}
        self.parts, self.mask_parts, rows, qh = [], [], [], 0
        strided: dict[int, list[int]] = {}  # each dense part's per-head offsets
        # per value-sparse head (qh): its kept part and first entry, mask part and byte offset, granule starts
        # (tensor, row) and compact tokens, for the fused kernel's items (FusedTables.layout)
        self.sparse_heads: dict[int, tuple] = {}
        self._own = []  # tensors the stack made (value-sparse stores' granule starts)
        for store in stores:
            b, h, _, d = store.shape
            if (h, d) != (self.heads, self.head_dim):
                raise ValueError(f"value stores of one stack need {self.heads} heads of {self.head_dim} channels")
            compact, dense = value_parts(store)
            n_old = 0
            if compact is not None:  # each head's tokens from its first kept entry, its masks D/8 bytes per token
                n_old = compact.length
                starts, first_entry = granule_starts(compact)
                kept, masks = len(self.parts), len(self.mask_parts)
                self.parts.append(compact.kept)
                self.mask_parts.append(compact.mask_bits.reshape(-1))
                self._own.append(starts)
                for i in range(b * h):
                    rows.append((qh + i, 0, n_old, kept, first_entry[i], masks, i * n_old * (d // 8)))
                    self.sparse_heads[qh + i] = (*rows[-1][3:], starts, i, n_old)
            if dense is not None and dense.shape[-2]:
                if id(dense) not in unique:
                    data = dense
                    if data.stride(-1) != 1 or (data.shape[-2] > 1 and data.stride(-2) != d):
                        data = data.contiguous()
                    unique[id(dense)] = len(self.parts)
                    strided[len(self.parts)] = [(i // h) * data.stride(0) + (i % h) * data.stride(1)
                                                for i in range(b * h)]
                    self.parts.append(data)
                part = unique[id(dense)]
                rows += [(qh + i, n_old, dense.shape[-2], part, strided[part][i], -1, 0) for i in range(b * h)]
            qh += b * h
        self.device = self.parts[0].device
        self.row_heads = stores[0].shape[0] * stores[0].shape[1]
        self._set_rows(rows)

    @property
    def sparse(self) -> bool:
        """Some segment is value-sparse."""
        return bool(self.sparse_heads)

    def _set_rows(self, rows: list[tuple]) -> None:
        """``rows``: (qh, w_off, n, part, offset in the part, mask part (−1: dense), mask byte offset)."""
        rows = sorted(rows, key=lambda r: (r[3], r[4], r[2]))  # one tensor's segments adjacent: read once per run
        self._rows = rows

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """The C++ ``pv_segments`` table (made on first use)."""
        return torch.tensor(self._rows, dtype=torch.int64, device=self.device).reshape(-1, 7)


def _gather_rows(gather: list, keys: "SegmentStack", at: int) -> list[int]:
    """``gather``'s rows (kept count, (channel part, offset) or −1) as int64: each offset resolved to where the
    indices are copied, after the rows (from int64 word ``at`` of the tables), followed by those indices' words."""
    rows, words, where, host = [], b"", {}, {}
    size = channel_index_dtype(keys.head_dim).itemsize
    for i in range(0, len(gather), 2):
        t, src = gather[i], gather[i + 1]
        if src == -1:
            rows += [0, 0]
            continue
        if src not in where:
            cp, co = src
            where[src] = (at * 8 + len(words)) // size
            if cp not in host:  # (one device → host copy of each part)
                host[cp] = keys.chan_parts[cp].reshape(-1).cpu().numpy()
            words += host[cp][co:co + t].tobytes()
            words += bytes(-len(words) % 8)
        rows += [t, where[src]]
    return rows + list(memoryview(words).cast("q")) if words else rows


def _address(part: torch.Tensor, offset: int) -> int:
    """Byte address of element ``offset`` of ``part`` (0 for an absent part)."""
    return part.data_ptr() + offset * part.element_size()


@dataclass(frozen=True)
class FusedTables:
    """The fused decode kernel's view of a stacked batch (:mod:`.triton_decode`): 64-bit addresses into the rows' own
    tensors (nothing copied), all tables in one int64 device tensor made by one host→device copy.

    * ``seg`` (one row per key segment): token offset in its head, kept channels, kept/mask/μ/sign addresses, mask
      stride, sign bit offset, mode, the constant fill's float32 bits;
    * ``head`` (one row per query head = row × kv-head): its first segment, the second (ThinK's dense recent tokens)
      and where it starts, its validity bits' address (AdaKV; 0 = every token valid), its first partial-softmax slot,
      its number of slots (chunks), its tokens;
    * ``work`` (one row per program): a run of ``lists`` (query heads reading the same value tensor, at most
      ``members``), the chunk's tokens, the value tensor's address, the chunk index.
    """

    packed: torch.Tensor
    seg: torch.Tensor
    head: torch.Tensor
    work: torch.Tensor
    lists: torch.Tensor
    n_slots: int
    n_work: int
    members: int
    aligned: bool = False  # every value tensor and dense key run starts 16-byte aligned (16-byte loads)
    width: int = 0  # the kernel's TK: the structured (ThinK) segments' kept channels, padded (0: none)
    pairs: bool = False  # every structured segment keeps an even number of channels from a 4-byte aligned start
    kinds: int = ALL_KINDS  # the member kinds its work items hold (bit k: KINDS[k]): the kernel's loops
    # the signed members' constant table at a decode step (official-recovery keys, head_dim a multiple of 32 up to
    # 128, masks 4-byte aligned; a slice of ``packed``): the walk's (storage/triton_walk.py) or, with ``tiles``, the
    # tiles' (storage/triton_tiles.py); None where neither applies
    walk_tab: torch.Tensor | None = None
    ragged: bool = False  # a segment's tokens keep different numbers of channels (granule starts: the kernel's RAGGED)
    vsparse: bool = False  # a work item's values are value-sparse (rebuilt from their masks: the kernel's VSPARSE)
    # a decode step's signed members are built into tiles (storage/triton_tiles.py; walk_layout.tiled: bfloat16,
    # members of 4 query rows or more), every signed segment holding four kept entries or more (a nibble's four
    # entries are read together, moved back to stay inside them)
    tiles: bool = False

    @staticmethod
    def chunk_of(n: int, block: int = 16) -> int:
        """Tokens per work item for a value tensor of ``n`` tokens: 32 to 64 blocks (512–1024 tokens at 16), more
        work items for longer tensors (127.5K tokens: 125 per head) — so a work item's partial softmax (``(D + 2)·4``
        bytes per query row) and what a program runs once (its table rows and queries, the epilogue's stores: ~630
        warp-instructions on sm_90, as many as 1.8 blocks of dense keys) stay a few per cent of its work: a 512-token
        store (a KV-512 row) is one work item, not two (modelled, ``make bench``'s latency table, sm_90 GQA 4: SnapKV
        at KV 512 88 → 94% of the HBM bound, ThinK(0.8) 58 → 72%, this alone). It depends on the tensor alone, so a
        row's splits (and its float32 sums) are the same in any batch."""
        return block * max(32, min(64, n // (8 * block)))

    @classmethod
    def build(cls, keys: "SegmentStack", values: "ValueStack", valid: list, members: int,
              chunk: int | None = None) -> "FusedTables":
        """``valid``: per query head, ``(bits tensor, byte offset)`` of its validity bits or None; ``members``: query
        heads per work item (:func:`~.triton_decode.launch_shape`); ``chunk``: tokens per work item (default
        :meth:`chunk_of` each value tensor). One host→device copy."""
        flat, layout = cls.layout(keys, values, valid, members, chunk)
        return cls.view(torch.tensor(flat, dtype=torch.int64, device="cpu").to(keys.device), layout)

    @classmethod
    def view(cls, packed: torch.Tensor, layout: tuple) -> "FusedTables":
        """The tables over ``packed`` (the device copy of :meth:`layout`'s list, or a slice of a larger upload)."""
        a, b, c, slots, n_work, members, aligned, width, pairs, kinds, walk_at, ragged, vsparse, tiles = layout
        lists = packed[a + b + c:walk_at if walk_at >= 0 else None]
        walk_tab = packed[walk_at:walk_at + (TILE_TABLE_BYTES if tiles else WALK_TABLE_BYTES) // 8] \
            if walk_at >= 0 else None
        return cls(packed, packed[:a], packed[a:a + b], packed[a + b:a + b + c], lists, slots, n_work,
                   members, aligned, width, pairs, kinds, walk_tab, ragged, vsparse, tiles)

    @classmethod
    def layout(cls, keys: "SegmentStack", values: "ValueStack", valid: list, members: int,
               chunk: int | None = None) -> tuple[list[int], tuple]:
        """The tables as one host list of int64 and its layout (for :meth:`view`): built on the host, so a caller
        can send several tables (and its own indices) to the device in one copy."""
        import struct

        n_heads = len(valid)
        seg_rows, first, second, split = [], [-1] * n_heads, [-1] * n_heads, [1 << 62] * n_heads
        d8 = keys.head_dim // 8
        widest = 0  # the widest structured segment (the kernel's TK)
        tiles = True  # (every signed segment holds four kept entries or more: FusedTables.tiles)
        structured: dict = {}  # query head → its structured segment's (kept count, (channel-index part, offset))
        for row, fill, (cp, co) in zip(keys._rows, keys._fills, keys._chans):
            qh, out_off, n, t, kp, ko, mp, mo, ms, up, uo, sp, so, mode, gp, go = row
            if n * keys.head_dim >= 1 << 31:
                raise ValueError(f"a key segment of {n} tokens × {keys.head_dim} channels: the fused decode's offsets "
                                 "inside a segment are 32-bit (at most 2³¹ entries)")
            seg_rows.append([out_off, t, _address(keys.kept_parts[kp], ko),
                             _address(keys.mask_parts[mp], mo * d8) if mp >= 0 else 0, ms,
                             _address(keys.mu_parts[up], uo) if up >= 0 else 0,
                             keys.sign_parts[sp].data_ptr() if sp >= 0 else 0, so if sp >= 0 else 0, mode,
                             struct.unpack("<i", struct.pack("<f", fill))[0],
                             _address(keys.start_parts[gp], go) if gp >= 0 else 0])
            widest = max(widest, t if cp >= 0 else 0)
            tiles = tiles and (mode != MODES["signed"] or n * t >= 4)
            if first[qh] < 0:
                first[qh] = len(seg_rows) - 1
                if cp >= 0 and t > 0:  # a structured head: its kept count and indices, copied into the tables
                    structured[qh] = (t, (cp, co))
            elif mode != MODES["dense"]:  # the kernel reads a second segment as dense rows (ThinK's recent tokens)
                raise ValueError(f"query head {qh}: a second key segment must be dense keys, got mode {mode}")
            else:
                second[qh], split[qh] = len(seg_rows) - 1, out_off
        groups: dict = {}
        sparse = values.sparse_heads
        window: dict[int, tuple] = {}  # a value-sparse head's dense window: (part, offset, tokens)
        for qh, w_off, n, part, offset, mask_part, _ in values._rows:
            if qh in sparse:
                if mask_part < 0:
                    window[qh] = (part, offset, n)
                continue
            groups.setdefault((part, offset, n), []).append(qh)
        for qh in sparse:  # an item of its own per chunk: the compact tokens, then the window
            groups[("sparse", qh, sparse[qh][6] + window.get(qh, (0, 0, 0))[2])] = [qh]
        tokens, chunks = [0] * n_heads, [1] * n_heads
        for (_, _, n), m in groups.items():
            for qh in m:
                tokens[qh], chunks[qh] = n, chunk or cls.chunk_of(n)
        slot_base, slots = [], 0
        for qh in range(n_heads):
            slot_base.append(slots)
            slots += -(-tokens[qh] // chunks[qh])
        work, lists, gather, present = [], [], [], 0  # present: the kinds the work items hold, a bit each
        modes = [r[8] for r in seg_rows]
        bare = [r[8] == MODES["dense"] or (r[8] == MODES["constant"] and r[9] == 0) for r in seg_rows]

        def kind(qh: int, t1: int) -> int:
            """The kernel's member loop for ``qh`` in a work item ending at token ``t1`` (:mod:`.triton_decode`): 0
            dense keys and every token valid, 1 structured keys (ThinK's channel subset, every token of the item
            before the recent dense ones), 2 pruned entries read as 0 (no recovery term: ThinK's item holding its
            recent tokens, zero/none recoveries, AdaKV's dense rows), 3 a compact layout with a recovery, without
            signs, 4 with them (official recovery)."""
            segs = (first[qh], second[qh] if second[qh] >= 0 else first[qh])
            both = (modes[segs[0]], modes[segs[1]])
            if both == (3, 3) and valid[qh] is None:
                return 0
            if keys._chans[segs[0]][0] >= 0 and seg_rows[segs[0]][1] > 0 and valid[qh] is None and t1 <= split[qh]:
                return 1
            return 4 if 2 in both else 2 if bare[segs[0]] and bare[segs[1]] else 3

        for (part, offset, n), heads in groups.items():
            extra = [0, 0, 0, 0]
            if part == "sparse":  # (the window's address, else the kept entries': never read as dense rows)
                kp, ko, mp, mo, starts, row, n_old = sparse[heads[0]]
                wp, wo, _ = window.get(heads[0], (kp, ko, 0))
                address = _address(values.parts[wp], wo)
                extra = [_address(values.mask_parts[mp], mo), _address(values.parts[kp], ko),
                         _address(starts, row * starts.shape[1]), n_old]
            else:
                address = _address(values.parts[part], offset)
            step = chunks[heads[0]]
            known: dict = {}  # the list of each ordering of the heads (most items of a tensor share one)
            gathers: dict = {}  # its structured members' gather rows (one per list), where they start in ``gather``
            for k, t0 in enumerate(range(0, n, step)):
                t1 = min(t0 + step, n)
                kinds = {qh: kind(qh, t1) for qh in heads}
                for x in kinds.values():
                    present |= 1 << x
                ordered = tuple(sorted(heads, key=kinds.get))  # an item's heads by kind: one kernel loop per kind
                for i in range(0, len(ordered), members):
                    batch = ordered[i:i + members]
                    if batch not in known:
                        known[batch] = len(lists)
                        lists += batch
                    if batch not in gathers:
                        gathers[batch] = len(gather)
                        gather += [x for qh in batch for x in structured.get(qh, (0, -1))]
                    ends = [sum(kinds[qh] <= x for qh in batch) for x in range(4)]
                    work.append([known[batch], len(batch), t0, t1, address, k, *ends, *extra, gathers[batch]])
        head_rows = []
        for qh in range(n_heads):
            bits = valid[qh]
            head_rows.append([first[qh], second[qh] if second[qh] >= 0 else first[qh], split[qh],
                              _address(bits[0], bits[1]) if bits is not None else 0, slot_base[qh],
                              -(-tokens[qh] // chunks[qh]), tokens[qh]])
        for r in work:  # (the gather rows follow the lists; an item's column counts from the lists' start)
            r[-1] += len(lists)
        flat = [x for r in seg_rows for x in r] + [x for r in head_rows for x in r] + [x for r in work for x in r]
        flat += lists
        # the gather rows, then the kept channels' indices they point at, packed into int64 words
        flat += _gather_rows(gather, keys, len(flat) + len(gather))
        # the signed walk (storage/triton_walk.py) where its keys allow: masks of whole 32-bit words, 4-byte aligned
        d = keys.head_dim
        walk_at = -1
        if present & 1 << KINDS.index("signed") and walks(d) and all(
                r[3] % 4 == 0 and r[1] >= 0 for r in seg_rows if r[8] == MODES["signed"]):  # (fixed T: walked)
            walk_at = len(flat)
            tiles = tiles and tiled(members, keys.dtype.itemsize)  # (else the walk's table)
            table = tile_table() if tiles else walk_table()
            flat += list(struct.unpack(f"<{len(table) // 8}q", table))
        tiles = tiles and walk_at >= 0
        rows = (keys.head_dim * keys.dtype.itemsize) % 16 == 0
        aligned = rows and all(r[4] % 16 == 0 for r in work) and all(r[2] % 16 == 0 for r in seg_rows if r[8] == 3)
        vsparse = any(r[10] for r in work)  # the kernel's VSPARSE: some item's values are rebuilt from masks
        # the structured loop's width (TK), 0 when no work item has structured keys (the kernel then has no such loop)
        width = max(32, 1 << (widest - 1).bit_length()) if widest and present & 2 else 0
        pairs = all(r[1] % 2 == 0 and r[2] % 4 == 0 for r, (cp, _) in zip(seg_rows, keys._chans)
                    if cp >= 0 and r[1] > 0)  # (structured)
        ragged = any(r[1] < 0 for r in seg_rows)  # the kernel's RAGGED: a token's entries from its granule's start
        return flat, (SEG_COLS * len(seg_rows), HEAD_COLS * n_heads, WORK_COLS * len(work), slots, len(work), members,
                      aligned, width, pairs, present, walk_at, ragged, vsparse, tiles)

    def nbytes(self) -> int:
        return tensor_bytes(self.packed)
