"""Fidelity numbers (answer_nll, kl_full, agree_full; spark_bench/engine/fidelity.py): the teacher-forced pass equals
a plain forward on a dense cache, the full cache gives exactly 0 / 1, a config that changes nothing equals its base,
and a sweep stores them beside the scores (and says why they are empty without a full config)."""

import json

import pytest
import torch
from conftest import DEVICE

from spark_bench.benchmarks.base import Sample
from spark_bench.benchmarks.reference import reference_text
from spark_bench.engine.decode import DecodeRow, prime_rows
from spark_bench.engine.fidelity import ForcedRow, forced_log_probs, kl_agree, measure
from spark_bench.engine.prefill import run_prefill
from spark_bench.methods import MethodConfig, Pipeline

REFERENCE = [311, 4045, 77, 2930, 905, 18]


@pytest.fixture(scope="module")
def prompt(tiny_lm):
    ids = torch.randint(100, 5000, (1, 120), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    return ids, run_prefill(tiny_lm.model, ids, window=32)


def _row(prefill, config, selections, suffix=()):
    cache = Pipeline.from_config(config).build_cache(prefill, selections=selections)[0]
    return ForcedRow(cache, prefill.first_logits, prefill.prompt_length, tuple(suffix), [])


@torch.no_grad()
def _plain_log_probs(model, ids, continuation):
    """A plain dense forward over prompt + continuation: the log-probabilities predicting each continuation token."""
    full = torch.cat([ids, torch.tensor([continuation], device=ids.device)], dim=1)
    logits = model(full).logits[0, ids.shape[1] - 1:-1].float()
    return torch.log_softmax(logits, -1)


@torch.no_grad()
def test_teacher_forced_nll_equals_a_plain_forward_on_a_dense_cache(tiny_lm, prompt, monkeypatch):
    ids, prefill = prompt
    row = _row(prefill, MethodConfig(name="full"), {})
    fidelity, _ = measure(tiny_lm.model, [row], REFERENCE, REFERENCE[:3], full=0)
    plain = _plain_log_probs(tiny_lm.model, ids, REFERENCE)
    expected = -plain.gather(-1, torch.tensor(REFERENCE, device=plain.device).unsqueeze(-1)).mean()
    assert fidelity[0].answer_nll == pytest.approx(float(expected), abs=1e-4)
    # every position's distribution, not only the mean, through the compressed-cache attention
    forced = forced_log_probs(tiny_lm.model, [ForcedRow(row.cache, row.first_logits, row.position, (),
                                                         REFERENCE[:-1])])[0]
    torch.testing.assert_close(forced, plain, atol=1e-4, rtol=0)
    # a model whose forward does more than its lm_head (a logit scale, a soft cap): the whole forward's logits
    from spark_bench.engine import fidelity

    with monkeypatch.context() as patch:
        patch.setattr(fidelity, "_output_head", lambda model: None)
        whole = forced_log_probs(tiny_lm.model, [ForcedRow(row.cache, row.first_logits, row.position, (),
                                                           REFERENCE[:-1])])[0]
    torch.testing.assert_close(whole, forced, atol=1e-5, rtol=0)
    # with part of the prompt run through the cache as a suffix (compress_scope=question): the same numbers
    part = run_prefill(tiny_lm.model, ids, window=32, ends=(100,)).at(100, True)
    cache = Pipeline.from_config(MethodConfig(name="full")).build_cache(part)[0]
    suffixed = ForcedRow(cache, None, 100, tuple(ids[0, 100:].tolist()), REFERENCE[:-1])
    torch.testing.assert_close(forced_log_probs(tiny_lm.model, [suffixed])[0], plain, atol=1e-4, rtol=0)


def test_full_gives_exactly_zero_and_one_and_lambda_zero_equals_its_base(tiny_lm, prompt):
    _, prefill = prompt
    selections = {}
    configs = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=48),
               MethodConfig(name="snapkv+spark", budget=48, ratio=0.0),
               MethodConfig(name="snapkv+think", budget=48, ratio=0.8)]
    rows = [_row(prefill, c, selections) for c in configs]
    greedy = [17, 2044, 9, 380, 4211]
    (full, snap, spark0, think), log_probs = measure(tiny_lm.model, rows, REFERENCE, greedy, full=0)
    assert (full.kl_full, full.agree_full, full.kl_tokens) == (0.0, 1.0, 6)  # 5 fed tokens: 6 positions
    assert spark0.answer_nll == pytest.approx(snap.answer_nll, abs=1e-6)
    assert spark0.kl_full == pytest.approx(snap.kl_full, abs=1e-6)
    assert spark0.agree_full == snap.agree_full
    assert think.kl_full > 0 and snap.kl_full > 0 and think.kl_full != snap.kl_full  # (a random tiny model)
    assert 0 <= think.agree_full <= 1 and think.answer_nll != full.answer_nll
    # no full row: only the answer NLL; the stacked and per-row paths agree
    alone, none = measure(tiny_lm.model, rows[1:], REFERENCE, [], stack=False)
    assert [f.kl_full for f in alone] == [None] * 3 and none is None
    assert [f.answer_nll for f in alone] == pytest.approx([snap.answer_nll, spark0.answer_nll, think.answer_nll],
                                                          abs=1e-5)
    # a later batch's rows against the full row's log-probabilities from an earlier call: the same numbers (to the
    # rounding of a forward stacking other rows)
    later, _ = measure(tiny_lm.model, rows[2:], REFERENCE, greedy, full_log_probs=log_probs)
    assert [(f.agree_full, f.kl_tokens) for f in later] == [(f.agree_full, f.kl_tokens) for f in (spark0, think)]
    assert [x for f in later for x in (f.answer_nll, f.kl_full)] == pytest.approx(
        [x for f in (spark0, think) for x in (f.answer_nll, f.kl_full)], abs=1e-5)


