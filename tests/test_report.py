"""Reports: the paper's own tables round-trip through the layouts cell for cell; our runs render the same way."""

import io
import os
from pathlib import Path

import pandas as pd
import pytest

from spark_bench.report import main as report_main
from spark_bench.report.frame import clean_method, read_paper_csv, read_runs, row_names
from spark_bench.report.layouts import DIST, LONGBENCH, RULER, VARIANTS
from spark_bench.report.paper import PAPER_DIR, paper_table, paper_tables
from spark_bench.report.render import table, to_csv, to_latex, to_markdown
from spark_bench.report.setup import sample_note

PAPER = PAPER_DIR  # the paper's tables ship inside the package


def test_every_paper_table_ships_and_resolves_by_name():
    assert {"tab_main", "tab_main_ruler", "tab_ab_dist", "tab_ab_var", "tab_app_kv_llama3-8b"} <= set(paper_tables())
    assert paper_table("tab_main") == paper_table("tab_main.csv") == PAPER / "tab_main.csv"
    assert paper_table("/gone/shared/paper/tables/tab_main_ruler.csv") == PAPER / "tab_main_ruler.csv"  # old paths
    with pytest.raises(FileNotFoundError, match=r"paper table 'tab_nine': not a file .*shipped: fig_app_bsz_mem, figure2c, tab_ab_dist"):
        paper_table("tab_nine")


@pytest.mark.parametrize("csv,layout", [("tab_main.csv", LONGBENCH), ("tab_full_llama3-8b.csv", LONGBENCH),
                                        ("tab_main_ruler.csv", RULER), ("tab_app_kv_llama3-8b.csv", LONGBENCH),
                                        ("tab_ab_dist.csv", DIST), ("tab_ab_var.csv", VARIANTS)])
def test_paper_table_round_trips_cell_for_cell(csv, layout):
    raw = pd.read_csv(PAPER / csv, keep_default_na=False, dtype={"value": str})
    frame = read_paper_csv(PAPER / csv)
    rendered = pd.read_csv(io.StringIO(to_csv(frame, layout)), keep_default_na=False)
    expected = [(str(b).strip(), clean_method(m), str(c).strip(), float(v)) for b, m, c, v
                in raw[["block", "method", "column", "value"]].itertuples(index=False)]
    got = [(str(b), m, c, float(v)) for b, m, c, v in rendered[["block", "method", "column", "value"]]
           .itertuples(index=False)]
    assert got == expected  # same rows, same order, same columns, same numbers


def test_table1_layout_matches_the_paper():
    md = to_markdown(read_paper_csv(PAPER / "tab_main.csv"), LONGBENCH).splitlines()
    assert md[0].startswith("| | Single-Doc QA |") and "Multi-Doc QA" in md[0] and "Code" in md[0]
    assert md[1] == "| Method | " + " | ".join(LONGBENCH.columns) + " | Avg. |"
    block = md[md.index("| **KV-size 128** |" + " |" * 17) + 1:][:13]
    assert [r.split(" | ")[0][2:] for r in block] == [
        "StreamingLLM", "ExpectedAttention", "TOVA", "SnapKV", "+ThinK (0.5)", "+ThinK (0.8)", "+SparK (0.5)",
        "+SparK (0.8)", "PyramidKV", "+ThinK (0.5)", "+ThinK (0.8)", "+SparK (0.5)", "+SparK (0.8)"]
    rows, columns, cells = table(read_paper_csv(PAPER / "tab_main.csv"), LONGBENCH)
    assert cells[("KV-size 128", "SnapKV", "+SparK (0.8)", "Avg.")] == 31.16  # the paper's own Avg., kept


def test_clean_method_strips_latex():
    assert clean_method(r"\cdashline1-15 SnapKV") == "SnapKV"
    assert clean_method(r"\midrule Vanilla") == "Vanilla"
    assert clean_method("+ThinK(0.5)") == "+ThinK (0.5)"


def test_row_names_follow_the_paper():
    base = dict(budget=128, ratio=0.8, value_ratio=0.0, recovery="degenerate", variant="fixed", top_p=0.99, groups=4)
    assert row_names({**base, "name": "snapkv+spark"}) == ("KV-size 128", "SnapKV", "+SparK (0.8)")
    assert row_names({**base, "name": "full"}) == ("", "Vanilla", "Vanilla")
    assert row_names({**base, "name": "pyramidkv+spark", "value_ratio": 0.3, "ratio": 0.5}) == \
        ("KV-size 128", "PyramidKV", "+SparK (0.5+0.3)")
    assert row_names({**base, "name": "snapkv+spark", "variant": "top_p", "budget": 0.2})[1:] == \
        ("SnapKV", "+SparK-p (0.99)")


