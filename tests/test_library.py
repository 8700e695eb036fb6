"""SparK as a library (:mod:`spark_bench.api`): ``model.generate`` continued from compressed contexts gives the
harness's tokens and bytes across the method matrix and every ``compress_scope``, sampling is reproducible, one
compressed context answers several questions as separate compressions would, and nothing stays switched on."""

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import DEVICE, ROOT, model_config
from transformers import StoppingCriteria, StoppingCriteriaList

import spark_bench
from spark_bench.benchmarks.base import Prompt, Sample
from spark_bench.checks import ConfigError
from spark_bench.engine.attention import ATTENTION_NAME
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.pipeline import sweep_labels
from spark_bench.models import load_model
from spark_bench.runner import run_samples
from test_methods import MATRIX

MAX_NEW = 5
CONTEXT_END, QUESTION_END, LENGTH = 100, 136, 150  # a prompt's parts: context, question, then a suffix


def _sample(ids, max_new=MAX_NEW) -> Sample:
    return Sample(task="t", id="s", input_ids=tuple(ids), answers=("x",), max_new_tokens=max_new,
                  metric="string_match_all", context_end=CONTEXT_END, question_end=QUESTION_END)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(100, 5000, (LENGTH,), generator=torch.Generator().manual_seed(11)).tolist()


def _harness(lm, sample, configs):
    """The runner's own path (one prefill, every config compressed, all rows decoded in one batch)."""
    pipelines = [Pipeline.from_config(c, label) for c, label in zip(configs, sweep_labels(configs))]
    return run_samples(lm, [(sample, pipelines)])[0]


