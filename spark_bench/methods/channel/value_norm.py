"""Value-channel pruning (paper Appendix D): per token, keep the value channels with the largest magnitude.

For token ``t`` the importance of value channel ``c`` is ``|v_tc|`` (the norm of a single entry); the
``int(λ_v·D)`` smallest are pruned (``T_v = D − int(λ_v·D)`` kept, as for keys in the official code). Values are
consumed directly by the weighted sum, so recovery needs no rescaling: pruned entries read as zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.methods.channel.recovery import ConstantFill
from spark_bench.storage.stores import UnstructuredStore


@dataclass(frozen=True)
class ValueNorm:
    ratio: float

    def compress_values(self, values: torch.Tensor) -> UnstructuredStore:
        d = values.shape[-1]
        top = values.float().abs().topk(d - int(self.ratio * d), dim=-1).indices
        mask = torch.zeros(values.shape, dtype=torch.bool, device=values.device).scatter_(-1, top, True)
        return UnstructuredStore.from_mask(values, mask, ConstantFill(0.0))
