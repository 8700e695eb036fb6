"""Observation 1 (paper §4.1, Fig. 2a/2b; Appendix B): how unstructured, token by token, key-channel importance is.

From one prefill (:func:`~spark_bench.engine.prefill.run_prefill`: per layer the post-RoPE keys ``(B, H_kv, S, D)``
and window queries), the contribution of channel ``j`` of kv-head ``h`` to the attention logit of prompt token ``t``
is ``c[t, j] = |q_j · k_{t, j}|`` with ``q`` (``query=``):

* ``window_mean`` (default): ``q̄``, the mean over the last ``window`` prompt positions of the window queries
  averaged within the kv-head's query group, i.e. exactly SparK's paper saliency ``|q̄_j|·|k_tj|`` (Eq. 6), the
  quantity the method ranks channels by;
* ``last``: the query of the prompt's last position (group-averaged), the query that picks the first answer token.

The paper's Fig. 2a plots such per-token, per-channel contributions for one head; its text does not say which
query it used. Per channel, the coefficient of variation across tokens (Appendix B) is ``CV_j = σ_j / μ_j`` with
``μ_j = E_t[c[t, j]]`` and ``σ_j = (E_t[(c[t, j] − μ_j)²])^½`` (population moments); the paper reports the average
CV above 1.1. The top-T overlap measures "unstructured" directly: each token's top ``T = ⌊(1 − λ)·D⌋`` channels
``S_t``; the mean over token pairs ``t ≠ u`` of ``|S_t ∩ S_u| / T`` is 1 when every token keeps the same channels (a
structured method loses nothing) and ``T / D`` when the sets are unrelated; ``recall`` is the mean share of ``S_t``
inside the head's single best ``T`` channels (by ``Σ_t c[t, j]²``, ThinK's kind of score), what a structured method
keeps of each token's own choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spark_bench.engine.prefill import LayerPrefill, Prefill

QUERY_MODES = ("window_mean", "last")
PAPER_LAYER, PAPER_HEAD, PAPER_CV = 18, 0, 1.1  # Fig. 2: "the 18th attention layer and the 0th attention head"


def contributions(layer: LayerPrefill, query: str = "window_mean", window: int = 32) -> torch.Tensor:
    """``(H_kv, S, D)`` float32 ``|q_j · k_{t,j}|`` of batch row 0 (see the module docstring for ``query``)."""
    if query not in QUERY_MODES:
        raise ValueError(f"query must be one of {', '.join(QUERY_MODES)}; got {query!r}")
    grouped = layer.grouped_window_queries(window if query == "window_mean" else 1)[0].float()  # (H_kv, W, D)
    q = grouped.mean(dim=1)
    return (q.unsqueeze(1) * layer.keys[0].float()).abs()


def channel_cv(c: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation across tokens of each channel: ``c (…, S, D)`` → ``(…, D)`` (NaN where a channel
    contributes nothing to any token)."""
    mean = c.mean(dim=-2)
    std = c.std(dim=-2, correction=0)
    return torch.where(mean > 0, std / mean, torch.full_like(mean, float("nan")))


def kept_channels(head_dim: int, ratio: float) -> int:
    """``T = ⌊(1 − λ)·D⌋`` (the paper's count; at least one channel)."""
    return max(int((1 - ratio) * head_dim + 1e-9), 1)