def _new_tokens(out, prompt_length, stops) -> list[list[int]]:
    """model.generate's rows → the new tokens up to (not including) the first stop token, as the harness records."""
    rows = []
    for row in out[:, prompt_length:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        rows.append(row[:cut])
    return rows


@pytest.mark.parametrize("scope", ["prompt", "question", "context"])
def test_generate_equals_the_harness_over_the_method_matrix(tiny_lm, ids, scope):
    """Every method × option, each scope: the library's greedy model.generate gives the harness's tokens, and the
    context's bytes and key ratio are the runner's kv_bytes and key_ratio."""
    configs = [MethodConfig(name=name, budget=64, compress_scope=scope, **opts) for name, opts in MATRIX]
    sample = _sample(ids)
    expected = _harness(tiny_lm, sample, configs)
    contexts = spark_bench.compress(tiny_lm.model, sample, configs)
    stops = sorted(tiny_lm.stop_token_ids)
    for context, prediction in zip(contexts, expected):
        out = spark_bench.generate(tiny_lm.model, context, max_new_tokens=MAX_NEW, do_sample=False,
                                   eos_token_id=stops)
        assert _new_tokens(out, LENGTH, stops)[0] == prediction.tokens, prediction.config
        assert context.label == prediction.config
        assert (context.kv_bytes, context.key_ratio) == (prediction.kv_bytes, prediction.key_ratio)
        assert context.end == sample.scope_end(scope)
    assert len(configs) > 100


@pytest.fixture(scope="module")
def tiny_qwen3():
    return load_model(model_config("tiny-qwen3"), str(DEVICE))


@pytest.mark.parametrize("protocol", ["official", "paper"])
def test_generate_equals_the_harness_on_qwen3(tiny_qwen3, protocol, ids):
    """Qwen3 (per-head q_norm; the official protocol's window queries without it)."""
    lm = tiny_qwen3
    configs = [spark_bench.method(name, protocol=protocol, ratio=0.8, budget=64)
               for name in ("snapkv+spark", "pyramidkv+think", "adasnapkv+spark", "spark", "full")]
    sample = _sample(ids)
    expected = _harness(lm, sample, configs)
    for context, prediction in zip(spark_bench.compress(lm.model, sample, configs), expected):
        out = spark_bench.generate(lm.model, context, max_new_tokens=MAX_NEW, eos_token_id=sorted(lm.stop_token_ids))
        assert _new_tokens(out, LENGTH, lm.stop_token_ids)[0] == prediction.tokens, prediction.config
        assert context.kv_bytes == prediction.kv_bytes


def test_stops_and_min_new_tokens_as_the_harness(tiny_lm, ids):
    """A stop token ends the answer where the harness stops; min_new_tokens bans it until then."""
    config = spark_bench.method("snapkv+spark", protocol="official", ratio=0.8, budget=64)
    free = spark_bench.generate(tiny_lm.model, spark_bench.compress(tiny_lm.model, _sample(ids), config),
                                max_new_tokens=8)[0, LENGTH:].tolist()
    stop = free[3]
    for min_new in (0, 5):
        sample = replace(_sample(ids, max_new=8), stop_token_ids=(stop,), min_new_tokens=min_new)
        expected = _harness(tiny_lm, sample, [config])[0].tokens
        context = spark_bench.compress(tiny_lm.model, sample, config)
        stops = sorted(tiny_lm.stop_token_ids | {stop})
        out = spark_bench.generate(tiny_lm.model, context, max_new_tokens=8, eos_token_id=stops,
                                   min_new_tokens=min_new)
        assert _new_tokens(out, LENGTH, set(stops))[0] == expected
        assert len(expected) == (3 if min_new == 0 else len(expected)) and (min_new == 0 or len(expected) > 3)


def test_stop_strings_end_generation(tiny_lm, ids):
    context = spark_bench.compress(tiny_lm.model, ids, spark_bench.method("snapkv+spark", ratio=0.8, budget=64))
    free = spark_bench.generate(tiny_lm.model, context, max_new_tokens=8)[0, LENGTH:].tolist()
    stop = tiny_lm.tokenizer.decode(free[2:3]).strip()
    out = spark_bench.generate(tiny_lm.model, context, max_new_tokens=8, stop_strings=[stop],
                               tokenizer=tiny_lm.tokenizer)
    assert out[0, LENGTH:].tolist() == free[:3]


def test_sampling_is_reproducible_with_a_seed(tiny_lm, ids):
    config = spark_bench.method("snapkv+spark", ratio=0.8, budget=64, recovery="gaussian", seed=3)
    first = spark_bench.compress(tiny_lm.model, _sample(ids), config)
    again = spark_bench.compress(tiny_lm.model, _sample(ids), config)  # seeded recovery: the same stores

    def sampled(context, seed):
        torch.manual_seed(seed)
        return spark_bench.generate(tiny_lm.model, context, max_new_tokens=8, do_sample=True, temperature=1.5,
                                    top_k=50)[0, LENGTH:].tolist()

    runs = [sampled(first, 0), sampled(again, 0), sampled(first, 0)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 8
    assert any(sampled(first, seed) != runs[0] for seed in (1, 2, 3))  # the seed is what fixes them
    greedy = spark_bench.generate(tiny_lm.model, first, max_new_tokens=8)[0, LENGTH:].tolist()
    assert any(sampled(first, seed) != greedy for seed in (0, 1, 2))


def test_batched_contexts_equal_each_alone(tiny_lm, ids):
    """Several configs over one prompt generate as one batch (one row each), with each one's own tokens."""
    configs = [spark_bench.method(n, ratio=0.8, budget=64) for n in ("snapkv+spark", "think", "full", "tova+spark")]
    contexts = spark_bench.compress(tiny_lm.model, _sample(ids), configs)
    batch = spark_bench.generate(tiny_lm.model, contexts, max_new_tokens=MAX_NEW)
    alone = [spark_bench.generate(tiny_lm.model, c, max_new_tokens=MAX_NEW)[0] for c in contexts]
    assert batch.shape[0] == len(configs)
    assert [row.tolist() for row in batch] == [row.tolist() for row in alone]


def test_the_decoded_tail_grows_past_its_preallocated_capacity(tiny_lm, ids, monkeypatch):
    """generate preallocates max_new_tokens per row; generating past it (a capacity of 1 here) grows the tail and
    gives the same tokens."""
    from spark_bench.engine import generate as engine_generate

    context = spark_bench.compress(tiny_lm.model, _sample(ids), spark_bench.method("snapkv+spark", ratio=0.8,
                                                                                   budget=64))
    expected = spark_bench.generate(tiny_lm.model, context, max_new_tokens=6).tolist()
    monkeypatch.setattr(engine_generate, "generation_capacity", lambda *args: 1)
    assert spark_bench.generate(tiny_lm.model, context, max_new_tokens=6).tolist() == expected


class _Boom(StoppingCriteria):
    def __init__(self, after: int):
        self.calls, self.after = 0, after

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("boom")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("scope,after", [("prompt", 0), ("prompt", 2), ("question", 1)])
def test_an_exception_inside_generate_leaves_the_model_as_it_was(tiny_lm, ids, scope, after):
    model = tiny_lm.model
    before = (model.config._attn_implementation, dict(model._forward_hooks), dict(model._forward_pre_hooks),
              {name: dict(m._forward_pre_hooks) for name, m in model.named_modules()})
    context = spark_bench.compress(model, _sample(ids), spark_bench.method("snapkv+spark", ratio=0.8, budget=64,
                                                                           compress_scope=scope))
    with pytest.raises(RuntimeError, match="boom"):
        spark_bench.generate(model, context, max_new_tokens=6, stopping_criteria=StoppingCriteriaList([_Boom(after)]))
    after_call = (model.config._attn_implementation, dict(model._forward_hooks), dict(model._forward_pre_hooks),
                  {name: dict(m._forward_pre_hooks) for name, m in model.named_modules()})
    assert after_call == before and before[0] != ATTENTION_NAME
    # the context is untouched by the failed call: the next one gives the tokens of a fresh compression
    fresh = spark_bench.compress(model, _sample(ids), context.method)
    assert (spark_bench.generate(model, context, max_new_tokens=4).tolist()
            == spark_bench.generate(model, fresh, max_new_tokens=4).tolist())


@pytest.mark.parametrize("name,options", [("snapkv+spark", dict(ratio=0.8)), ("pyramidkv+think", dict(ratio=0.5)),
                                          ("adasnapkv+spark", dict(variant="top_p", top_p=0.9)),
                                          ("expected_attention", {}), ("full", {}), ("spark", dict(ratio=0.5)),
                                          ("streamingllm+spark", dict(ratio=0.8, recovery="gaussian"))])
def test_several_questions_over_one_context_equal_separate_compressions(tiny_lm, ids, name, options):
    """ask: the context compressed once, each question run through it, equals compressing each question's whole
    prompt under compress_scope=context; the compressed context is not changed by the questions."""
    config = spark_bench.method(name, budget=80, **options)  # official protocol: compress_scope=question
    context = ids[:CONTEXT_END]
    questions = [ids[CONTEXT_END:], ids[CONTEXT_END + 20:], list(reversed(ids[CONTEXT_END:]))]
    answers = spark_bench.ask(tiny_lm.model, context, questions, config, max_new_tokens=MAX_NEW)
    for question, answer in zip(questions, answers):
        full = Prompt(context + question, CONTEXT_END, len(context) + len(question))
        alone = spark_bench.compress(tiny_lm.model, full, replace(config, compress_scope="context"))
        assert alone.end == CONTEXT_END
        out = spark_bench.generate(tiny_lm.model, alone, max_new_tokens=MAX_NEW)
        assert out[0, len(full):].tolist() == answer
    assert len({tuple(a) for a in answers}) > 1
    compressed = spark_bench.compress(tiny_lm.model, context, replace(config, compress_scope="context"))
    held = compressed.nbytes
    assert spark_bench.ask(tiny_lm.model, compressed, questions, max_new_tokens=MAX_NEW) == answers
    assert compressed.nbytes == held  # the questions' tokens went into each call's own tail


def test_ask_over_text_builds_each_prompt_from_the_chat_template(tiny_lm, monkeypatch):
    """Each question's prompt is the chat template's; ``return_context=True`` hands back the compressed context,
    and a second round of text questions over it costs no prefill and gives the same answers."""
    tok = tiny_lm.tokenizer
    context = " ".join(f"The code of door {i} is {1000 + 7 * i}." for i in range(30))
    questions = ["What is the code of door 4?", "What is the code of door 17?"]
    config = spark_bench.method("snapkv+spark", ratio=0.8, budget=64)
    answers = spark_bench.ask(tiny_lm.model, context, questions, config, tokenizer=tok, answer_prefix=" Answer:",
                              max_new_tokens=MAX_NEW)
    for question, answer in zip(questions, answers):
        prompt = spark_bench.prompt(tok, context, question, " Answer:")
        assert tok.decode(prompt.ids[prompt.context_end:prompt.question_end]) == question
        assert tok.decode(prompt.ids[prompt.question_end:]).endswith("assistant\n Answer:")
        alone = spark_bench.compress(tiny_lm.model, prompt, replace(config, compress_scope="context"))
        out = spark_bench.generate(tiny_lm.model, alone, max_new_tokens=MAX_NEW)
        assert tok.decode(out[0, len(prompt.ids):], skip_special_tokens=True) == answer
    first, compressed = spark_bench.ask(tiny_lm.model, context, questions[:1], config, tokenizer=tok,
                                        answer_prefix=" Answer:", max_new_tokens=MAX_NEW, return_context=True)
    from spark_bench import api

    monkeypatch.setattr(api, "prefill_for", lambda *args: pytest.fail("a second round must not prefill"))
    second = spark_bench.ask(tiny_lm.model, compressed, questions[1:], tokenizer=tok, answer_prefix=" Answer:",
                             max_new_tokens=MAX_NEW)
    assert first + second == answers


def test_compressed_bytes_are_the_stores_true_bytes(tiny_lm, ids):
    """nbytes are the stores' allocated bytes: SparK λ = 0.8 holds under half of a dense cache of its tokens, and a
    budget of 64 tokens about 64/150 of it."""
    full, spark, snap = spark_bench.compress(
        tiny_lm.model, ids, [spark_bench.method(n, ratio=0.8, budget=64) for n in ("full", "spark", "snapkv")])
    assert full.nbytes == full.dense_nbytes == full.kv_bytes == full.dense_bytes
    assert spark.nbytes < 0.7 * spark.dense_nbytes and spark.key_ratio > 0.7
    assert snap.nbytes == pytest.approx(64 / LENGTH * snap.dense_nbytes, rel=0.02)


def test_method_takes_the_command_lines_names_options_and_messages():
    from omegaconf import OmegaConf

    from spark_bench.cli import method_configs
    from spark_bench.checks import CONF_DIR

    official = spark_bench.method("snapkv+spark", ratio=0.8)
    assert (official.compress_scope, official.window_size, official.channel_window, official.pooling) == \
        ("question", 64, 32, "avg")
    cfg = OmegaConf.load(CONF_DIR / "config.yaml")
    cfg.merge_with(OmegaConf.load(CONF_DIR / "protocol" / "official.yaml"))
    cfg.method, cfg.ratio = {"name": "snapkv+spark"}, 0.8
    assert method_configs(cfg) == [official]  # what `spark-bench method=snapkv+spark ratio=0.8` runs
    assert spark_bench.method("snapkv+spark", protocol="paper", ratio=0.8).compress_scope == "prompt"
    assert spark_bench.method("think", protocol=None, ratio=0.5).window_size == MethodConfig().window_size
    # one rule for an unset ratio, CLI and library: a fixed-T +think/+spark method must say it; ratio=0 said is the base
    with pytest.raises(ValueError, match=r"^snapkv\+spark needs ratio= .*\(ratio=0 is the base method\)$"):
        spark_bench.method("snapkv+spark")
    assert spark_bench.method("snapkv+spark", ratio=0).ratio == 0
    assert spark_bench.method("snapkv+spark", variant="top_p").variant == "top_p"  # SparK-p keeps by p, not λ
    cfg.ratio = 1.5
    with pytest.raises(ConfigError) as cli:
        method_configs(cfg)
    with pytest.raises(ValueError) as lib:
        spark_bench.method("snapkv+spark", ratio=1.5)
    assert str(cli.value) == f"method: {lib.value}" and "ratio must be a number >= 0 and < 1" in str(lib.value)
    with pytest.raises(ValueError, match="unknown method 'snapkv\\+spork'; valid: full, streamingllm"):
        spark_bench.method("snapkv+spork")
    with pytest.raises(ValueError, match=r"unknown method option\(s\) \['ration'\]"):
        spark_bench.method("spark", ration=0.8)
    with pytest.raises(ValueError, match="protocol 'offical'.*valid: kvcache_factory, official, paper"):
        spark_bench.method("spark", protocol="offical")


def test_a_budget_covering_the_prompt_warns_once_per_call(tiny_lm, ids):
    configs = [spark_bench.method("snapkv", budget=4096, protocol="paper"),
               spark_bench.method("snapkv+spark", budget=4096, ratio=0.5, protocol="paper")]
    with pytest.warns(UserWarning) as seen:
        spark_bench.compress(tiny_lm.model, ids, configs)
    assert [str(w.message) for w in seen] == [
        f"spark_bench.compress: budget=4096 is at or above the {len(ids)} tokens it compresses: the whole part is "
        "kept (the full cache)"]


def test_bad_library_inputs_are_one_line_errors(tiny_lm, tiny_qwen3, ids, monkeypatch):
    """Each bad call raises one ValueError line naming the argument and what is valid, never a tensor error."""
    model, config = tiny_lm.model, spark_bench.method("snapkv+spark", ratio=0.8, budget=64)
    context = spark_bench.compress(model, ids, config)  # token ids alone: every scope compresses all of them
    assert context.end == LENGTH and context.first_logits is not None
    vocab = model.get_input_embeddings().num_embeddings
    cases = [
        (lambda: spark_bench.compress(model, "some text", config), "prompt: .*not text"),
        (lambda: spark_bench.compress(model, [], config), "prompt: expected at least one token"),
        (lambda: spark_bench.compress(model, torch.zeros(2, 5, dtype=torch.long), config), "several prompts"),
        (lambda: spark_bench.compress(model, ids[:-1] + [vocab], config), f"token id {vocab} is outside"),
        (lambda: spark_bench.compress(model, [ids, [1.5, None]], config), "prompt: expected token ids"),
        (lambda: spark_bench.compress(model, ids, "snapkv+spark"), "methods: .*MethodConfig"),
        (lambda: spark_bench.compress(model, Prompt(ids), config), "compress_scope=question needs"),
        (lambda: spark_bench.generate(model, context, input_ids=ids[:-1] + [7]), "must begin with"),
        (lambda: spark_bench.generate(model, context, input_ids=ids + [vocab + 3]), "outside the model's vocab"),
        (lambda: spark_bench.generate(model, context, num_beams=2), "num_beams: .*not beam search"),
        (lambda: spark_bench.generate(model, context, past_key_values=None), "past_key_values: generate sets it"),
        (lambda: spark_bench.generate(model, [], max_new_tokens=2), "contexts: "),
        (lambda: spark_bench.generate(tiny_qwen3.model, context), "contexts: compressed by another model"),
        (lambda: spark_bench.ask(model, ids, "a question", config), "questions: .*non-empty list"),
        (lambda: spark_bench.ask(model, ids, [ids[:3]]), "config: .*needs config="),
        (lambda: spark_bench.ask(model, "text", ["q"], config), "tokenizer: "),
        (lambda: spark_bench.ask(model, context, ["q"], tokenizer=object()), "compressed from token ids"),
        (lambda: spark_bench.load("tiny-lama"), "no such model config"),
        (lambda: model.generate(torch.tensor([context.continuation_ids()]), past_key_values=context),
         "past_key_values: a CompressedContext is not a transformers Cache; pass context.as_cache"),
        (lambda: model.generate(torch.tensor([context.continuation_ids()]), past_key_values=context.cache),
         "past_key_values: context.cache holds a context's compressed stores, not a generation cache"),
        (lambda: spark_bench.CompressedContext.load(ROOT / "README.md", model), "not a readable safetensors"),
        (lambda: spark_bench.press(model, "snapkv+spark", ratio=0.8, compress_scope="question").__enter__(),
         "compress_scope='question': a press compresses the whole prompt"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert "\n" not in str(err.value)
    from spark_bench.engine import generate as engine_generate  # a model moved after compressing (no GPU here)

    monkeypatch.setattr(engine_generate, "store_device", lambda store: torch.device("cuda", 0))
    with pytest.raises(ValueError, match="stores are on cuda:0 but the model now runs it on cpu"):
        spark_bench.generate(model, context)


def test_a_config_list_with_mixed_scopes_compresses_each_as_alone(tiny_lm, ids):
    """compress_scope is per config: a list mixing scopes gives each config the context it gives alone."""
    configs = [spark_bench.method("snapkv+spark", ratio=0.8, budget=64, compress_scope=s)
               for s in ("prompt", "question", "context")]
    together = spark_bench.compress(tiny_lm.model, _sample(ids), configs)
    for config, context in zip(configs, together):
        alone = spark_bench.compress(tiny_lm.model, _sample(ids), config)
        assert (context.end, context.nbytes) == (alone.end, alone.nbytes)
        assert torch.equal(spark_bench.generate(tiny_lm.model, context, max_new_tokens=3),
                           spark_bench.generate(tiny_lm.model, alone, max_new_tokens=3))


FAMILIES = [("snapkv", {}), ("snapkv+spark", dict(ratio=0.8)), ("snapkv+think", dict(ratio=0.5)),
            ("snapkv+spark", dict(ratio=0.5, value_ratio=0.3)), ("adasnapkv+spark", dict(ratio=0.8)),
            ("pyramidkv+spark", dict(ratio=0.8))]


@pytest.mark.parametrize("name,options", FAMILIES, ids=[f"{n}{o}" for n, o in FAMILIES])
def test_press_cache_generate_and_harness_give_the_same_tokens(tiny_lm, ids, name, options):
    """The four ways in (fp32, the whole prompt compressed): (a) ``with press(model): model.generate``, (b)
    ``model.generate(..., past_key_values=context.as_cache())`` on the spark_bench attention, (c)
    ``spark_bench.generate``, (d) the harness: the same tokens and the same bytes."""
    model, stops = tiny_lm.model, sorted(tiny_lm.stop_token_ids)
    config = spark_bench.method(name, budget=64, compress_scope="prompt", **options)
    sample = replace(_sample(ids), context_end=LENGTH, question_end=LENGTH)
    (expected,) = _harness(tiny_lm, sample, [config])
    with spark_bench.press(model, name, budget=64, **options) as pressed:
        a = model.generate(torch.tensor([ids], device=DEVICE), max_new_tokens=MAX_NEW, do_sample=False,
                           eos_token_id=stops)
    context = spark_bench.compress(model, ids, config)
    cache = context.as_cache()
    model.set_attn_implementation("spark_bench")
    try:
        b = model.generate(torch.tensor([context.continuation_ids()], device=DEVICE), past_key_values=cache,
                           max_new_tokens=MAX_NEW - 1, do_sample=False, eos_token_id=stops)
    finally:
        model.set_attn_implementation("sdpa")
    c = spark_bench.generate(model, context, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=stops)
    for out in (a, b, c):
        assert _new_tokens(out, LENGTH, stops)[0] == expected.tokens
    assert pressed.context.kv_bytes == context.kv_bytes == cache.store_bytes == expected.kv_bytes
    assert pressed.context.key_ratio == expected.key_ratio


def test_a_cache_serves_a_hand_written_loop_and_a_pipeline(smollm2):
    """Under the official protocol (the user turn compressed; end of turn and assistant header run through the
    cache): a ``model(...)`` loop holds the harness's bytes once the suffix ran, and a text-generation pipeline
    answers as spark_bench.generate does."""
    import transformers

    model, tok = smollm2.model, smollm2.tokenizer
    context = spark_bench.compress(model, spark_bench.prompt(tok, "The code is 4521. " * 12, "What is the code?"),
                                   spark_bench.method("snapkv+spark", ratio=0.8, budget=96))
    assert context.suffix and context.first_logits is None
    reference = spark_bench.generate(model, context, max_new_tokens=6, do_sample=False)[0, len(context.input_ids):]
    model.set_attn_implementation("spark_bench")
    try:
        cache, ids = context.as_cache(), torch.tensor([context.suffix], device=model.device)
        positions = torch.arange(context.end, len(context.input_ids), device=model.device)[None]
        tokens = []
        with torch.no_grad():
            for _ in range(6):
                logits = model(input_ids=ids, position_ids=positions, past_key_values=cache).logits[:, -1]
                if not tokens:
                    assert cache.nbytes() == context.kv_bytes  # the stores + the suffix, dense
                tokens.append(int(logits.argmax()))
                ids, positions = torch.tensor([[tokens[-1]]], device=model.device), positions[:, -1:] + 1
        pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok)
        text = pipe(tok.decode(context.input_ids), past_key_values=context.as_cache(), max_new_tokens=6,
                    do_sample=False, return_full_text=False)[0]["generated_text"]
    finally:
        model.set_attn_implementation("sdpa")
    assert tokens == reference.tolist()
    assert text == tok.decode(reference, skip_special_tokens=True)


def test_a_cache_on_another_attention_or_repeating_the_prompt_is_refused(tiny_lm, ids):
    import transformers

    model = tiny_lm.model
    context = spark_bench.compress(model, ids, spark_bench.method("snapkv+spark", ratio=0.8, budget=64))
    with pytest.raises(ValueError, match="ran another attention function .*set_attn_implementation"):
        model.generate(torch.tensor([context.continuation_ids()]), past_key_values=context.as_cache(),
                       max_new_tokens=2)
    model.set_attn_implementation("spark_bench")
    try:
        # transformers < 5.3's generate slices the whole prompt away against the cache's length itself (an
        # IndexError, before any forward); from 5.3 the forward's positions reach the cache's own refusal
        old = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 3)
        with pytest.raises(IndexError) if old else pytest.raises(
                ValueError, match="starts at position 0 but the cache holds 150 tokens"):
            model.generate(torch.tensor([ids]), past_key_values=context.as_cache(), max_new_tokens=2)
        dense = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)  # dense caches: sdpa
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(dense, model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False))


