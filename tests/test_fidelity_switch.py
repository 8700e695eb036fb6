"""``fidelity=false`` skips the teacher-forced fidelity pass (issue 54 item 6): the same tokens, its columns empty and
said why, its seconds in timings.jsonl when on, the default run directory unchanged, a later run with it on computes
the missing numbers, the planner counts the pass only when on."""

import json

import pytest
import torch

from spark_bench.benchmarks.base import Sample
from spark_bench.methods import MethodConfig
from spark_bench.runner import run_sweep
from spark_bench.tables import FIDELITY_SKIPPED

CONFIGS = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=40),
           MethodConfig(name="snapkv+think", budget=40, ratio=0.5)]
FIDELITY_FIELDS = ("answer_nll", "kl_full", "agree_full", "kl_tokens")


def _samples(vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(5)
    return [Sample(task=task, id=f"{task}-0", input_ids=tuple(torch.randint(3, vocab, (140,), generator=g).tolist()),
                   answers=("7 8 9",), max_new_tokens=4, metric="string_match_all") for task in ("a", "b")]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tiny_lm, tmp_path_factory):
    root = tmp_path_factory.mktemp("switch")
    samples = _samples(tiny_lm.model.config.vocab_size)
    run_sweep(tiny_lm, samples, CONFIGS, root / "on", progress=False)
    run_sweep(tiny_lm, samples, CONFIGS, root / "off", progress=False, fidelity=False)
    return root, samples


def test_off_skips_the_pass_and_the_table_says_why(runs):
    root, _ = runs
    on, off = _lines(root / "on" / "predictions.jsonl"), _lines(root / "off" / "predictions.jsonl")
    assert [r["tokens"] for r in on] == [r["tokens"] for r in off]  # the pass changes no answer
    assert all(r["fidelity"] and all(f in r for f in FIDELITY_FIELDS) for r in on)
    assert all(r["fidelity"] is False and not any(f in r for f in FIDELITY_FIELDS) for r in off)
    common = [k for k in on[0] if k not in (*FIDELITY_FIELDS, "fidelity")]
    assert [[r[k] for k in common] for r in on] == [[r[k] for k in common] for r in off]
    assert all(t["fidelity_s"] > 0 for t in _lines(root / "on" / "timings.jsonl"))
    assert all(t["fidelity_s"] is None for t in _lines(root / "off" / "timings.jsonl"))
    table = (root / "off" / "table.md").read_text()
    assert FIDELITY_SKIPPED + "." in table and "made before spark-bench measured them" not in table
    full = next(line for line in table.splitlines() if line.startswith("| Full |")).split(" | ")
    assert full[4:7] == ["–", "–", "–"] and full[-1] == "– |"  # NLL, KL full, Agree; Fidelity s
    assert FIDELITY_SKIPPED not in (root / "on" / "table.md").read_text()


def test_a_rerun_with_it_on_computes_the_missing_numbers(tiny_lm, runs, tmp_path, caplog):
    import shutil

    root, samples = runs
    shutil.copytree(root / "off", tmp_path / "run")
    with caplog.at_level("INFO", logger="spark_bench.runner"):  # off again: nothing to compute
        run_sweep(tiny_lm, samples, CONFIGS, tmp_path / "run", progress=False, fidelity=False)
    assert "6 of 6 predictions already done" in caplog.text and "computed again" not in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="spark_bench.runner"):
        run_sweep(tiny_lm, samples, CONFIGS, tmp_path / "run", progress=False)
    assert "lack answer_nll, kl_full, agree_full, kl_tokens" in caplog.text and "computed again" in caplog.text
    numbers = [{k: r[k] for k in (*FIDELITY_FIELDS, "tokens", "fidelity")}
               for r in _lines(tmp_path / "run" / "predictions.jsonl")]
    assert numbers == [{k: r[k] for k in (*FIDELITY_FIELDS, "tokens", "fidelity")}
                       for r in _lines(root / "on" / "predictions.jsonl")]
    assert len(_lines(tmp_path / "run" / "timings.jsonl")) == 6  # the old timing lines went with their predictions


