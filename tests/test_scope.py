"""``compress_scope``: which part of the prompt is compressed, where the first answer token comes from, and that
running a suffix through a compressed cache works for every method on both attention paths (tiny model)."""

import pytest
import torch
from conftest import DEVICE
from transformers import DynamicCache

from spark_bench.benchmarks.base import Sample, _token_boundary, encode_prompt
from spark_bench.engine.decode import DecodeRow, decode_rows, prime_rows
from spark_bench.engine.prefill import QueryStatsSpec, run_prefill
from spark_bench.methods import MethodConfig, Pipeline
from test_methods import MATRIX

SUFFIX = "<|im_end|>\n<|im_start|>assistant\n The answer is"


def test_prompt_parts_follow_the_chat_template(tiny_lm):
    tok = tiny_lm.tokenizer
    text = "Some haystack text here.\nWhat is the magic number?"
    prompt = encode_prompt(tok, text, " The answer is", question_at=text.index("What"))
    ids = prompt.ids
    templated = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    assert ids == tok(templated + " The answer is", add_special_tokens=False)["input_ids"]  # boundaries change no id
    assert tok.decode(ids[:prompt.context_end]).endswith("<|im_start|>user\nSome haystack text here.\n")
    assert tok.decode(ids[prompt.context_end:prompt.question_end]) == "What is the magic number?"
    assert tok.decode(ids[prompt.question_end:]) == SUFFIX
    plain = encode_prompt(tok, text, " The answer is", chat_template=False, question_at=text.index("What"))
    assert tok.decode(plain.ids[plain.question_end:]) == " The answer is"
    assert tok.decode(plain.ids[plain.context_end:plain.question_end]) == "What is the magic number?"
    whole = encode_prompt(tok, text)  # no question given: the user turn is all context
    assert whole.context_end == whole.question_end


def test_a_token_straddling_a_boundary_belongs_to_the_later_part():
    offsets = [(0, 0), (0, 3), (3, 7), (7, 9)]  # a BOS with empty offsets, then three tokens
    assert _token_boundary(offsets, 3) == 2
    assert _token_boundary(offsets, 5) == 2  # "3..7" holds character 5: it goes with what follows
    assert _token_boundary(offsets, 7) == 3


