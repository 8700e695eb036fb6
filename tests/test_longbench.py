"""LongBench: official metrics on hand-checked cases (quirks included), loading, protocol, and an end-to-end run."""

import json
from pathlib import Path

import pytest

from spark_bench.benchmarks.longbench import TASKS, build_sample, load_longbench, read_records
from spark_bench.benchmarks.longbench.metrics import (
    FUZZ_BACKEND, classification_score, code_sim_score, count_score, qa_f1_score, retrieval_score, rouge_score,
)
from spark_bench.benchmarks.metrics import score

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"


@pytest.mark.parametrize("prediction,truth,expected", [
    ("The Eiffel Tower.", "eiffel tower", 1.0),          # articles, case and punctuation normalised away
    ("Paris, France", "Paris", 2 / 3),                   # P = 1/2, R = 1
    ("", "Paris", 0.0),                                  # empty prediction
])
def test_qa_f1(prediction, truth, expected):
    assert qa_f1_score(prediction, truth) == pytest.approx(expected)


def test_rouge_l_comes_from_the_rouge_package():
    # the `rouge` package and Google's rouge-score disagree on the same pair: the official number is the former
    assert rouge_score("the cat sat", "the cat sat on the mat") == pytest.approx(0.75, abs=1e-6)
    assert rouge_score("the cat sat", "the cat sat on the mat", backend="rouge_score") == pytest.approx(2 / 3)
    assert rouge_score("", "the cat") == 0.0  # the package raises on an empty hypothesis; official returns 0


def test_classification_with_overlapping_class_names():
    classes = ["location", "Other location", "City"]
    # "location" is inside the truth "Other location" and is dropped: 1 match left → 1.0
    assert classification_score("Other location", "Other location", all_classes=classes) == 1.0
    # official loop removes from the list it iterates: after dropping "loc" it skips "location" → 2 matches → 0.5
    assert classification_score("Other location", "Other location",
                                all_classes=["loc", "location", "Other location"]) == 0.5
    # two classes named, one right → 0.5; none named → 0 (the difflib fallback never runs in the official code)
    assert classification_score("City or location", "City", all_classes=classes) == 0.5
    assert classification_score("I do not know", "City", all_classes=classes) == 0.0


def test_retrieval_and_count_share_of_numbers():
    assert retrieval_score("Paragraph 2", "Paragraph 2") == 1.0
    assert retrieval_score("Paragraph 2 or Paragraph 12", "Paragraph 2") == 0.5
    assert retrieval_score("no idea", "Paragraph 2") == 0.0
    assert count_score("There are 3 unique, not 2", "2") == 0.5
    assert count_score("", "2") == 0.0


def test_code_sim_skips_comment_lines_and_uses_difflib_fuzz():
    assert FUZZ_BACKEND == "difflib"  # python-Levenshtein absent, as in the official environment
    assert code_sim_score("\n# add the numbers\n    return a - b\nfoo", "    return a - b") == 1.0
    assert code_sim_score("// js comment\n```\nreturn a-b", "return a - b") == pytest.approx(0.91)
    # a pair where difflib (43) and Levenshtein's LCS ratio (57) disagree: the official scorer gives 43
    assert code_sim_score("  b aa", " b bbb  ") == pytest.approx(0.43)
    assert code_sim_score("# only a comment", "x = 1") == 0.0  # no usable line → empty string → ratio 0


def test_first_line_rule_and_max_over_answers():
    args = {"first_line": True, "all_classes": ["City", "Individual"]}
    assert score("classification", "City\nQuestion: who?\nType: Individual", ["City"], **args) == 100.0
    assert score("qa_f1", "\nParis\nRome", ["London", "Paris"], first_line=True) == 100.0
    assert score("qa_f1", "Paris Rome", ["Paris", "Rome"]) == pytest.approx(100 * 2 / 3)


def test_fixture_records_load_in_the_official_format():
    records = read_records("trec", str(FIXTURES))
    assert records[0]["all_classes"] and records[0]["answers"] == ["City"]
    with pytest.raises(FileNotFoundError, match="no narrativeqa_e.jsonl"):
        read_records("narrativeqa", str(FIXTURES), e=True)