def test_the_option_is_declared_once_and_leaves_the_run_directory_alone():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from spark_bench.checks import config_hash
    from spark_bench.cli import CONF_DIR, ConfigError, validate
    from spark_bench.options import RUN_OPTIONS

    assert RUN_OPTIONS["fidelity"].valid() == "true or false"
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config")
        off = compose("config", ["fidelity=false"])
        bad = compose("config", ["fidelity=2"])
    assert cfg.fidelity is True and off.fidelity is False
    before = cfg.copy()  # the configuration as a version without the option composed it
    with open_dict(before):
        del before["fidelity"]
    assert config_hash(_root_=cfg) == config_hash(_root_=before) == config_hash(_root_=off)
    with pytest.raises(ConfigError, match=r"^fidelity must be true or false; got 2$"):
        validate(bad)
    assert OmegaConf.select(cfg, "fidelity") is True


def test_the_planner_counts_the_pass_only_when_on():
    from spark_bench import plan
    from tests.conftest import model_config

    model = model_config("llama3.1-8b")
    configs = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=0.2)]
    work = [plan.TaskWork("niah_single_1", 10, 128, "configured")]
    on, off = plan.estimate(model, configs, work, 16384), plan.estimate(model, configs, work, 16384, fidelity=False)
    assert on.hours == off.hours  # prefill and decode as before
    assert off.fidelity_hours == {} and all(h > 0 for h in on.fidelity_hours.values())
    assert on.fidelity_forwards == 10 * plan.fidelity_forwards(len(configs)) and off.fidelity_forwards == 0
    assert any("fidelity pass" in line for line in on.lines())
    assert any("fidelity=false: no fidelity pass" in line for line in off.lines())


REFERENCE = [311, 4045, 77, 2930, 905, 18]


@pytest.mark.parametrize("greedy", [REFERENCE[:3], REFERENCE[:-1] + [17, 2044, 9, 380], [17, 2044, 9]],
                         ids=["greedy-shorter", "greedy-longer", "unlike"])
def test_one_continuation_per_row_where_they_agree_gives_the_two_continuations_numbers(tiny_lm, greedy,
                                                                                       monkeypatch):
    """Where the full cache's greedy tokens and the reference begin alike, each row runs the longer continuation
    alone: the numbers of the old path (two continuations per row), for about half the tokens."""
    from conftest import DEVICE

    from spark_bench.engine import fidelity
    from spark_bench.engine.prefill import run_prefill
    from spark_bench.methods import Pipeline

    ids = torch.randint(100, 5000, (1, 120), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    prefill, selections = run_prefill(tiny_lm.model, ids, window=32), {}
    rows = [fidelity.ForcedRow(Pipeline.from_config(c).build_cache(prefill, selections=selections)[0],
                               prefill.first_logits, prefill.prompt_length, (), []) for c in CONFIGS]
    fed = []
    real = fidelity.iter_forced_log_probs
    monkeypatch.setattr(fidelity, "iter_forced_log_probs", lambda model, forced, *a: (
        fed.append(sum(len(f.fed) for f in forced)), real(model, forced, *a))[1])
    old, old_lp = fidelity.measure(tiny_lm.model, rows, REFERENCE, greedy, full=0, merge=False)
    old_tokens, fed[:] = sum(fed), []
    new, new_lp = fidelity.measure(tiny_lm.model, rows, REFERENCE, greedy, full=0)
    agree = greedy[:len(REFERENCE) - 1] == REFERENCE[:-1][:len(greedy)]  # the fed tokens begin alike
    assert (sum(fed) < old_tokens / 1.5) if agree else sum(fed) == old_tokens
    for a, b in zip(old, new):
        assert (a.kl_tokens, a.agree_full) == (b.kl_tokens, b.agree_full)
        assert a.answer_nll == pytest.approx(b.answer_nll, abs=1e-5) and a.kl_full == pytest.approx(b.kl_full,
                                                                                                    abs=1e-5)
    torch.testing.assert_close(new_lp, old_lp, atol=1e-5, rtol=0)
    later, _ = fidelity.measure(tiny_lm.model, rows[1:], REFERENCE, greedy, full_log_probs=new_lp)
    assert [x for f in later for x in (f.answer_nll, f.kl_full)] == pytest.approx(
        [x for f in old[1:] for x in (f.answer_nll, f.kl_full)], abs=1e-5)
