"""SparK as a library: compress any transformers causal LM's cache under any method config, then keep generating
with ``model.generate``, holding the compact stores (their true bytes), not a dense cache with zeroed entries.

    import spark_bench

    lm = spark_bench.load("smollm2-135m")                     # or any AutoModelForCausalLM + tokenizer
    config = spark_bench.method("snapkv+spark", ratio=0.8, budget=0.2, protocol="official")
    prompt = spark_bench.prompt(lm.tokenizer, context, question)
    context = spark_bench.compress(lm.model, prompt, config)  # one prefill, then the compact stores
    out = spark_bench.generate(lm.model, context, max_new_tokens=32)   # model.generate(...) underneath
    answers = spark_bench.ask(lm.model, context_text, [q1, q2], config, tokenizer=lm.tokenizer)
    nll = spark_bench.answer_nll(lm.model, context, " Paris", tokenizer=lm.tokenizer)  # a reference's likelihood

The harness's runner compresses with the same two steps (:mod:`spark_bench.engine.compress`), so a
library call and a harness run of the same prompt and config give the same tokens (tests check it across the method
matrix). Nothing global is changed: :func:`generate` switches the model's attention and puts its hooks on for the
call only (:mod:`spark_bench.engine.generate`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from omegaconf import OmegaConf

from spark_bench.benchmarks.base import Prompt, Sample, encode_prompt
from spark_bench.checks import CONF_DIR, protocol_options, resolve_device
from spark_bench.engine.compress import compress_prefill, prefill_for
from spark_bench.engine.fastpaths import FastPaths
from spark_bench.engine.fidelity import ForcedRow, forced_log_probs, mean_nll
from spark_bench.engine.generate import CompressedContext, SparkCache, check_contexts, check_vocabulary
from spark_bench.engine.generate import generate as _generate
from spark_bench.engine.prefill import model_key
from spark_bench.engine.press import Pressed, pressed
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.pipeline import ratio_needed, sweep_labels
from spark_bench.models import LoadedModel, ModelConfig, load_model

__all__ = ["CompressedContext", "SparkCache", "answer_nll", "ask", "compress", "generate", "load", "method", "press",
           "prompt"]


def method(name: str = "full", protocol: str | None = "official", **options) -> MethodConfig:
    """A method config from the command line's names and options: ``method("snapkv+spark", ratio=0.8,
    budget=0.2)`` is ``spark-bench method=snapkv+spark ratio=0.8 budget=0.2``. ``protocol`` (default ``official``, as
    on the command line; None: none) sets its options first (``conf/protocol/<name>.yaml``); ``options`` win;
    ``repr(config)`` starts with it.
    A bad name or value raises ``ValueError`` with the command line's message; so does a fixed-T ``+think`` /
    ``+spark`` method without ``ratio`` (:func:`~spark_bench.methods.pipeline.ratio_needed`: ``ratio=0`` said
    explicitly is the base method)."""
    values = {**(protocol_options(protocol) if protocol else {}), **options, "name": name}
    config = MethodConfig.from_dict(values)
    needed = ratio_needed(config) if "ratio" not in values else None
    if needed:
        raise ValueError(needed)
    return replace(config, protocol=protocol)


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
    config = ModelConfig.from_dict(values)
    return load_model(config, resolve_device(device, config))  # an absent GPU: one line, before anything loads


def _as_prompt(value) -> Prompt:
    if isinstance(value, Prompt):
        parts = value
    elif isinstance(value, Sample):
        parts = Prompt(list(value.input_ids), value.context_end, value.question_end)
    else:
        if isinstance(value, torch.Tensor):
            if value.dim() > 2 or (value.dim() == 2 and value.shape[0] != 1):
                raise ValueError(f"prompt: token ids of shape (S,) or (1, S), got {tuple(value.shape)} (several "
                                 "prompts: a list of them)")
            value = value.reshape(-1).tolist()
        if isinstance(value, str):
            raise ValueError("prompt: expected token ids or a spark_bench.prompt(tokenizer, context, question), "
                             "not text")
        try:
            ids = [int(i) for i in value]
        except (TypeError, ValueError):
            raise ValueError(f"prompt: expected token ids, a spark_bench.prompt(...) or a sample, got "
                             f"{type(value).__name__}") from None
        if not ids:
            raise ValueError("prompt: expected at least one token id")
        parts = Prompt(ids, len(ids), len(ids))  # no parts: every scope compresses all of it
    return parts


def _many(prompts) -> bool:
    """A list of prompts (each a Prompt, a sample, a tensor or a list of ids), not one prompt's ids."""
    return isinstance(prompts, (list, tuple)) and bool(prompts) and not isinstance(prompts[0], int)


