"""Continue from compressed caches with transformers' own ``model.generate``.

``model.generate`` restarts from a cache the usual way: the cache says how many tokens it has seen, generate runs
the rest of ``input_ids`` through it, then decodes with its own logits processors, sampling and stopping criteria.
:class:`SparkCache` is a :class:`~spark_bench.engine.cache.BatchedCache` (each row's compact stores, the decoded
tokens dense) that reports the *uncompressed* count, so positions continue from the uncompressed prompt length, as
the harness's decoding does (and kvpress / the official SparK code).

When the whole prompt is compressed (``compress_scope=prompt``) no prompt token is left to run, and the first answer
token comes from the full-cache prefill's logits. generate needs one forward to start, so the cache reports one token
fewer and *replays* the prompt's last token: in that forward the cache stores nothing and attention returns zeros,
and a forward hook replaces the forward's logits by the prefill's. generate then picks the first token from exactly
the logits the harness uses, through its own processors. The step costs one decode forward without attention.

The attention function finds the cache through the keys its ``update`` returned
(:data:`~spark_bench.engine.attention.CACHE_ATTRIBUTE`), so the same cache also serves ``model.generate``,
pipelines and hand-written ``model(...)`` loops on a model whose attention is ``spark_bench``. The replay needs a
forward hook; :func:`generate` puts it on for the call and undoes it (and the attention switch) when it returns or
raises. Contexts of different prompts decode together through the harness's greedy decoder
(:func:`~spark_bench.engine.decode.decode_rows`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from spark_bench.engine.attention import ATTENTION_NAME, CACHE_ATTRIBUTE, compressed_attention_enabled
from spark_bench.engine.cache import BatchedCache, CompressedCache, store_device
from spark_bench.engine.fastpaths import FastPaths
from spark_bench.engine.prefill import attention_modules, model_key


CACHE_API = frozenset({"is_compileable", "get_seq_length", "get_mask_sizes", "update", "layers", "is_sliding",
                       "max_batch_size", "max_cache_len", "reorder_cache", "crop", "batch_repeat_interleave"})


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
    model_key: tuple = ()  # model_key() of the model it was compressed with (checked when it is used)
    source: tuple | None = None  # (context text, chat_template, separator) when compressed from text (ask)

    def __getattr__(self, name: str):
        """A context passed where transformers expects a cache (``past_key_values=context``) fails on its first
        cache attribute with one line saying what to pass instead."""
        if name in CACHE_API:
            raise ValueError("past_key_values: a CompressedContext is not a transformers Cache; pass "
                             "context.as_cache() (on the spark_bench attention), or use spark_bench.generate / "
                             "spark_bench.press")
        raise AttributeError(f"'CompressedContext' object has no attribute {name!r}")

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
    def first_token(self) -> int | None:
        """The greedy first answer token when the whole prompt is compressed (from the prefill's logits)."""
        return None if self.first_logits is None else int(self.first_logits.argmax())

    def continuation_ids(self) -> list[int]:
        """Token ids to hand ``model.generate`` with :meth:`as_cache`: the prompt, plus the greedy first token when
        nothing follows the compressed part (the cache cannot give generate the prefill's logits; spark_bench.generate
        replays them instead, for sampling too)."""
        ids = list(self.input_ids)
        return ids if self.suffix else ids + [self.first_token]

    def as_cache(self, rows: int = 1, max_new_tokens: int = 256, stack: bool = True,
                 checks: FastPaths | None = None) -> "SparkCache":
        """A fresh :class:`SparkCache` over this context's stores (``rows`` rows reading them, nothing copied) for
        ``model.generate(context.continuation_ids(), past_key_values=cache)`` or a ``model(...)`` loop on a model
        whose attention is ``spark_bench``. A cache is used up by one generation; the context is not. ``checks``:
        the fast-path record its attention checks against (:mod:`~spark_bench.engine.fastpaths`; default: its own)."""
        if rows < 1:
            raise ValueError(f"rows={rows}: a cache needs at least one row")
        return SparkCache([self.cache] * rows, len(self.suffix) + 1 + max_new_tokens, seen=self.end, stack=stack,
                          fast_paths=checks)

    def save(self, path) -> "Path":
        """Write the compact stores to ``path`` (safetensors; :mod:`spark_bench.engine.saved`)."""
        from spark_bench.engine.saved import save_context

        return save_context(self, path)

    @classmethod
    def load(cls, path, model: nn.Module) -> "CompressedContext":
        """A context :meth:`save` wrote, for ``model`` (refused in one line if another model's)."""
        from spark_bench.engine.saved import load_context

        return load_context(cls, path, model)

    @property
    def key_ratio(self) -> float:
        """Achieved key pruning ratio over the stored tokens (the paper's "Overall Ratio", Table 5)."""
        return round(1 - self.cache.kept_key_fraction(), 6)


class SparkCache(BatchedCache):
    """A :class:`transformers.Cache` over compressed contexts, one row each (rows may share a context: sampling's
    ``num_return_sequences``), reading their stores in place (nothing is copied; the contexts stay usable). Pass it
    as ``past_key_values=`` to ``model.generate``, a pipeline or ``model(...)`` on a model whose attention is
    ``spark_bench`` (:mod:`spark_bench.engine.attention`); the tokens run through it land in a dense tail.

    ``seen``: the uncompressed length of the compressed part (what :meth:`get_seq_length` reports first, so
    positions continue from the uncompressed prompt, as the harness decodes); ``replay``: ``(R, V)`` logits to
    replay for the prompt's last token (the module docstring; only :func:`generate` sets it, with its hook);
    ``fast_paths``: the run's record of its fast paths (:class:`~spark_bench.engine.cache.BatchedCache`).
    """

    def __init__(self, caches: list[CompressedCache], capacity: int, seen: int, replay: torch.Tensor | None = None,
                 stack: bool = True, fast_paths: FastPaths | None = None):
        super().__init__(caches, capacity, stack, consume=False, fast_paths=fast_paths)
        self.seen = seen
        self.replay = replay
        self.store_bytes = sum({id(c): c.nbytes() for c in caches}.values())  # each context once
        self._unattended: int | None = None  # the layer updated last and not yet attended (misuse check)
        self._positions_checked = False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen + self.layers[layer_idx].length - (self.replay is not None)

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older callers pass cache_position
            query_length = query_length.shape[0]
        return self.get_seq_length(layer_idx) + query_length, 0  # the attention function masks by itself

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._unattended is None and not self._positions_checked:  # the first update: the attention module that
            caller = sys._getframe(1).f_locals.get("self")  # calls it names its attention function (another one,
            implementation = getattr(getattr(caller, "config", None), "_attn_implementation", ATTENTION_NAME)
            if implementation != ATTENTION_NAME:  # e.g. sdpa under model.generate, would fail on the mask's shape)
                self._unattended = layer_idx
        if self._unattended is not None:
            raise ValueError(f"past_key_values: layer {self._unattended} of a spark_bench cache ran another "
                             "attention function (it needs the model's spark_bench attention): call "
                             "model.set_attn_implementation('spark_bench') (dense caches still run sdpa), or use "
                             "spark_bench.generate / spark_bench.press")
        layer = self.layers[layer_idx]
        if key_states.shape[0] != layer.tail_keys.shape[0]:
            raise ValueError(f"past_key_values: the cache has {layer.tail_keys.shape[0]} rows, the input "
                             f"{key_states.shape[0]}; build it with context.as_cache(rows=...) or use "
                             "spark_bench.generate(..., num_return_sequences=k)")
        if key_states.device != layer.tail_keys.device:
            raise ValueError(f"past_key_values: layer {layer_idx}'s stores are on {layer.tail_keys.device} but the "
                             f"model runs it on {key_states.device}; compress again on the model's device")
        if key_states.shape[-2] == 0:
            raise ValueError("input_ids: nothing follows the compressed tokens; pass input_ids that continue them "
                             "(context.continuation_ids()), or use spark_bench.generate")
        if self.replay is None:
            super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self._unattended = layer_idx
        setattr(key_states, CACHE_ATTRIBUTE, self)
        return key_states, value_states

    def check_positions(self, layer_idx: int, position_ids: torch.Tensor, q_len: int) -> None:
        """On the first forward (one host read): its tokens must continue the compressed ones. ``model.generate``
        given exactly the compressed tokens would run them all again through the cache."""
        if self._positions_checked or layer_idx != 0:
            return
        self._positions_checked = True
        expected = self.seen - 1 if self.replay is not None else self.seen + self.layers[0].length - q_len
        first = int(position_ids.reshape(-1)[0])
        if first != expected:
            raise ValueError(f"input_ids: the forward starts at position {first} but the cache holds {expected} "
                             "tokens; pass input_ids that continue the compressed ones (context.continuation_ids()), "
                             "or use spark_bench.generate")

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        self._unattended = None
        if self.replay is not None:  # the replayed forward's output is replaced by the prefill's logits
            return query.new_zeros(query.shape).transpose(1, 2)
        return super().attend(layer_idx, query, scaling)

    def nbytes(self) -> int:
        """Bytes held: the contexts' compressed stores (each once, however many rows read it) plus the tokens run
        through the cache so far, dense (the harness's ``kv_bytes`` once a context's suffix has run)."""
        layer = self.layers[0]
        per_token = sum(2 * lay.tail_keys[:, :, :1].numel() * lay.tail_keys.element_size() for lay in self.layers)
        return self.store_bytes + layer.length * per_token

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise ValueError("num_beams: compressed caches decode one sequence per row; use greedy decoding or "
                         "sampling (num_return_sequences=k), not beam search")


@contextmanager
def generation_switched_on(model: nn.Module, cache: SparkCache):
    """Within the block, the model's attention is ``spark_bench`` and, while ``cache.replay`` is set, its next forward
    returns the replayed logits; all of it is undone on exit, also when an exception escapes."""

    def put_replayed_logits(module, args, kwargs, output):
        if cache.replay is not None and kwargs.get("past_key_values") is cache:
            logits = output.logits
            logits[:, -1] = cache.replay.to(device=logits.device, dtype=logits.dtype)
            cache.replay = None
        return output

    handles = [model.register_forward_hook(put_replayed_logits, with_kwargs=True)]
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


def check_contexts(model: nn.Module, contexts: list[CompressedContext]) -> None:
    """One-line refusals for contexts the model cannot continue: compressed by another model, or stored on
    another device than the layer that reads them (the model moved since)."""
    key = model_key(model)
    for c in contexts:
        if c.model_key and c.model_key != key:
            raise ValueError(f"contexts: compressed by another model ({c.model_key[0]!r}: {c.model_key[1]} layers, "
                             f"{c.model_key[2]} kv heads × {c.model_key[3]}); this model is {key[0]!r}: {key[1]} "
                             f"layers, {key[2]} kv heads × {key[3]}")
    for module in attention_modules(model):
        device = module.k_proj.weight.device
        for c in contexts:
            held = store_device(c.cache.layers[module.layer_idx].value_store)
            if held != device and not (held.type == device.type == "cpu"):
                raise ValueError(f"contexts: layer {module.layer_idx}'s stores are on {held} but the model now runs "
                                 f"it on {device}; compress again after moving the model")


def check_vocabulary(ids: list[int], model: nn.Module, argument: str) -> None:
    """One line when a token id lies outside the model's vocabulary (the embedding would fail inside torch)."""
    vocab = model.get_input_embeddings().num_embeddings
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise ValueError(f"{argument}: token id {bad} is outside the model's vocabulary (0 … {vocab - 1})")


def _ids_of(input_ids) -> list[int]:
    return input_ids.reshape(-1).tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)


