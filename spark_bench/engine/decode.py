"""Greedy decoding through the model's own forward pass with a (compressed) transformers cache."""

from __future__ import annotations

import torch
from torch import nn

from spark_bench.engine.attention import compressed_attention_enabled
from spark_bench.engine.cache import CompressedCache


@torch.inference_mode()
def greedy_decode(model: nn.Module, cache: CompressedCache, first_token: int, prompt_length: int,
                  max_new_tokens: int, stop_token_ids: frozenset[int]) -> list[int]:
    """Generate up to ``max_new_tokens`` tokens (the first comes from the prefill logits).

    Positions continue from the original prompt length even when eviction shortened the cache, so RoPE phases
    match the uncompressed model (as in kvpress / the official SparK code). Stop tokens are not returned.
    Attention reads the compressed stores directly (:mod:`spark_bench.engine.attention`).
    """
    tokens: list[int] = []
    token, position = first_token, prompt_length
    device = next(model.parameters()).device
    with compressed_attention_enabled(model):
        while token not in stop_token_ids:
            tokens.append(token)
            if len(tokens) >= max_new_tokens:
                break
            out = model(
                input_ids=torch.tensor([[token]], device=device),
                position_ids=torch.tensor([[position]], device=device),
                past_key_values=cache,
                compressed_cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            token = int(out.logits[0, -1].argmax())
            position += 1
    return tokens