@torch.no_grad()
def compress(model: torch.nn.Module, prompt, methods: MethodConfig | list[MethodConfig]):
    """Prefill ``prompt`` once and compress it under ``methods`` (one config: one :class:`CompressedContext`; a
    list: one per config, from the same prefill). ``prompt``: a :func:`prompt`, a benchmark sample, or token ids (a
    list, ``(S,)`` or ``(1, S)`` tensor); a *list* of prompts gives one result per prompt (one prefill each), which
    :func:`generate` decodes together. Each config compresses what its ``compress_scope`` says (``prompt``: all
    of it; ``question`` / ``context``: up to the end of the user turn / the start of the question; token ids alone
    have no parts, so every scope compresses all of them); the rest runs through the cache when :func:`generate`
    starts."""
    single = isinstance(methods, MethodConfig)
    configs = [methods] if single else list(methods) if isinstance(methods, (list, tuple)) else []
    if not configs or not all(isinstance(c, MethodConfig) for c in configs):
        raise ValueError("methods: compress takes a MethodConfig (spark_bench.method(...)) or a non-empty list of them")
    if _many(prompt):
        return [compress(model, p, methods) for p in prompt]
    parts = _as_prompt(prompt)
    check_vocabulary(parts.ids, model, "prompt")
    pipelines = [Pipeline.from_config(c, label) for c, label in zip(configs, sweep_labels(configs))]
    ends = [parts.scope_end(c.compress_scope) for c in configs]
    covered = sorted({(c.budget, end) for c, end in zip(configs, ends)
                      if c.eviction_name is not None and c.budget >= 1 and c.budget >= end})
    for budget, end in covered:  # once per call and budget, as the CLI warns once per run
        warnings.warn(f"spark_bench.compress: budget={budget:g} is at or above the {end} tokens it compresses: "
                      f"the whole part is kept (the full cache)", stacklevel=2)
    prefill = prefill_for(model, parts.ids, pipelines, ends)
    selections: dict = {}
    key = model_key(model)
    out = [compress_prefill(prefill, p, parts.ids, end, selections) for p, end in zip(pipelines, ends)]
    for context in out:
        context.model_key = key
    return out[0] if single else out


@contextmanager
def press(model: torch.nn.Module, name: str = "snapkv+spark", protocol: str | None = "official",
          **options) -> Iterator[Pressed]:
    """kvpress' habit: inside ``with spark_bench.press(model, "snapkv+spark", ratio=0.8, budget=0.2):``, the model's
    own ``generate`` (or a ``model(...)`` loop) prefills each prompt, compresses it under :func:`method`'s config
    and decodes from the compact stores (:mod:`spark_bench.engine.press`): the harness's tokens. The whole prompt is
    compressed (``compress_scope=prompt``; for ``question`` / ``context`` use :func:`compress` on a :func:`prompt`).
    Yields a record whose ``.context`` is the last compressed context (bytes, times). On exit the model is as before
    (weights, attention implementation, hooks)."""
    scope = options.pop("compress_scope", "prompt")
    if scope != "prompt":
        raise ValueError(f"compress_scope={scope!r}: a press compresses the whole prompt the prefill sees "
                         "('prompt'); for 'question' / 'context' use spark_bench.compress on a spark_bench.prompt")
    if not isinstance(name, str):  # a kvpress press object: it selects the tokens, SparK / ThinK prune them
        pipeline = _press_pipeline(name, protocol, options)
    else:
        pipeline = Pipeline.from_config(method(name, protocol, compress_scope="prompt", **options))
    with pressed(model, pipeline) as record:
        yield record