def test_malformed_record_names_file_and_line(tmp_path):
    (tmp_path / "hotpotqa.jsonl").write_text(json.dumps({"input": "q", "context": "c", "answers": ["a"]})
                                             + "\n{not json\n")
    with pytest.raises(ValueError, match=r"hotpotqa.jsonl:2: not valid JSON"):
        read_records("hotpotqa", str(tmp_path))
    (tmp_path / "musique.jsonl").write_text(json.dumps({"input": "q", "context": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"musique.jsonl:1: LongBench record lacks field\(s\) \['answers'\]"):
        read_records("musique", str(tmp_path))


def test_protocol_truncation_chat_and_stops(tiny_lm):
    tok = tiny_lm.tokenizer
    record = {"input": "What is it?", "context": "word " * 3000, "answers": ["x"]}
    sample = build_sample("hotpotqa", record, 0, tiny_lm, max_length=500)
    assert sample.meta["truncated"] and 500 <= len(sample.input_ids) < 600  # middle-truncated, then chat-wrapped
    text = tok.decode(sample.input_ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("assistant")
    assert "Question: What is it?" in text and "Answer the question based on the given passages" in text
    few_shot = build_sample("samsum", {"input": "Dialogue: a\nSummary: ", "context": "x", "answers": ["y"]}, 0,
                            tiny_lm, max_length=500)
    assert "<|im_start|>" not in tok.decode(few_shot.input_ids)  # no chat template for samsum
    assert few_shot.stop_token_ids == (tok.encode("\n", add_special_tokens=False)[-1],)
    assert few_shot.min_new_tokens == 1 and few_shot.metric_args["first_line"]
    assert sample.max_new_tokens == 32 and TASKS["gov_report"].max_new_tokens == 512


def test_prompt_parts_survive_truncation(tiny_lm):
    """The question is the template's part after the context; the suffix is the end of turn + assistant header."""
    tok = tiny_lm.tokenizer
    record = {"input": "What is it?", "context": "word " * 3000, "answers": ["x"]}
    sample = build_sample("hotpotqa", record, 0, tiny_lm, max_length=500)
    ids = sample.input_ids
    assert tok.decode(ids[sample.context_end:sample.question_end]) == (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nQuestion: What is it?\nAnswer:")
    assert tok.decode(ids[sample.question_end:]) == "<|im_end|>\n<|im_start|>assistant\n"
    code = build_sample("repobench-p", {"input": "def f():", "context": "x = 1\n", "answers": ["y"]}, 0, tiny_lm,
                        max_length=500)  # no chat template: the user text runs to the end, nothing after it
    assert code.question_end == len(code.input_ids)
    assert tok.decode(code.input_ids[code.context_end:]) == "def f():Next line of code:\n"


def test_unknown_task_lists_valid_ones(tiny_lm):
    with pytest.raises(ValueError, match="unknown LongBench task"):
        load_longbench(["lsht"], tiny_lm, data_dir=str(FIXTURES))
    with pytest.raises(ValueError, match="unknown LongBench-E task"):
        load_longbench(["narrativeqa"], tiny_lm, data_dir=str(FIXTURES), e=True)


def test_cli_longbench_end_to_end(tmp_path, console):
    code, _, err = console(["model=tiny-llama", "benchmark=longbench", f"longbench.data_dir={FIXTURES}",
                            "method=snapkv+spark", "ratio=0.8", "budget=64", f"output_root={tmp_path}", "run=lb"])
    assert code == 0, err[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "lb" / "predictions.jsonl").read_text().splitlines()]
    assert sorted(r["task"] for r in rows) == sorted(TASKS)
    table = (tmp_path / "lb" / "table.md").read_text()
    assert "SnapKV+SparK(0.8) @64" in table and "repobench-p" in table
    assert all(isinstance(r["length"], int) for r in rows)  # the record's length reaches the predictions


def test_longbench_e_runs_its_13_tasks_and_reports_length_buckets(tmp_path, console):
    """``longbench.e=true`` with the default (null) task list runs LongBench-E's 13 tasks; the report buckets them."""
    import shutil

    from spark_bench.benchmarks.longbench import LONGBENCH_E_TASKS
    from spark_bench.report import main as report_main

    data = tmp_path / "data"
    data.mkdir()
    for i, task in enumerate(LONGBENCH_E_TASKS):  # the fixtures, as <task>_e files with lengths in every bucket
        records = [json.loads(line) for line in (FIXTURES / f"{task}.jsonl").read_text().splitlines()]
        for r in records:
            r["length"] = (1000, 5000, 9000)[i % 3]
        (data / f"{task}_e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code, _, err = console(["model=tiny-llama", "benchmark=longbench", "longbench.e=true", f"longbench.data_dir={data}",
                            "method=snapkv", "budget=64", f"output_root={tmp_path}", "run=lbe"])
    assert code == 0, err[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "lbe" / "predictions.jsonl").read_text().splitlines()]
    assert sorted(r["task"] for r in rows) == sorted(LONGBENCH_E_TASKS)
    report_main([str(tmp_path / "lbe"), "--layout", "longbench_e", "--ci", "--out", str(tmp_path / "rep")])
    md = (tmp_path / "rep" / "table.md").read_text()
    assert "| Method | 0-4k | 4-8k | 8k+ | All |" in md and "| SnapKV | " in md


def test_truncation_limit_per_model_config():
    """LongBench cuts at the official fork's model2maxlen (Llama-3-8B 7950, not 7950 − 500), else context − 500;
    ``longbench.max_length`` overrides both."""
    from conftest import model_config
    from spark_bench.benchmarks.longbench import truncation_limit

    limits = {name: truncation_limit(model_config(name)) for name in
              ("llama3-8b", "llama3.1-8b", "llama3.1-70b", "qwen3-8b", "qwen3-32b", "smollm2-135m", "tiny-llama")}
    assert limits == {"llama3-8b": 7950, "llama3.1-8b": 127500, "llama3.1-70b": 127500, "qwen3-8b": 31500,
                      "qwen3-32b": 31500, "smollm2-135m": 7692, "tiny-llama": 3596}
    assert truncation_limit(model_config("llama3-8b"), 3000) == 3000
    assert model_config("llama3-8b").max_length == 8192  # the context, against which RULER lengths are checked


def test_kvpress_protocol_is_the_official_codes_prompt_path(tiny_lm):
    """Point 9: ``longbench.protocol=kvpress`` (the SparK fork): chat template first, then the user turn's token ids
    cut in the middle at max_length (the end of turn and assistant header kept); few-shot / code tasks without chat
    template, BOS or minimum length and with a newline suffix; LongBench's max_new_tokens + 20."""
    tok = tiny_lm.tokenizer
    record = {"input": "What is it?", "context": "word " * 3000, "answers": ["x"]}
    fork = build_sample("hotpotqa", record, 0, tiny_lm, max_length=500, protocol="kvpress")
    header = tok("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert fork.meta["truncated"] and fork.question_end == 500 and len(fork.input_ids) == 500 + len(header)
    assert list(fork.input_ids[500:]) == header
    templated = tok.apply_chat_template([{"role": "user", "content": TASKS["hotpotqa"].prompt.format(**record)}],
                                        tokenize=False, add_generation_prompt=True)
    whole = tok(templated, add_special_tokens=False)["input_ids"]
    assert list(fork.input_ids[:250]) == whole[:250]  # the first half of the templated ids, as they are
    assert list(fork.input_ids[250:500]) == whole[len(whole) - len(header) - 250:len(whole) - len(header)]
    assert tok.decode(fork.input_ids[fork.context_end:fork.question_end]).startswith("Answer the question based")
    assert fork.max_new_tokens == 32 + 20
    pred = build_sample("hotpotqa", record, 0, tiny_lm, max_length=500)
    assert pred.input_ids != fork.input_ids and pred.max_new_tokens == 32

    samsum = build_sample("samsum", {"input": "Dialogue: a\nSummary: ", "context": "x", "answers": ["y"]}, 0, tiny_lm,
                          max_length=500, protocol="kvpress")
    text = tok.decode(samsum.input_ids)
    assert "<|im_start|>" not in text and text.endswith("Summary: \n")  # the fork's question_suffix
    assert samsum.input_ids[0] != tok.bos_token_id or tok.bos_token_id is None
    assert tok.decode(samsum.input_ids[samsum.question_end:]).strip(" ") == "\n"  # " \n" is one token here
    assert samsum.min_new_tokens == 0 and samsum.stop_token_ids == (tok.encode("\n", add_special_tokens=False)[-1],)
    with pytest.raises(ValueError, match="longbench.protocol must be one of pred, kvpress; got 'x'"):
        build_sample("samsum", record, 0, tiny_lm, max_length=500, protocol="x")
