"""SparK as a library: compress any transformers causal LM's cache under any method config, then keep generating
with ``model.generate``, holding the compact stores (their true bytes), not a dense cache with zeroed entries.

    import spark_bench

    lm = spark_bench.load("smollm2-135m")                     # or any AutoModelForCausalLM + tokenizer
    config = spark_bench.method("snapkv+spark", ratio=0.8, budget=0.2, protocol="official")
    prompt = spark_bench.prompt(lm.tokenizer, context, question)
    context = spark_bench.compress(lm.model, prompt, config)  # one prefill, then the compact stores
    out = spark_bench.generate(lm.model, context, max_new_tokens=32)   # model.generate(...) underneath
    answers = spark_bench.ask(lm.model, context_text, [q1, q2], config, tokenizer=lm.tokenizer)

The harness's runner compresses with the same two steps (:mod:`spark_bench.engine.compress`), so a
library call and a harness run of the same prompt and config give the same tokens (tests check it across the method
matrix). Nothing global is changed: :func:`generate` switches the model's attention and puts its hooks on for the
call only (:mod:`spark_bench.engine.generate`).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
from omegaconf import OmegaConf

from spark_bench.benchmarks.base import Prompt, Sample, encode_prompt
from spark_bench.checks import CONF_DIR, protocol_options
from spark_bench.engine.compress import compress_prefill, prefill_for
from spark_bench.engine.generate import CompressedContext, generate
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.pipeline import ratio_needed, sweep_labels
from spark_bench.models import LoadedModel, ModelConfig, load_model

__all__ = ["CompressedContext", "ask", "compress", "generate", "load", "method", "prompt"]


def method(name: str = "full", protocol: str | None = "official", **options) -> MethodConfig:
    """A method config from the command line's names and options: ``method("snapkv+spark", ratio=0.8,
    budget=0.2)`` is ``spark-bench method=snapkv+spark ratio=0.8 budget=0.2``. ``protocol`` (default ``official``, as
    on the command line; None: none) sets its options first (``conf/protocol/<name>.yaml``); ``options`` win.
    A bad name or value raises ``ValueError`` with the command line's message; so does a fixed-T ``+think`` /
    ``+spark`` method without ``ratio`` (:func:`~spark_bench.methods.pipeline.ratio_needed`: ``ratio=0`` said
    explicitly is the base method)."""
    values = {**(protocol_options(protocol) if protocol else {}), **options, "name": name}
    config = MethodConfig.from_dict(values)
    needed = ratio_needed(config) if "ratio" not in values else None
    if needed:
        raise ValueError(needed)
    return config


def prompt(tokenizer, context: str, question: str = "", answer_prefix: str = "", chat_template: bool | str = True,
           separator: str = "\n") -> Prompt:
    """Token ids of one user turn ``context + separator + question`` (in the tokenizer's chat template unless
    ``chat_template=False``) followed by ``answer_prefix``, with the boundaries ``compress_scope`` needs: the
    context ends where the question starts, the user turn where the question ends (RULER / LongBench prompts)."""
    text = context + separator + question if question else context
    return encode_prompt(tokenizer, text, answer_prefix, chat_template=chat_template,
                         question_at=len(context) + len(separator) if question else None)


def load(name: str = "smollm2-135m", device: str = "auto", **overrides) -> LoadedModel:
    """A model of ``conf/model/<name>.yaml`` (``smollm2-135m``: the embedded offline default) with its tokenizer;
    ``overrides`` change its keys (``path=``, ``dtype=``, ``device_map=``). ``.model``, ``.tokenizer``,
    ``.stop_token_ids``."""
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        valid = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise ValueError(f"model {name!r}: no such model config (conf/model/); valid: {valid}")
    values = {**OmegaConf.to_container(OmegaConf.load(path), resolve=True), **overrides}
    return load_model(ModelConfig.from_dict(values), device)


def _as_prompt(value) -> Prompt:
    if isinstance(value, Prompt):
        return value
    if isinstance(value, Sample):
        return Prompt(list(value.input_ids), value.context_end, value.question_end)
    if isinstance(value, torch.Tensor):
        if value.dim() > 2 or (value.dim() == 2 and value.shape[0] != 1):
            raise ValueError(f"compress takes one prompt: token ids of shape (S,) or (1, S), got {tuple(value.shape)}")
        value = value.reshape(-1).tolist()
    if isinstance(value, str):
        raise ValueError("expected token ids or a spark_bench.prompt(tokenizer, context, question), not text")
    ids = [int(i) for i in value]
    if not ids:
        raise ValueError("expected at least one token id")
    return Prompt(ids, len(ids), len(ids))  # no parts: every scope compresses all of it


@torch.no_grad()
def compress(model: torch.nn.Module, prompt, methods: MethodConfig | list[MethodConfig]):
    """Prefill ``prompt`` once and compress it under ``methods`` (one config: one :class:`CompressedContext`; a
    list: one per config, from the same prefill). ``prompt``: a :func:`prompt`, a benchmark sample, or token ids (a
    list, ``(S,)`` or ``(1, S)`` tensor). Each config compresses what its ``compress_scope`` says (``prompt``: all
    of it; ``question`` / ``context``: up to the end of the user turn / the start of the question; token ids alone
    have no parts, so every scope compresses all of them); the rest runs through the cache when :func:`generate`
    starts."""
    single = isinstance(methods, MethodConfig)
    configs = [methods] if single else list(methods)
    if not configs or not all(isinstance(c, MethodConfig) for c in configs):
        raise ValueError("compress takes a MethodConfig (spark_bench.method(...)) or a non-empty list of them")
    parts = _as_prompt(prompt)
    pipelines = [Pipeline.from_config(c, label) for c, label in zip(configs, sweep_labels(configs))]
    ends = [parts.scope_end(c.compress_scope) for c in configs]
    covered = sorted({(c.budget, end) for c, end in zip(configs, ends)
                      if c.eviction_name is not None and c.budget >= 1 and c.budget >= end})
    for budget, end in covered:  # once per call and budget, as the CLI warns once per run
        warnings.warn(f"spark_bench.compress: budget={budget:g} is at or above the {end} tokens it compresses: "
                      f"the whole part is kept (the full cache)", stacklevel=2)
    prefill = prefill_for(model, parts.ids, pipelines, ends)
    selections: dict = {}
    out = [compress_prefill(prefill, p, parts.ids, end, selections) for p, end in zip(pipelines, ends)]
    return out[0] if single else out


def ask(model: torch.nn.Module, context, questions: list, config: MethodConfig | None = None, tokenizer=None,
        answer_prefix: str = "", chat_template: bool | str = True, separator: str = "\n",
        **generate_kwargs) -> list:
    """Compress ``context`` once and answer each question over it (kvpress's question-answering pipeline): each
    question (with the end of turn, the assistant header and ``answer_prefix``) runs through the compressed cache,
    which stays as it is for the next one. The same tokens as compressing each question's whole prompt under
    ``compress_scope=context`` (whatever ``config`` says: the questions are not known when the context is
    compressed).

    ``context``: text (with ``tokenizer``; each question's prompt is :func:`prompt`'s), token ids, or a
    :class:`CompressedContext` from :func:`compress` (used as it is; ``config`` is not needed). ``questions``:
    strings with text, else token id sequences that follow the context's ids directly. The answers are the new
    token ids, decoded when a ``tokenizer`` is given. ``generate_kwargs`` go to ``model.generate``."""
    if isinstance(questions, (str, bytes)) or not questions:
        raise ValueError("ask takes a non-empty list of questions")
    if isinstance(context, CompressedContext):
        if context.end != len(context.input_ids):
            raise ValueError("ask over a compressed context needs one compressed whole (compress the context alone)")
        compressed, head = context, list(context.input_ids)
        full = [head + _as_prompt(q).ids for q in questions]
    else:
        if not isinstance(config, MethodConfig):
            raise ValueError("ask needs config= (spark_bench.method(...)) to compress the context")
        if isinstance(context, str):
            if tokenizer is None:
                raise ValueError("ask over text needs tokenizer=")
            prompts = [prompt(tokenizer, context, q, answer_prefix, chat_template, separator) for q in questions]
            head = prompts[0].ids[:prompts[0].context_end]
            for q, p in zip(questions, prompts):
                if p.ids[:p.context_end] != head:
                    raise ValueError(f"question {q!r} changes how the context tokenizes; end the context with "
                                     "whitespace or pass token ids")
            full = [p.ids for p in prompts]
        else:
            head = _as_prompt(context).ids
            full = [head + _as_prompt(q).ids for q in questions]
        compressed = compress(model, head, replace(config, compress_scope="context"))
    answers = []
    for ids in full:
        out = generate(model, compressed, input_ids=ids, **generate_kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        new = sequences[0, len(ids):].tolist()
        answers.append(tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else new)
    return answers
