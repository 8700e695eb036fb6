"""A store whose older tokens are compact and whose most recent tokens are kept dense: Mustafar's local window.

Mustafar's official code (github dhjoo98/mustafar, ``models/llama_mustafar_Kt_Mag_Vt_Mag.py``,
``LlamaFlashAttention_MUSTAFAR.forward``) prunes every prompt token but the last ``residual_length`` (32 in its
``long_test.sh``), for keys and for values alike. :class:`WindowedStore` holds exactly that: ``old``, any compact
store of the first ``S − R`` tokens (an :class:`~.stores.UnstructuredStore` with a zero fill: the fused kernel's
``bare`` member kind for keys), and ``recent``, the last ``R`` tokens as they are ``(B, H, R, D)``.

Nothing is rebuilt to answer :meth:`nbytes`: it is the compact part's bytes plus the recent tokens' bytes. As keys,
the segment tables of :mod:`.segments` describe it as two segments per head (the compact part's, then a dense one
for the window), so a Mustafar row stacks with the batch's others; a row on the per-row path (``decode_stack=false``,
or values held this way) has :func:`~.dispatch.compact_logits` serve the compact part with the C++ kernel and the
recent tokens with a plain product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_bench.storage.bits import tensor_bytes
from spark_bench.storage.stores import Store, dense_logits


@dataclass(frozen=True)
class WindowedStore:
    """``old``: a store of the first ``S − R`` tokens; ``recent``: the last ``R`` tokens dense ``(B, H, R, D)``."""

    old: Store
    recent: torch.Tensor

    def __post_init__(self):
        b, h, _, d = self.old.shape
        if tuple(self.recent.shape[:2]) != (b, h) or self.recent.shape[-1] != d:
            raise ValueError(f"recent tokens of shape {tuple(self.recent.shape)} for a compact part of shape "
                             f"{tuple(self.old.shape)}")

    @property
    def length(self) -> int:
        return self.old.length + self.recent.shape[-2]

    @property
    def old_length(self) -> int:
        return self.old.length

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h, _, d = self.old.shape
        return (b, h, self.length, d)

    @property
    def dtype(self) -> torch.dtype:
        return self.recent.dtype

    @property
    def device(self) -> torch.device:
        return self.recent.device

    def materialize(self) -> torch.Tensor:
        return torch.cat([self.old.materialize().to(self.recent.dtype), self.recent], dim=-2)

    def logits(self, queries: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.old.logits(queries), dense_logits(queries, self.recent)], dim=-1)

    def nbytes(self) -> int:
        return self.old.nbytes() + tensor_bytes(self.recent)

    def kept_fraction(self) -> float:
        old, recent = self.old.length, self.recent.shape[-2]
        return (self.old.kept_fraction() * old + recent) / max(old + recent, 1)
