"""The schema of a data file (``benchmark.data_file``): one JSON object per line, one
:class:`~spark_bench.benchmarks.base.Sample` each, as ``spark-bench-export`` writes them. Every field is declared
once in :data:`FIELDS` with its :class:`~spark_bench.options.Option` type (the types and ranges of the command
line's options) and the rules between fields; :func:`read_samples` checks every record of a file against it before
the model loads and reports all problems in one line (the first :data:`SHOWN` named ``file:line: field …``, then
"… and N more"), so a file is fixed in one pass rather than one traceback at a time, after the model loaded.

A record holds exactly the :class:`Sample` fields (the required ones, :data:`FIELDS`); ``prompt`` (the prompt's
text, which export adds for reading) is ignored; any other field is refused by name (a misspelt optional field
would otherwise be dropped silently; annotations of one's own go in ``meta``). All text must be UTF-8: a JSON
``"\\ud800"`` escape decodes to a lone surrogate, which no file can be written with, so it is refused here rather
than when the predictions are written. A byte-order mark opening the file and blank lines are fine.

Checked against the model and the run (:class:`Limits`): token ids inside its vocabulary, the boundaries the
configs' ``compress_scope`` needs, and the prompt plus ``max_new_tokens`` within the model's context
``max_length``; a longer sample is refused, cut in the middle as LongBench cuts its prompts
(``benchmark.truncate=middle``: the first and last halves of the prompt up to ``question_end``, the suffix after it
kept, the question kept whole or the sample refused), or run as it is (``keep``). ``benchmark.truncate`` is for
data files only: generated RULER samples fit ``benchmark.length`` (at most ``max_length``), LongBench's are cut to
``longbench.max_length`` by its protocol."""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

from spark_bench.benchmarks.base import Sample, cut_middle, jsonl_records
from spark_bench.benchmarks.longbench.metrics import ANSWER_METRICS
from spark_bench.benchmarks.metrics import METRICS
from spark_bench.options import LONGBENCH_OPTIONS, Option


@dataclass(frozen=True)
class Field:
    """A record's field: its type (``option``), whether a record must have it, and the rule between it and other
    fields or the model, in words (checked in :func:`_rules`)."""

    option: Option
    required: bool = False
    rule: str = ""


TEXT = Option("str", nonempty=True)
TOKEN_ID = Option("int", 0)
BOUNDARY = Option("int", 0, nullable=True, null="unknown: compress_scope=prompt only")

# the metric_args each metric reads (:func:`spark_bench.benchmarks.metrics.score`): RULER's string matches none,
# LongBench's those of :func:`~spark_bench.benchmarks.longbench.metrics.longbench_score`
LONGBENCH_ARGS = {"first_line": Option("bool"), "all_classes": Option("list", items=TEXT),
                  "rouge_backend": LONGBENCH_OPTIONS["rouge_backend"]}
METRIC_ARGS: dict[str, dict[str, Option]] = {**{name: {} for name in METRICS},
                                             **{name: LONGBENCH_ARGS for name in ANSWER_METRICS}}

