"""Decode attention over a :class:`~spark_bench.engine.cache.CompressedCache`, plugged in through transformers'
attention-function registry (``AttentionInterface``) under its own name — no transformers function is replaced.

During decoding, :func:`compressed_attention_enabled` switches the model to the ``spark_bench`` attention for the
duration of the block; :func:`greedy_decode` passes the cache as the ``compressed_cache`` keyword, which
transformers forwards to the attention function, and each layer attends over its own stores
(:meth:`StoredLayer.attend`). Prefill never runs through it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface

ATTENTION_NAME = "spark_bench"


def compressed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask, scaling: float | None = None, dropout: float = 0.0,
                         compressed_cache=None, **kwargs):
    """transformers attention-function signature; ``key``/``value`` are the dense decoded tail (unused here)."""
    if compressed_cache is None:
        raise RuntimeError("spark_bench attention needs the compressed_cache keyword (decode_rows and "
                           "spark_bench.generate pass it)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return compressed_cache.attend(module.layer_idx, query, scale), None


AttentionInterface.register(ATTENTION_NAME, compressed_attention)


@contextmanager
def compressed_attention_enabled(model: nn.Module):
    """Route the model's attention through :func:`compressed_attention` inside the block, then restore it."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
