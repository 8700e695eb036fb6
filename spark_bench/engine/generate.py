"""Continue from compressed caches with transformers' own ``model.generate``.

``model.generate`` restarts from a cache the usual way: the cache says how many tokens it has seen, generate runs
the rest of ``input_ids`` through it, then decodes with its own logits processors, sampling and stopping criteria.
:class:`GenerationCache` is a :class:`~spark_bench.engine.cache.BatchedCache` (each row's compact stores, the decoded
tokens dense) that reports the *uncompressed* count, so positions continue from the uncompressed prompt length, as
the harness's decoding does (and kvpress / the official SparK code).

When the whole prompt is compressed (``compress_scope=prompt``) no prompt token is left to run, and the first answer
token comes from the full-cache prefill's logits. generate needs one forward to start, so the cache reports one token
fewer and *replays* the prompt's last token: in that forward the cache stores nothing and attention returns zeros,
and a forward hook replaces the forward's logits by the prefill's. generate then picks the first token from exactly
the logits the harness uses, through its own processors. The step costs one decode forward without attention.

generate only forwards the keyword arguments a model declares, so the cache reaches the attention function (as the
``compressed_cache`` keyword, like :func:`~spark_bench.engine.decode.decode_rows` passes it) through a forward
pre-hook on the model. Everything switched on for a call (the attention function, the two hooks) is undone when it
returns or raises.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from spark_bench.engine.attention import compressed_attention_enabled
from spark_bench.engine.cache import BatchedCache, CompressedCache


@dataclass
class CompressedContext:
    """A prompt compressed under one method config: ``input_ids[:end]`` in ``cache``'s compact stores; the rest of
    ``input_ids`` (under ``compress_scope`` ``question`` / ``context``: the end of turn, the assistant header, the
    question) is run through the cache, uncompressed, when generation starts. ``first_logits``: the full-cache
    prefill's logits after ``input_ids`` (None when part of it is left to run)."""

    cache: CompressedCache
    input_ids: tuple[int, ...]
    end: int
    first_logits: torch.Tensor | None
    dense_bytes: int  # a dense cache of all of input_ids, in the model's dtype
    method: object = None  # the MethodConfig it was compressed under
    label: str = ""
    prefill_s: float = 0.0
    compress_s: float = 0.0

    @property
    def suffix(self) -> tuple[int, ...]:
        return self.input_ids[self.end:]

    @property
    def nbytes(self) -> int:
        """Bytes the compressed stores hold (keys, values, validity bits), as allocated."""
        return self.cache.nbytes()

    @property
    def dense_nbytes(self) -> int:
        """Bytes a dense cache of the same ``end`` tokens holds."""
        return self.end * self.dense_bytes // len(self.input_ids)

    @property
    def kv_bytes(self) -> int:
        """Bytes held when decoding starts: the compressed stores plus the suffix run through them (dense); the
        harness's ``kv_bytes`` column."""
        return self.nbytes + len(self.suffix) * self.dense_bytes // len(self.input_ids)

    @property
    def key_ratio(self) -> float:
        """Achieved key pruning ratio over the stored tokens (the paper's "Overall Ratio", Table 5)."""
        return round(1 - self.cache.kept_key_fraction(), 6)


class GenerationCache(BatchedCache):
    """The rows of one ``model.generate`` call (contexts of the same prompt), each over its own stores (no copy: the
    contexts stay usable for the next call). ``seen``: the uncompressed length of the compressed part; ``replay``:
    ``(R, V)`` logits to replay for the prompt's last token (see the module docstring), or None."""

    def __init__(self, caches: list[CompressedCache], capacity: int, seen: int, replay: torch.Tensor | None = None,
                 stack: bool = True):
        super().__init__(caches, capacity, stack, consume=False)
        self.seen = seen
        self.replay = replay

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen + self.layers[layer_idx].length - (self.replay is not None)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0  # the attention function masks by itself

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.replay is not None:  # the replayed token is already in the stores
            return key_states, value_states
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        if self.replay is not None:  # the replayed forward's output is replaced by the prefill's logits
            return query.new_zeros(query.shape).transpose(1, 2)
        return super().attend(layer_idx, query, scaling)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise RuntimeError("compressed caches decode one sequence per row: beam search is not supported")


