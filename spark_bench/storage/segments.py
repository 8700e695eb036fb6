"""Many compact key stores read by one kernel call: the *segment table* behind batched compact attention.

A decode batch holds one compressed cache per method config. To make a step's cost independent of how many rows it
has, the compact key stores of every row of a layer (SparK fixed-T stores in the recoveries that fold into per-token
work, ThinK's structured stores) are concatenated once, when the batch is formed, into flat arrays, and described by
a table with one *segment* per (row, kv-head, layout): which query head reads it, where its tokens land in the
output, how many channels each token keeps, where its kept entries, mask bits, recovery statistic and sign bits
start, and its mode. Nothing is padded: tokens of every row are stored back to back, so the stack holds exactly the
rows' compact bytes; only the ``(R, H, G, S_max)`` output is padded (the caller masks the padding).

Modes (the kernel header ``engine/kernels/spark_logits.cpp`` has the formulas): 0 constant fill (``zero``, ``none``,
``constant``; ThinK's pruned channels read as 0), 1 paper degenerate (``saliency=paper``), 2 official degenerate
(signs + ``sqrt(μ/‖q‖)``), 3 dense (every channel kept: ThinK's recent tokens).

Backends (:func:`compact_backend` decides, on the device of the tensors): the C++ kernel on CPU tensors, the Triton
kernel (:mod:`.triton_logits`) on CUDA tensors. Where neither can run, rows are not stacked and each row's store
serves its own logits (:meth:`Store.logits`, the reference path for non-CPU devices).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.storage.bits import tensor_bytes

# the C++ kernel's table: each array read from one of several parts (the rows' own tensors) at an offset in it
PART_COLUMNS = ("qh", "out_off", "n_tokens", "t_kept", "kept_part", "kept_off", "mask_part", "mask_off", "mask_stride",
                "mu_part", "mu_off", "sign_part", "sign_off", "mode")
# the Triton kernel's table: offsets into one concatenated array per kind
SEGMENT_COLUMNS = ("qh", "out_off", "n_tokens", "t_kept", "kept_off", "mask_off", "mask_stride", "mu_off",
                   "sign_off", "mode")
MODES = {"constant": 0, "aligned": 1, "signed": 2, "dense": 3}
_EMPTY = torch.empty(0)
MAX_GROUP = 8  # query rows per kv-head one C++ call takes; more (a suffix through the cache) go in chunks


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


def _triton_ready() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def compact_backend(device: torch.device, cpp_kernel=None, triton_ready: bool | None = None) -> str:
    """``cpp`` (CPU tensors, the compiled kernel), ``triton`` (CUDA tensors, Triton importable), or the reason
    neither serves ``device`` (a string starting with ``no:``): then the rows are not stacked. ``cpp_kernel``: the
    loaded extension or the reason it is unavailable (default: :func:`~.fast_logits.load_kernel`)."""
    if device.type == "cpu":
        if cpp_kernel is None:
            from spark_bench.storage.fast_logits import load_kernel
            cpp_kernel = load_kernel()
        return f"no: {cpp_kernel}" if isinstance(cpp_kernel, str) else "cpp"
    if device.type == "cuda":
        ready = _triton_ready() if triton_ready is None else triton_ready
        return "triton" if ready else "no: triton is not installed (pip install triton) for the CUDA kernel"
    return f"no: no compact kernel for {device.type} tensors"


def store_blocker(store) -> str | None:
    """Why ``store`` cannot join a segment stack (None: it can)."""
    from spark_bench.storage.stores import DenseStore, StructuredKeyStore, UnstructuredStore

    if isinstance(store, DenseStore):
        return None if store.shape[-1] % 8 == 0 else f"head_dim {store.shape[-1]} is not a multiple of 8"
    if isinstance(store, StructuredKeyStore):
        return None if store.head_dim % 8 == 0 else f"head_dim {store.head_dim} is not a multiple of 8"
    if not isinstance(store, UnstructuredStore):
        return f"{type(store).__name__} is not a compact key store"
    if store.row_kept is None:
        return "tokens keep different numbers of channels (SparK-p / SparK-g)"
    if store.head_dim % 8:
        return f"head_dim {store.head_dim} is not a multiple of 8"
    terms = store.recovery.kernel_terms()
    return terms if isinstance(terms, str) else None


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
        from spark_bench.storage.bits import pack_bits
        from spark_bench.storage.stores import DenseStore, StructuredKeyStore

        first = stores[0]
        self.heads, self.head_dim = first.shape[1], first.shape[-1]
        self.s_max = s_max if s_max is not None else max(s.length for s in stores)
        device = _device_of(first)
        d = self.head_dim
        self.kept_parts, self.mask_parts, self.mu_parts, self.sign_parts = [], [], [], []
        rows, fills, scales, qh = [], [], [], 0

        def part(parts: list, tensor: torch.Tensor) -> int:
            parts.append(tensor)
            return len(parts) - 1

        flat_kept = []  # each segment's kept offset in its part's contiguous layout (the Triton copy)

        def segment(qh, out_off, n, t, kept, mask, mu, sign, mode, fill=0.0):
            """``kept``: (part, offset, contiguous offset); ``mu``/``sign``: (part, offset); ``mask``: (part, offset,
            stride); absent: (-1, 0[, 0])."""
            rows.append((qh, out_off, n, t, *kept[:2], *mask, *mu, *sign, MODES[mode]))
            flat_kept.append(kept[2])
            fills.append(fill)

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
                    segment(qh + i, 0, s, d, (k, offsets[i], i * s * d), no_mask, none, none, "dense")
                scales.append(torch.ones(b * h, d, device=device))
            elif isinstance(store, StructuredKeyStore):
                s_old, t = store.kept.shape[-2], store.kept.shape[-1]
                n_recent = store.recent.shape[-2]
                channel_mask = torch.zeros(b, h, d, dtype=torch.bool, device=device)
                channel_mask.scatter_(-1, store.channels.long(), True)
                m = part(self.mask_parts, pack_bits(channel_mask).reshape(-1, d // 8))
                k_old = part(self.kept_parts, store.kept.contiguous())
                recent, recent_offsets = head_offsets(store.recent)
                k_recent = part(self.kept_parts, recent) if n_recent else -1
                for i in range(b * h):
                    segment(qh + i, 0, s_old, t, (k_old, i * s_old * t, i * s_old * t), (m, i, 0), none, none,
                            "constant")
                    if n_recent:
                        segment(qh + i, s_old, n_recent, d, (k_recent, recent_offsets[i], i * n_recent * d), no_mask,
                                none, none, "dense")
                scales.append(torch.ones(b * h, d, device=device))
            else:
                terms = store.recovery.kernel_terms()
                t, p = store.row_kept, d - store.row_kept
                k = part(self.kept_parts, store.kept)
                m = part(self.mask_parts, store.mask_bits.reshape(-1, d // 8))
                mu = part(self.mu_parts, terms.mu.to(store.kept.dtype).reshape(-1)) if terms.mu is not None else -1
                sg = part(self.sign_parts, terms.sign_bits.reshape(-1)) if terms.sign_bits is not None else -1
                for i in range(b * h):
                    segment(qh + i, 0, s, t, (k, i * s * t, i * s * t), (m, i * s, 1), (mu, i * s) if mu >= 0 else none,
                            (sg, i * s * p) if sg >= 0 else none, terms.mode, terms.fill)
                scale = terms.aux_scale if terms.aux_scale is not None else torch.ones(b, h, d, device=device)
                scales.append(scale.float().reshape(b * h, d))
            qh += b * h
        self.row_heads = first.shape[0] * first.shape[1]  # query-head blocks per row (B·H)
        self.dtype = first.dtype
        self.device = device
        self.aux_scale = _join(scales, None).contiguous()
        self._set_rows(rows, fills, flat_kept)
        self._flat = None
        self._backend = None

    def _set_rows(self, rows: list[tuple], fills: list[float], flat_kept: list[int]) -> None:
        self._rows, self._fills, self._flat_kept = rows, fills, flat_kept
        self.table = torch.tensor(rows, dtype=torch.int64, device=self.device).reshape(-1, len(PART_COLUMNS))
        self.fills = torch.tensor(fills, dtype=torch.float32, device=self.device)
        self.max_tokens = max((r[2] for r in rows), default=0)
        self._flat_table = None

    def flat(self):
        """The Triton layout: (kept, mask, mu, signs) concatenated (once per stack) and the table with absolute
        offsets (:data:`SEGMENT_COLUMNS`)."""
        if self._flat is None:
            def bases(parts, unit=lambda t: t.numel()):
                out, total = [], 0
                for t in parts:
                    out.append(total)
                    total += unit(t)
                return out
            d8 = self.head_dim // 8
            self._flat = dict(
                kept=_join([t.contiguous().reshape(-1) for t in self.kept_parts],
                           torch.empty(0, dtype=self.dtype, device=self.device)),
                mask=_join(self.mask_parts, torch.empty(0, d8, dtype=torch.uint8, device=self.device)),
                mu=_join(self.mu_parts, torch.empty(0, dtype=self.dtype, device=self.device)),
                signs=_join(self.sign_parts, torch.empty(0, dtype=torch.uint8, device=self.device)),
                kept_base=bases(self.kept_parts), mask_base=bases(self.mask_parts, lambda t: t.shape[0]),
                mu_base=bases(self.mu_parts), sign_base=bases(self.sign_parts, lambda t: 8 * t.numel()))
        if self._flat_table is None:
            f = self._flat
            absolute = [(qh, out, n, t, f["kept_base"][kp] + kc if kp >= 0 else 0,
                         f["mask_base"][mp] + mo if mp >= 0 else -1, stride, f["mu_base"][up] + uo if up >= 0 else -1,
                         f["sign_base"][sp] + so if sp >= 0 else -1, mode)
                        for (qh, out, n, t, kp, _, mp, mo, stride, up, uo, sp, so, mode), kc
                        in zip(self._rows, self._flat_kept)]
            self._flat_table = torch.tensor(absolute, dtype=torch.int64, device=self.device).reshape(
                -1, len(SEGMENT_COLUMNS))
        return self._flat, self._flat_table

    def select(self, rows: list[int]) -> "SegmentStack":
        """The stack of the stacked rows ``rows`` (indices in stack order), sharing this stack's parts: only the
        table is rebuilt (rows that stopped decoding drop out of it), nothing is copied."""
        keep = {r: i for i, r in enumerate(rows)}
        k = self.row_heads
        picked = [(seg, fill, kc) for seg, fill, kc in zip(self._rows, self._fills, self._flat_kept)
                  if seg[0] // k in keep]
        out = object.__new__(SegmentStack)
        out.__dict__.update(self.__dict__)
        out._set_rows([(keep[seg[0] // k] * k + seg[0] % k, *seg[1:]) for seg, _, _ in picked],
                      [f for _, f, _ in picked], [kc for _, _, kc in picked])
        heads = torch.tensor([r * k + j for r in rows for j in range(k)], device=self.device)
        out.aux_scale = self.aux_scale.index_select(0, heads)
        return out

    def nbytes(self) -> int:
        """Bytes the stack adds to its rows' stores (table, per-head scales, ThinK's per-head masks, and the Triton
        layout's concatenated copy once it exists)."""
        own = tensor_bytes(self.table, self.fills, self.aux_scale)
        flat = sum(tensor_bytes(v) for k, v in (self._flat or {}).items() if isinstance(v, torch.Tensor))
        return own + flat

    def backend(self) -> str:
        if self._backend is None:
            self._backend = compact_backend(self.device)
        return self._backend

    def logits(self, queries: torch.Tensor, tail: torch.Tensor | None = None, tail_len: int = 0,
               q_len: int = 1) -> torch.Tensor:
        """``queries (ΣB, H, G, D)`` → ``(ΣB, H, G, S_max + tail_len)`` float32, −inf past a row's length.

        ``tail (ΣB, H, capacity, D)``: the rows' decoded tokens (the first ``tail_len`` filled), scored into the
        positions after ``S_max``; the last ``q_len`` of them are this step's own tokens, causal among themselves
        (query row ``r`` of a kv-head is the step's query ``r % q_len``)."""
        n, h, g, d = queries.shape
        q = queries.reshape(n * h, g, d)
        if q.dtype != torch.float32:
            q = q.float()
        tail_flat = tail.reshape(n * h, tail.shape[2], d) if tail_len else None
        backend = self.backend()
        chunks = []
        for g0 in range(0, g, MAX_GROUP):  # query rows per call: the C++ kernel's bound, Triton's compiled variants
            c = q[:, g0:g0 + MAX_GROUP].contiguous()
            if backend == "cpp":
                from spark_bench.storage.fast_logits import load_kernel

                chunks.append(load_kernel().spark_segments(
                    c, self.aux_scale, self.table, self.fills, self.kept_parts, self.mask_parts, self.mu_parts,
                    self.sign_parts, self.s_max, tail_flat if tail_len else _EMPTY, tail_len, q_len,
                    g0))
            elif backend == "triton":
                from spark_bench.storage.triton_logits import segment_logits

                f, table = self.flat()
                chunks.append(segment_logits(c, self.aux_scale, table, self.fills, f["kept"], f["mask"], f["mu"],
                                             f["signs"], self.s_max, self.max_tokens, tail_flat, tail_len, q_len, g0))
            else:
                raise RuntimeError(f"segment stack on {self.device}: {backend[4:]}")
        out = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
        return out.view(n, h, g, self.s_max + tail_len)