def test_press_leaves_the_model_bit_identical(tiny_lm, ids):
    model = tiny_lm.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = (model.config._attn_implementation, dict(model._forward_hooks), dict(model._forward_pre_hooks),
             [dict(m._forward_pre_hooks) for m in model.modules()])
    with spark_bench.press(model, "snapkv+spark", ratio=0.8, budget=64):
        model.generate(torch.tensor([ids]), max_new_tokens=2)
    with pytest.raises(RuntimeError, match="inside"):
        with spark_bench.press(model, "pyramidkv+think", ratio=0.5, budget=64):
            raise RuntimeError("inside the block")
    after = (model.config._attn_implementation, dict(model._forward_hooks), dict(model._forward_pre_hooks),
             [dict(m._forward_pre_hooks) for m in model.modules()])
    assert after == state
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="input_ids: press compresses one prompt per forward"):
        with spark_bench.press(model, "snapkv", budget=64):
            model.generate(torch.tensor([ids, ids]), max_new_tokens=2)


def test_a_batch_of_different_prompts_decodes_each_prompts_own_tokens(tiny_lm, ids):
    """Three prompts of different lengths (and suffixes), compressed in one call, decode together as each alone."""
    model, stops = tiny_lm.model, sorted(tiny_lm.stop_token_ids)
    prompts = [Prompt(ids[:120], 90, 110), Prompt(ids, CONTEXT_END, QUESTION_END), Prompt(ids[:135] + ids[:30],
                                                                                         120, 151)]
    config = spark_bench.method("snapkv+spark", ratio=0.8, budget=64)
    contexts = spark_bench.compress(model, prompts, config)
    together = spark_bench.generate(model, contexts, max_new_tokens=MAX_NEW, eos_token_id=stops)
    assert [len(c.suffix) for c in contexts] == [10, 14, 14]
    for prompt, context, row in zip(prompts, contexts, together):
        alone = spark_bench.generate(model, context, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=stops)
        assert row[:len(prompt.ids)].tolist() == prompt.ids
        assert row[len(prompt.ids):].tolist() == _new_tokens(alone, len(prompt.ids), stops)[0]
    with pytest.raises(ValueError, match="do_sample: contexts of different prompts decode together greedily"):
        spark_bench.generate(model, contexts, do_sample=True)