@torch.no_grad()
def generate(model: nn.Module, contexts: CompressedContext | list[CompressedContext],
             input_ids: torch.Tensor | list[int] | None = None, stack: bool = True, checks: FastPaths | None = None,
             **generate_kwargs):
    """``model.generate`` continued from compressed contexts, one row per context; returns what ``model.generate``
    returns (the sequences: ``input_ids`` then the new tokens, per row).

    ``input_ids``: the tokens to continue from (default: the contexts' own prompt, suffix included); they must
    begin with the compressed tokens, and whatever follows them runs through the cache first (e.g. a question
    over a compressed context). ``generate_kwargs`` go to ``model.generate`` (``max_new_tokens``, ``do_sample``,
    ``temperature``, ``num_return_sequences``, ``eos_token_id``, ``stop_strings`` with ``tokenizer``, ``streamer``,
    ...); ``num_return_sequences=k`` reads each context's stores from k rows (nothing copied); beam search and
    assisted decoding are refused. ``stack`` (default, as the harness): the rows a compact kernel serves share one
    kernel call per layer (:class:`~spark_bench.engine.cache.BatchedLayer`); ``False``: each row on its own.
    ``checks``: the fast-path record (:mod:`~spark_bench.engine.fastpaths`; default: a new one, the call a run of its
    own): pass one :class:`~spark_bench.engine.fastpaths.FastPaths` to several calls to check each variant once
    over them and keep a fallback.

    Contexts of *different* prompts (a batch of :func:`spark_bench.compress` calls) decode together through the
    harness's greedy decoder, each row with its own positions and stop tokens (``max_new_tokens``,
    ``min_new_tokens``, ``eos_token_id``; sampling is refused): returns one 1-D tensor per context, its prompt then
    its new tokens (up to, not including, a stop token), the tokens of decoding it alone."""
    contexts = [contexts] if isinstance(contexts, CompressedContext) else list(contexts)
    if not contexts or not all(isinstance(c, CompressedContext) for c in contexts):
        raise ValueError("contexts: generate takes a CompressedContext (spark_bench.compress) or a non-empty list")
    check_contexts(model, contexts)
    first = contexts[0]
    for key in ("past_key_values", "compressed_cache", "use_cache"):
        if key in generate_kwargs:
            raise ValueError(f"{key}: generate sets it itself")
    if generate_kwargs.get("num_beams", 1) != 1 or generate_kwargs.get("assistant_model") is not None:
        raise ValueError("num_beams: compressed contexts support greedy decoding and sampling "
                         "(num_return_sequences=k), not beam search or assisted decoding")
    if input_ids is None and any(c.input_ids != first.input_ids for c in contexts):
        return _generate_apart(model, contexts, stack, generate_kwargs, checks)
    ids = list(first.input_ids) if input_ids is None else _ids_of(input_ids)
    for c in contexts:
        if c.end != first.end or tuple(c.input_ids[:c.end]) != tuple(ids[:first.end]):
            raise ValueError("input_ids must begin with the tokens every context compressed "
                             f"({first.end} tokens); a batch of contexts must share them")
    if len(ids) < first.end:
        raise ValueError(f"input_ids holds {len(ids)} tokens, fewer than the {first.end} compressed ones")
    check_vocabulary(ids, model, "input_ids")
    copies = int(generate_kwargs.get("num_return_sequences") or 1)
    rows = [c for c in contexts for _ in range(copies)]  # generate expands input ids the same way (interleaved)
    replay = None
    if len(ids) == first.end:
        if any(c.first_logits is None for c in contexts):
            raise ValueError("nothing follows the compressed tokens and no prefill logits were kept for them")
        replay = torch.stack([c.first_logits.reshape(-1) for c in rows])
    device = model.get_input_embeddings().weight.device
    batch = torch.tensor([ids] * len(contexts), device=device)
    cache = SparkCache([c.cache for c in rows],
                       len(ids) - first.end + generation_capacity(model, len(ids), generate_kwargs),
                       seen=first.end, replay=replay, stack=stack, fast_paths=checks)
    with generation_switched_on(model, cache):
        return model.generate(batch, past_key_values=cache, use_cache=True, **generate_kwargs)