def top_overlap(c: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``c (H, S, D)``: per head, the mean over token pairs ``t ≠ u`` of ``|S_t ∩ S_u| / T`` and the mean share of
    ``S_t`` inside the head's global top-T channels; each ``(H,)``. Computed from the per-channel counts ``n_j``
    (tokens keeping ``j``): ``Σ_{t≠u} |S_t ∩ S_u| = Σ_j n_j (n_j − 1)``, no ``S × S`` matrix."""
    h, s, d = c.shape
    t = kept_channels(d, ratio)
    top = c.topk(t, dim=-1).indices                                    # (H, S, T)
    chosen = torch.zeros_like(c, dtype=torch.bool).scatter_(-1, top, True)
    counts = chosen.sum(dim=1).double()                                 # (H, D): tokens keeping each channel
    pairs = (counts * (counts - 1)).sum(dim=-1)
    overlap = pairs / (s * (s - 1) * t) if s > 1 else torch.ones(h, dtype=torch.float64)
    best = c.double().pow(2).sum(dim=1).topk(t, dim=-1).indices         # (H, T): a structured method's channels
    structured = torch.zeros(h, d, dtype=torch.bool, device=c.device).scatter_(-1, best, True)
    recall = (chosen & structured.unsqueeze(1)).sum(dim=-1).double().mean(dim=-1) / t
    return overlap.float(), recall.float()


@dataclass
class SampleAnalysis:
    """One prompt: per-channel CVs ``(L, H, D)``; per λ, the overlap and recall ``(L, H)``; the contributions of the
    chosen layer and head ``(S, D)`` (for the figures)."""

    sample_id: str
    tokens: int
    cv: np.ndarray
    overlap: dict
    recall: dict
    chosen: np.ndarray


def analyze(prefill: Prefill, sample_id: str, query: str, window: int, ratios, layer: int, head: int
            ) -> SampleAnalysis:
    """Every layer and kv-head of one prefill (one layer's contributions at a time, so the whole ``(L, H, S, D)``
    tensor is never held)."""
    cvs, overlaps, recalls, chosen = [], {r: [] for r in ratios}, {r: [] for r in ratios}, None
    for i, layer_prefill in enumerate(prefill.layers):
        c = contributions(layer_prefill, query, window)
        cvs.append(channel_cv(c).cpu().numpy())
        for r in ratios:
            o, rec = top_overlap(c, r)
            overlaps[r].append(o.cpu().numpy())
            recalls[r].append(rec.cpu().numpy())
        if i == layer:
            chosen = c[head].cpu().numpy()
    return SampleAnalysis(sample_id, prefill.prompt_length, np.stack(cvs),
                          {r: np.stack(v) for r, v in overlaps.items()}, {r: np.stack(v) for r, v in recalls.items()},
                          chosen)


def default_layer(num_layers: int) -> int:
    """The paper's layer 18 when the model has it, else the middle layer."""
    return PAPER_LAYER if num_layers > PAPER_LAYER else num_layers // 2


def summarize(samples: list[SampleAnalysis], layer: int, head: int, resamples: int = 1000, seed: int = 0) -> dict:
    """Averages over samples (each prompt weighs the same) with 95% bootstrap intervals over samples: the mean CV
    over every layer, head and channel, and of the chosen head; the overlap and recall per λ; the verdict against
    the paper's "average CV exceeds 1.1"."""
    rng = np.random.default_rng(seed)
    n = len(samples)
    idx = rng.integers(0, n, size=(resamples, n))

    def interval(values: np.ndarray) -> dict:
        values = np.asarray(values, dtype=float)
        reps = values[idx].mean(axis=1)
        low, high = np.percentile(reps, [2.5, 97.5])
        return {"mean": float(values.mean()), "low": float(low), "high": float(high)}

    overall = np.array([np.nanmean(s.cv) for s in samples])
    paper_head = np.array([np.nanmean(s.cv[layer, head]) for s in samples])
    per_head = np.nanmean(np.stack([s.cv for s in samples]), axis=(0, 3))   # (L, H)
    ratios = list(samples[0].overlap)
    d = samples[0].cv.shape[-1]
    out = {
        "samples": n, "tokens": [s.tokens for s in samples], "layer": layer, "head": head,
        "layers": int(samples[0].cv.shape[0]), "kv_heads": int(samples[0].cv.shape[1]), "head_dim": d,
        "cv_all": interval(overall), "cv_chosen_head": interval(paper_head),
        "cv_per_layer_head": per_head.round(4).tolist(),
        "overlap": {str(r): {"kept": kept_channels(d, r), "chance": kept_channels(d, r) / d,
                             "overlap": interval([np.mean(s.overlap[r]) for s in samples]),
                             "recall": interval([np.mean(s.recall[r]) for s in samples]),
                             "overlap_chosen_head": interval([s.overlap[r][layer, head] for s in samples])}
                    for r in ratios},
    }
    verdict = "holds" if out["cv_all"]["low"] > PAPER_CV else (
        "does not hold" if out["cv_all"]["high"] < PAPER_CV else "is not decided (the interval contains 1.1)")
    out["verdict"] = (f"Observation 1 (average CV > {PAPER_CV}) {verdict}: average CV {out['cv_all']['mean']:.3f} "
                      f"[{out['cv_all']['low']:.3f}, {out['cv_all']['high']:.3f}] over {n} prompts")
    return out
