"""Exact softmax attention in parts: a block of keys' un-normalised softmax (:class:`Partial`), merged with others
by log-sum-exp (:func:`merge`), the decoded tail's part (:func:`tail_attention`), and a key store's keys in float32 as
the compact kernels compute them (:func:`exact_keys`). The caches (:mod:`.cache`) and the run-time check of the
kernels (the reference they are compared with) share this arithmetic; float32 throughout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.storage.stores import Store, UnstructuredStore


@dataclass(frozen=True)
class Partial:
    """Softmax attention over one block of keys, un-normalised: ``out = Σ_j exp(s_j − m)·v_j``, ``norm = Σ_j
    exp(s_j − m)``, ``m = max_j s_j`` (float32, per query row). Two blocks merge exactly (:func:`merge`): this is
    how a row's compact prompt stores and the decoded tail — batched across rows — make one softmax."""

    out: torch.Tensor   # (..., n_q, D) float32
    norm: torch.Tensor  # (..., n_q, 1)
    peak: torch.Tensor  # (..., n_q, 1)

    @classmethod
    def of(cls, scores: torch.Tensor, values: torch.Tensor) -> "Partial":
        """``scores (..., n_q, S)`` (already scaled, −inf where masked) and ``values (..., S, D)``."""
        peak = scores.amax(dim=-1, keepdim=True)  # finite: every block has a visible key per query row
        w = (scores - peak).exp_()  # float32 weights times float32 values: one precision on every path
        values = values.float()
        if w.shape[0] > 1 and values.shape[0] == 1:  # rows sharing one value tensor: fold them into the query dim
            r, h, n, s = w.shape                      # (a broadcast matmul would copy the values once per row)
            out = (w.transpose(0, 1).reshape(1, h, r * n, s) @ values).view(h, r, n, -1).transpose(0, 1)
        else:
            out = w @ values
        return cls(out, w.sum(dim=-1, keepdim=True), peak)


def merge(parts: list[Partial], dtype: torch.dtype) -> torch.Tensor:
    """Normalised attention output over the union of the parts' keys (log-sum-exp merge)."""
    if len(parts) == 1:
        return (parts[0].out / parts[0].norm).to(dtype)
    peak = torch.maximum(parts[0].peak, parts[1].peak)
    for p in parts[2:]:
        peak = torch.maximum(peak, p.peak)
    out = sum(p.out * (p.peak - peak).exp() for p in parts)
    norm = sum(p.norm * (p.peak - peak).exp() for p in parts)
    return (out / norm).to(dtype)


def exact_keys(store: Store) -> torch.Tensor:
    """A key store's keys in float32 as the compact kernels compute them: a SparK store's recovered entries in float32
    (``materialize`` rounds them to the store's dtype), every other store's keys converted exactly."""
    if isinstance(store, UnstructuredStore):
        mask = store.kept_mask()
        return store.recovery.fill(mask, torch.float32).masked_scatter(mask, store.kept.float())
    return store.materialize().float()


def tail_attention(grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_len: int) -> Partial:
    """Attention of ``grouped (R, H, G·q, D)`` (scaled, float32) queries over the decoded tail ``(R, H, t, D)``: the
    newest ``q`` tokens are the tail's last ``q`` entries, causal among themselves; float32 throughout."""
    r, h, gq, _ = grouped.shape
    t = keys.shape[-2]
    scores = grouped.float() @ keys.float().transpose(-1, -2)
    if q_len > 1:  # query i (tail position t − q + i) sees tail keys 0 … t − q + i
        causal = torch.ones(q_len, t, dtype=torch.bool, device=grouped.device).tril(t - q_len)
        scores = scores.view(r, h, gq // q_len, q_len, t).masked_fill(~causal, float("-inf")).view(r, h, gq, t)
    return Partial.of(scores, values)


def scaled_queries(queries: torch.Tensor, scaling: float) -> torch.Tensor:
    """The queries times ``scaling`` in float32 (a new tensor: the model's query is never changed)."""
    return queries * scaling if queries.dtype == torch.float32 else queries.float().mul_(scaling)
