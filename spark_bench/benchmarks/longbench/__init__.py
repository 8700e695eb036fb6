"""LongBench v1 (Bai et al., 2024): the 16 English tasks of the SparK paper, with the official protocol.

Protocol (THUDM/LongBench ``pred.py`` and ``config/*.json``): the task's prompt template is filled from the record;
if the tokenized prompt is longer than ``max_length`` it is cut in the middle (first and last ``max_length // 2``
tokens, decoded and joined); the chat template is applied except for trec/triviaqa/samsum/lcc/repobench-p;
greedy decoding for the task's ``max_new_tokens``; samsum also stops at a newline and generates at least one
token. ``max_length`` defaults to the model config's ``longbench_max_length`` (the ``model2maxlen`` of the official
SparK fork: 7950 for Llama-3-8B, 127500 for Llama-3.1) and else to its context minus 500 tokens (LongBench's
convention: 7500 for 8K models, 31500 for 32K) — see :func:`truncation_limit`.

``longbench.protocol=kvpress`` is the official SparK code's path instead (its ``eval.py`` + kvpress pipeline, the
runs behind the paper): the same prompt text is wrapped in the chat template first and then, if longer than
``max_length`` tokens, the user turn's token ids are cut in the middle (first and last half, no decode round trip;
the end of turn and assistant header are kept); trec/triviaqa/samsum/lcc/repobench-p get no chat template, no BOS
token and a ``"\n"`` suffix (``question_suffix``); generation runs LongBench's ``max_new_tokens`` + 20 (the fork's
records), samsum stops at a newline but has no minimum length. The fork reads its records from the hub mirror, whose
context/question split only matters for ``compress_scope=context``; here the question is the template's part after
the context in both protocols.

Data: ``longbench.data_dir`` holds the official ``<task>.jsonl`` files (``<task>_e.jsonl`` for LongBench-E);
otherwise the records come from the hub parquet mirror ``longbench.hub_path`` (``Xnhyacinth/LongBench``, the one
the official SparK code reads; the original ``THUDM/LongBench`` needs a loading script recent ``datasets`` no
longer runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spark_bench.benchmarks.base import Prompt, Sample, cut_middle, encode_prompt, read_jsonl
from spark_bench.models import LoadedModel, ModelConfig

_QA_MULTI = ("Answer the question based on the given passages. Only give me the answer and do not output any other "
             "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
             "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:")
_QASPER_RULE = ("as concisely as you can, using a single phrase or sentence if possible. If the question cannot be "
                "answered based on the information in the article, write \"unanswerable\". If the question is a "
                "yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.")
_CODE = "Please complete the code given below. \n{context}"


@dataclass(frozen=True)
class LongBenchTask:
    category: str
    prompt: str
    max_new_tokens: int
    metric: str
    chat: bool = True         # official: no chat template for few-shot and code tasks
    first_line: bool = False  # official scorer keeps the first line (trec, triviaqa, samsum)


# official config/dataset2prompt.json and dataset2maxlen.json, eval.py dataset2metric; paper column order
TASKS = {
    "narrativeqa": LongBenchTask(
        "Single-Doc QA",
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
        "{context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:", 128, "qa_f1"),
    "qasper": LongBenchTask(
        "Single-Doc QA",
        "You are given a scientific article and a question. Answer the question " + _QASPER_RULE
        + "\n\nArticle: {context}\n\n Answer the question based on the above article " + _QASPER_RULE
        + "\n\nQuestion: {input}\n\nAnswer:", 128, "qa_f1"),
    "multifieldqa_en": LongBenchTask(
        "Single-Doc QA",
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
        64, "qa_f1"),
    "hotpotqa": LongBenchTask("Multi-Doc QA", _QA_MULTI, 32, "qa_f1"),
    "2wikimqa": LongBenchTask("Multi-Doc QA", _QA_MULTI, 32, "qa_f1"),
    "musique": LongBenchTask("Multi-Doc QA", _QA_MULTI, 32, "qa_f1"),
    "gov_report": LongBenchTask(
        "Summarization",
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:", 512, "rouge"),
    "qmsum": LongBenchTask(
        "Summarization",
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:", 512, "rouge"),
    "multi_news": LongBenchTask(
        "Summarization",
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, "
        "write a one-page summary of all the news.\n\nSummary:", 512, "rouge"),
    "trec": LongBenchTask(
        "Few-shot",
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n"
        "{input}", 64, "classification", chat=False, first_line=True),
    "triviaqa": LongBenchTask(
        "Few-shot",
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}", 32, "qa_f1", chat=False,
        first_line=True),
    "samsum": LongBenchTask(
        "Few-shot",
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
        "{input}", 128, "rouge", chat=False, first_line=True),
    "passage_count": LongBenchTask(
        "Synthetic",
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: ", 32, "count"),
    "passage_retrieval_en": LongBenchTask(
        "Synthetic",
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        "the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", "
        "etc.\n\nThe answer is: ", 32, "retrieval"),
    "lcc": LongBenchTask("Code", _CODE + "Next line of code:\n", 64, "code_sim", chat=False),
    "repobench-p": LongBenchTask("Code", _CODE + "{input}Next line of code:\n", 64, "code_sim", chat=False),
}
LONGBENCH_E_TASKS = ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
                     "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p")
REQUIRED_FIELDS = ("input", "context", "answers")
PROTOCOLS = ("pred", "kvpress")
KVPRESS_EXTRA_TOKENS = 20  # the fork's records: LongBench's max_new_tokens + 20


def _answers_are_a_list(record: dict) -> str | None:
    answers = record["answers"]
    return None if isinstance(answers, list) else f"'answers' must be a list, got {type(answers).__name__}"


def hub_source(hub_path: str) -> str:
    """Where the hub mirror is read from: a local directory, its snapshot in the hub cache, or the hub id when the
    hub is reachable; else :class:`~spark_bench.hub.HubUnavailable` naming ``longbench.data_dir``."""
    from spark_bench import hub

    return hub.resolve(hub_path, "dataset", "LongBench data (longbench.data_dir is not set)",
                       f"set longbench.data_dir=DIR (the official <task>.jsonl files, e.g. THUDM/LongBench's "
                       f"data.zip unpacked), or download the mirror once with `hf download {hub_path} --repo-type "
                       f"dataset` (or set longbench.hub_path= to a local copy)")


def read_records(task: str, data_dir: str | None, e: bool = False, hub_path: str = "Xnhyacinth/LongBench") -> list[dict]:
    """The task's records from ``data_dir/<task>[_e].jsonl``, or from the hub mirror when ``data_dir`` is None."""
    name = f"{task}_e" if e else task
    if data_dir is None:
        from datasets import load_dataset

        return [dict(r) for r in load_dataset(hub_source(hub_path), name, split="test")]
    path = Path(data_dir) / f"{name}.jsonl"
    if not path.is_file():
        found = sorted(p.name for p in Path(data_dir).glob("*.jsonl")) if Path(data_dir).is_dir() else []
        raise FileNotFoundError(f"longbench.data_dir: no {path.name} in {data_dir} "
                                f"({'found: ' + ', '.join(found) if found else 'no .jsonl files there'})")
    return read_jsonl(path, REQUIRED_FIELDS, "LongBench record", _answers_are_a_list)