def test_kl_and_agreement_are_the_textbook_ones():
    p = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), -1)
    q = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0], [0.0, 3.0, 0.5]]), -1)
    kl, agree = kl_agree(p, q)
    expected = sum(float((p[i].exp() * (p[i] - q[i])).sum()) for i in range(2)) / 2
    assert kl == pytest.approx(expected) and agree == 0.5
    assert kl_agree(p, p.clone()) == (0.0, 1.0)


def test_reference_text_follows_each_task_s_answer_form():
    def sample(task, answers, metric="string_match_all"):
        return Sample(task=task, id="x", input_ids=(1,), answers=tuple(answers), max_new_tokens=8, metric=metric)

    assert reference_text(sample("niah_multivalue", ["12", "34"])) == " 12, 34."
    assert reference_text(sample("cwe", ["a", "b"])) == " 1. a 2. b"
    assert reference_text(sample("vt", ["X", "Y"])) == " X Y"
    assert reference_text(sample("qa_1", ["Paris", "paris"], "string_match_part")) == " Paris"
    assert reference_text(sample("narrativeqa", ["The dog.", "A dog"], "qa_f1_score")) == "The dog."
    assert reference_text(sample("qa_1", [], "string_match_part")) == ""


def test_sweep_stores_them_beside_the_score_and_says_why_kl_is_empty(tiny_lm, tmp_path, caplog):
    from spark_bench.benchmarks.ruler import load_ruler
    from spark_bench.runner import run_sweep

    samples = load_ruler(["niah_single_1", "niah_multikey_1"], 384, 1, 0, tiny_lm, max_new_tokens=4)
    configs = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=48),
               MethodConfig(name="snapkv+spark", budget=48, ratio=0.8)]
    preds = run_sweep(tiny_lm, samples, configs, tmp_path / "with", progress=False)
    records = [json.loads(line) for line in (tmp_path / "with" / "predictions.jsonl").read_text().splitlines()]
    full = [r for r in records if r["config"] == "Full"]
    assert all(r["kl_full"] == 0 and r["agree_full"] == 1 and r["answer_nll"] > 0 for r in full)
    others = [r for r in records if r["config"] != "Full"]
    assert all(r["kl_full"] > 0 and 1 <= r["kl_tokens"] <= 16 for r in others)
    scores = (tmp_path / "with" / "scores.csv").read_text().splitlines()[0].split(",")
    assert {"answer_nll", "kl_full", "agree_full"} <= set(scores)
    table = (tmp_path / "with" / "table.md").read_text()
    assert "| NLL | KL full | Agree |" in table and "sweep has no full config" not in table
    assert preds.answer_nll.notna().all()
    from spark_bench.report import build
    from spark_bench.report.layouts import RULER

    kl = build([str(tmp_path / "with")], RULER, metric="kl_full").set_index(["method", "column"]).value
    assert kl["Vanilla", "Avg."] == 0 and kl["Vanilla", "Niah1"] == 0 and kl["+SparK (0.8)", "Avg."] > 0
    run_sweep(tiny_lm, samples, configs[1:], tmp_path / "without", progress=False)
    records = [json.loads(line) for line in (tmp_path / "without" / "predictions.jsonl").read_text().splitlines()]
    assert all(r["kl_full"] is None and r["agree_full"] is None and r["answer_nll"] > 0 for r in records)
    # the same configs' answer NLL does not depend on the full row joining the pass (to float noise)
    with_full = {(r["id"], r["config"]): r["answer_nll"] for r in map(json.loads, (
        tmp_path / "with" / "predictions.jsonl").read_text().splitlines())}
    assert all(r["answer_nll"] == pytest.approx(with_full[r["id"], r["config"]], abs=1e-5) for r in records)
    assert "KL full / Agree are empty: the sweep has no full config" in (tmp_path / "without" / "table.md").read_text()
    # one row per decode batch (each batch's pass, its caches then released; the full row planned first): the same
    # numbers, byte for byte; resumed with only the full rows done (the full cache built again for the pass): too
    def numbers(run):
        return {(r["id"], r["config"]): (r["answer_nll"], r["kl_full"], r["agree_full"], r["kl_tokens"])
                for r in map(json.loads, (tmp_path / run / "predictions.jsonl").read_text().splitlines())}

    whole = numbers("with")
    run_sweep(tiny_lm, samples, configs[::-1], tmp_path / "split", progress=False, decode_batch=1)
    resumed = tmp_path / "split" / "predictions.jsonl"
    resumed.write_text("".join(line + "\n" for line in resumed.read_text().splitlines()
                               if json.loads(line)["config"] == "Full"))
    with caplog.at_level("INFO", logger="spark_bench.runner"):
        run_sweep(tiny_lm, samples, configs[::-1], tmp_path / "split", progress=False, decode_batch=2)
    assert "2 of 6 predictions already done" in caplog.text
    assert numbers("split") == whole


