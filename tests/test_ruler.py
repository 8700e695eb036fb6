"""RULER generators: determinism, length fit, answers present, task-specific structure, QA sources, export."""

import collections
import json
import re
from pathlib import Path

import pytest

from spark_bench.benchmarks.export import read_samples, write_samples
from spark_bench.benchmarks.ruler import RULER_TASKS, load_ruler
from spark_bench.benchmarks.ruler.freq_words import zeta

FIXTURES = Path(__file__).parent / "fixtures" / "ruler"
OFFLINE = [t for t in RULER_TASKS if not t.startswith("qa")]
TOKENS = {"vt": 30, "cwe": 120, "fwe": 50}


@pytest.mark.parametrize("task", OFFLINE)
def test_offline_task_fits_length_is_seeded_and_holds_its_answers(tiny_lm, task):
    first = load_ruler([task], 1536, 2, 5, tiny_lm)
    assert [s.input_ids for s in first] == [s.input_ids for s in load_ruler([task], 1536, 2, 5, tiny_lm)]
    assert first[0].input_ids != load_ruler([task], 1536, 1, 6, tiny_lm)[0].input_ids
    for s in first:
        assert len(s.input_ids) + TOKENS.get(task, 128) <= 1536
        assert len(s.input_ids) > 700  # the haystack really grew toward the target
        text = tiny_lm.tokenizer.decode(s.input_ids)
        assert all(a in text for a in s.answers) and s.metric == "string_match_all"


def test_vt_chain_and_one_shot_example(tiny_lm):
    (s,) = load_ruler(["vt"], 1024, 1, 1, tiny_lm)
    text = tiny_lm.tokenizer.decode(s.input_ids)
    a = s.answers
    assert len(a) == 5 and all(re.fullmatch(r"[A-Z]{5}", v) for v in a)
    value = re.search(rf"VAR {a[0]} = (\d{{5}})", text).group(1)
    for prev, cur in zip(a, a[1:]):  # the chain, hop by hop
        assert f"VAR {cur} = VAR {prev}" in text
    assert text.count("Memorize and track the chain") == 2  # one-shot example + the question
    assert f"assigned the value {value}, they are:" in text
    shot, _, rest = text.partition("\n\nMemorize and track the chain")  # a blank line between example and input
    assert "Memorize and track the chain" in shot and rest


def test_vt_one_shot_example_is_redrawn_per_sample(tiny_lm):
    """RULER's randomize_icl: each sample re-draws the example's answer names and its root value."""
    samples = load_ruler(["vt"], 1024, 2, 1, tiny_lm)
    shots = [tiny_lm.tokenizer.decode(s.input_ids).partition("\n\nMemorize and track")[0] for s in samples]
    names = [re.findall(r"they are: ([A-Z ]+)", shot)[0].split() for shot in shots]
    assert len(names[0]) == 5 and names[0] != names[1]
    assert all("12345" not in shot for shot in shots)


def test_cwe_common_words_repeat_as_configured(tiny_lm):
    (s,) = load_ruler(["cwe"], 1024, 1, 2, tiny_lm)
    text = tiny_lm.tokenizer.decode(s.input_ids)
    question = text[text.rindex("Below is a numbered list"):]
    counts = collections.Counter(re.findall(r"\d+\. ([^\s]+)", question.split("\nQuestion:")[0]))
    assert len(s.answers) == 10 and all(counts[w] == 6 for w in s.answers)  # below 4K: 6 vs 1
    assert max(c for w, c in counts.items() if w not in s.answers) == 1


def test_fwe_zipf_counts():
    assert zeta(2.0) == pytest.approx(3.141592653589793 ** 2 / 6, abs=1e-10)


def test_fwe_answers_are_the_most_frequent_words(tiny_lm):
    (s,) = load_ruler(["fwe"], 1024, 1, 3, tiny_lm)
    text = tiny_lm.tokenizer.decode(s.input_ids)
    coded = text[text.index("coded words. ") + 13:text.index("\nQuestion:")].split()
    ranked = [w for w, _ in collections.Counter(coded).most_common() if w != "..."]
    assert list(s.answers) == ranked[:3]


