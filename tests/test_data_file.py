"""A data file (``benchmark.data_file``) meets one schema before the model loads (issue 56): every kind of bad record
is named ``file:line: field …``, all of them counted in one line; a sample longer than the model's context is
refused or cut as ``benchmark.truncate`` says; the docs' table is the schema's."""

import json
import re
import sys
from pathlib import Path

import pytest
from test_bad_inputs import BASE, no_loading  # noqa: F401 — the fixture: fail if a model or tokenizer loads
from test_protocol import _compose

import spark_bench.cli as cli
from spark_bench.benchmarks import records
from spark_bench.benchmarks.base import Sample, cut_middle
from spark_bench.benchmarks.records import FIELDS, DataFileError, Limits, read_samples
from spark_bench.checks import ConfigError

ROOT = Path(__file__).resolve().parent.parent
GOOD = {"task": "niah_single_1", "id": "s0", "input_ids": [1, 2, 3, 4, 5, 6], "answers": ["x"], "max_new_tokens": 4,
        "metric": "string_match_all", "context_end": 3, "question_end": 5}
BARE = {k: v for k, v in GOOD.items() if not k.endswith("_end")}  # no boundaries: compress_scope=prompt only
LIMITS = Limits("tiny-llama", 4096, 49152)
CLASSES = {"metric": "classification", "metric_args": {"all_classes": ["a", "b"]}}


