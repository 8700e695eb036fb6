"""What the harness and the library share: one full-cache prefill that serves many method configs, and the
compression of a prefill (a prefix of it) under one config into a :class:`~spark_bench.engine.generate.CompressedContext`.

``spark_bench.runner`` (the harness) and ``spark_bench.api`` (the library) both call these, so a library call and a
harness run of the same prompt and config give the same tokens. ``pipelines`` are
:class:`~spark_bench.methods.Pipeline` objects (used through their ``config``, ``query_stats`` and ``build_cache``;
this module imports no method).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from spark_bench.engine.generate import CompressedContext
from spark_bench.engine.prefill import Prefill, run_prefill

if TYPE_CHECKING:
    from spark_bench.methods import Pipeline


def prefill_spec(pipelines: list[Pipeline]) -> tuple[int, object, bool]:
    """What one prefill must capture to serve every pipeline: the largest observation window, the query statistics
    an eviction needs (one setting), raw queries where a config asks (``window_q_norm=False``)."""
    window = max([p.config.observation_window for p in pipelines] + [1])
    specs = {p.query_stats for p in pipelines} - {None}
    if len(specs) > 1:
        raise ValueError(f"one prefill cannot serve several query-statistics settings {sorted(map(str, specs))} "
                         "(n_sink)")
    return window, next(iter(specs), None), any(not p.config.window_q_norm for p in pipelines)


def prefill_hooks(pipelines: list[Pipeline]) -> tuple:
    """The layer hooks the pipelines' methods run during the prefill (e.g. a kvpress press's scorer), each once
    however many configs share it (:attr:`~spark_bench.methods.Pipeline.prefill_hooks`)."""
    return tuple(dict.fromkeys(h for p in pipelines for h in p.prefill_hooks))


def prefill_for(model: torch.nn.Module, input_ids, pipelines: list[Pipeline], ends: list[int]) -> Prefill:
    """One full-cache prefill of ``input_ids`` that serves every pipeline (:func:`prefill_spec`,
    :func:`prefill_hooks`), whatever prefix (``ends``) it compresses."""
    window, stats, raw = prefill_spec(pipelines)
    ids = torch.tensor([list(input_ids)], device=model.get_input_embeddings().weight.device)
    return run_prefill(model, ids, window, query_stats=stats, ends=tuple(set(ends)), raw_queries=raw,
                       hooks=prefill_hooks(pipelines))


def compress_prefill(prefill: Prefill, pipeline: Pipeline, input_ids, end: int,
                     selections: dict | None = None) -> CompressedContext:
    """Compress the first ``end`` tokens of a prefill of ``input_ids`` under ``pipeline``. ``selections``: one dict
    per prefill, shared by its configs (token selections are computed once per eviction method and prefix)."""
    view = prefill.at(end, pipeline.config.window_q_norm)
    memo = None if selections is None else selections.setdefault(id(view), {})
    cache, seconds = pipeline.build_cache(view, selections=memo)
    return CompressedContext(cache, tuple(input_ids), end, view.first_logits, prefill.dense_kv_bytes(),
                             pipeline.config, pipeline.label, prefill.seconds, seconds)
