"""Value-channel pruning (paper Appendix D): per token, keep the value channels with the largest importance.

``value_score``:

* ``norm`` (the paper's text, "norm-based scoring"): the importance of value channel ``c`` of token ``t`` is
  ``|v_tc|``.
* ``fork`` (the official SparK code, ``compress_values``): ``0.7·|v_tc| + 0.3·div_tc`` with the diversity
  ``div_tc = (Var_t'(v_t'c) + Var_c'(v_tc')) / 2`` (unbiased variances over the stored tokens of the head and over the
  token's channels), divided by its maximum over the head (+1e-8).

The ``int(λ_v·D)`` least important entries of each token are pruned (``T_v = D − int(λ_v·D)`` kept, as for keys in
the official code). ``value_fill``: ``zero`` (pruned entries read as zero: values enter the weighted sum directly,
so no rescaling is needed) or ``mean`` (the fork's ``generate_value_mean_fill``: the mean of the token's pruned
values, one number per token and head kept as metadata).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.methods.channel.recovery import ConstantFill, TokenFill
from spark_bench.storage.stores import UnstructuredStore

VALUE_SCORES = ("norm", "fork")
VALUE_FILLS = ("zero", "mean")


def value_scores(values: torch.Tensor, score: str = "norm") -> torch.Tensor:
    """``(B, H, S, D)`` float32 importance of every value entry (see the module docstring)."""
    v = values.float()
    if score == "norm":
        return v.abs()
    if score != "fork":
        raise ValueError(f"value_score must be one of {VALUE_SCORES}, got {score!r}")
    across_tokens = v.var(dim=2, keepdim=True) if v.shape[2] > 1 else torch.zeros_like(v[:, :, :1])
    diversity = (across_tokens + v.var(dim=3, keepdim=True)) / 2  # broadcasts to (B, H, S, D)
    diversity = diversity / (diversity.amax(dim=(2, 3), keepdim=True) + 1e-8)
    return 0.7 * v.abs() + 0.3 * diversity


@dataclass(frozen=True)
class ValueNorm:
    ratio: float
    score: str = "norm"
    fill: str = "zero"

    def __post_init__(self):
        if self.score not in VALUE_SCORES:
            raise ValueError(f"value_score must be one of {VALUE_SCORES}, got {self.score!r}")
        if self.fill not in VALUE_FILLS:
            raise ValueError(f"value_fill must be one of {VALUE_FILLS}, got {self.fill!r}")

    def compress_values(self, values: torch.Tensor) -> UnstructuredStore:
        d = values.shape[-1]
        top = value_scores(values, self.score).topk(d - int(self.ratio * d), dim=-1, sorted=False).indices
        mask = torch.zeros(values.shape, dtype=torch.bool, device=values.device).scatter_(-1, top, True)
        if self.fill == "zero":
            return UnstructuredStore.from_mask(values, mask, ConstantFill(0.0))
        pruned = ~mask
        mean = (values.float() * pruned).sum(-1) / (pruned.sum(-1) + 1e-8)
        return UnstructuredStore.from_mask(values, mask, TokenFill(mean.to(values.dtype)))