def test_num_return_sequences_shares_the_stores_and_is_reproducible(tiny_lm, ids):
    """k sampled rows read one context's stores (nothing copied). Rows draw from one generator stream, so row i is
    not the single-row run with the same seed; it is the same as passing the context k times."""
    model = tiny_lm.model
    context = spark_bench.compress(model, ids, spark_bench.method("snapkv+spark", ratio=0.8, budget=64))

    def sampled(contexts, **kwargs):
        torch.manual_seed(5)
        return spark_bench.generate(model, contexts, max_new_tokens=6, do_sample=True, temperature=2.0, **kwargs)

    two = sampled(context, num_return_sequences=2)
    assert two.shape == (2, LENGTH + 6) and torch.equal(two, sampled(context, num_return_sequences=2))
    assert torch.equal(two, sampled([context, context]))
    assert not torch.equal(two[0], two[1])


@pytest.mark.parametrize("name,options,scope", [("snapkv+spark", dict(ratio=0.8), "prompt"),
                                                ("adasnapkv+spark", dict(ratio=0.5, value_ratio=0.3), "question"),
                                                ("pyramidkv+think", dict(ratio=0.5), "question")])
def test_save_load_generate_gives_the_same_tokens(tiny_lm, tiny_qwen3, ids, tmp_path, name, options, scope):
    """The file holds the stores (plus the prefill's last logits when the whole prompt was compressed) and a
    header under 64 KiB; loaded, it generates the same tokens; another model's is refused."""
    model = tiny_lm.model
    context = spark_bench.compress(model, _sample(ids), spark_bench.method(name, budget=64, compress_scope=scope,
                                                                           **options))
    path = context.save(tmp_path / "context.safetensors")
    logits = 0 if context.first_logits is None else context.first_logits.numel() * 4
    assert path.stat().st_size <= context.nbytes + logits + 64 * 1024
    loaded = spark_bench.CompressedContext.load(path, model)
    assert (loaded.nbytes, loaded.kv_bytes, loaded.end, loaded.input_ids) == (context.nbytes, context.kv_bytes,
                                                                              context.end, context.input_ids)
    assert torch.equal(spark_bench.generate(model, loaded, max_new_tokens=MAX_NEW),
                       spark_bench.generate(model, context, max_new_tokens=MAX_NEW))
    with pytest.raises(ValueError, match="model: the context was compressed by"):
        spark_bench.CompressedContext.load(path, tiny_qwen3.model)


