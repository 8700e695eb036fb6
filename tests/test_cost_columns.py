"""Per answer: the tokens generated, whether it stopped on its own, its end-to-end seconds (issue 54 item 2); per
config, their means with 95% intervals in the cost columns and a paired row of output length against ``full``; old
predictions without these fields read and resume."""

import json

import pandas as pd
import pytest
import torch

from spark_bench.benchmarks.base import Sample
from spark_bench.methods import MethodConfig
from spark_bench.report import stats
from spark_bench.runner import run_sweep
from spark_bench.tables import cost_markdown, length_markdown, render_markdown, summarize, with_cost

CONFIGS = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=48),
           MethodConfig(name="snapkv+spark", budget=48, ratio=0.8)]
MAX_NEW = 5


def _samples(vocab: int, stops: tuple = ()) -> list[Sample]:
    """Random prompts (a tiny random model answers nothing; its lengths and stops are what matter here)."""
    g = torch.Generator().manual_seed(3)
    return [Sample(task=task, id=f"{task}-{k}", input_ids=tuple(torch.randint(3, vocab, (160,), generator=g).tolist()),
                   answers=("12 34",), max_new_tokens=MAX_NEW, metric="string_match_all", stop_token_ids=stops)
            for task in ("a", "b") for k in range(2)]


@pytest.fixture(scope="module")
def run(tiny_lm, tmp_path_factory):
    vocab = tiny_lm.model.config.vocab_size
    out = tmp_path_factory.mktemp("cost")
    samples = _samples(vocab, tuple(range(3, vocab, 4)))  # a quarter of the vocabulary stops: some rows stop early
    return out, samples, run_sweep(tiny_lm, samples, CONFIGS, out, progress=False)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_prediction_records_its_length_stop_and_seconds(run):
    out, samples, _ = run
    records, timings = _lines(out / "predictions.jsonl"), {(t["id"], t["config"]): t
                                                         for t in _lines(out / "timings.jsonl")}
    assert len(records) == len(samples) * len(CONFIGS)
    stops = {s.id: set(s.stop_token_ids) for s in samples}
    assert {r["stopped"] for r in records} == {True, False}  # both kinds occur in this fixture
    for r in records:
        assert r["new_tokens"] == len(r["tokens"]) <= MAX_NEW
        assert r["stopped"] == (len(r["tokens"]) < MAX_NEW)  # only a stop token ends a row earlier
        assert not stops[r["id"]] & set(r["tokens"])  # the stop token itself is not an answer token
        t = timings[r["id"], r["config"]]
        assert "answer_s" not in r and "fidelity_s" not in r  # seconds differ run to run: timings.jsonl only
        # end to end: its share of the sample's one prefill (3 configs), its compression, its decode
        assert t["answer_s"] == pytest.approx(t["prefill_s"] / 3 + t["compress_s"] + t["decode_s"], rel=1e-9)
        assert t["fidelity_s"] > 0


def test_the_cost_columns_carry_intervals_and_length_is_paired_with_full(run):
    out, samples, preds = run
    table = (out / "table.md").read_text()
    head = next(line for line in table.splitlines() if line.startswith("| Method"))
    assert head.endswith("| Out tok | Stop % | s/answer | Fidelity s |")
    costs = with_cost(preds)
    labels, tasks = list(dict.fromkeys(preds.config)), ["a", "b"]
    for label in labels:  # the cell: the mean over tasks of the task means ± the stratified bootstrap half-width
        mine = costs[costs.config == label]
        _, avg = stats.mean_intervals([mine[mine.task == t].out_tokens.to_numpy() for t in tasks])
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
        assert f"| {avg.estimate:.1f} ± {avg.half_width:.1f} |" in row
    scores = pd.read_csv(out / "scores.csv")
    assert {"out_tokens", "stop_pct", "answer_s", "fidelity_s"} <= set(scores.columns)
    full = preds[preds.config == "Full"]
    assert scores[scores.config == "Full"].out_tokens.tolist() == [
        full[full.task == t].tokens.map(len).mean() for t in tasks]
    # the paired row: each config's Δ output tokens against Full on the same samples, stats.paired's numbers
    paired = length_markdown(preds, labels, tasks)
    assert "Output length against the full cache" in paired and "| Full | Full |" not in paired
    x = [costs[(costs.config == "SnapKV @48") & (costs.task == t)].sort_values("id").out_tokens.to_numpy()
         for t in tasks]
    y = [costs[(costs.config == "Full") & (costs.task == t)].sort_values("id").out_tokens.to_numpy() for t in tasks]
    delta = stats.paired(x, y).delta
    assert "| SnapKV @48 | Full | 4 | " in paired
    assert f"{delta.estimate:+.1f} [{delta.low:+.1f}, {delta.high:+.1f}]" in paired
    assert paired in table


def test_predictions_from_before_read_derived_and_resume_without_recompute(tiny_lm, run, tmp_path, caplog):
    out, samples, preds = run
    old = tmp_path / "old"
    old.mkdir()
    for name in ("manifest.json",):
        (old / name).write_text((out / name).read_text())
    drop = {"new_tokens", "stopped", "fidelity"}
    (old / "predictions.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if k not in drop}) + "\n" for r in _lines(out / "predictions.jsonl")))
    (old / "timings.jsonl").write_text("".join(
        json.dumps({k: v for k, v in t.items() if k not in ("answer_s", "fidelity_s")}) + "\n"
        for t in _lines(out / "timings.jsonl")))
    # read as they are (a report): lengths counted from the tokens, seconds recomputed, stops unknown and said so
    from spark_bench.report.figures import load_predictions

    frame = load_predictions([str(old)])
    costs = with_cost(frame)
    assert costs.out_tokens.tolist() == frame.tokens.map(len).tolist() and costs.stop_pct.isna().all()
    assert costs.answer_s.tolist() == pytest.approx(with_cost(preds).answer_s.tolist(), rel=1e-9)
    text, cost = cost_markdown(frame)
    assert "Stop % is empty where predictions were written before" in text
    assert cost["Stop %"].isna().all() and cost["s/answer"].notna().all()
    # resumed: filled in from the tokens and max_new_tokens, nothing computed again, the records the run wrote
    with caplog.at_level("INFO", logger="spark_bench.runner"):
        again = run_sweep(tiny_lm, samples, CONFIGS, old, progress=False)
    assert "12 of 12 predictions already done" in caplog.text and "computed again" not in caplog.text
    assert _lines(old / "predictions.jsonl") == _lines(out / "predictions.jsonl")
    assert again.stopped.tolist() == preds.stopped.tolist()
    assert "Stop % is empty" not in (old / "table.md").read_text()


def test_a_sweep_without_full_has_no_length_pairs(run):
    _, _, preds = run
    rest = preds[preds.config != "Full"]
    assert length_markdown(rest, list(dict.fromkeys(rest.config)), ["a", "b"]) == ""
    scores = summarize(rest, list(dict.fromkeys(rest.config)), ["a", "b"])
    assert "Output length against" not in render_markdown(scores, list(dict.fromkeys(rest.config)), ["a", "b"],
                                                          rest)