FIELDS = {
    "task": Field(TEXT, True, "one line (the tables group by it)"),
    "id": Field(TEXT, True, "one line, unique in the file (predictions are stored and resumed by it)"),
    "input_ids": Field(Option("list", nonempty=True, items=TOKEN_ID), True,
                       "inside the model's vocabulary; with max_new_tokens within its max_length (benchmark.truncate)"),
    "answers": Field(Option("list", nonempty=True, items=TEXT), True,
                     "not blank (a blank reference matches any prediction); a bare string is refused, not split; "
                     "metric retrieval: each names 'Paragraph <n>'"),
    "max_new_tokens": Field(Option("int", 1), True, "the most tokens decoded"),
    "metric": Field(Option("str", choices=tuple(METRIC_ARGS)), True, "scores the sample (0–100)"),
    "meta": Field(Option("dict"), rule="anything JSON; its \"length\" (an integer >= 0, or null) fills the "
                                       "predictions' length column (LongBench-E's buckets)"),
    "metric_args": Field(Option("dict"), rule="only the keys the metric reads: none for the string_match metrics; "
                                              "first_line (bool), all_classes (list of strings, which classification "
                                              "needs), rouge_backend (rouge or rouge_score) for LongBench's"),
    "stop_token_ids": Field(Option("list", items=TOKEN_ID), rule="inside the model's vocabulary"),
    "min_new_tokens": Field(Option("int", 0), rule="at most max_new_tokens"),
    "context_end": Field(BOUNDARY, rule="where the question starts: at most question_end and len(input_ids)"),
    "question_end": Field(BOUNDARY, rule="where the user turn ends: at least context_end, at most len(input_ids)"),
}
# several questions over one context (a record of its own, not a Sample field: the record stands for one sample per
# question, :func:`to_samples`): the record's ``input_ids`` are the context (template head + context), each question
# object holds the ids that follow it (the question, then the end of turn, assistant header and answer prefix) and its
# own answers; under a query-agnostic scope (``compress_scope=context``) each config compresses the context once and
# answers every question from that one cache (:mod:`spark_bench.runner`)
QUESTION_FIELDS = {
    "input_ids": Field(Option("list", nonempty=True, items=TOKEN_ID), True,
                       "the question and what follows it (end of turn, assistant header, answer prefix): they follow "
                       "the record's input_ids (the context); inside the model's vocabulary"),
    "answers": FIELDS["answers"],
    "question_end": Field(Option("int", 0, nullable=True, null="unknown: compress_scope=context or prompt only"),
                          rule="where the user turn ends, counted in the question's own input_ids (at most their "
                               "length)"),
    "id": Field(TEXT, rule="one line, unique in the file; the question's predictions are stored under it"),
}
QUESTIONS = Field(Option("list", nonempty=True, items=Option("dict")),
                  rule="several questions over the record's input_ids (then its context, whole): one object each, with "
                       "the questions[].* fields below; the record then has no answers, context_end or question_end "
                       "(each question has its own); one sample per question, scored on its own")
QUESTION_DEFAULTS = {"question_end": "null", "id": '"<id>/q<k>" (k = 1, 2, …)'}
# the keys of ``meta`` spark-bench itself reads (the runner's length column, LongBench-E's 0-4k / 4-8k / 8k+
# buckets; the context a question shares with others and its position among them, which spark-bench sets:
# :func:`spark_bench.samples.group_contexts`); the others are the user's own
META = {"length": Option("int", 0, nullable=True, null="unknown"), "truncated": Option("bool"),
        "context": TEXT, "question": Option("int", 1)}
IGNORED = ("prompt",)  # what export adds besides the fields: the prompt's text, for people to read
SHOWN = 5  # problems named in the one line; the rest are counted
_SAMPLE_FIELDS = {f.name: f for f in fields(Sample)}
assert set(FIELDS) == set(_SAMPLE_FIELDS), "records.FIELDS must declare every Sample field"


@dataclass(frozen=True)
class Limits:
    """What a data file's samples must fit: model ``model``'s context ``max_length`` and vocabulary (``vocab``
    ids; None: unknown, not checked), what to do with a longer sample (``benchmark.truncate``), and the run's
    ``compress_scope`` values (``scopes``: ``question`` needs every sample's ``question_end``, ``context`` its
    ``context_end``)."""

    model: str
    max_length: int
    vocab: int | None = None
    truncate: str = "refuse"
    scopes: frozenset = frozenset()


class DataFileError(ValueError):
    """A data file with bad records: one line counting every problem and naming the first :data:`SHOWN`."""


def default(name: str) -> str:
    """A field's default as JSON (``required`` when a record must have it)."""
    f = _SAMPLE_FIELDS[name]
    if f.default is MISSING and f.default_factory is MISSING:
        return "required"
    value = f.default if f.default is not MISSING else f.default_factory()
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def schema_rows() -> list[tuple[str, str, str, str]]:
    """(field, type, rule, default) per field, then ``questions`` and its objects' fields: the table of
    docs/results.md (tests/test_data_file.py)."""
    return ([(name, f.option.valid(), f.rule, default(name)) for name, f in FIELDS.items()]
            + [("questions", QUESTIONS.option.valid(), QUESTIONS.rule, "[]")]
            + [(f"questions[].{name}", f.option.valid(), f.rule, "required" if f.required else QUESTION_DEFAULTS[name])
               for name, f in QUESTION_FIELDS.items()])