# a mix of rows a sample's pass stacks: full, an eviction, eviction + SparK / ThinK, ThinK alone, Mustafar, and a row
# whose question runs through its cache as a suffix (a forward of its own: another suffix length)
STACKED = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=48),
           MethodConfig(name="snapkv+spark", budget=48, ratio=0.8), MethodConfig(name="think", ratio=0.5),
           MethodConfig(name="mustafar", ratio=0.5)]


@pytest.mark.parametrize("greedy", [REFERENCE[:3], [17, 2044, 9, 380, 4211]], ids=["merged", "two-continuations"])
def test_stacked_pass_equals_the_per_config_reference(tiny_lm, prompt, monkeypatch, greedy):
    """The pass of a sample's configs stacked into one forward per ``batch`` configs gives the numbers of one
    forward per config (``stacked=False``, the reference) within 1e-5, in fewer forwards."""
    from spark_bench.engine import fidelity

    ids, prefill = prompt
    selections = {}
    rows = [_row(prefill, c, selections) for c in STACKED]
    part = run_prefill(tiny_lm.model, ids, window=32, ends=(100,)).at(100, True)
    cache = Pipeline.from_config(MethodConfig(name="snapkv", budget=48)).build_cache(part)[0]
    rows.append(ForcedRow(cache, None, 100, tuple(ids[0, 100:].tolist()), []))
    forwards = []
    real = fidelity.iter_forced_log_probs
    monkeypatch.setattr(fidelity, "iter_forced_log_probs", lambda model, forced, *a: (
        forwards.append(len({len(f.suffix) for f in forced})), real(model, forced, *a))[1])

    def numbers(**kw):
        forwards.clear()
        out, log_probs = fidelity.measure(tiny_lm.model, rows, REFERENCE, greedy, full=0, **kw)
        return [(f.answer_nll, f.kl_full, f.agree_full, f.kl_tokens) for f in out], log_probs, sum(forwards)

    reference, ref_lp, per_config = numbers(stacked=False)
    assert per_config == len(rows) + (greedy != REFERENCE[:3])  # the full row's greedy continuation alone first
    for batch, expected in ((None, 2), (2, 4), (1, len(rows))):  # one forward per suffix length in each batch
        got, lp, count = numbers(batch=batch)
        assert count == expected
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
        for (nll, kl, agree, positions), want in zip(got, reference):
            assert (agree, positions) == want[2:] and (nll, kl) == pytest.approx(want[:2], abs=1e-5)
    assert reference[0][1:3] == (0.0, 1.0) and all(r[1] > 0 for r in reference[1:])
    # no full row (only the answer NLL): both paths too
    alone = [[f.answer_nll for f in fidelity.measure(tiny_lm.model, rows[1:], REFERENCE, [], stacked=s)[0]]
             for s in (False, True)]
    assert alone[1] == pytest.approx(alone[0], abs=1e-5) and alone[0] == pytest.approx([r[0] for r in reference[1:]],
                                                                                     abs=1e-5)
    # the suffix row primed as a sweep primes it (decode.prime_rows: its suffix run on its own before decoding): the
    # pass then feeds only the compared tokens from the suffix's keys and values, with the same numbers
    primed = DecodeRow(cache, None, 100, 1, frozenset(), suffix=rows[-1].suffix)
    prime_rows(tiny_lm.model, [primed])
    assert primed.suffix == () and primed.position == ids.shape[1] and primed.tail[0][0].shape[-2] == 20
    rows[-1] = ForcedRow(cache, primed.first_logits, primed.position, (), [], primed.tail)
    for kw in (dict(stacked=False), dict(batch=None)):
        got = numbers(**kw)[0]
        assert got[-1][2:] == reference[-1][2:] and got[-1][:2] == pytest.approx(reference[-1][:2], abs=1e-5)
    # forwards of a fixed number of rows (a sweep's pass, group_size): stacked, yet each row's numbers byte for byte
    # the same whatever rows share its forwards — all rows, or the full row and one other (a decode batch of two)
    fixed = numbers(configs=3, width=ids.shape[1])[0]
    assert fixed[-1][2:] == reference[-1][2:] and fixed[-1][:2] == pytest.approx(reference[-1][:2], abs=1e-5)
    pair = fidelity.measure(tiny_lm.model, [rows[0], rows[-1]], REFERENCE, greedy, full=0, configs=3,
                            width=ids.shape[1])[0]
    assert [(f.answer_nll, f.kl_full, f.agree_full) for f in pair] == [fixed[0][:3], fixed[-1][:3]]
    # a later batch against the full row's log-probabilities from an earlier call, stacked: the same numbers
    later, _ = fidelity.measure(tiny_lm.model, rows[1:], REFERENCE, greedy, full_log_probs=ref_lp)
    assert [x for f in later for x in (f.answer_nll, f.kl_full)] == pytest.approx(
        [x for r in reference[1:] for x in r[:2]], abs=1e-5)


