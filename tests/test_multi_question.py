"""Several questions over one context (issue 54 item 4): a data file's ``questions``, RULER's ``ruler.questions``,
records that share their context. Under ``compress_scope=context`` each config compresses the context once and
answers every question from that one cache, which no earlier answer changes: each question's tokens are those of a
sample holding that question alone, compressed the same way over the same context (tiny model)."""

import json
from dataclasses import replace

import pytest
import torch
from conftest import DEVICE

import spark_bench.runner as runner
from spark_bench.benchmarks import records
from spark_bench.benchmarks.base import Sample
from spark_bench.benchmarks.records import DataFileError, Limits, read_samples
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.pipeline import sweep_labels
from spark_bench.samples import context_units, group_contexts

CONTEXT = 120
CONFIGS = [MethodConfig(name="full", compress_scope="context"),
           MethodConfig(name="snapkv+spark", budget=0.5, ratio=0.8, compress_scope="context"),
           MethodConfig(name="think", ratio=0.5, compress_scope="context"),
           MethodConfig(name="streamingllm+think", budget=48, ratio=0.5, compress_scope="context"),
           MethodConfig(name="snapkv+spark", budget=0.5, ratio=0.8, compress_scope="question")]


def _record(seed: int = 0) -> dict:
    """A context of 120 random token ids and three questions (question, then a 3-token suffix each)."""
    ids = torch.randint(100, 5000, (CONTEXT + 40,), generator=torch.Generator().manual_seed(seed)).tolist()
    questions = [ids[CONTEXT:CONTEXT + 9], ids[CONTEXT + 9:CONTEXT + 21], list(reversed(ids[CONTEXT:CONTEXT + 7]))]
    return {"task": "t", "id": f"c{seed}", "input_ids": ids[:CONTEXT], "max_new_tokens": 5,
            "metric": "string_match_all", "questions": [
                {"input_ids": q + [11, 12, 13], "answers": [f"a{k}"], "question_end": len(q)}
                for k, q in enumerate(questions)]}


def _alone(sample: Sample) -> Sample:
    """The same question as a sample of its own (no context shared with any other)."""
    return replace(sample, id=f"alone-{sample.id}", meta={})


def _run(lm, samples, configs=CONFIGS, **kwargs):
    pipelines = [Pipeline.from_config(c, label) for c, label in zip(configs, sweep_labels(configs))]
    return [p for per in runner.run_samples(lm, [(s, pipelines) for s in samples], **kwargs) for p in per]


@pytest.fixture
def counted(monkeypatch):
    """How many prefills and compressions the runner does."""
    seen = {"prefill": 0, "compress": 0}

    def wrap(name, fn):
        def counting(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)
        return counting

    monkeypatch.setattr(runner, "_prefill", wrap("prefill", runner._prefill))
    monkeypatch.setattr(runner, "compress_prefill", wrap("compress", runner.compress_prefill))
    return seen


def test_each_question_answers_as_if_asked_alone_from_one_compression(tiny_lm, counted):
    """The invariant: a context's questions answered from one cache per query-agnostic config give, question by
    question, the tokens (and scores, bytes) of each question asked alone — so no answer changed the cache. The
    query-aware config compresses each question on its own, as before."""
    many = group_contexts(records.to_samples(_record()))
    assert [(s.id, s.meta, s.context_end) for s in many] == [
        (f"c0/q{k}", {"context": "c0", "question": k}, CONTEXT) for k in (1, 2, 3)]
    shared = _run(tiny_lm, many)
    assert counted == {"prefill": 3, "compress": 4 + 3}  # 4 context configs once; the question one per question
    counted.update(prefill=0, compress=0)
    alone = _run(tiny_lm, [_alone(s) for s in many])
    assert counted == {"prefill": 3, "compress": 5 * 3}
    assert len(shared) == len(alone) == 3 * len(CONFIGS)
    for a, b in zip(shared, alone):
        assert (a.config, a.id) == (b.config, b.id[len("alone-"):])
        assert a.tokens == b.tokens and a.score == b.score and a.kv_bytes == b.kv_bytes, (a.config, a.id)
        assert (a.kv_bytes_full, a.prompt_length, a.key_ratio) == (b.kv_bytes_full, b.prompt_length, b.key_ratio)
        assert (a.kl_full, a.answer_nll) == pytest.approx((b.kl_full, b.answer_nll), abs=1e-5)
        assert a.question == int(a.id[-1]) and b.question is None
    first = {p.config: p.compress_s for p in shared if p.question == 1}
    assert any(len({tuple(p.tokens) for p in shared if p.config == c}) > 1 for c in first)  # questions differ
    assert all(p.compress_s == 0.0 for p in shared if p.question > 1 and "question" not in p.config)
    assert all(first[c] > 0 for c in first)