@contextmanager
def generation_switched_on(model: nn.Module, cache: GenerationCache):
    """Within the block, the model's attention reads ``cache``'s stores (forwards given ``past_key_values=cache`` get
    ``compressed_cache=cache``) and, while ``cache.replay`` is set, its next forward returns the replayed logits;
    all of it is undone on exit, also when an exception escapes."""

    def pass_cache(module, args, kwargs):
        if kwargs.get("past_key_values") is cache:
            kwargs["compressed_cache"] = cache
        return args, kwargs

    def put_replayed_logits(module, args, kwargs, output):
        if cache.replay is not None and kwargs.get("past_key_values") is cache:
            logits = output.logits
            logits[:, -1] = cache.replay.to(device=logits.device, dtype=logits.dtype)
            cache.replay = None
        return output

    handles = [model.register_forward_pre_hook(pass_cache, with_kwargs=True),
               model.register_forward_hook(put_replayed_logits, with_kwargs=True)]
    try:
        with compressed_attention_enabled(model):
            yield
    finally:
        for handle in handles:
            handle.remove()


def generation_capacity(model: nn.Module, prompt_length: int, kwargs: dict) -> int:
    """Decoded tokens to preallocate per row: ``max_new_tokens`` (or ``max_length`` − the prompt), from the call's
    arguments, its ``generation_config`` or the model's. A hint only: the tail grows if generation runs longer."""
    config = kwargs.get("generation_config") or model.generation_config
    new = kwargs.get("max_new_tokens", config.max_new_tokens)
    if new is None:
        new = kwargs.get("max_length", config.max_length) - prompt_length
    return max(int(new), 1)


@torch.no_grad()
def generate(model: nn.Module, contexts: CompressedContext | list[CompressedContext],
             input_ids: torch.Tensor | list[int] | None = None, stack: bool = True, **generate_kwargs):
    """``model.generate`` continued from compressed contexts, one row per context (all built from the same prompt);
    returns what ``model.generate`` returns (the sequences: ``input_ids`` then the new tokens, per row).

    ``input_ids``: the tokens to continue from (default: the contexts' own prompt, suffix included); they must
    begin with the compressed tokens, and whatever follows them runs through the cache first (e.g. a question
    over a compressed context). ``generate_kwargs`` go to ``model.generate`` (``max_new_tokens``, ``do_sample``,
    ``temperature``, ``eos_token_id``, ``stop_strings`` with ``tokenizer``, ``streamer``, ...); beam search and
    assisted decoding are not supported. ``stack`` (default, as the harness): the rows a compact kernel serves share
    one kernel call per layer (:class:`~spark_bench.engine.cache.BatchedLayer`), reading the contexts' stores in
    place (nothing is copied; the contexts stay usable); ``False``: each row on its own."""
    contexts = [contexts] if isinstance(contexts, CompressedContext) else list(contexts)
    if not contexts:
        raise ValueError("generate needs at least one compressed context")
    first = contexts[0]
    ids = list(first.input_ids) if input_ids is None else (
        input_ids.reshape(-1).tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids))
    for c in contexts:
        if c.end != first.end or tuple(c.input_ids[:c.end]) != tuple(ids[:first.end]):
            raise ValueError("input_ids must begin with the tokens every context compressed "
                             f"({first.end} tokens); a batch of contexts must share them")
    if len(ids) < first.end:
        raise ValueError(f"input_ids holds {len(ids)} tokens, fewer than the {first.end} compressed ones")
    replay = None
    if len(ids) == first.end:
        if any(c.first_logits is None for c in contexts):
            raise ValueError("nothing follows the compressed tokens and no prefill logits were kept for them")
        replay = torch.stack([c.first_logits.reshape(-1) for c in contexts])
    for key in ("past_key_values", "compressed_cache", "use_cache"):
        if key in generate_kwargs:
            raise ValueError(f"generate sets {key} itself")
    if generate_kwargs.get("num_beams", 1) != 1 or generate_kwargs.get("assistant_model") is not None:
        raise ValueError("compressed contexts support greedy decoding and sampling, not beam search or assisted "
                         "decoding")
    device = model.get_input_embeddings().weight.device
    batch = torch.tensor([ids] * len(contexts), device=device)
    cache = GenerationCache([c.cache for c in contexts],
                            len(ids) - first.end + generation_capacity(model, len(ids), generate_kwargs),
                            seen=first.end, replay=replay, stack=stack)
    with generation_switched_on(model, cache):
        return model.generate(batch, past_key_values=cache, use_cache=True,
                              **generate_kwargs)
