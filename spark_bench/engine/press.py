"""kvpress' habit, ``with press(model): model.generate(...)``, over compressed stores.

Inside :func:`pressed`, every *prefill* forward of the model (one row, an empty or no cache, more than one token)
runs as it always does — the model's own attention, a dense cache — while the window queries the method needs are
recorded (:func:`~spark_bench.engine.prefill.capture_window_queries`); when it returns, its cache is compressed
under the pipeline (:func:`~spark_bench.engine.compress.compress_prefill`, as the harness does) and the forward's
output hands back a :class:`~spark_bench.engine.generate.SparkCache` over the compact stores instead of the dense
cache. ``model.generate`` takes its cache from that output, so its first token comes from the full prefill's
logits and every later step attends over the compact stores (the forwards that read a ``SparkCache`` run the
``spark_bench`` attention, the others the model's own). The whole prompt is compressed
(``compress_scope=prompt``), as kvpress' presses compress what the prefill sees.

Two hooks on the model and the attention switch are all that is changed, and all of it is undone on exit, also when
an exception escapes: the model is bit-identical afterwards.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import nn
from transformers import Cache

from spark_bench.engine.attention import ATTENTION_NAME
from spark_bench.engine.compress import compress_prefill, prefill_hooks, prefill_spec
from spark_bench.engine.fastpaths import FastPaths
from spark_bench.engine.generate import CompressedContext, SparkCache
from spark_bench.engine.prefill import assemble_prefill, capture_window_queries, has_q_norm, model_key

if TYPE_CHECKING:
    from spark_bench.methods import Pipeline

FIRST_CAPACITY = 64  # decoded tokens preallocated per row; the tail doubles when generation runs longer
_ACTIVE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models inside a pressed() block now


class Pressed:
    """What a :func:`pressed` block did: ``contexts``, one :class:`CompressedContext` per prefill it compressed
    (the last is ``context``), with their bytes, times and key ratio; ``checks``: the block's fast-path record (a
    run: every cache the block hands out checks each variant once, :mod:`~spark_bench.engine.fastpaths`)."""

    def __init__(self):
        self.contexts: list[CompressedContext] = []
        self.checks = FastPaths()

    @property
    def context(self) -> CompressedContext | None:
        return self.contexts[-1] if self.contexts else None


@contextmanager
def pressed(model: nn.Module, pipeline: Pipeline):
    """Within the block, the model's prefill forwards compress their cache under ``pipeline`` (module docstring).
    Yields a :class:`Pressed` record of the contexts built. One press at a time per model: entering a second one
    while the first is active is refused (one ``ValueError``; the first stays as it was)."""
    if model in _ACTIVE:
        raise ValueError("press: another spark_bench.press is already active on this model; one press at a time "
                         "(leave its `with` block first, or compress several configs with spark_bench.compress)")
    window, stats, raw_asked = prefill_spec([pipeline])
    hooks = prefill_hooks([pipeline])
    normed = has_q_norm(model)
    config = model.config
    previous = config._attn_implementation
    record = Pressed()
    state: dict = {}

    def before(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        config._attn_implementation = ATTENTION_NAME if isinstance(cache, SparkCache) else previous
        ids = kwargs.get("input_ids", args[0] if args else None)
        fresh = cache is None or (isinstance(cache, Cache) and cache.get_seq_length() == 0)
        if ids is None or ids.shape[-1] < 2 or not fresh or kwargs.get("use_cache") is False:
            return None
        if ids.shape[0] != 1:
            raise ValueError(f"input_ids: press compresses one prompt per forward, got a batch of {ids.shape[0]}; "
                             "for several prompts use spark_bench.compress([...]) and spark_bench.generate")
        length = ids.shape[-1]
        capture = capture_window_queries(model, min(window, length), stats, length, (), raw_asked and normed, hooks)
        state.update(capture=capture, queries=capture.__enter__(), ids=ids[0].tolist(), start=time.perf_counter())
        return None

    def after(module, args, kwargs, output):
        capture = state.pop("capture", None)
        if capture is None:
            return output
        capture.__exit__(None, None, None)
        dense = output.past_key_values
        prefill = assemble_prefill(dense, state.pop("queries"), output.logits[0, -1].float(), (),
                                   raw_asked and normed, normed, state.pop("start"))
        ids = state.pop("ids")
        context = compress_prefill(prefill, pipeline, ids, len(ids), {})
        context.model_key = model_key(model)
        record.contexts.append(context)
        output.past_key_values = SparkCache([context.cache], FIRST_CAPACITY, seen=len(ids), fast_paths=record.checks)
        return output

    handles = [model.register_forward_pre_hook(before, with_kwargs=True),
               model.register_forward_hook(after, with_kwargs=True)]
    _ACTIVE.add(model)
    try:
        yield record
    finally:
        _ACTIVE.discard(model)
        for handle in handles:
            handle.remove()
        capture = state.pop("capture", None)
        if capture is not None:  # an exception inside a prefill forward
            capture.__exit__(None, None, None)
        state.clear()
        config._attn_implementation = previous
