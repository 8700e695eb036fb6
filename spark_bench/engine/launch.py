"""How a batched layer's stacked rows reach the compiled kernels — the launch policy, apart from the cache that
holds the rows (:class:`~spark_bench.engine.cache.BatchedLayer`) and from the kernels (:mod:`spark_bench.storage`).

* CUDA (``triton``): per unit of stacked rows, the fused decode (:func:`~spark_bench.storage.dispatch.fused_attention`,
  :mod:`~spark_bench.storage.triton_decode`): the work tables of the query width (``launch_shape``'s heads per work
  item; built the first time a width needs them, then with the layer's other indices when rows stop), a suffix's
  query rows in chunks whose partials stay under ``work_bytes``, and the step's own tokens attended from
  :meth:`~spark_bench.engine.cache.BatchedLayer.update`'s arguments: the layer's first launch of a step advances the
  device-held tail length by them and the kernel writes them into the tail. Attended again before the next update
  (a timing loop), the launch reads them back from the tail and advances nothing: the same output, nothing new
  written.
* CPU (``cpp``): the C++ logits of the stacked rows and their tail in one call (the loose rows' own scores beside
  them), one float32 softmax over prompt and tail, the C++ ``weights · values``; a long suffix in chunks of query
  rows.

:class:`StackedLaunch` is a mixin of ``BatchedLayer``: it reads the layer's ``units`` (stacks, row index, tables),
``tail_keys``/``tail_values``, ``length``/``length_t``, ``pending``, ``valid_bits``, ``s_max``, ``alone`` and its row
order (``stacked``, ``loose``, ``prefix``, ``order``, ``stacked_index``, ``out_order``), which the layer builds in
``_arrange``, and calls its per-row path (``_attend_rows``) for loose rows. It imports nothing from the cache module.
"""

from __future__ import annotations

import torch

from spark_bench.engine.partial import scaled_queries
from spark_bench.storage import dispatch
from spark_bench.storage.bits import unpack_bits
from spark_bench.storage.segments import FusedTables