def test_qa_from_official_files(tiny_lm):
    samples = load_ruler(["qa_1", "qa_2"], 512, 2, 0, tiny_lm, squad_file=str(FIXTURES / "squad_dev.json"),
                         hotpotqa_file=str(FIXTURES / "hotpot_dev.json"))
    assert [s.task for s in samples] == ["qa_1", "qa_1", "qa_2", "qa_2"]
    for s in samples:
        text = tiny_lm.tokenizer.decode(s.input_ids)
        assert s.metric == "string_match_part" and "Document 1:" in text
        assert s.answers[0] in text or s.task == "qa_2"
    assert "Who painted it pink" not in tiny_lm.tokenizer.decode(samples[0].input_ids)  # unanswerable dropped


def test_qa_without_data_stops_with_the_key_to_set(tiny_lm, monkeypatch, tmp_path):
    from spark_bench.hub import HubUnavailable

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(HubUnavailable, match=r"RULER squad data \(qa_1\): rajpurkar/squad_v2 is not on disk.*"
                                             r"set ruler.squad_file="):
        load_ruler(["niah_single_1", "qa_1"], 512, 1, 0, tiny_lm)
    with pytest.raises(FileNotFoundError, match="ruler.squad_file: /nope.json does not exist"):
        load_ruler(["qa_1"], 512, 1, 0, tiny_lm, squad_file="/nope.json")


def test_essay_file_is_used_and_recorded(tiny_lm, tmp_path):
    essays = tmp_path / "PaulGrahamEssays.json"
    essays.write_text(json.dumps({"text": "Startups are hard. Founders matter most. " * 400}))
    (s,) = load_ruler(["niah_single_2"], 1200, 1, 0, tiny_lm, essay_file=str(essays))
    assert s.meta["haystack"] == "PaulGrahamEssays.json"
    assert "Founders matter most" in tiny_lm.tokenizer.decode(s.input_ids)


def test_short_essay_corpus_repeats(tiny_lm, tmp_path):
    """RULER repeats the essays when the length needs more words than the corpus has."""
    essays = tmp_path / "short.txt"
    essays.write_text("Startups are hard. Founders matter most. " * 10)  # 60 words
    (s,) = load_ruler(["niah_single_2"], 1200, 1, 0, tiny_lm, essay_file=str(essays))
    assert s.meta["haystack_units"] > 60 and len(s.input_ids) > 700


def test_export_roundtrip(tiny_lm, tmp_path):
    samples = load_ruler(["niah_single_1", "vt"], 1024, 1, 0, tiny_lm)
    path = tmp_path / "ruler.jsonl"
    write_samples(samples, path, tiny_lm.tokenizer)
    assert read_samples(path) == samples
    assert "prompt" in json.loads(path.read_text().splitlines()[0])
    path.write_text(path.read_text() + '{"task": "x"}\n')
    with pytest.raises(ValueError, match=r"ruler.jsonl:3: id is missing \(required: a non-empty string\)"):
        read_samples(path)


def test_cli_ruler_all_tasks_end_to_end(tmp_path, console):
    """``spark-bench benchmark=ruler_all`` on tiny-llama with the qa tasks left out (they need data): every offline
    task runs (the console script's own start, in this process, offline)."""
    code, _, err = console(["model=tiny-llama", "benchmark=ruler_all", "benchmark.length=1536",
                            f"benchmark.tasks=[{','.join(OFFLINE)}]", "benchmark.num_samples=1",
                            "benchmark.max_new_tokens=4", "method=snapkv+spark", "ratio=0.8", "budget=0.5",
                            f"output_root={tmp_path}", "run=ruler"])
    assert code == 0, err[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "ruler" / "predictions.jsonl").read_text().splitlines()]
    assert sorted(r["task"] for r in rows) == sorted(OFFLINE)


