"""Every paper table with a LongBench or RULER row layout has an experiment whose method configs are the paper's rows,
one to one and in the paper's order (same methods, ratios, budgets), and a Makefile target of its name."""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from spark_bench.cli import CONF_DIR
from spark_bench.methods import MethodConfig
from spark_bench.report.frame import read_paper_csv, row_names

ROOT = Path(__file__).resolve().parent.parent


def _kv(budget) -> str:
    return f"KV-size {budget:g}"


def _ruler_block(tag):
    return lambda budget: f"{tag} input, {100 * budget:g}% KV cache"


# experiment → (paper table, the paper's block name of a budget, the part of the table it covers)
TARGETS = {
    "table1": ("tab_main", _kv, None),
    "table2": ("tab_main_ruler", lambda budget: "", None),  # one block: 20% at 16K
    "tab_full_llama3_8b": ("tab_full_llama3-8b", _kv, None),
    "tab_full_llama3_1_8b": ("tab_full_llama3.1-8b", _kv, None),
    "tab_full_llama3_1_70b": ("tab_full_llama3.1-70b", _kv, None),
    "tab_full_qwen3_8b": ("tab_full_qwen3-8b", _kv, None),
    "tab_full_qwen3_32b": ("tab_full_qwen3-32b", _kv, None),
    "tab_app_full_ruler_8k": ("tab_app_full_ruler", _ruler_block("8K"), "8K input"),
    "tab_app_full_ruler_16k": ("tab_app_full_ruler", _ruler_block("16K"), "16K input"),
}


def _experiment(name):
    exp = OmegaConf.load(CONF_DIR / "experiment" / f"{name}.yaml")
    sweep = next(d["override /sweep"] for d in exp.defaults if "override /sweep" in d)
    model = next(d["override /model"] for d in exp.defaults if "override /model" in d)
    configs = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "sweep" / f"{sweep}.yaml"))["configs"]
    return exp, model, [MethodConfig(**c) for c in configs]


@pytest.mark.parametrize("experiment", sorted(TARGETS))
def test_experiment_rows_are_the_paper_rows(experiment):
    table, block_of, part = TARGETS[experiment]
    exp, model, configs = _experiment(experiment)
    paper = read_paper_csv(table)
    if part is not None:
        paper = paper[paper.block.str.startswith(part)]
    expected = list(dict.fromkeys(zip(paper.block, paper.group, paper.method)))
    ours = []
    for c in configs:
        _, group, method = row_names(c.to_dict())
        block = (f"{part}, full KV cache" if part else "") if c.name == "full" else block_of(c.budget)
        ours.append((block, group, method))
    assert ours == expected


# ablation experiments → (paper table, layout): each config is one cell of the paper's table (the ``variants``
# table's "Overall ratio" column is the rows' mean achieved ratio, not a config of its own)
ABLATIONS = {"ablation_dist": ("tab_ab_dist", "dist"), "ablation_variants": ("tab_ab_var", "variants")}


@pytest.mark.parametrize("experiment", sorted(ABLATIONS))
def test_ablation_cells_are_the_paper_cells(experiment):
    from spark_bench.report.frame import ablation_cell

    table, kind = ABLATIONS[experiment]
    _, model, configs = _experiment(experiment)
    paper = read_paper_csv(table)
    paper = paper[paper.column != "Overall ratio"]
    assert model == "llama3-8b"
    assert [ablation_cell(c.to_dict(), kind) for c in configs] == list(zip(paper.block, paper.method, paper.column))


def test_kv_joint_rows_are_the_paper_rows():
    _, model, configs = _experiment("kv_joint")
    paper = read_paper_csv("tab_app_kv_llama3-8b")
    expected = list(dict.fromkeys(zip(paper.block, paper.group, paper.method)))
    ours = [(f"LLaMA-3-8B-Instruct, {_kv(c.budget)}", *row_names(c.to_dict())[1:]) for c in configs]
    assert model == "llama3-8b" and ours == expected


# paper table → its Makefile target (named after it; Tables 1, 2 and the ablations keep their established names)
MAKE_TARGETS = {"tab_main": "table1", "tab_main_ruler": "table2", "tab_ab_dist": "ablation-dist",
                "tab_ab_var": "ablation-variants", "tab_app_kv_llama3-8b": "kv-joint",
                "figure2c": "figure2", "fig_app_bsz_mem": "figure2",
                **{t: t for t in ("tab_full_llama3-8b", "tab_full_llama3.1-8b", "tab_full_llama3.1-70b",
                                  "tab_full_qwen3-8b", "tab_full_qwen3-32b", "tab_app_full_ruler")}}


def test_every_paper_table_has_a_make_target_and_make_paper_runs_them_all():
    from spark_bench.report.paper import paper_tables

    makefile = (ROOT / "Makefile").read_text()
    assert set(paper_tables()) == set(MAKE_TARGETS)
    assert {table for table, _, _ in TARGETS.values()} <= set(MAKE_TARGETS)
    assert re.search(r"^paper: \$\(PAPER_TARGETS\)$", makefile, re.M)
    paper = re.search(r"^PAPER_TARGETS = ((?:.*\\\n)*.*)$", makefile, re.M).group(1).replace("\\\n", " ").split()
    for target in MAKE_TARGETS.values():
        assert re.search(rf"^{re.escape(target)}: ", makefile, re.M), target
        assert target in paper, target