def test_prefix_view_equals_a_prefill_of_the_prefix_alone(tiny_lm):
    ids = torch.randint(100, 5000, (1, 150), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    stats = QueryStatsSpec(n_sink=4, n_future=64)
    full = run_prefill(tiny_lm.model, ids, window=32, ends=(100, 130), query_stats=stats)
    for end in (100, 130):
        alone, view = run_prefill(tiny_lm.model, ids[:, :end], window=32, query_stats=stats), full.at(end)
        assert view.prompt_length == end and view.first_logits is None and full.at(end) is view
        for a, b in zip(alone.layers, view.layers):
            torch.testing.assert_close(b.keys, a.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b.values, a.values, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b.window_queries, a.window_queries, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b.query_mean, a.query_mean, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b.query_cov, a.query_cov, atol=1e-5, rtol=1e-5)
    assert full.at(150) is full
    with pytest.raises(ValueError, match="no window queries for a prefix of 90 tokens"):
        full.at(90)


def _sample(ids, context_end, question_end) -> Sample:
    return Sample(task="t", id="s", input_ids=tuple(ids), answers=("x",), max_new_tokens=4, metric="string_match_all",
                  context_end=context_end, question_end=question_end)


def _row(prefill, sample, config, scope, attention="compact", max_new=4):
    end = sample.scope_end(scope)
    cache, _ = Pipeline.from_config(config).build_cache(prefill.at(end), attention=attention)
    return DecodeRow(cache, prefill.at(end).first_logits, end, max_new, frozenset(),
                     suffix=tuple(sample.input_ids[end:]))


def _reference_first_token(model, cache, suffix, start) -> int:
    """Plain transformers: a DynamicCache holding the compressed cache's (materialized) keys and values, the suffix
    run through it at positions start, start + 1, …"""
    dense = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        keys, values = layer.materialized()
        dense.update(keys, values, i)
    ids = torch.tensor([list(suffix)], device=DEVICE)
    positions = torch.arange(start, start + len(suffix), device=DEVICE).unsqueeze(0)
    with torch.inference_mode():
        logits = model(input_ids=ids, position_ids=positions, past_key_values=dense, logits_to_keep=1).logits
    return int(logits[0, -1].argmax())


@pytest.fixture(scope="module")
def scoped(tiny_lm):
    """A 200-token prompt: context 0..150, question 150..180, suffix 180..200; prefilled once for all scopes."""
    ids = torch.randint(100, 5000, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    sample = _sample(ids, 150, 180)
    prefill = run_prefill(tiny_lm.model, torch.tensor([ids], device=DEVICE), window=32, ends=(150, 180),
                          query_stats=QueryStatsSpec())  # ExpectedAttention's statistics, per prefix too
    return sample, prefill


EVICTING = [MethodConfig(name="full"), MethodConfig(name="streamingllm", budget=8),
            MethodConfig(name="snapkv", budget=40), MethodConfig(name="snapkv+spark", budget=48, ratio=0.8),
            MethodConfig(name="pyramidkv+think", budget=48, ratio=0.5)]


def test_first_answer_token_comes_from_the_compressed_cache(tiny_lm, scoped):
    sample, prefill = scoped
    model = tiny_lm.model
    # prompt scope: every method takes its first token from the full-cache prefill
    prompt_rows = decode_rows(model, [_row(prefill, sample, c, "prompt", max_new=1) for c in EVICTING])
    assert {row.tokens[0] for row in prompt_rows} == {prefill.first_token}
    for scope in ("question", "context"):
        rows = decode_rows(model, [_row(prefill, sample, c, scope, max_new=1) for c in EVICTING])
        for row in rows[:4]:  # the first token is the one plain transformers gives over the compressed cache
            assert row.tokens[0] == _reference_first_token(model, row.cache, row.suffix, row.position)
        # (PyramidKV keeps different lengths per layer, which one DynamicCache mask cannot express; the method
        # matrix below checks its suffix against the materialize reference)
        assert rows[0].tokens[0] == prefill.first_token  # the full cache: the same as prefilling everything
        # eviction that keeps 8 of the prompt's tokens changes the first token (it came from the full cache before)
        assert rows[1].tokens[0] != prefill.first_token


def test_context_scope_never_lets_the_question_into_the_window(tiny_lm):
    """Two prompts with the same context and different questions: under ``context`` the compressed caches are
    identical (the question never reaches the observation window or the scores); under ``question`` they differ."""
    g = torch.Generator().manual_seed(5)
    context = torch.randint(100, 5000, (150,), generator=g).tolist()
    tail = torch.randint(100, 5000, (20,), generator=g).tolist()
    questions = [torch.randint(100, 5000, (30,), generator=g).tolist() for _ in range(2)]
    config = MethodConfig(name="snapkv+spark", budget=40, ratio=0.8, window_size=16, channel_window=8)
    caches = {}
    for scope in ("context", "question"):
        for k, question in enumerate(questions):
            ids = context + question + tail
            prefill = run_prefill(tiny_lm.model, torch.tensor([ids], device=DEVICE), window=16, ends=(150, 180))
            end = _sample(ids, 150, 180).scope_end(scope)
            cache, _ = Pipeline.from_config(config).build_cache(prefill.at(end), attention="materialize")
            caches[scope, k] = [layer.materialized() for layer in cache.layers]
    for (k0, v0), (k1, v1) in zip(caches["context", 0], caches["context", 1]):
        torch.testing.assert_close(k0, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v0, v1, atol=1e-5, rtol=1e-5)
    assert any(not torch.allclose(a[0], b[0], atol=1e-3) or a[0].shape != b[0].shape
               for a, b in zip(caches["question", 0], caches["question", 1]))


CONFIGS = [MethodConfig(name=name, budget=64, **options) for name, options in MATRIX[::4]]


def test_suffix_rows_batch_like_rows_alone_on_both_attention_paths(tiny_lm, scoped):
    """The method matrix under ``question`` and ``context`` (suffixes of 20 and 50 tokens) in one call: batched
    tokens equal one-at-a-time tokens, and the compact attention equals the materialize reference."""
    sample, prefill = scoped
    model = tiny_lm.model

    def rows(attention="compact"):
        return [_row(prefill, sample, c, scope, attention) for scope in ("question", "context") for c in CONFIGS]

    batched = [r.tokens for r in decode_rows(model, rows())]
    alone = [decode_rows(model, [r])[0].tokens for r in rows()]
    reference = [r.tokens for r in decode_rows(model, rows("materialize"))]
    primed = rows()  # the suffixes first, in forwards of 3 or 2 rows (a sweep with the fidelity pass on), then batched
    prime_rows(model, primed, configs=3, width=200)
    assert all(not r.suffix and len(r.tail) == len(r.cache.layers) for r in primed)
    assert batched == alone == reference == [r.tokens for r in decode_rows(model, primed)]
    for row, one in zip(primed[::5], rows()[::5]):  # each row's suffix the same whatever rows share its forward
        prime_rows(model, [one], configs=3, width=200)
        assert torch.equal(one.first_logits, row.first_logits) and all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one.tail, row.tail))
    assert len(batched) == 2 * len(CONFIGS) and all(len(t) == 4 for t in batched)


def test_runner_scopes_and_bytes(tiny_lm, tmp_path):
    from spark_bench.benchmarks.ruler import load_ruler
    from spark_bench.runner import run_sweep

    samples = load_ruler(["niah_single_1", "niah_multikey_2"], 512, 1, 0, tiny_lm, max_new_tokens=3)
    configs = [MethodConfig(name=n, budget=0.5, ratio=r, compress_scope=s) for s in ("prompt", "question", "context")
               for n, r in (("full", 0.0), ("snapkv", 0.0), ("snapkv+spark", 0.8))]
    preds = run_sweep(tiny_lm, samples, configs, tmp_path / "run")
    assert preds.config.nunique() == 9  # labels tell the scopes apart
    full = preds[preds.config.str.startswith("Full")]
    assert (full.kv_bytes == full.kv_bytes_full).all()  # the suffix run through the cache is counted, densely
    snap = preds[preds.config.str.startswith("SnapKV @")].set_index("config").kv_bytes
    assert snap.filter(like="prompt").sum() < snap.filter(like="question").sum() < snap.filter(like="context").sum()
    bare = [Sample(**{**s.__dict__, "context_end": None, "question_end": None}) for s in samples]
    with pytest.raises(ValueError, match="compress_scope=question needs the prompt's context/question boundaries"):
        run_sweep(tiny_lm, bare, configs[3:4], tmp_path / "bare")