def test_library_answer_nll_ask_and_generate(tiny_lm, prompt):
    import spark_bench

    ids, _ = prompt
    flat = ids[0].tolist()
    full = spark_bench.compress(tiny_lm.model, flat, spark_bench.method("full"))
    plain = _plain_log_probs(tiny_lm.model, ids, REFERENCE)
    expected = float(-plain.gather(-1, torch.tensor(REFERENCE, device=plain.device).unsqueeze(-1)).mean())
    assert spark_bench.answer_nll(tiny_lm.model, full, REFERENCE) == pytest.approx(expected, abs=1e-4)
    out, nll = spark_bench.generate(tiny_lm.model, full, max_new_tokens=2, reference=REFERENCE)
    assert out.shape[-1] == len(flat) + 2 and nll == pytest.approx(expected, abs=1e-4)
    # a question run through the cache first: the plain forward over context + question + answer
    context, question = flat[:100], flat[100:]
    answers = spark_bench.ask(tiny_lm.model, context, [question], spark_bench.method("full"), max_new_tokens=2,
                              references=[REFERENCE])
    assert len(answers[0][0]) == 2 and answers[0][1] == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ValueError, match="references: one reference answer per question"):
        spark_bench.ask(tiny_lm.model, context, [question], spark_bench.method("full"), references=[])
    with pytest.raises(ValueError, match="reference: a text reference needs tokenizer="):
        spark_bench.answer_nll(tiny_lm.model, full, "Paris")