def test_a_context_scoped_sweep_prefills_a_context_once(tiny_lm, counted):
    """With every config query-agnostic, the later questions need no prefill of their own; batching the rows one
    at a time gives the same tokens."""
    many = group_contexts(records.to_samples(_record(1)))
    together = _run(tiny_lm, many, CONFIGS[:2])
    assert counted == {"prefill": 1, "compress": 2}
    assert [p.prefill_s > 0 for p in together] == [True, True] + [False] * 4
    assert [p.kv_bytes_full for p in together[::2]] == [p.prompt_length * together[0].kv_bytes_full
                                                        // together[0].prompt_length for p in together[::2]]
    one_by_one = _run(tiny_lm, many, CONFIGS[:2], decode_batch=1)
    assert [p.tokens for p in together] == [p.tokens for p in one_by_one]


def test_run_sweep_over_a_data_file_with_questions(tiny_lm, tmp_path, counted):
    """End to end: a data file whose records hold questions, one prediction per question and config, stored with
    its position; each context compressed once per query-agnostic config however many samples decode together."""
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(_record(seed)) + "\n" for seed in (2, 3)))
    samples = group_contexts(read_samples(path, Limits("tiny-llama", 4096, 49152, scopes=frozenset({"context"}))))
    assert [len(u) for u in context_units(samples)] == [3, 3]
    preds = runner.run_sweep(tiny_lm, samples, CONFIGS[:2], tmp_path / "run", progress=False, decode_samples=1)
    assert counted["compress"] == 2 * 2
    assert list(preds.question) == [1, 1, 2, 2, 3, 3] * 2
    stored = [json.loads(line) for line in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in stored[::2]] == [f"c{s}/q{k}" for s in (2, 3) for k in (1, 2, 3)]
    assert all(r["question"] == int(r["id"][-1]) for r in stored)


def test_records_sharing_a_context_are_grouped_and_others_left_alone():
    """LongBench-style records, one question each: those of one task with the same context ids (up to their
    context_end) become one context's questions, together where the first was; the rest are untouched."""
    def sample(i, context, question, task="t"):
        return Sample(task=task, id=f"s{i}", input_ids=(*context, *question), answers=("x",), max_new_tokens=2,
                      metric="string_match_all", context_end=len(context), question_end=len(context) + len(question))

    a, b = (1, 2, 3, 4), (1, 2, 3, 5)
    samples = [sample(0, a, (9,)), sample(1, b, (9,)), sample(2, a, (8, 7)), sample(3, a, (6,), task="u"),
               sample(4, (1, 2, 3), (4, 9))]  # s4: the same ids as s0 but its context ends earlier
    grouped = group_contexts(samples)
    assert [s.id for s in grouped] == ["s0", "s2", "s1", "s3", "s4"]
    assert [s.meta for s in grouped] == [{"context": "s0", "question": 1}, {"context": "s0", "question": 2}, {}, {},
                                         {}]
    assert grouped[2] is samples[1] and [len(u) for u in context_units(grouped)] == [2, 1, 1, 1]