GREEDY_KEYS = {"max_new_tokens", "min_new_tokens", "eos_token_id", "do_sample", "pad_token_id"}


def _generate_apart(model: nn.Module, contexts: list[CompressedContext], stack: bool, kwargs: dict,
                    checks: FastPaths | None) -> list:
    """Contexts of different prompts: the harness's batched greedy decoder (:func:`decode_rows`)."""
    from spark_bench.engine.decode import DecodeRow, decode_rows

    other = sorted(set(kwargs) - GREEDY_KEYS)
    if other or kwargs.get("do_sample"):
        raise ValueError(f"{', '.join(other) or 'do_sample'}: contexts of different prompts decode together "
                         f"greedily (keys: {', '.join(sorted(GREEDY_KEYS - {'do_sample', 'pad_token_id'}))}); "
                         "sample each prompt with its own generate call")
    config = model.generation_config
    stops = kwargs.get("eos_token_id", config.eos_token_id)
    stops = frozenset([] if stops is None else [stops] if isinstance(stops, int) else stops)
    max_new = kwargs.get("max_new_tokens") or config.max_new_tokens or 20
    rows = [DecodeRow(c.cache, c.first_logits, c.end, max_new, stops, kwargs.get("min_new_tokens") or 0,
                      suffix=c.suffix) for c in contexts]
    decode_rows(model, rows, stack=stack, graph=False, checks=checks)
    return [torch.tensor(list(c.input_ids) + row.tokens) for c, row in zip(contexts, rows)]