def test_a_paper_table_part_reads_as_our_blocks():
    """``tab_app_full_ruler@8K``: the 8K rows, blocks named as a run names them (``KV 20%``, the full cache's none)."""
    part = read_paper_csv("tab_app_full_ruler@8K")
    assert set(part.block) == {"", "KV 20%", "KV 50%"}
    whole = read_paper_csv("tab_app_full_ruler")
    assert len(part) == (whole.block.str.startswith("8K input")).sum()


@pytest.mark.parametrize("experiment", sorted(TARGETS))
def test_experiment_settings(experiment):
    exp, model, configs = _experiment(experiment)
    assert next(d["override /protocol"] for d in exp.defaults if "override /protocol" in d) == "official"
    table = TARGETS[experiment][0]
    if table.startswith("tab_full_"):
        assert model == table.removeprefix("tab_full_")
    if "ruler" in table:
        assert model == "llama3.1-8b" and exp.ruler.source == "kvpress"
        assert exp.benchmark.length == (8192 if experiment.endswith("_8k") else 16384)


def test_cost_constants_are_the_measured_figures():
    """The measured constants of the cost model equal the tracked figures they cite; the decode step is the slower
    of reading its bytes at the stated bandwidth share and dispatching its operations."""
    from spark_bench.plan import H100_US_PER_OP, OPS_PER_LAYER_STEP, SMOLLM2_LAYERS, measured_sources

    figures = measured_sources(ROOT)
    h100, ops = figures["decode_h100"], figures["ops"]
    dense_ops = ops["fourteen"]["dense"]["ops_per_step"]
    assert H100_US_PER_OP == pytest.approx(1000 * h100["step_fourteen"]["dense_dynamic_cache_step_ms"] / dense_ops)
    assert OPS_PER_LAYER_STEP == pytest.approx(ops["fourteen"]["stacked"]["ops_per_step"] / SMOLLM2_LAYERS)


def test_the_plan_is_a_roofline_with_its_assumptions_printed(tmp_path):
    """An 8B model at 127.5K: prefill hours = FLOPs ÷ (stated share of the bf16 peak); a decode step is the slower
    of reading the weights and caches at the stated share of the bandwidth and dispatching its measured operations;
    make gpu-check's figures are printed where they exist."""
    import json

    from spark_bench import plan
    from spark_bench.memory import Arch
    from spark_bench.methods import MethodConfig
    from conftest import model_config

    model = model_config("llama3.1-8b")
    configs = [MethodConfig(name="snapkv", budget=0.2), MethodConfig(name="snapkv+spark", budget=0.2, ratio=0.8)]
    work = [plan.TaskWork("narrativeqa", 10, 128, "published")]
    cost = plan.estimate(model, configs, work, 127500, root=tmp_path)
    arch = Arch.of(model)
    flops = plan.prefill_flops(arch.num_params, arch.num_layers, arch.num_heads, arch.head_dim, 127500)
    h100 = plan.DEVICES["h100"]
    assert cost.hours["h100"][0] == pytest.approx(10 * flops / (h100.peak_flops * plan.UTILISATION["prefill"]) / 3600)
    read = cost.step_gb * 1e9 / (h100.bandwidth * plan.UTILISATION["decode"])
    dispatch = h100.us_per_op * 1e-6 * plan.OPS_PER_LAYER_STEP * arch.num_layers
    assert cost.hours["h100"][1] == pytest.approx(1280 * max(read, dispatch) / 3600)
    assert ("memory-bound" if read > dispatch else "dispatch-bound") in cost.bound["h100"]
    assert "memory-bound" in cost.bound["a100"] and "dispatch not measured" in cost.bound["a100"]
    lines = cost.lines()
    assert any("40% of the dense bf16 peak" in line for line in lines) and "no make gpu-check figures" in lines[-1]
    (tmp_path / "results" / "bench" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "bench" / "gpu" / "check.json").write_text(json.dumps({"device": "NVIDIA H100", "calibration": [
        {"model": "llama3.1-8b (random)", "tokens": 8192, "prefill_tflops": 400.0, "step_ms": 30.0, "rows": 14}]}))
    assert "prefill 400 TFLOP/s" in plan.estimate(model, configs, work, 127500, root=tmp_path).lines()[-1]


def test_dry_run_prints_the_plan_of_every_table(console):
    """Every paper target's dry run plans its samples, configs, forwards, memory and hours (no model, no data)."""
    from spark_bench.plan import LONGBENCH_RECORDS

    assert sum(LONGBENCH_RECORDS.values()) == 3750
    code, out, err = console(["+experiment=tab_full_llama3_1_8b", "dry_run=true", "hub_timeout_s=1"])
    # the model is not on this machine: the plan is printed, and the dry run says the real run would stop (exit 2)
    assert code == 2 and "the run would stop: model llama3.1-8b" in err, err
    plan = [line.strip() for line in out.splitlines() if line.strip().startswith("plan:")]
    assert plan[0].startswith("plan: samples per task (published): narrativeqa 200")
    assert plan[1].startswith("plan: 3750 samples × 56 configs; prompts ≤ 127500 tokens;")
    assert "KV per sample ≤" in plan[2] and any("GPU-hours on one NVIDIA H100" in line for line in plan)