def _press_pipeline(press, protocol: str | None, options: dict) -> Pipeline:
    """``press(model, kvpress.KnormPress(0.5), ratio=0.8[, channel="think"])``: the press keeps the tokens kvpress
    keeps (its own ``compression_ratio``; :mod:`~spark_bench.methods.eviction.kvpress_scorer`), then
    ``channel`` (``spark`` by default; ``ratio=0`` or unset: none) prunes their key channels."""
    from spark_bench.methods.eviction.kvpress_scorer import PREFIX, KvpressEviction, _kvpress

    if not isinstance(press, _kvpress().presses.base_press.BasePress):
        raise ValueError(f"name: a method name (str) or a kvpress press, got {type(press).__name__}")
    channel = options.pop("channel", "spark")
    if channel not in ("spark", "think"):
        raise ValueError(f"channel must be one of spark, think; got {channel!r}")
    pruned = bool(options.get("ratio")) or options.get("variant", "fixed") != "fixed"
    config = method(channel if pruned else "full", protocol, compress_scope="prompt", **{"ratio": 0.0, **options})
    label = PREFIX + type(press).__name__.removesuffix("Press") + (f"+{config.label}" if pruned else "")
    kept = 1 - float(getattr(press, "compression_ratio", None) or 0.0)
    return replace(Pipeline.from_config(config), eviction=KvpressEviction(press), label=f"{label} @{kept:g}")


def _reference_ids(reference, tokenizer, model) -> list[int]:
    if isinstance(reference, str):
        if tokenizer is None:
            raise ValueError("reference: a text reference needs tokenizer=")
        ids = list(tokenizer(reference, add_special_tokens=False)["input_ids"])
    elif isinstance(reference, torch.Tensor):
        ids = reference.reshape(-1).tolist()
    else:
        try:
            ids = [int(i) for i in reference]
        except (TypeError, ValueError):
            raise ValueError(f"reference: text or token ids, got {type(reference).__name__}") from None
    if not ids:
        raise ValueError("reference: expected at least one token")
    check_vocabulary(ids, model, "reference")
    return ids


@torch.no_grad()
def answer_nll(model: torch.nn.Module, context: CompressedContext, reference, input_ids=None, tokenizer=None,
               stack: bool = True) -> float:
    """The mean negative log-likelihood per token (nats) of ``reference`` (text with ``tokenizer``, or token ids)
    as the continuation of ``context``, teacher-forced through its compressed cache — the harness's ``answer_nll``
    (:mod:`spark_bench.engine.fidelity`): the first token from the logits generation takes it from, the rest through
    the same compressed-cache attention as decoding. ``input_ids``: as for :func:`generate` (what runs through the
    cache before the answer, e.g. a question over a compressed context; default: the context's own prompt)."""
    if not isinstance(context, CompressedContext):
        raise ValueError("context: answer_nll takes a CompressedContext (spark_bench.compress)")
    check_contexts(model, [context])
    ids = _reference_ids(reference, tokenizer, model)
    prompt_ids = list(context.input_ids) if input_ids is None else _as_prompt(input_ids).ids
    if prompt_ids[:context.end] != list(context.input_ids[:context.end]) or len(prompt_ids) < context.end:
        raise ValueError(f"input_ids must begin with the {context.end} tokens the context compressed")
    suffix = tuple(prompt_ids[context.end:])
    if not suffix and context.first_logits is None:
        raise ValueError("nothing follows the compressed tokens and no prefill logits were kept for them")
    row = ForcedRow(context.cache, context.first_logits if not suffix else None, context.end, suffix, ids[:-1])
    return mean_nll(forced_log_probs(model, [row], stack)[0], ids)


def generate(model: torch.nn.Module, contexts, input_ids=None, stack: bool = True, reference=None,
             tokenizer=None, **generate_kwargs):
    """:func:`spark_bench.engine.generate.generate` (``model.generate`` continued from compressed contexts; its
    docstring says all); with ``reference`` (text with ``tokenizer``, or token ids) also each context's
    :func:`answer_nll` of it: returns ``(output, nll)``, ``nll`` a float for one context, else a list."""
    # ``tokenizer`` is model.generate's own argument too (stop strings need it): pass it on
    out = _generate(model, contexts, input_ids, stack,
                    **generate_kwargs, **({} if tokenizer is None else {"tokenizer": tokenizer}))
    if reference is None:
        return out
    many = not isinstance(contexts, CompressedContext)
    nll = [answer_nll(model, c, reference, input_ids, tokenizer, stack) for c in (contexts if many else [contexts])]
    return out, (nll if many else nll[0])