@pytest.fixture(scope="module")
def run_dir(tiny_lm, tmp_path_factory):
    from spark_bench.benchmarks.ruler import load_ruler
    from spark_bench.methods import MethodConfig
    from spark_bench.runner import run_sweep

    samples = load_ruler(["niah_single_1", "niah_multikey_2"], 512, 1, 7, tiny_lm, max_new_tokens=4)
    configs = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=64)] + [
        MethodConfig(name=f"snapkv+{c}", budget=64, ratio=r, recovery=rec)
        for c, rec in (("spark", "degenerate"), ("think", "degenerate"), ("spark", "none")) for r in (0.5, 0.8)]
    out = tmp_path_factory.mktemp("report_run")
    run_sweep(tiny_lm, samples, configs, out)
    return out


def test_paper_comparisons_say_what_is_not_like_with_like(run_dir, tmp_path, capsys):
    """A tiny-model run at KV 64 beside Table 2 (LLaMA-3.1-8B, RULER 16K, 20%, official): one warning line per
    differing field on stderr and in the report's header, the Δ labelled not comparable (another model)."""
    report_main([str(run_dir), "--layout", "ruler", "--paper", "tab_main_ruler", "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "not like with like" in line]
    assert f"{run_dir} vs tab_main_ruler: model tiny-llama (paper: llama3.1-8b)" in warned[0]
    assert any("budgets 64 (paper: 0.2)" in line for line in warned)
    md = (tmp_path / "rep" / "table.md").read_text()
    assert "**Not like with like:**" in md and "NOT COMPARABLE, another model" in md
    assert f"Run {run_dir}: tiny-llama" in md and "paper tab_main_ruler: llama3.1-8b, ruler at 16384 tokens" in md


def test_our_runs_render_with_the_paper_beside(run_dir, tmp_path):
    out = run_dir
    frame = read_runs([out], RULER)
    md = to_markdown(frame, RULER)
    assert "| Method | Niah1 | MKey2 | Avg. | NLL | KL full | Agree | KV % | Key ratio |" in md
    assert "| **KV-size 64** |" in md and "| +SparK (0.8) [none] |" in md
    paper = frame.assign(value=frame.value - 1.0)  # a fake "paper" one point lower everywhere
    side = to_markdown(frame, RULER, paper)
    assert ", +1.00)" in side and "Cells: ours (paper, ours − paper)" in side
    latex = to_latex(frame, RULER)
    assert latex.startswith(r"\begin{tabular}") and r"\textit{KV-size 64}" in latex
    report_main([str(out), "--layout", "ruler", "--out", str(tmp_path / "rep"), "--figures"])
    for name in ("table.md", "table.csv", "table.tex", "cost.md", "cost.csv", "fig5a_score_vs_ratio.png",
                 "fig5c_score_vs_bytes.png", "fig_score_vs_throughput.png"):
        data = (tmp_path / "rep" / name).read_bytes()
        assert data and (not name.endswith(".png") or data[:4] == b"\x89PNG")
    md = (tmp_path / "rep" / "table.md").read_text()  # two RULER samples per cell: below the paper's 500
    assert "samples per cell below the paper's: all 2 tasks n=1 (paper 500)" in md
    cost = pd.read_csv(tmp_path / "rep" / "cost.csv", index_col="config")  # the run's own scores.csv, per config
    scores = pd.read_csv(out / "scores.csv")
    for config, part in scores.groupby("config"):
        assert cost.loc[config, "KV MiB"] == pytest.approx((part.kv_bytes * part.n).sum() / part.n.sum() / 2 ** 20)
        assert cost.loc[config, "Decode tok/s"] == pytest.approx(part.new_tokens.sum() / part.decode_s.sum())
        assert cost.loc[config, "Prefill s"] > 0 and cost.loc[config, "Peak MiB"] > 0


def test_ablation_layouts_from_runs(tiny_lm, tmp_path):
    from spark_bench.benchmarks.ruler import load_ruler
    from spark_bench.methods import MethodConfig
    from spark_bench.report.frame import read_ablation
    from spark_bench.runner import run_sweep

    samples = load_ruler(["niah_single_1"], 512, 1, 7, tiny_lm, max_new_tokens=3)
    configs = [MethodConfig(name="snapkv+spark", budget=b, ratio=0.5, recovery=r)
               for r in ("gaussian", "degenerate") for b in (64, 128)] + [
        MethodConfig(name="snapkv+spark", budget=b, variant="group", groups=4) for b in (64, 128)]
    run_sweep(tiny_lm, samples, configs, tmp_path)
    dist = to_markdown(read_ablation([tmp_path], "dist"), DIST)
    assert "| Method | KV-size 64 | KV-size 128 |" in dist and "| Normal |" in dist and "| Degenerate |" in dist
    variants = read_ablation([tmp_path], "variants")
    ratio = variants[(variants.method == "SparK-g (g=4)") & (variants.column == "Overall ratio")].value
    assert len(ratio) == 1 and ratio.iloc[0] == pytest.approx(1 - 6 / 16)  # g=4 over D=16 keeps 4+2+... by hand
    assert "Overall ratio" in to_markdown(variants, VARIANTS)


@pytest.mark.parametrize("target", ["table1", "paper-shape"])  # make itself: a hub model's plan, the tiny model's
def test_make_targets_resolve_and_start(target):
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["make", "-s", target, "DRY_RUN=true"], cwd=root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert "spark-bench (dry run):" in out.stdout and "method configs" in out.stdout
    if target == "paper-shape":  # the tiny model, offline: the real run would start
        assert out.returncode == 0, out.stderr[-2000:]
    else:  # the hub model is not on this machine: the dry run says the real run would stop, and make stops
        assert out.returncode == 2 and "spark-bench: error: the run would stop: model" in out.stderr, out.stderr
    if target in ("table1", "table2"):
        table = {"table1": "tab_main", "table2": "tab_main_ruler"}[target]
        assert f"spark-bench-report: paper table {table} → " in out.stdout and "cells)" in out.stdout


def test_the_targets_experiments_plan_and_start(console, monkeypatch, capsys):
    """The other make targets' experiments (each recipe's ``$(call experiment,…)``, as `make <target> DRY_RUN=true`
    runs them), dry-run from the console script's entry in this process: each plans its configs; a hub model's stops
    at the model (exit 2), SmolLM2's would start (exit 0). A target's paper table passes `spark-bench-report --check`."""
    import re

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    makefile = (root / "Makefile").read_text()
    recipes = dict(re.findall(r"^([\w.\-]+):.*\n((?:\t.*\n)+)", makefile, flags=re.M))
    # the appendix's full tables (tab_full_*, tab_app_full_ruler) plan like table1 and are checked row by row in
    # tests/test_paper_targets.py; figure2's run in tests/test_analysis.py
    others = ["table2", "ablation-dist", "ablation-variants", "kv-joint", "figure5", "channel-methods"]
    assert set(others) <= {t for t, r in recipes.items() if "$(call experiment," in r}
    for target in others:
        for name, paper in re.findall(r"\$\(call experiment,(\w+),\w+,([^,]*),", recipes[target]):
            code, out, err = console([f"+experiment={name}", "dry_run=true", "hub_timeout_s=1"])
            assert "spark-bench (dry run):" in out and "method configs" in out, (target, name, err[-800:])
            hub = "smollm2" not in out.split("\n", 1)[0]
            assert (code, "the run would stop: model" in err) == ((2, True) if hub else (0, False)), (name, err)
            if paper:
                report_main(["--check", *paper.split()])  # as the recipe: --check --paper tab_main_ruler
                assert "cells)" in capsys.readouterr().out, (target, paper)


def test_report_with_intervals_paired_deltas_and_claims(run_dir, tmp_path):
    report_main([str(run_dir), "--layout", "ruler", "--ci", "--claims", "--out", str(tmp_path / "rep")])
    md = (tmp_path / "rep" / "table.md").read_text()
    assert " ± " in md and "Samples per cell: 1." in md and "seeded 95% bootstrap interval" in md
    csv = pd.read_csv(tmp_path / "rep" / "table.csv")
    assert {"n", "low", "high"} <= set(csv.columns) and set(csv[csv.column == "Niah1"].n) == {1}
    paired = pd.read_csv(tmp_path / "rep" / "paired.csv")
    spark = paired[(paired.method == "+SparK (0.8)")].iloc[0]
    assert spark.base == "SnapKV" and spark.wins + spark.ties + spark.losses == 2
    assert set(paired[paired.method == "SnapKV"].base) == {"Vanilla"}
    claims = pd.read_csv(tmp_path / "rep" / "claims.csv")
    assert len(claims) == 8 and set(claims.verdict) == {"too few samples (n=1 per task, need 20)"}  # 1 per task
    assert set(paired.metric) == {"score", "answer_nll", "kl_full", "agree_full"}  # the run has a full config
    assert {"NLL", "KL full", "Agree"} <= set(csv.column) and "Paired" not in md
    assert r"$\pm$" in (tmp_path / "rep" / "table.tex").read_text()


def test_task_scores_are_averaged_as_printed():
    frame = pd.DataFrame([("", "Vanilla", "Vanilla", "Niah1", 100 / 3), ("", "Vanilla", "Vanilla", "Niah2", 200 / 3)],
                         columns=["block", "group", "method", "column", "value"])
    rows, columns, cells = table(frame, RULER)
    assert cells[("", "Vanilla", "Vanilla", "Avg.")] == (33.33 + 66.67) / 2  # rounded task scores, then the mean
    assert "33.333333" in to_csv(frame, RULER)  # the CSV keeps full precision


LATEX_COMMANDS = {"begin", "end", "toprule", "midrule", "bottomrule", "multicolumn", "textbf", "textit", "pm",
                  "textbackslash", "textasciitilde", "textasciicircum"}


def assert_strict_latex(source: str, columns: int) -> None:
    """The generated source held to what compiles, also where no TeX engine is (``tests/test_latex.py`` runs
    pdflatex where one is): only known commands, escaped specials, balanced braces, math only in ``$\\pm$``, and
    every row with ``columns`` cells."""
    import re

    for line in source.splitlines():
        rest = line.replace(r"$\pm$", "")
        assert "$" not in rest.replace(r"\$", ""), line
        for command in re.findall(r"\\([A-Za-z]+)", rest):
            assert command in LATEX_COMMANDS, (command, line)
        bare = re.sub(r"\\[A-Za-z]+|\\[\\&%$#_{}]", "", rest)  # drop commands, escaped specials and \\ row ends
        assert not re.search(r"[%#_^~\\]", bare), line
        depth = 0
        for ch in re.sub(r"\\[{}]", "", rest):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            assert depth >= 0, line
        assert depth == 0, line
        if rest.endswith(r"\\") and "multicolumn" not in rest:
            assert len(re.findall(r"(?<!\\)&", rest)) == columns, line


def test_latex_escapes_every_special_character(run_dir):
    from spark_bench.report.render import latex_escape

    assert latex_escape(r"a_b 50% #1 $x$ {y} ~^ & \z") == (r"a\_b 50\% \#1 \$x\$ \{y\} \textasciitilde{}"
                                                          r"\textasciicircum{} \& \textbackslash{}z")
    frame = read_runs([run_dir], RULER)
    nasty = r"+SparK (0.8) [window_size=32, budget_rounding=official] #1 ~^{&}$\ 50%"
    frame.loc[frame.method == frame.method.iloc[-1], "method"] = nasty
    frame.loc[frame.block != "", "block"] = "KV 50% & 20_x"
    source = to_latex(frame, RULER)
    columns = source.splitlines()[2].count(" & ")
    assert_strict_latex(source, columns)
    assert latex_escape(nasty) in source


def test_sample_note_names_each_task_below_the_papers_count(tmp_path):
    """One phrase when every task has the same count; otherwise each task below the paper's, and nothing at or
    above it (LongBench: 200 per task, 150 for multi-field QA, 500 for the code tasks)."""
    assert sample_note(tmp_path, {"niah_single_1": 25, "vt": 25}) == \
        f"{tmp_path}: samples per cell below the paper's: all 2 tasks n=25 (paper 500)"
    assert sample_note(tmp_path, {"multifieldqa_en": 150, "narrativeqa": 30, "lcc": 30}) == \
        f"{tmp_path}: samples per cell below the paper's: narrativeqa n=30 (paper 200), lcc n=30 (paper 500)"
    assert sample_note(tmp_path, {"niah_single_1": 500}) == ""


@pytest.mark.parametrize("name, recovery, expected", [
    ("full", None, "full / eviction only"), ("snapkv", None, "full / eviction only"),
    ("pyramidkv+think", None, "ThinK"), ("think", None, "ThinK"),
    ("snapkv+spark", "degenerate", "SparK"), ("spark", "gaussian", "SparK"),
    ("snapkv+spark", "none", "SparK, no recovery"), ("snapkv+mustafar", None, "Mustafar"), ("leank", None, "LeanK")])
def test_every_config_has_a_scatter_family(name, recovery, expected):
    """Fig. 5c and score vs throughput plot every config: channel methods alone and unrecovered SparK included."""
    from spark_bench.report.figures import family

    assert family(name, recovery) == expected