def _shown(value) -> str:
    """A value as JSON (``null``, ``true``, a surrogate escaped), cut to one short piece of a line."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "…"


def _type_problem(name: str, value, option: Option) -> str | None:
    """What is wrong with ``value`` for ``option`` (None: nothing); a list names its first bad element."""
    if option.items == TOKEN_ID and isinstance(value, list) and set(map(type, value)) <= {int} \
            and (not value or min(value) >= 0) and (value or not option.nonempty):
        return None  # token ids, the bulk of a file: 20 times faster than Option.accepts element by element
    if option.accepts(value):
        return None
    if option.kind == "list" and isinstance(value, str):
        return f"{name} must be {option.valid()}; got the bare string {_shown(value)} (write [{_shown(value)}])"
    if option.kind == "list" and isinstance(value, list) and value and option.items is not None:
        bad = [i for i, v in enumerate(value) if not option.items.accepts(v)]
        more = f" ({len(bad)} of its {len(value)} elements are not)" if len(bad) > 1 else ""
        return f"{name}[{bad[0]}] must be {option.items.valid()}; got {_shown(value[bad[0]])}{more}"
    return f"{name} must be {option.valid()}; got {_shown(value)}"


def _bad_text(value, where: str) -> str | None:
    """The first string in ``value`` (keys included) that cannot be written as UTF-8 (a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return (f"{where} is not valid UTF-8 text (a lone surrogate {_shown(value[err.start])[1:-1]} at "
                    f"character {err.start}, from a JSON \\u escape)")
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            problem = _bad_text(key, f"{where} (a key)") or _bad_text(item, f"{where}.{key}")
            if problem:
                return problem
    elif isinstance(value, list):
        for i, item in enumerate(value):
            problem = _bad_text(item, f"{where}[{i}]")
            if problem:
                return problem
    return None


def _vocab_problem(name: str, ids: list[int], limits: Limits | None) -> str | None:
    if limits is None or limits.vocab is None or not ids or max(ids) < limits.vocab:
        return None
    return (f"{name}: token ids outside model {limits.model}'s vocabulary (0 … {limits.vocab - 1}; found "
            f"{min(ids)} … {max(ids)}): exported with another tokenizer?")


def _rules(record: dict, ok: set[str], limits: Limits | None) -> list[str]:
    """The rules between fields (and against the model) whose fields have their types (``ok``)."""
    problems = []
    n = len(record["input_ids"]) if "input_ids" in ok else None
    for name in ("task", "id"):
        if name in ok and not record[name].isprintable():
            problems.append(f"{name} must be one line of printable text; got {_shown(record[name])}")
    if "answers" in ok:
        blank = [i for i, a in enumerate(record["answers"]) if not a.strip()]
        if blank:
            problems.append(f"answers[{blank[0]}] is blank, so it matches any prediction; got "
                            f"{_shown(record['answers'][blank[0]])}")
        elif record.get("metric") == "retrieval" and not all(re.search(r"Paragraph \d+", a)
                                                              for a in record["answers"]):
            problems.append(f"answers: metric retrieval needs each answer to name 'Paragraph <n>'; got "
                            f"{_shown(record['answers'])}")
    if "meta" in ok:
        for key, option in META.items():
            if key in record["meta"]:
                problem = _type_problem(f"meta.{key}", record["meta"][key], option)
                if problem:
                    problems.append(problem)
    if {"min_new_tokens", "max_new_tokens"} <= ok and record["min_new_tokens"] > record["max_new_tokens"]:
        problems.append(f"min_new_tokens={record['min_new_tokens']} exceeds max_new_tokens="
                        f"{record['max_new_tokens']}")
    bounds = {k: record.get(k) for k in ("context_end", "question_end") if k in ok}
    if n is not None:
        for name, value in bounds.items():
            if value is not None and value > n:
                problems.append(f"{name}={value} is past the prompt's end (len(input_ids)={n})")
    if bounds.get("context_end") is not None and bounds.get("question_end") is not None \
            and bounds["context_end"] > bounds["question_end"]:
        problems.append(f"question_end={bounds['question_end']} is before context_end={bounds['context_end']}")
    if "metric" in ok and ("metric_args" in ok or "metric_args" not in record):
        metric, args = record["metric"], record.get("metric_args", {})
        valid = METRIC_ARGS[metric]
        for key, value in args.items():
            if key not in valid:
                reads = f"reads only {', '.join(valid)}" if valid else "reads none"
                problems.append(f"metric_args.{key}: metric {metric} {reads}")
            else:
                problem = _type_problem(f"metric_args.{key}", value, valid[key])
                if problem:
                    problems.append(problem)
        if metric == "classification" and not args.get("all_classes"):
            problems.append("metric_args.all_classes: metric classification needs the class names (a non-empty "
                            "list of strings); without them every prediction scores 0")
    for name in ("input_ids", "stop_token_ids"):
        if name in ok:
            problem = _vocab_problem(name, record[name], limits)
            if problem:
                problems.append(problem)
    for scope in sorted(limits.scopes if limits else ()):
        name = f"{scope}_end"
        if "questions" in record:
            break  # its context ends at len(input_ids); each question's question_end is checked with it
        if scope != "prompt" and (name in ok or name not in record) and record.get(name) is None:
            problems.append(f"{name} is null, and compress_scope={scope} needs it (where the "
                            f"{'user turn ends' if scope == 'question' else 'question starts'}): re-export the "
                            f"samples with their boundaries, or run with compress_scope=prompt")
    return problems


def check_record(record, limits: Limits | None = None) -> list[str]:
    """Every problem of one record (``field …`` each), against :data:`FIELDS` and, given ``limits``, the model's
    vocabulary and the run's ``compress_scope`` (the length is :func:`fit`'s)."""
    if not isinstance(record, dict):
        return [f"a record must be a JSON object (one sample: {', '.join(k for k, f in FIELDS.items() if f.required)}"
                f", …); got {_shown(record)}"]
    problems = []
    for key in record:
        if key not in FIELDS and key not in IGNORED and key != "questions":
            close = difflib.get_close_matches(key, [*FIELDS, "questions", *IGNORED], n=1)
            hint = f"did you mean {close[0]}?" if close else "annotations of one's own go in meta"
            problems.append(f"{_shown(key)} is not a field of a sample ({hint})")
    ok = set()
    many = "questions" in record
    for name, f in FIELDS.items():
        if name not in record:
            if f.required and not (many and name == "answers"):
                problems.append(f"{name} is missing (required: {f.option.valid()})")
            continue
        problem = _type_problem(name, record[name], f.option)
        if problem:
            problems.append(problem)
        else:
            ok.add(name)
    for name in record:
        if name in ok and FIELDS[name].option.items == TOKEN_ID:
            continue  # integers only: no text in them
        problem = _bad_text(name, "a field's name") or _bad_text(record[name], name)
        if problem:
            problems.append(problem)
            ok.discard(name)
    if many:
        problems += _question_problems(record, limits)
    return problems + _rules(record, ok, limits)


def _question_problems(record: dict, limits: Limits | None) -> list[str]:
    """What is wrong with a record's ``questions`` (:data:`QUESTIONS`, each object against
    :data:`QUESTION_FIELDS`, named ``questions[k].field``) and with the fields such a record may not have."""
    own = {"answers": "questions[k].answers", "context_end": "its context is the whole of input_ids",
           "question_end": "questions[k].question_end"}
    problems = [f"{name}: a record with questions has none ({own[name]}); drop {name}" for name in own
                if name in record]
    problem = _type_problem("questions", record["questions"], QUESTIONS.option)
    if problem:
        return problems + [problem]
    for k, question in enumerate(record["questions"]):
        where = f"questions[{k}]"
        for key in question:
            if key not in QUESTION_FIELDS:
                close = difflib.get_close_matches(key, list(QUESTION_FIELDS), n=1)
                hint = f"did you mean {close[0]}?" if close else f"valid: {', '.join(QUESTION_FIELDS)}"
                problems.append(f"{where}: {_shown(key)} is not a field of a question ({hint})")
        for name, f in QUESTION_FIELDS.items():
            if name not in question:
                if f.required:
                    problems.append(f"{where}.{name} is missing (required: {f.option.valid()})")
                continue
            problem = _type_problem(f"{where}.{name}", question[name], f.option)
            if problem is None and f.option.items != TOKEN_ID:
                problem = _bad_text(question[name], f"{where}.{name}")
            if problem:
                problems.append(problem)
                continue
            if name == "answers":
                blank = [i for i, a in enumerate(question[name]) if not a.strip()]
                if blank:
                    problems.append(f"{where}.answers[{blank[0]}] is blank, so it matches any prediction; got "
                                    f"{_shown(question[name][blank[0]])}")
                elif record.get("metric") == "retrieval" and not all(re.search(r"Paragraph \d+", a)
                                                                      for a in question[name]):
                    problems.append(f"{where}.answers: metric retrieval needs each answer to name 'Paragraph <n>'; "
                                    f"got {_shown(question[name])}")
            elif name == "id" and not question[name].isprintable():
                problems.append(f"{where}.id must be one line of printable text; got {_shown(question[name])}")
            elif name == "input_ids":
                problem = _vocab_problem(f"{where}.input_ids", question[name], limits)
                if problem:
                    problems.append(problem)
            elif name == "question_end" and question[name] is not None and \
                    isinstance(question.get("input_ids"), list) and question[name] > len(question["input_ids"]):
                problems.append(f"{where}.question_end={question[name]} is past the question's end "
                                f"(len(questions[{k}].input_ids)={len(question['input_ids'])})")
        if "question" in (limits.scopes if limits else ()) and question.get("question_end") is None:
            problems.append(f"{where}.question_end is null, and compress_scope=question needs it (where the user "
                            "turn ends): give it, or run with compress_scope=context or prompt")
    return problems


def to_sample(record: dict) -> Sample:
    """A checked record (without ``questions``) as a :class:`Sample` (lists as tuples, ``prompt`` dropped)."""
    values = {k: record[k] for k in FIELDS if k in record}
    values.update({k: tuple(values[k]) for k in ("input_ids", "answers", "stop_token_ids") if k in values})
    return Sample(**values)


def question_id(record_id: str, k: int) -> str:
    """The id of a record's ``k``-th question (from 1) when the question names none."""
    return f"{record_id}/q{k}"


def to_samples(record: dict) -> list[Sample]:
    """A checked record as its samples: itself, or with ``questions`` one sample per question — the context's ids
    then the question's (``context_end`` where the question starts, ``question_end`` shifted by it), the question's
    answers and id, ``meta.context`` the record's id and ``meta.question`` the position (from 1)."""
    if "questions" not in record:
        return [to_sample(record)]
    context = to_sample({**record, "answers": ["-"]})
    n = len(context.input_ids)
    return [replace(context, id=q.get("id", question_id(context.id, k)), input_ids=context.input_ids + tuple(
        q["input_ids"]), answers=tuple(q["answers"]), context_end=n, question_end=None if q.get("question_end") is None
        else n + q["question_end"], meta={**context.meta, "context": context.id, "question": k})
        for k, q in enumerate(record["questions"], 1)]


def fit(sample: Sample, limits: Limits) -> tuple[Sample | None, str | None]:
    """The sample within the model's context (``len(input_ids) + max_new_tokens <= max_length``), as
    ``limits.truncate`` says: ``refuse`` a longer one, cut its prompt's middle (``middle``: :func:`cut_middle`,
    LongBench's kvpress-protocol cut; the suffix after ``question_end`` and the question from ``context_end`` kept
    whole, or the sample refused), or ``keep`` it. Returns (sample, None) or (None, the problem)."""
    n, new = len(sample.input_ids), sample.max_new_tokens
    if n + new <= limits.max_length or limits.truncate == "keep":
        return sample, None
    over = (f"sample {sample.id}: {n} prompt tokens + max_new_tokens={new} = {n + new} exceed model {limits.model}'s "
            f"max_length={limits.max_length}")
    if limits.truncate != "middle":
        return None, (f"input_ids: {over}; benchmark.truncate=middle cuts the prompt's middle to fit (as LongBench "
                      f"does), benchmark.truncate=keep runs it as it is")
    end = n if sample.question_end is None else sample.question_end
    keep = limits.max_length - new - (n - end)
    if keep < 2:
        return None, (f"input_ids: {over}, and benchmark.truncate=middle cannot cut it to fit: the {n - end} tokens "
                      f"after question_end and max_new_tokens={new} leave {keep} for the rest")
    cut = cut_middle(sample.input_ids, keep, sample.question_end, sample.context_end)
    if sample.context_end is not None and cut.context_end is None:
        return None, (f"input_ids: {over}, and benchmark.truncate=middle would cut into its question (tokens "
                      f"{sample.context_end} … {end}, more than half of the {keep} kept before question_end)")
    return replace(sample, input_ids=tuple(cut.ids), context_end=cut.context_end, question_end=cut.question_end,
                   meta={**sample.meta, "truncated": True}), None


# what a file that is not JSON lines at all opens with → what it is (one problem for the file, not one per line)
NOT_JSON_LINES = ((b"\x1f\x8b", "a gzip-compressed file: decompress it first (gunzip)"),
                  (b"PK\x03\x04", "a zip archive: extract the JSON-lines file from it"),
                  (b"\xff\xfe", "UTF-16 text (a byte-order mark FF FE): save it as UTF-8"),
                  (b"\xfe\xff", "UTF-16 text (a byte-order mark FE FF): save it as UTF-8"))


def file_kind_problem(path: Path) -> str | None:
    """Why the file is not JSON lines at all, from its first bytes (compressed, UTF-16, one JSON array or an
    object spread over lines, as ``json.dump(..., indent=2)`` writes), or None."""
    with open(path, "rb") as f:
        head = f.read(4096)
    for magic, what in NOT_JSON_LINES:
        if head.startswith(magic):
            return f"not a JSON-lines file: {what}"
    first = head.lstrip(b"\xef\xbb\xbf \t\r\n").split(b"\n", 1)[0].strip()
    if first in (b"[", b"{"):
        shape = "one JSON array" if first == b"[" else "a JSON object spread over several lines"
        return (f"not a JSON-lines file: it holds {shape} (as json.dump(..., indent=2) writes); write one sample "
                "object per line (spark-bench-export's format)")
    return None


def parse(path: str | Path, limits: Limits | None = None) -> tuple[list[Sample], list[tuple[int, str]], int]:
    """(samples, problems as (line, text), records) of a data file: every line checked (:func:`check_record`,
    ids unique across lines, :func:`fit` given ``limits``); a file that is not JSON lines at all
    (:func:`file_kind_problem`) is one problem on line 1."""
    whole = file_kind_problem(Path(path))
    if whole:
        return [], [(1, whole)], 1
    samples, problems, seen, records = [], [], {}, 0
    for lineno, record, problem in jsonl_records(Path(path)):
        records += 1
        found = [problem] if problem else check_record(record, limits)
        for name, value in _ids(record):
            first = seen.setdefault(value, (lineno, name))
            if first != (lineno, name):
                where = "line {}'s".format(first[0]) if first[0] != lineno else "another question's of this record"
                found.append(f"{name} {_shown(value)} repeats {where} (ids must be unique)")
        if not found:
            for sample in to_samples(record):
                if limits is not None:
                    sample, problem = fit(sample, limits)
                    found += [problem] if problem else []
                if sample is not None:
                    samples.append(sample)
        problems += [(lineno, text) for text in found]
    return samples, problems, records


def _ids(record) -> list[tuple[str, str]]:
    """``(field, id)`` of every sample a record stands for that has a string id: its ``id``, or with ``questions``
    each question's (given, or :func:`question_id`)."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return []
    questions = record.get("questions")
    if not isinstance(questions, list):
        return [("id", record["id"])]
    return [(f"questions[{k}].id", q.get("id", question_id(record["id"], k + 1))) for k, q in enumerate(questions)
            if isinstance(q, dict) and isinstance(q.get("id", ""), str)]


def summary(path, problems: list[tuple[int, str]], records: int) -> str:
    """One line: every problem counted, the first :data:`SHOWN` named ``file:line: …``."""
    named = "; ".join(f"{path}:{lineno}: {text}" for lineno, text in problems[:SHOWN])
    if len(problems) == 1:
        return named
    lines = len({lineno for lineno, _ in problems})
    more = f"; … and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    return f"{len(problems)} problems in {lines} of {records} records: {named}{more}"


_CACHE: list = []  # [(key, samples)]: the last file read, so the run's start-up check and its loading parse once


def read_samples(path: str | Path, limits: Limits | None = None) -> list[Sample]:
    """A data file's samples, every record checked (:func:`parse`); raises :class:`DataFileError` (one line,
    :func:`summary`) when any is bad, ``FileNotFoundError`` when there is no file. The result is kept for the
    same file (unchanged on disk) and ``limits``: ``spark-bench`` checks the file before the model loads and
    reuses the samples it parsed then."""
    file = Path(path)
    if not file.is_file():
        what = "is a directory, not a file" if file.is_dir() else "is not a regular file" if file.exists() else \
            "does not exist"
        raise FileNotFoundError(f"benchmark.data_file: {path} {what}")
    stat = file.stat()
    key = (str(file.resolve()), stat.st_mtime_ns, stat.st_size, limits)
    if _CACHE and _CACHE[0][0] == key:
        return list(_CACHE[0][1])
    samples, problems, records = parse(file, limits)
    if problems:
        raise DataFileError(summary(path, problems, records))
    _CACHE[:] = [(key, samples)]
    return list(samples)
