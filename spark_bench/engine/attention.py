"""Decode attention over compressed caches, plugged in through transformers' attention-function registry
(``AttentionInterface``) under its own name, ``spark_bench`` — no transformers function is replaced.

The function finds the cache of a forward in one of two ways: the ``compressed_cache`` keyword (the harness's
:func:`~spark_bench.engine.decode.decode_rows` passes it), or the key tensor that a
:class:`~spark_bench.engine.generate.SparkCache`'s ``update`` returned, which carries its cache under
:data:`CACHE_ATTRIBUTE` (so ``model.generate(..., past_key_values=cache)`` and hand-written loops need no hook). A
forward whose keys carry no compressed cache (a dense ``DynamicCache``, or none) runs transformers' ``sdpa``
function: a model loaded with ``attn_implementation="spark_bench"`` (or switched with
``model.set_attn_implementation("spark_bench")``) runs everything else as it did under ``sdpa``.

:func:`compressed_attention_enabled` switches a model to it for the duration of a block (the harness's decoding,
:func:`spark_bench.generate`) and restores the previous implementation. Prefill never runs through it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTENTION_NAME = "spark_bench"
CACHE_ATTRIBUTE = "spark_bench_cache"  # set on the key tensor a SparkCache.update returns


def compressed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask, dropout: float = 0.0, scaling: float | None = None,
                         compressed_cache=None, **kwargs):
    """transformers attention-function signature, in ``sdpa_attention_forward``'s order (``dropout`` before
    ``scaling``: kvpress wraps every registered function and passes ``dropout`` sixth, by position); ``key``/``value``
    are the step's own keys and values (read from the cache's tail, not from here), or a dense cache's whole keys and
    values (then ``sdpa`` attends them)."""
    cache = compressed_cache if compressed_cache is not None else getattr(key, CACHE_ATTRIBUTE, None)
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    check = getattr(cache, "check_positions", None)
    if check is not None and kwargs.get("position_ids") is not None:
        check(module.layer_idx, kwargs["position_ids"], query.shape[-2])
    return cache.attend(module.layer_idx, query, scale), None


AttentionInterface.register(ATTENTION_NAME, compressed_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # dense forwards get sdpa's masks (compact ones ignore it)


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
