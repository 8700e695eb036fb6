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


def test_ask_over_text_builds_each_prompt_from_the_chat_template(tiny_lm):
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


def test_bad_library_inputs_are_one_line_errors(tiny_lm, ids):
    model, config = tiny_lm.model, spark_bench.method("snapkv+spark", ratio=0.8, budget=64)
    context = spark_bench.compress(model, ids, config)  # token ids alone: every scope compresses all of them
    assert context.end == LENGTH and context.first_logits is not None
    cases = [
        (lambda: spark_bench.compress(model, "some text", config), "not text"),
        (lambda: spark_bench.compress(model, [], config), "at least one token"),
        (lambda: spark_bench.compress(model, torch.zeros(2, 5, dtype=torch.long), config), "one prompt"),
        (lambda: spark_bench.compress(model, ids, "snapkv+spark"), "MethodConfig"),
        (lambda: spark_bench.compress(model, Prompt(ids), config), "compress_scope=question needs"),
        (lambda: spark_bench.generate(model, context, input_ids=ids[:-1] + [7]), "must begin with"),
        (lambda: spark_bench.generate(model, context, num_beams=2), "not beam search"),
        (lambda: spark_bench.generate(model, context, past_key_values=None), "sets past_key_values itself"),
        (lambda: spark_bench.ask(model, ids, "a question", config), "non-empty list"),
        (lambda: spark_bench.ask(model, ids, [ids[:3]]), "needs config="),
        (lambda: spark_bench.ask(model, "text", ["q"], config), "needs tokenizer="),
        (lambda: spark_bench.load("tiny-lama"), "no such model config"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert "\n" not in str(err.value)


def test_the_top_level_names_are_the_api_and_load_lazily():
    from spark_bench import api

    assert spark_bench.__all__ == api.__all__
    assert all(getattr(spark_bench, name) is getattr(api, name) for name in api.__all__)
    with pytest.raises(AttributeError, match="no attribute 'compres'"):
        spark_bench.compres
    code = "import sys, spark_bench; print('torch' in sys.modules)"  # the CLI's cheap checks stay cheap
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False"]


@pytest.fixture(scope="module")
def smollm2():
    return spark_bench.load("smollm2-135m", device=str(DEVICE))


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