def _kvpress_set(tmp_path: Path) -> Path:
    """A local copy of ``simonjegou/ruler`` in its layout: one directory per length, records split into context /
    question / answer prefix."""
    root = tmp_path / "ruler_kvpress"
    (root / "4096").mkdir(parents=True)
    records = [{"context": "Some special magic numbers are hidden within the following text.\nOne of the special magic "
                           f"numbers for key-{i} is: {1000 + i}.\n" + "The grass is green. " * 40,
                "question": f"What are all the special magic numbers for key-{i} mentioned in the provided text?",
                "answer_prefix": f" The special magic numbers for key-{i} mentioned in the provided text are",
                "answer": [str(1000 + i)], "task": "niah_single_1", "max_new_tokens": 128} for i in range(3)]
    records.append({**records[0], "task": "qa_1", "answer": ["a", "b"], "max_new_tokens": 32})
    (root / "4096" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def test_kvpress_ruler_records_become_samples(tiny_lm, tmp_path):
    """``ruler.source=kvpress``: the user turn is context + question, the answer prefix after the assistant header,
    the record's max_new_tokens, string_match_part for qa."""
    from spark_bench.benchmarks.ruler.kvpress_records import load_kvpress_ruler

    root = _kvpress_set(tmp_path)
    samples = load_kvpress_ruler(["niah_single_1", "qa_1"], 4096, 2, tiny_lm, str(root))
    assert [s.id for s in samples] == ["niah_single_1-0", "niah_single_1-1", "qa_1-0"]
    tok, first = tiny_lm.tokenizer, samples[0]
    assert tok.decode(first.input_ids[first.context_end:first.question_end]).lstrip() == (  # " What": one token
        "What are all the special magic numbers for key-0 mentioned in the provided text?")
    assert tok.decode(first.input_ids[first.question_end:]) == (
        "<|im_end|>\n<|im_start|>assistant\n The special magic numbers for key-0 mentioned in the provided text are")
    assert first.max_new_tokens == 128 and first.answers == ("1000",) and first.metric == "string_match_all"
    assert samples[2].metric == "string_match_part"
    with pytest.raises(ValueError, match=r"has no records of task\(s\) \['vt'\]; it has: niah_single_1, qa_1"):
        load_kvpress_ruler(["vt"], 4096, 2, tiny_lm, str(root))


def test_cli_runs_the_kvpress_ruler_set(tmp_path, console):
    root = _kvpress_set(tmp_path)
    code, _, err = console(["model=tiny-llama", "method=snapkv", "budget=0.5", "ruler.source=kvpress",
                            f"ruler.kvpress_path={root}", "benchmark.length=4096", "benchmark.num_samples=2",
                            "benchmark.tasks=[niah_single_1]", "benchmark.max_new_tokens=3", "progress=false",
                            f"output_root={tmp_path}", "run=kv"])  # the console script's own start, in-process
    assert code == 0, err[-2000:]
    lines = (tmp_path / "kv" / "predictions.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["niah_single_1-0", "niah_single_1-1"]


LLAMA31_LIKE = ("{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']"
                "|trim %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
                "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{{- 'Cutting Knowledge Date: December 2023"
                "\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}{%- for message in messages %}{{- '<|start_header_id|>'"
                " + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n'"
                " }}{%- endif %}")


def test_chat_template_without_its_default_system_prompt(tiny_lm):
    """RULER's model templates have no system prompt: ``ruler.system_prompt=false`` drops the one a chat template adds
    by default (SmolLM2's, a Llama-3.1-style date block), keeping the BOS text before it."""
    import copy

    from spark_bench.benchmarks.base import chat_text

    tok = tiny_lm.tokenizer
    assert chat_text(tok, "Hi\nWhat?", system_prompt=False) == "<|im_start|>user\nHi\nWhat?<|im_end|>\n<|im_start|>assistant\n"
    llama = copy.deepcopy(tok)
    llama.chat_template = LLAMA31_LIKE
    assert "Cutting Knowledge Date" in chat_text(llama, "Hi", system_prompt=True)
    assert chat_text(llama, "Hi", system_prompt=False) == (
        f"{llama.bos_token}<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    (plain,) = load_ruler(["niah_single_1"], 600, 1, 0, tiny_lm, system_prompt=False)
    (default,) = load_ruler(["niah_single_1"], 600, 1, 0, tiny_lm)
    assert "You are a helpful AI assistant" in tok.decode(default.input_ids)
    text = tok.decode(plain.input_ids)
    assert "You are a helpful AI assistant" not in text and text.startswith("<|im_start|>user\n")
    assert tok.decode(plain.input_ids[plain.question_end:]).startswith("<|im_end|>\n<|im_start|>assistant\n")