class ValueStack:
    """The dense value tensors of several rows, each read once however many rows share it (configs sharing an
    eviction selection share its values), with one value segment per (row, kv-head): :meth:`apply` computes
    ``weights · values`` for every row in one kernel call. The tensors are parts read in place on the CPU; the
    Triton kernel gets them concatenated once."""

    def __init__(self, stores: list, width: int):
        first = stores[0].data
        self.heads, self.head_dim, self.width = first.shape[1], first.shape[-1], width
        self.device, self.dtype = first.device, first.dtype
        unique: dict[int, int] = {}
        self.parts, strided, rows, qh = [], [], [], 0  # strided: each part's per-head offsets
        for store in stores:
            data = store.data
            b, h, s, d = data.shape
            if (h, d) != (self.heads, self.head_dim):
                raise ValueError(f"value stores of one stack need {self.heads} heads of {self.head_dim} channels")
            if id(data) not in unique:
                if data.stride(-1) != 1 or (s > 1 and data.stride(-2) != d):
                    data = data.contiguous()
                unique[id(store.data)] = len(self.parts)
                self.parts.append(data)
                strided.append([(i // h) * data.stride(0) + (i % h) * data.stride(1) for i in range(b * h)])
            part = unique[id(store.data)]
            for i in range(b * h):
                rows.append((qh + i, 0, s, part, strided[part][i], i * s * d))
            qh += b * h
        self.row_heads = first.shape[0] * first.shape[1]
        self._set_rows(rows)
        self._flat = None
        self._backend = None

    def _set_rows(self, rows: list[tuple]) -> None:
        """``rows``: (qh, w_off, n, part, offset in the part, offset in the part's contiguous layout)."""
        rows = sorted(rows, key=lambda r: (r[3], r[4], r[2]))  # one tensor's segments adjacent: read once per run
        self._rows = rows
        self.table = torch.tensor([r[:5] for r in rows], dtype=torch.int64, device=self.device).reshape(-1, 5)
        self._flat_table = None

    def flat(self):
        """The Triton layout: the parts concatenated (once) and the table with absolute offsets."""
        if self._flat is None:
            bases, total = [], 0
            for t in self.parts:
                bases.append(total)
                total += t.numel()
            self._flat = (_join([t.contiguous().reshape(-1) for t in self.parts], None), bases)
        if self._flat_table is None:
            values, bases = self._flat
            self._flat_table = torch.tensor([(qh, w, n, bases[p] + flat) for qh, w, n, p, _, flat in self._rows],
                                            dtype=torch.int64, device=self.device).reshape(-1, 4)
        return self._flat[0], self._flat_table

    def select(self, rows: list[int]) -> "ValueStack":
        """The stack of ``rows`` (indices in stack order), sharing this stack's values (nothing is copied)."""
        keep, k = {r: i for i, r in enumerate(rows)}, self.row_heads
        out = object.__new__(ValueStack)
        out.__dict__.update(self.__dict__)
        out._set_rows([(keep[seg[0] // k] * k + seg[0] % k, *seg[1:]) for seg in self._rows if seg[0] // k in keep])
        return out

    def apply(self, weights: torch.Tensor, tail: torch.Tensor | None = None, tail_len: int = 0) -> torch.Tensor:
        """``weights (ΣB, H, G, W)`` float32 (W ≥ every row's length; the prompt's weights first) →
        ``(ΣB, H, G, D)`` float32. ``tail (ΣB, H, capacity, D)``: the rows' decoded values, weighted by positions
        ``width`` … ``width + tail_len − 1`` of ``weights``."""
        n, h, g, w = weights.shape
        flat = weights.reshape(n * h, g, w)
        tail_flat = tail.reshape(n * h, tail.shape[2], self.head_dim) if tail_len else _EMPTY
        if self._backend is None:
            self._backend = compact_backend(self.device)
        if self._backend == "cpp":
            from spark_bench.storage.fast_logits import load_kernel

            out = load_kernel().pv_segments(flat.contiguous(), self.table, self.parts, self.head_dim, tail_flat,
                                            self.width, tail_len)
        elif self._backend == "triton":  # query rows in chunks: a program holds (rows, block, D) in registers
            from spark_bench.storage.triton_logits import pv_segments

            values, table = self.flat()
            parts = [pv_segments(c.contiguous(), table, values, self.head_dim, tail_flat, self.width, tail_len)
                     for c in flat.split(MAX_GROUP, dim=1)]
            out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        else:
            raise RuntimeError(f"value stack on {self.device}: {self._backend[4:]}")
        return out.view(n, h, g, self.head_dim)