def _fidelity_samples():
    import pandas as pd

    from spark_bench.report.frame import SAMPLE_COLUMNS
    from spark_bench.tables import FIDELITY

    rows, block = [], "KV 50%"
    for method, kl, score in (("SnapKV", 0.5, 100.0), ("+ThinK (0.8)", 2.0, 100.0), ("+SparK (0.8)", 0.8, 100.0)):
        for task in ("Niah1", "MKey1"):
            for i in range(25):
                wobble = 0.01 * (i % 5)
                rows.append((block, "SnapKV", method, task, f"{task}-{i}", score, 500, 1000, 0.0, None,
                             1.0 + kl / 2 + wobble, kl + wobble, 1 - kl / 4))
    return pd.DataFrame(rows, columns=[*SAMPLE_COLUMNS, *FIDELITY])


def test_reports_pair_and_claim_on_the_fidelity_numbers():
    from spark_bench.report import claims
    from spark_bench.report.compare import interval_frame, paired_frame, paired_markdown
    from spark_bench.report.layouts import RULER

    samples = _fidelity_samples()
    paired = paired_frame(samples, RULER)
    kl = paired[(paired.metric == "kl_full") & (paired.base == "+ThinK (0.8)")].iloc[0]
    assert kl.method == "+SparK (0.8)" and kl.delta == pytest.approx(0.8 - 2.0) and kl.high < 0 and kl.n == 50
    score = paired[(paired.metric == "score") & (paired.base == "+ThinK (0.8)")].iloc[0]
    assert score.delta == 0 and (score.low, score.high) == (0, 0)  # the scores cannot tell them apart
    assert "**-1.200 [-1.200, -1.200]**" in paired_markdown(paired)
    verdicts = {r.claim: r.verdict for r in claims.check(samples, RULER).itertuples()}
    assert verdicts["SparK(0.8) moves the distribution less than ThinK(0.8) (KL to full)"] == "holds"
    assert verdicts["SparK(0.8) answer NLL below ThinK(0.8)"] == "holds"
    assert verdicts["SparK(0.8) keeps >= 95% of its base's agreement with full"] == "fails"  # 0.8 / 0.875
    cells = interval_frame(samples, RULER, value="kl_full").set_index(["method", "column"])
    assert cells.loc[("+ThinK (0.8)", "Avg."), "value"] == pytest.approx(2.02)
    assert cells.loc[("+ThinK (0.8)", "KL full"), "value"] == pytest.approx(2.02)
    assert cells.loc[("SnapKV", "NLL"), "low"] < 1.27 < cells.loc[("SnapKV", "NLL"), "high"]