BAD_QUESTIONS = {  # the record's fields over _record()'s → the one problem after "data.jsonl:1: "
    "answers beside questions": (dict(answers=["x"]), "answers: a record with questions has none "
                                                      "(questions[k].answers); drop answers"),
    "context_end beside questions": (dict(context_end=3), "context_end: a record with questions has none (its context "
                                                          "is the whole of input_ids); drop context_end"),
    "a question not an object": (dict(questions=["what?"]), 'questions[0] must be an object (a mapping of names to '
                                                            'values); got "what?"'),
    "no questions": (dict(questions=[]), "questions must be a non-empty list (an object (a mapping of names to "
                                         "values) each); got []"),
    "a question without answers": (dict(questions=[{"input_ids": [5]}]), "questions[0].answers is missing (required: "
                                                                         "a non-empty list (a non-empty string each))"),
    "a misspelt question field": (dict(questions=[{"input_ids": [5], "answers": ["a"], "answer": ["b"]}]),
                                  'questions[0]: "answer" is not a field of a question (did you mean answers?)'),
    "a float token id": (dict(questions=[{"input_ids": [5, 1.5], "answers": ["a"]}]),
                         "questions[0].input_ids[1] must be an integer >= 0; got 1.5"),
    "question_end past the question": (dict(questions=[{"input_ids": [5], "answers": ["a"], "question_end": 2}]),
                                       "questions[0].question_end=2 is past the question's end "
                                       "(len(questions[0].input_ids)=1)"),
    "a repeated question id": (dict(questions=[{"input_ids": [5], "answers": ["a"]},
                                               {"input_ids": [6], "answers": ["b"], "id": "c0/q1"}]),
                               'questions[1].id "c0/q1" repeats another question\'s of this record (ids must be '
                               'unique)'),
    "a token outside the vocabulary": (dict(questions=[{"input_ids": [5, 60000], "answers": ["a"]}]),
                                       "questions[0].input_ids: token ids outside model tiny-llama's vocabulary "
                                       "(0 … 49151; found 5 … 60000): exported with another tokenizer?"),
}


@pytest.mark.parametrize("case", BAD_QUESTIONS)
def test_a_bad_question_is_named_file_line_field(case, tmp_path):
    fields, expected = BAD_QUESTIONS[case]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({**_record(), **fields}) + "\n")
    with pytest.raises(DataFileError) as err:
        read_samples(path, Limits("tiny-llama", 4096, 49152))
    assert str(err.value) == f"{path}:1: {expected}"


def test_question_scope_needs_each_questions_end(tmp_path):
    record = _record()
    del record["questions"][1]["question_end"]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(record) + "\n")
    assert len(read_samples(path, Limits("m", 4096, None, scopes=frozenset({"context", "prompt"})))) == 3
    with pytest.raises(DataFileError, match=r"data.jsonl:1: questions\[1\].question_end is null, and "
                                            "compress_scope=question needs it"):
        read_samples(path, Limits("m", 4096, None, scopes=frozenset({"question"})))


def test_ruler_asks_several_needles_of_one_haystack(tiny_lm):
    """``ruler.questions=3``: three samples per haystack, the same context ids, each asking another needle; one
    question is RULER's own sample."""
    from spark_bench.benchmarks.ruler.niah import generate_niah

    one = generate_niah("niah_single_1", tiny_lm.tokenizer, 512, 1, 42)
    three = generate_niah("niah_single_1", tiny_lm.tokenizer, 512, 1, 42, questions=3)
    assert [s.id for s in one] == ["niah_single_1-0"] and "context" not in one[0].meta
    assert [s.id for s in three] == [f"niah_single_1-0/q{k}" for k in (1, 2, 3)]
    assert [s.meta["question"] for s in three] == [1, 2, 3] and {s.meta["context"] for s in three} == {
        "niah_single_1-0"}
    assert len({s.input_ids[:s.context_end] for s in three}) == 1 and len({s.answers for s in three}) == 3
    haystack = tiny_lm.tokenizer.decode(three[0].input_ids[:three[0].context_end])
    assert all(s.answers[0] in haystack for s in three)  # every needle asked is in the one haystack
    assert all(len(s.input_ids) + 128 <= 512 for s in three)
    assert group_contexts(three) == three


def test_ruler_questions_is_for_the_needle_tasks():
    from test_protocol import _compose

    from spark_bench.checks import ConfigError
    from spark_bench.samples import check_benchmark
    from conftest import model_config

    cfg = _compose(["benchmark.tasks=[niah_single_1,vt]", "ruler.questions=2"])
    with pytest.raises(ConfigError, match=r"^ruler.questions=2: several questions over one haystack are asked of "
                                          r"the needle tasks \(niah_\*\) generated here; drop vt from"):
        check_benchmark(cfg, model_config("tiny-llama"), sources=False)
    check_benchmark(_compose(["benchmark.tasks=[niah_single_1]", "ruler.questions=2"]), model_config("tiny-llama"),
                    sources=False)