def ask(model: torch.nn.Module, context, questions: list, config: MethodConfig | None = None, tokenizer=None,
        answer_prefix: str = "", chat_template: bool | str = True, separator: str = "\n",
        return_context: bool = False, references: list | None = None, **generate_kwargs):
    """Compress ``context`` once and answer each question over it (kvpress's question-answering pipeline): each
    question (with the end of turn, the assistant header and ``answer_prefix``) runs through the compressed cache,
    which stays as it is for the next one. The same tokens as compressing each question's whole prompt under
    ``compress_scope=context`` (whatever ``config`` says: the questions are not known when the context is
    compressed).

    ``context``: text (with ``tokenizer``; each question's prompt is :func:`prompt`'s), token ids, or a
    :class:`CompressedContext` (from an earlier ``ask(..., return_context=True)``, which remembers its text, so
    text questions work again; or from :func:`compress` over token ids, then questions are token ids).
    ``questions``: strings with text, else token id sequences that follow the context's ids directly. The answers
    are the new token ids, decoded when a ``tokenizer`` is given. ``return_context``: also return the compressed
    context, ``(answers, context)``, so a second round of questions costs no prefill. ``references``: one reference
    answer per question (text with ``tokenizer``, or token ids): each answer comes back as ``(answer, nll)``, ``nll``
    the reference's :func:`answer_nll` after that question. ``generate_kwargs`` go to ``model.generate`` (``checks``:
    the fast-path record, :mod:`spark_bench.engine.fastpaths`; default: one for this call's questions)."""
    if isinstance(questions, (str, bytes)) or not isinstance(questions, (list, tuple)) or not questions:
        raise ValueError("questions: ask takes a non-empty list of questions")
    texts = [q for q in questions if isinstance(q, str)]
    if texts and len(texts) != len(questions):
        raise ValueError("questions: all text or all token ids, not both")
    if texts and tokenizer is None:
        raise ValueError("tokenizer: text questions need tokenizer=")
    if references is not None and (not isinstance(references, (list, tuple)) or len(references) != len(questions)):
        raise ValueError(f"references: one reference answer per question ({len(questions)}), got "
                         f"{len(references) if isinstance(references, (list, tuple)) else type(references).__name__}")
    if isinstance(context, CompressedContext):
        if context.end != len(context.input_ids):
            raise ValueError("context: ask over a compressed context needs it compressed whole (compress the context "
                             "alone, or ask(..., return_context=True))")
        compressed, head = context, list(context.input_ids)
        if texts:
            if context.source is None:
                raise ValueError("questions: this context was compressed from token ids, so its questions are token "
                                 "ids too (text needs a context from ask(text, ..., return_context=True))")
            full = [p.ids for p in _text_prompts(tokenizer, context.source, questions, answer_prefix, head)]
        else:
            full = [head + _as_prompt(q).ids for q in questions]
    else:
        if not isinstance(config, MethodConfig):
            raise ValueError("config: ask needs config= (spark_bench.method(...)) to compress the context")
        source = None
        if isinstance(context, str):
            if tokenizer is None:
                raise ValueError("tokenizer: ask over text needs tokenizer=")
            if not texts:
                raise ValueError("questions: a text context takes text questions")
            source = (context, chat_template, separator)
            full = _text_prompts(tokenizer, source, questions, answer_prefix)
            head = full[0].ids[:full[0].context_end]
            full = [p.ids for p in full]
        else:
            head = _as_prompt(context).ids
            full = [head + _as_prompt(q).ids for q in questions]
        compressed = compress(model, head, replace(config, compress_scope="context"))
        compressed.source = source
    answers = []
    generate_kwargs.setdefault("checks", FastPaths())  # one run: each variant checked once over the questions
    for k, ids in enumerate(full):
        out = _generate(model, compressed, input_ids=ids, **generate_kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        new = sequences[0, len(ids):].tolist()
        answer = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else new
        if references is not None:
            answer = (answer, answer_nll(model, compressed, references[k], ids, tokenizer))
        answers.append(answer)
    return (answers, compressed) if return_context else answers


def _text_prompts(tokenizer, source: tuple, questions: list[str], answer_prefix: str,
                  head: list[int] | None = None) -> list[Prompt]:
    """Each question's whole :func:`prompt` over the context text ``source = (text, chat_template, separator)``;
    every context part must tokenize as ``head`` (the compressed ids; None: as the first question's does)."""
    text, chat_template, separator = source
    prompts = [prompt(tokenizer, text, q, answer_prefix, chat_template, separator) for q in questions]
    head = prompts[0].ids[:prompts[0].context_end] if head is None else head
    for q, p in zip(questions, prompts):
        if p.ids[:p.context_end] != head:
            raise ValueError(f"questions: {q!r} changes how the context tokenizes; end the context with whitespace "
                             "or pass token ids")
    return prompts