def _question_at(prompt: str, question: str) -> int | None:
    """Where the question (the template's part after the context) starts in ``prompt``, if it is there whole."""
    if not prompt.endswith(question):
        return None
    return len(prompt) - len(question.lstrip())


def _kvpress_prompt(prompt: str, question: str, spec: LongBenchTask, lm: LoadedModel,
                    max_length: int) -> tuple[Prompt, bool, bool]:
    """The fork's path: template first, then a middle cut of the user turn's token ids (see the module docstring).
    Returns (prompt, truncated, whether the question survived the cut whole)."""
    tok = lm.tokenizer
    chat = bool(lm.config.chat_template and spec.chat and tok.chat_template)
    encoded = encode_prompt(tok, prompt, "" if chat else "\n", chat_template=chat,
                            question_at=_question_at(prompt, question), bos=False)
    if encoded.question_end <= max_length:
        return encoded, False, True
    cut = cut_middle(encoded.ids, max_length, encoded.question_end, encoded.context_end)  # the turn's middle dropped
    return cut, True, cut.context_end is not None


def build_sample(task: str, record: dict, index: int, lm: LoadedModel, max_length: int,
                 rouge_backend: str = "rouge", protocol: str = "pred") -> Sample:
    if protocol not in PROTOCOLS:
        raise ValueError(f"longbench.protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
    spec, tok = TASKS[task], lm.tokenizer
    prompt = spec.prompt.format(**record)
    # the question is the template's part after the context (with the record's input), when truncation left it whole
    question = spec.prompt.split("{context}", 1)[1].format(**record)
    stops = (tok.encode("\n", add_special_tokens=False)[-1],) if task == "samsum" else ()
    if protocol == "kvpress":
        encoded, truncated, whole = _kvpress_prompt(prompt, question, spec, lm, max_length)
        return _sample(task, record, index, encoded, whole, spec, rouge_backend, truncated, stops,
                       spec.max_new_tokens + KVPRESS_EXTRA_TOKENS, 0)
    ids = tok(prompt)["input_ids"]
    if len(ids) > max_length:  # official middle truncation
        half = max_length // 2
        prompt = tok.decode(ids[:half], skip_special_tokens=True) + tok.decode(ids[-half:], skip_special_tokens=True)
    question_at = _question_at(prompt, question)
    encoded = encode_prompt(tok, prompt, chat_template=lm.config.chat_template and spec.chat, question_at=question_at)
    return _sample(task, record, index, encoded, question_at is not None, spec, rouge_backend, len(ids) > max_length,
                   stops, spec.max_new_tokens, 1 if task == "samsum" else 0)


def _sample(task, record, index, encoded: Prompt, whole: bool, spec: LongBenchTask, rouge_backend: str,
            truncated: bool, stops: tuple, max_new_tokens: int, min_new_tokens: int) -> Sample:
    metric_args = {"first_line": spec.first_line, "rouge_backend": rouge_backend}
    if spec.metric == "classification":
        metric_args["all_classes"] = list(record.get("all_classes") or [])
    return Sample(task=task, id=str(record.get("_id", f"{task}-{index}")), input_ids=tuple(encoded.ids),
                  answers=tuple(str(a) for a in record["answers"]), max_new_tokens=max_new_tokens,
                  metric=spec.metric, meta={"length": record.get("length"), "truncated": truncated},
                  metric_args=metric_args, stop_token_ids=stops, min_new_tokens=min_new_tokens,
                  context_end=encoded.context_end if whole else None,
                  question_end=encoded.question_end)


def truncation_limit(model: ModelConfig, max_length: int | None = None) -> int:
    """Prompt tokens kept before middle truncation: ``longbench.max_length`` if given, else the model's
    ``longbench_max_length``, else its context ``max_length`` minus 500."""
    if max_length:
        return max_length
    return model.longbench_max_length or model.max_length - 500


def load_longbench(tasks, lm: LoadedModel, data_dir: str | None = None, num_samples: int | None = None,
                   e: bool = False, max_length: int | None = None, hub_path: str = "Xnhyacinth/LongBench",
                   rouge_backend: str = "rouge", protocol: str = "pred") -> list[Sample]:
    valid = LONGBENCH_E_TASKS if e else tuple(TASKS)
    unknown = [t for t in tasks if t not in valid]
    if unknown:
        raise ValueError(f"unknown LongBench{'-E' if e else ''} task(s) {unknown}; valid: {', '.join(valid)}")
    if data_dir is not None and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"longbench.data_dir={data_dir} is not a directory")
    limit = truncation_limit(lm.config, max_length)
    samples = []
    for task in tasks:
        records = read_records(task, data_dir, e, hub_path)[:num_samples]
        samples += [build_sample(task, r, i, lm, limit, rouge_backend, protocol) for i, r in enumerate(records)]
    return samples