class StackedLaunch:
    """The stacked rows' attention through the kernels (mixed into :class:`~spark_bench.engine.cache.BatchedLayer`)."""

    def _tables(self, unit: dict, members: int) -> FusedTables:
        """The fused kernel's tables of ``unit`` for ``members`` query heads per work item: built the first time a
        query width needs them (one host→device copy), then with the layer's other indices when rows stop."""
        if members not in unit["tables"]:
            unit["tables"][members] = FusedTables.build(unit["keys"], unit["values"], self._valid(unit["rows"]),
                                                        members)
            self._members.add(members)
        return unit["tables"][members]

    def _slots(self, unit: dict, members: int) -> int:
        """The unit's partial-softmax slots, which bound a suffix's chunk of query rows; with rows ``alone``, a bound
        from the batch's shape (rows × heads × the slots of ``s_max`` tokens), so that the chunks, and the kernel's
        specialisation with them, do not depend on the other rows' lengths."""
        if self.alone:
            return len(unit["rows"]) * self.batch_rows * self.tail_keys.shape[1] * -(
                -self.s_max // FusedTables.chunk_of(self.s_max))
        return self._tables(unit, members).n_slots

    def _rows_of(self, x: torch.Tensor, index, rows: list[int]) -> torch.Tensor:
        if index is not None:
            return x.index_select(0, index)
        return x if len(rows) == x.shape[0] else x[rows[0]:rows[0] + len(rows)]

    def _attend_fused(self, grouped: torch.Tensor, scaling: float, q_len: int) -> torch.Tensor:
        """CUDA: each unit's rows through the fused kernel (query rows in chunks bounded by ``work_bytes``), the
        loose rows through the per-row path. The layer's first launch after an update advances the device length by
        the step's ``q_len`` tokens, which the kernel writes into the tail (:attr:`kernel_writes_tail`) from
        :attr:`pending`; attended again before the next update, the step's tokens are read back from the tail (where
        the kernel, or :meth:`update`, wrote them) and the length is not advanced again."""
        from spark_bench.storage.triton_decode import launch_shape

        r, h, g, d = grouped.shape
        cap = self.tail_keys.shape[2]
        if self.pending is not None:
            (new_k, new_v), advance = self.pending, q_len
            self.pending = None
        elif self.length >= q_len:  # attended again after one update: nothing new to write
            new_k = self.tail_keys[:, :, self.length - q_len:self.length]
            new_v = self.tail_values[:, :, self.length - q_len:self.length]
            advance = 0
        else:
            raise ValueError(f"BatchedLayer.attend: {q_len} new token(s) to attend but the tail holds {self.length}; "
                             "call update() with the step's keys and values first")
        if grouped.stride()[2:] != (d, 1):
            grouped = grouped.contiguous()
        outs = []
        for unit in self.units:
            rows, index = unit["rows"], unit["index"]
            n = len(rows) * self.batch_rows * h
            q = self._rows_of(grouped, index, rows).reshape(n, g, d)
            tk = self._rows_of(self.tail_keys, index, rows).reshape(n, cap, d)
            tv = self._rows_of(self.tail_values, index, rows).reshape(n, cap, d)
            nk = self._rows_of(new_k, index, rows).reshape(n, q_len, d)
            nv = self._rows_of(new_v, index, rows).reshape(n, q_len, d)
            step = g
            while step > 1 and self._slots(unit, launch_shape(step)[1]) * step * (d + 2) * 4 > self.work_bytes:
                step = -(-step // 2)
            out = torch.empty(n, g, d, dtype=grouped.dtype, device=q.device)
            for g0 in range(0, g, step):  # a suffix's chunks of query rows: views read and written in place
                rows_g = slice(g0, g0 + step)
                tables = self._tables(unit, launch_shape(min(step, g - g0))[1])
                dispatch.fused_attention(tables, unit["keys"].aux_scale, tk, q[:, rows_g], scaling, nk, nv, tk, tv,
                                         self.length_t, q_len, g0, out[:, rows_g], advance)
                advance = 0
            outs.append(out)
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        out = out.view(-1, h, g, d)
        if self.loose:
            loose = self._attend_rows(scaled_queries(grouped, scaling), q_len, "compact")
            out = torch.cat([out, loose.to(out.dtype)])
        return out if self.out_order is None else out.index_select(0, self.out_order)

    def _attend_cpu(self, grouped: torch.Tensor, q_len: int) -> torch.Tensor:
        """CPU: the C++ logits of the stacked rows (and the loose rows' own scores), one float32 softmax over prompt
        and tail, the C++ ``weights · values``; a long suffix in chunks of query rows."""
        r, h, g, d = grouped.shape
        unit = self.units[0] if self.units else None  # (rows alone: possibly none stacked)
        width = self.s_max + self.length
        step = max(1, min(g, self.work_bytes // max(1, 3 * r * h * width * 4)))
        outs = [self._attend_cpu_rows(grouped[:, :, g0:g0 + step], q_len, g0, unit) for g0 in range(0, g, step)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _attend_cpu_rows(self, grouped: torch.Tensor, q_len: int, g0: int, unit: dict) -> torch.Tensor:
        r, h, g, d = grouped.shape
        n = len(self.stacked)
        if n == r and not self.alone:  # every row stacked: prompt and tail in the same two kernel calls (rows
            # alone, BatchedLayer's ``alone``: always the path below, so a row's sums do not depend on its neighbours)
            scores = dispatch.stack_logits(unit["keys"], grouped, self.tail_keys, self.length, q_len, g0)
            self._mask_invalid(scores)
            return dispatch.stack_apply(unit["values"], scores.softmax(dim=-1), self.tail_values, self.length)
        mine = grouped[:n] if self.prefix else grouped.index_select(0, self.stacked_index)
        prompt = [dispatch.stack_logits(unit["keys"], mine, g0=g0)] if n else []
        pad = [torch.nn.functional.pad(self.rows[i].prompt_scores(grouped[i:i + 1]),
                                       (0, self.s_max - self.rows[i].key_store.length), value=float("-inf"))
               for i in self.loose]
        prompt = torch.cat([*prompt, *pad])
        if self.order is not None:
            prompt = prompt.index_select(0, self.order)
        self._mask_invalid(prompt)
        t = self.length
        tail = grouped @ self.tail_keys[:, :, :t].float().transpose(-1, -2)
        if q_len > 1:  # query row k (step query (g0 + k) % q_len) sees tail keys 0 … t − q + (g0 + k) % q_len
            last = t - q_len + (torch.arange(g0, g0 + g, device=grouped.device) % q_len)
            visible = torch.arange(t, device=grouped.device)[None, :] <= last[:, None]
            tail = tail.masked_fill(~visible, float("-inf"))
        weights = torch.cat([prompt, tail], dim=-1).softmax(dim=-1)
        w_prompt, w_tail = weights[..., :self.s_max], weights[..., self.s_max:]
        mine = w_prompt[:n] if self.prefix else w_prompt.index_select(0, self.stacked_index)
        parts = [dispatch.stack_apply(unit["values"], mine)] if n else []
        for i in self.loose:
            store = self.rows[i].value_store
            parts.append(w_prompt[i:i + 1, ..., :store.length] @ store.materialize().float())
        out = torch.cat(parts)
        if self.order is not None:
            out = out.index_select(0, self.order)
        return out + w_tail @ self.tail_values[:, :, :t].float()

    def _mask_invalid(self, scores: torch.Tensor) -> None:
        """−inf on AdaKV's padded heads, from the validity bits (past a row's length the kernels give −inf)."""
        if self.valid_bits is not None:
            invalid = ~unpack_bits(self.valid_bits, self.s_max).unsqueeze(2)
            scores[..., :self.s_max].masked_fill_(invalid, float("-inf"))