def test_the_top_level_names_are_the_api_and_load_lazily():
    from spark_bench import api

    assert spark_bench.__all__ == api.__all__
    assert all(getattr(spark_bench, name) is getattr(api, name) for name in api.__all__)
    with pytest.raises(AttributeError, match="no attribute 'compres'"):
        spark_bench.compres
    code = "import sys, spark_bench; print('torch' in sys.modules)"  # the CLI's cheap checks stay cheap
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False"]


def test_the_example_runs_offline_on_smollm2(smollm2, capsys):
    """examples/needle_two_questions.py (the README's library example) on the embedded GGUF model, a short prompt;
    its command line is checked for its arguments only (the model loads once in this module)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import needle_two_questions
    finally:
        sys.path.remove(str(ROOT / "examples"))
    needle_two_questions.run(smollm2, length=1024)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("SnapKV+SparK(0.8) @0.2:") and "KV bytes held" in line for line in lines)
    assert sum("magic number for" in line for line in lines) == 6
    full = next(line for line in lines if line.startswith("Full:"))
    assert "(1.000x" in full
    out = subprocess.run([sys.executable, "examples/needle_two_questions.py", "--help"], capture_output=True,
                         text=True, cwd=ROOT, check=True)
    assert "--length" in out.stdout and "--ratio" in out.stdout


def test_generate_equals_the_harness_on_the_gguf_model(smollm2):
    """The embedded SmolLM2 (GGUF, the default model): library and harness agree on a RULER prompt."""
    from spark_bench.benchmarks.ruler import load_ruler

    sample = load_ruler(["niah_single_1"], 512, 1, seed=0, lm=smollm2)[0]
    configs = [spark_bench.method(name, ratio=0.8, budget=0.3) for name in ("snapkv+spark", "spark", "pyramidkv")]
    expected = _harness(smollm2, replace(sample, max_new_tokens=8), configs)
    stops = sorted(smollm2.stop_token_ids)
    for context, prediction in zip(spark_bench.compress(smollm2.model, sample, configs), expected):
        out = spark_bench.generate(smollm2.model, context, max_new_tokens=8, eos_token_id=stops)
        assert _new_tokens(out, len(sample.input_ids), stops)[0] == prediction.tokens, prediction.config
        assert context.kv_bytes == prediction.kv_bytes and context.end == sample.question_end
