"""Greedy decoding through the model's own forward pass with a (compressed) transformers cache."""

from __future__ import annotations

import torch
from torch import nn

from spark_bench.engine.attention import compressed_attention_enabled
from spark_bench.engine.cache import CompressedCache


def pick(logits: torch.Tensor, banned: frozenset[int] | set[int] = frozenset()) -> int:
    """Greedy choice, never one of ``banned`` (used for ``min_new_tokens``, like transformers' min_length)."""
    if banned:
        logits = logits.clone()
        logits[list(banned)] = float("-inf")
    return int(logits.argmax())


@torch.inference_mode()
def greedy_decode(model: nn.Module, cache: CompressedCache, first_logits: torch.Tensor, prompt_length: int,
                  max_new_tokens: int, stop_token_ids: frozenset[int] | set[int],
                  min_new_tokens: int = 0) -> list[int]:
    """Generate up to ``max_new_tokens`` tokens (the first from the prefill's logits); the first
    ``min_new_tokens`` tokens are never stop tokens.

    Positions continue from the original prompt length even when eviction shortened the cache, so RoPE phases
    match the uncompressed model (as in kvpress / the official SparK code). Stop tokens are not returned.
    Attention reads the compressed stores directly (:mod:`spark_bench.engine.attention`).
    """
    tokens: list[int] = []
    stops = frozenset(stop_token_ids)
    token, position = pick(first_logits, stops if min_new_tokens > 0 else frozenset()), prompt_length
    device = next(model.parameters()).device
    with compressed_attention_enabled(model):
        while token not in stops:
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
            token = pick(out.logits[0, -1], stops if len(tokens) < min_new_tokens else frozenset())
            position += 1
    return tokens