def _write(path: Path, lines: list) -> Path:
    """One line per entry: a dict as JSON, a str as it is (a line that is not JSON, a raw escape)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _problem(tmp_path, lines, limits=LIMITS) -> str:
    path = _write(tmp_path / "data.jsonl", lines)
    with pytest.raises(DataFileError) as err:
        read_samples(path, limits)
    message = str(err.value)
    assert "\n" not in message
    return message.replace(str(path), "data.jsonl")


# case → (the bad record's fields over BARE, or the file's lines; the one line's problem after "data.jsonl:<line>: ")
BAD = {
    # the kinds issue 56 names
    "duplicate id": ([GOOD, dict(BARE, input_ids=[7])], '2: id "s0" repeats line 1\'s (ids must be unique)'),
    "float input_ids": (dict(input_ids=[1, 2.5, 3]), "1: input_ids[1] must be an integer >= 0; got 2.5"),
    "string input_ids": (dict(input_ids="1 2 3"), '1: input_ids must be a non-empty list (an integer >= 0 each); got '
                                                  'the bare string "1 2 3"'),
    "string token id": (dict(input_ids=[1, "2"]), '1: input_ids[1] must be an integer >= 0; got "2"'),
    "empty input_ids": (dict(input_ids=[]), "1: input_ids must be a non-empty list (an integer >= 0 each); got []"),
    "empty answers": (dict(answers=[]), "1: answers must be a non-empty list (a non-empty string each); got []"),
    "answers a string": (dict(answers="42"), '1: answers must be a non-empty list (a non-empty string each); got the '
                                             'bare string "42" (write ["42"])'),
    "empty-string answer": (dict(answers=["ok", ""]), '1: answers[1] must be a non-empty string; got ""'),
    "blank answer": (dict(answers=["  "]), '1: answers[0] is blank, so it matches any prediction; got "  "'),
    "context_end past the prompt": (dict(context_end=9), "1: context_end=9 is past the prompt's end "
                                                         "(len(input_ids)=6)"),
    "question_end past the prompt": (dict(question_end=7), "1: question_end=7 is past the prompt's end"),
    "question_end before context_end": (dict(context_end=4, question_end=2),
                                        "1: question_end=2 is before context_end=4"),
    "negative context_end": (dict(context_end=-1), "1: context_end must be an integer >= 0, or null (unknown: "
                                                   "compress_scope=prompt only); got -1"),
    "unknown metric": (dict(metric="bleu"), '1: metric must be one of string_match_all, string_match_part, qa_f1, '
                                            'rouge, classification, retrieval, count, code_sim; got "bleu"'),
    "max_new_tokens a float": (dict(max_new_tokens=4.5), "1: max_new_tokens must be an integer >= 1; got 4.5"),
    "max_new_tokens a whole float": (dict(max_new_tokens=4.0), "1: max_new_tokens must be an integer >= 1; got 4.0"),
    "max_new_tokens a string": (dict(max_new_tokens="4"), '1: max_new_tokens must be an integer >= 1; got "4"'),
    "max_new_tokens zero": (dict(max_new_tokens=0), "1: max_new_tokens must be an integer >= 1; got 0"),
    "max_new_tokens negative": (dict(max_new_tokens=-3), "1: max_new_tokens must be an integer >= 1; got -3"),
    "lone surrogate in an answer": ([json.dumps(GOOD).replace('["x"]', '["ab\\ud800"]')],
                                    "1: answers[0] is not valid UTF-8 text (a lone surrogate \\ud800 at character 2, "
                                    "from a JSON \\u escape)"),
    "lone surrogate in the id": ([json.dumps(GOOD).replace('"s0"', '"\\udfff"')], "1: id is not valid UTF-8 text"),
    "lone surrogate deep in meta": ([json.dumps(dict(GOOD, meta={"a": [{"b": "X"}]})).replace("X", "\\ud83d")],
                                    "1: meta.a[0].b is not valid UTF-8 text"),
    "lone surrogate in a meta key": ([json.dumps(dict(GOOD, meta={"X": 1})).replace("X", "\\ud800")],
                                     "1: meta (a key) is not valid UTF-8 text"),
    "lone surrogate in the ignored prompt": ([json.dumps(dict(GOOD, prompt="X")).replace("X", "\\ud800")],
                                             "1: prompt is not valid UTF-8 text"),
    # more of the same kinds
    "missing field": ([{k: v for k, v in GOOD.items() if k != "metric"}],
                      "1: metric is missing (required: one of string_match_all"),
    "null where not allowed": (dict(answers=None), "1: answers must be a non-empty list (a non-empty string each); "
                                                   "got null"),
    "null answer": (dict(answers=["a", None]), "1: answers[1] must be a non-empty string; got null"),
    "null task": (dict(task=None), "1: task must be a non-empty string; got null"),
    "empty id": (dict(id=""), '1: id must be a non-empty string; got ""'),
    "id a number": (dict(id=7), "1: id must be a non-empty string; got 7"),
    "id over two lines": (dict(id="a\nb"), '1: id must be one line of printable text; got "a\\nb"'),
    "nested wrong type": (dict(CLASSES, metric_args={"all_classes": ["a", 2]}),
                          "1: metric_args.all_classes[1] must be a non-empty string; got 2"),
    "meta a list": (dict(meta=[1]), "1: meta must be an object (a mapping of names to values); got [1]"),
    "metric_args null": (dict(metric_args=None), "1: metric_args must be an object (a mapping of names to values); "
                                                 "got null"),
    "bool as int": (dict(max_new_tokens=True), "1: max_new_tokens must be an integer >= 1; got true"),
    "bool as token id": (dict(input_ids=[1, False]), "1: input_ids[1] must be an integer >= 0; got false"),
    "negative token id": (dict(input_ids=[3, -1, -2]), "1: input_ids[1] must be an integer >= 0; got -1 (2 of its 3 "
                                                       "elements are not)"),
    "token id outside the vocabulary": (dict(input_ids=[1, 49152]), "1: input_ids: token ids outside model "
                                                                   "tiny-llama's vocabulary (0 … 49151; found 1 … "
                                                                   "49152): exported with another tokenizer?"),
    "stop token outside the vocabulary": (dict(stop_token_ids=[10 ** 6]), "1: stop_token_ids: token ids outside"),
    "negative stop token": (dict(stop_token_ids=[-1]), "1: stop_token_ids[0] must be an integer >= 0; got -1"),
    "min above max": (dict(min_new_tokens=5), "1: min_new_tokens=5 exceeds max_new_tokens=4"),
    "negative min": (dict(min_new_tokens=-1), "1: min_new_tokens must be an integer >= 0; got -1"),
    "metric_args a string metric ignores": (dict(metric_args={"first_line": True}),
                                            "1: metric_args.first_line: metric string_match_all reads none"),
    "metric_args the metric lacks": (dict(metric="qa_f1", metric_args={"all_class": []}),
                                     "1: metric_args.all_class: metric qa_f1 reads only first_line, all_classes, "
                                     "rouge_backend"),
    "metric_args wrong value": (dict(metric="rouge", metric_args={"rouge_backend": "bleu"}),
                                '1: metric_args.rouge_backend must be one of rouge, rouge_score; got "bleu"'),
    "classification without classes": (dict(metric="classification"), "1: metric_args.all_classes: metric "
                                                                      "classification needs the class names"),
    "retrieval answer without a paragraph": (dict(metric="retrieval", answers=["the third"]),
                                             "1: answers: metric retrieval needs each answer to name 'Paragraph <n>'"),
    "misspelt field": (dict(contex_end=2), '1: "contex_end" is not a field of a sample (did you mean context_end?)'),
    "unknown field": (dict(source="web"), '1: "source" is not a field of a sample (annotations of one\'s own go in '
                                          'meta)'),
    "record not an object": ([[1, 2, 3]], "1: a record must be a JSON object (one sample: task, id, input_ids, "
                                          "answers, max_new_tokens, metric, …); got [1, 2, 3]"),
    "not JSON": (["{oops"], "1: not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
    "BOM inside the file": ([GOOD, "\ufeff" + json.dumps(dict(GOOD, id="s1"))], "2: not valid JSON (Unexpected UTF-8 "
                                                                                 "BOM"),
    "longer than the context": (dict(input_ids=[1] * 4093), "1: input_ids: sample s0: 4093 prompt tokens + "
                                                            "max_new_tokens=4 = 4097 exceed model tiny-llama's "
                                                            "max_length=4096; benchmark.truncate=middle cuts the "
                                                            "prompt's middle to fit (as LongBench does), "
                                                            "benchmark.truncate=keep runs it as it is"),
    # held out (audit of issue 56: odd but plausible records of the same kinds, /work/notes/audit56.md)
    "nested input_ids": (dict(input_ids=[[1, 2], [3]]), "1: input_ids[0] must be an integer >= 0; got [1, 2] (2 of its "
                                                        "2 elements are not)"),
    "NaN token id": ([json.dumps(dict(BARE, input_ids=[1, 2])).replace("[1, 2]", "[1, NaN]")],
                     "1: input_ids[1] must be an integer >= 0; got NaN"),
    "Infinity max_new_tokens": ([json.dumps(BARE).replace('"max_new_tokens": 4', '"max_new_tokens": Infinity')],
                                "1: max_new_tokens must be an integer >= 1; got Infinity"),
    "huge token id": (dict(input_ids=[1, 10 ** 30]), "1: input_ids: token ids outside model tiny-llama's vocabulary"),
    "huge max_new_tokens": (dict(max_new_tokens=10 ** 20), "1: input_ids: sample s0: 6 prompt tokens + "
                                                          "max_new_tokens=100000000000000000000"),
    "metric_args a list": (dict(metric_args=["first_line"]), "1: metric_args must be an object (a mapping of names to "
                                                             'values); got ["first_line"]'),
    "stop_token_ids a bare int": (dict(stop_token_ids=2), "1: stop_token_ids must be a list (an integer >= 0 each); "
                                                          "got 2"),
    "input_ids an object": (dict(input_ids={"0": 1}), '1: input_ids must be a non-empty list (an integer >= 0 each); '
                                                      'got {"0": 1}'),
    "meta.length a string": (dict(meta={"length": "long"}), '1: meta.length must be an integer >= 0, or null '
                                                            '(unknown); got "long"'),
    "meta.truncated not a bool": (dict(meta={"truncated": "no"}), '1: meta.truncated must be true or false; got "no"'),
    "a field given twice": ([json.dumps(BARE)[:-1] + ', "id": "s9"}'], '1: the field "id" is given twice in one '
                                                                       'object (JSON keeps only the last'),
    "a comment line": (["// exported by hand", BARE], "1: not valid JSON (Expecting value at column 1)"),
    "first_line a string": (dict(metric="qa_f1", metric_args={"first_line": "true"}),
                            '1: metric_args.first_line must be true or false; got "true"'),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_kind_of_bad_record_is_named_by_file_line_and_field(case, tmp_path):
    change, expected = BAD[case]
    lines = change if isinstance(change, list) else [{**BARE, **change}]
    message = _problem(tmp_path, lines)
    assert message == f"data.jsonl:{expected}" or message.startswith(f"data.jsonl:{expected}"), message


# a file that is not JSON lines at all → its one problem, on line 1 (not one per line)
NOT_JSON_LINES = {
    "gzip": (lambda: __import__("gzip").compress(json.dumps(GOOD).encode() + b"\n"),
             "a gzip-compressed file: decompress it first (gunzip)"),
    "zip": (lambda: b"PK\x03\x04" + b"\0" * 30, "a zip archive"),
    "UTF-16": (lambda: (json.dumps(GOOD) + "\n").encode("utf-16"), "UTF-16 text (a byte-order mark FF FE): save it as "
                                                                  "UTF-8"),
    "one JSON array": (lambda: json.dumps([GOOD, dict(GOOD, id="s1")], indent=2).encode(),
                       "it holds one JSON array (as json.dump(..., indent=2) writes); write one sample object per line"),
    "an object over lines": (lambda: json.dumps(GOOD, indent=2).encode(), "it holds a JSON object spread over several "
                                                                          "lines"),
}


@pytest.mark.parametrize("case", list(NOT_JSON_LINES))
def test_a_file_that_is_not_json_lines_is_one_problem(case, tmp_path):
    data, expected = NOT_JSON_LINES[case]
    path = tmp_path / "data.jsonl"
    path.write_bytes(data())
    with pytest.raises(DataFileError) as err:
        read_samples(path, LIMITS)
    assert str(err.value) == f"{path}:1: not a JSON-lines file: {expected}" or \
        str(err.value).startswith(f"{path}:1: not a JSON-lines file: {expected}"), str(err.value)


@pytest.mark.parametrize("kind", ["directory", "device", "missing"])
def test_a_data_file_that_is_no_file_is_named_for_what_it_is(kind, tmp_path):
    """The start-up check and the library say what the path is (a directory, a device), not "does not exist"."""
    from spark_bench.checks import check_file

    path = {"directory": tmp_path, "device": Path("/dev/null"), "missing": tmp_path / "nope.jsonl"}[kind]
    what = {"directory": "is a directory, not a file", "device": "is not a regular file",
            "missing": "does not exist"}[kind]
    with pytest.raises(ConfigError, match=f"^benchmark.data_file: {re.escape(str(path))} {what}"):
        check_file("benchmark.data_file", str(path))
    with pytest.raises(FileNotFoundError, match=f"^benchmark.data_file: {re.escape(str(path))} {what}"):
        read_samples(path, LIMITS)


def test_every_problem_is_counted_and_the_first_five_named(tmp_path):
    """Seven bad records among nine (one with two problems): one line, 8 problems counted, five named in file
    order, then how many more."""
    bad = [dict(GOOD, id=f"b{i}", max_new_tokens=0) for i in range(6)] + [dict(GOOD, id="b6", answers=[], metric="x")]
    message = _problem(tmp_path, [GOOD, *bad, dict(GOOD, id="last")])
    assert message.startswith("8 problems in 7 of 9 records: data.jsonl:2: max_new_tokens must be an integer >= 1; "
                              "got 0; data.jsonl:3: "), message
    assert re.findall(r"data\.jsonl:(\d+):", message) == ["2", "3", "4", "5", "6"]
    assert message.endswith("; … and 3 more"), message


def test_a_good_file_reads_back_with_a_bom_blank_lines_and_the_prompt(tmp_path):
    full = dict(GOOD, id="s1", meta={"length": 3}, metric="qa_f1", metric_args={"first_line": True},
                stop_token_ids=[2], min_new_tokens=1, context_end=2, question_end=5, prompt="text for people")
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(BARE) + "\n\n   \n" + json.dumps(full) + "\n\n").encode())
    first, second = read_samples(path, LIMITS)
    assert first == Sample(task="niah_single_1", id="s0", input_ids=(1, 2, 3, 4, 5, 6), answers=("x",),
                           max_new_tokens=4, metric="string_match_all")
    assert (second.meta, second.metric_args, second.stop_token_ids, second.context_end, second.question_end) == (
        {"length": 3}, {"first_line": True}, (2,), 2, 5)


def test_the_schema_covers_every_sample_field_and_is_the_docs_table():
    from dataclasses import fields

    assert list(FIELDS) == [f.name for f in fields(Sample)]
    docs = (ROOT / "docs" / "results.md").read_text()
    for name, kind, rule, default in records.schema_rows():
        row = f"| `{name}` | {kind} | {rule} | {'required' if default == 'required' else f'`{default}`'} |"
        assert row in docs, row
    assert "`benchmark.truncate`" in docs and "`middle`" in docs and "`keep`" in docs


LONG = dict(GOOD, input_ids=list(range(100)), max_new_tokens=10, context_end=80, question_end=90)


def test_truncate_middle_cuts_like_longbench_and_keeps_the_boundaries(tmp_path):
    """A 100-token prompt + 10 new tokens under max_length 50: the 10-token suffix after question_end stays, the
    turn keeps its first and last 15 tokens (LongBench's kvpress cut, the same function), the question (80 … 90)
    moves with the cut, whole."""
    path = _write(tmp_path / "data.jsonl", [LONG, dict(GOOD, id="s1")])
    cut, short = read_samples(path, Limits("m", 50, None, "middle"))
    assert cut.input_ids == (*range(15), *range(75, 100)) and len(cut.input_ids) + 10 == 50
    assert (cut.context_end, cut.question_end) == (20, 30)
    assert cut.input_ids[cut.context_end:cut.question_end] == tuple(range(80, 90))
    assert cut.meta == {"truncated": True} and short == Sample(**{**GOOD, "id": "s1", "input_ids": (1, 2, 3, 4, 5, 6),
                                                                  "answers": ("x",)})  # a short one is untouched
    expected = cut_middle(LONG["input_ids"], 30, 90, 80)
    assert (list(cut.input_ids), cut.context_end, cut.question_end) == (expected.ids, expected.context_end,
                                                                        expected.question_end)


def test_truncate_middle_keeps_the_question_whole_or_refuses(tmp_path):
    message = _problem(tmp_path, [dict(LONG, context_end=40)], Limits("m", 50, None, "middle"))
    assert message == ("data.jsonl:1: input_ids: sample s0: 100 prompt tokens + max_new_tokens=10 = 110 exceed model "
                       "m's max_length=50, and benchmark.truncate=middle would cut into its question (tokens 40 … 90, "
                       "more than half of the 30 kept before question_end)"), message
    message = _problem(tmp_path, [dict(LONG, max_new_tokens=45)], Limits("m", 50, None, "middle"))
    assert message.endswith("cannot cut it to fit: the 10 tokens after question_end and max_new_tokens=45 leave -5 "
                            "for the rest"), message
    (plain,) = read_samples(_write(tmp_path / "b.jsonl", [dict(BARE, input_ids=list(range(100)))]),
                            Limits("m", 50, None, "middle"))  # no boundaries: the whole prompt is the turn
    assert plain.input_ids == (*range(23), *range(77, 100)) and plain.question_end is None


def test_truncate_keep_runs_a_long_sample_as_it_is(tmp_path):
    (kept,) = read_samples(_write(tmp_path / "data.jsonl", [LONG]), Limits("m", 50, None, "keep"))
    assert kept.input_ids == tuple(range(100)) and kept.meta == {}


def test_the_file_is_parsed_once_per_run(tmp_path, monkeypatch):
    """The start-up check's samples are the ones the run loads (no second parse); a changed file is read again."""
    path = _write(tmp_path / "data.jsonl", [GOOD])
    calls = []
    parse = records.parse
    monkeypatch.setattr(records, "parse", lambda *a: calls.append(a) or parse(*a))
    assert read_samples(path, LIMITS) == read_samples(path, LIMITS) and len(calls) == 1
    _write(path, [GOOD, dict(GOOD, id="s1")])
    assert len(read_samples(path, LIMITS)) == 2 and len(calls) == 2


def _run(tmp_path, lines, *overrides):
    """The run's start-up in-process on tiny-llama (the fixture no_loading fails the test if a model or tokenizer
    loads): the ConfigError's one line, with nothing written."""
    data = _write(tmp_path / "data.jsonl", lines)
    cfg = _compose([*BASE, f"output_root={tmp_path / 'out'}", f"benchmark.data_file={data}", *overrides])
    before = set(tmp_path.rglob("*"))
    with pytest.raises(ConfigError) as err:
        cli.run(cfg, Path(cfg.output_root) / cfg.run)
    assert set(tmp_path.rglob("*")) == before and "\n" not in str(err.value)
    return str(err.value).replace(str(data), "data.jsonl")


def test_a_bad_file_is_refused_before_anything_loads(tmp_path, no_loading):
    bad = [GOOD, dict(GOOD, answers="xy"), dict(GOOD, id="s2", input_ids=[1.0])]
    assert _run(tmp_path, bad) == (
        'benchmark.data_file: 3 problems in 2 of 3 records: data.jsonl:2: answers must be a non-empty list (a '
        'non-empty string each); got the bare string "xy" (write ["xy"]); data.jsonl:2: id "s0" repeats line 1\'s '
        '(ids must be unique); data.jsonl:3: input_ids[0] must be an integer >= 0; got 1.0')


def test_a_sample_longer_than_the_context_is_refused_before_anything_loads(tmp_path, no_loading):
    assert _run(tmp_path, [dict(GOOD, input_ids=[1] * 4000, max_new_tokens=100)]) == (
        "benchmark.data_file: data.jsonl:1: input_ids: sample s0: 4000 prompt tokens + max_new_tokens=100 = 4100 "
        "exceed model tiny-llama's max_length=4096; benchmark.truncate=middle cuts the prompt's middle to fit (as "
        "LongBench does), benchmark.truncate=keep runs it as it is")


def test_truncate_is_for_data_files_only(tmp_path, no_loading):
    cfg = _compose([*BASE, f"output_root={tmp_path / 'out'}", "benchmark.truncate=middle"])
    with pytest.raises(ConfigError, match=r"^benchmark.truncate=middle applies to benchmark.data_file's samples only"):
        cli.run(cfg, Path(cfg.output_root) / cfg.run)
    with pytest.raises(ConfigError, match=r"^benchmark.truncate must be one of refuse, middle, keep; got 'cut'"):
        cli.run(_compose([*BASE, "benchmark.truncate=cut"]), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_console_script_exits_2_in_one_line(tmp_path, monkeypatch, capsys, no_loading):
    data = _write(tmp_path / "data.jsonl", [dict(GOOD, max_new_tokens=-1)])
    monkeypatch.setattr(sys, "argv", ["spark-bench", *BASE, f"output_root={tmp_path / 'out'}",
                                      f"benchmark.data_file={data}"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err == (f"spark-bench: error: benchmark.data_file: {data}:1: max_new_tokens must "
                                             f"be an integer >= 1; got -1"), err
    assert not (tmp_path / "out").exists()


def test_load_samples_cuts_as_the_check_does(tmp_path):
    """The run's samples (and the memory plan's bounds) are the checked, cut ones."""
    from types import SimpleNamespace

    from spark_bench import plan
    from spark_bench.samples import load_samples

    data = _write(tmp_path / "data.jsonl", [dict(GOOD, input_ids=[1] * 4100, max_new_tokens=10, context_end=4060,
                                                 question_end=4090)])
    cfg = _compose([*BASE, f"benchmark.data_file={data}", "benchmark.truncate=middle"])
    model = cli.model_config(cfg)
    (sample,) = load_samples(cfg, SimpleNamespace(config=model))
    assert (len(sample.input_ids), sample.context_end, sample.question_end) == (4096 - 10, 4060 - 14, 4090 - 14)
    assert sample.meta["truncated"] and plan.bounds(cfg, model, [], {"prompt"}).prompt == 4086


def test_the_boundaries_a_compress_scope_needs(tmp_path, no_loading):
    """compress_scope=question needs each sample's question_end, context its context_end: named per record before
    the tokenizer loads (the default protocol compresses up to the question's end)."""
    message = _problem(tmp_path, [BARE, dict(BARE, id="s1", question_end=5)],
                       Limits("m", 4096, None, scopes=frozenset({"prompt", "question", "context"})))
    assert message == ("3 problems in 2 of 2 records: data.jsonl:1: context_end is null, and compress_scope=context "
                       "needs it (where the question starts): re-export the samples with their boundaries, or run "
                       "with compress_scope=prompt; data.jsonl:1: question_end is null, and compress_scope=question "
                       "needs it (where the user turn ends): re-export the samples with their boundaries, or run with "
                       "compress_scope=prompt; data.jsonl:2: context_end is null, and compress_scope=context needs "
                       "it (where the question starts): re-export the samples with their boundaries, or run with "
                       "compress_scope=prompt"), message
    assert _run(tmp_path, [BARE]).startswith("benchmark.data_file: data.jsonl:1: question_end is null, and "
                                             "compress_scope=question needs it")


def test_a_good_file_runs_with_its_long_sample_cut(tmp_path):
    """End to end on tiny-llama with model.max_length=256: the 300-token sample runs cut to 251 tokens (+ 4 new),
    the short one as it is."""
    data = _write(tmp_path / "data.jsonl", [
        dict(GOOD, id="long", input_ids=list(range(10, 310)), context_end=280, question_end=295),
        dict(GOOD, id="short", input_ids=list(range(10, 60)), context_end=40, question_end=45)])
    out = tmp_path / "out" / "r"
    cli.run(_compose([*BASE, f"output_root={tmp_path / 'out'}", "run=r", f"benchmark.data_file={data}",
                      "benchmark.truncate=middle", "model.max_length=256", "method=full"]), out)
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {r["id"]: r["prompt_length"] for r in rows} == {"long": 251, "short": 50}
    assert all(len(r["tokens"]) <= 4 for r in rows)
