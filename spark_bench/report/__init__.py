"""``spark-bench-report``: any set of runs (or a paper CSV) in the paper's table layouts, as Markdown, CSV and
LaTeX, optionally beside the paper's numbers; plus the Fig. 5 plots.

    spark-bench-report results/table1 --layout longbench --paper tab_main --out out/
    spark-bench-report paper:tab_main --layout longbench              # the paper's own table (shipped CSVs)
    spark-bench-report results/paper_shape --layout ruler --ci --claims --out out/   # intervals, Δ, claims
    spark-bench-report results/demo --layout ruler --metric kl_full --ci             # KL to the full cache per task
    spark-bench-report --paper tab_main --check                       # does the paper table resolve?
    spark-bench-report results/paper_shape --at-bytes 0.3,0.5 --out out/   # method families at equal KV bytes
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pandas as pd

from spark_bench import logs
from spark_bench.report import stats
from spark_bench.report.figures import load_predictions
from spark_bench.report.frame import completeness, read_paper_csv, read_runs, read_sample_scores
from spark_bench.report.layouts import LAYOUTS, Layout
from spark_bench.report.paper import paper_table, paper_tables
from spark_bench.report.render import to_csv, to_latex, to_markdown
from spark_bench.report.setup import fast_path_note, provenance_differences, provenance_note, sample_note

LOG = logging.getLogger(__name__)
FORMATS = {"md": to_markdown, "csv": to_csv, "tex": to_latex}


METRICS = ("score", "answer_nll", "kl_full", "agree_full")


def build(inputs: list[str], layout: Layout, ci: bool = False, resamples: int = stats.RESAMPLES,
          seed: int = stats.SEED, metric: str = "score") -> pd.DataFrame:
    """Runs (directories) and paper tables (``paper:<csv>``) in one long frame; ``ci``: runs' cells with their
    bootstrap intervals (:func:`~spark_bench.report.compare.interval_frame`); ``metric``: the per-sample number in
    the task cells (``score``, or a fidelity number of :mod:`spark_bench.engine.fidelity`: runs only)."""
    frames = [read_paper_csv(i[len("paper:"):]) for i in inputs if i.startswith("paper:")]
    runs = [i for i in inputs if not i.startswith("paper:")]
    if metric != "score":
        if frames or not runs or layout.name not in ("ruler", "longbench"):
            raise ValueError(f"--metric {metric}: the paper reports scores only; give results directories and the "
                             "ruler or longbench layout")
        from spark_bench.report.compare import interval_frame

        samples = read_sample_scores(runs, layout)
        if samples[metric].isna().all():
            raise ValueError(f"--metric {metric}: not measured in {', '.join(runs)} (runs before spark-bench "
                             "measured it, or kl_full / agree_full without a full config in the sweep)")
        frame = interval_frame(samples, layout, resamples, seed, value=metric)
        frame = frame if ci else frame.assign(low=float("nan"), high=float("nan"))
        frame.attrs["digits"] = 3  # nats and fractions, well below 1 apart
        return frame
    if runs and layout.name == "longbench_e":
        from spark_bench.report.compare import length_frame

        frames.append(length_frame(read_sample_scores(runs, layout), resamples, seed, ci))
    elif runs and ci:
        from spark_bench.report.compare import interval_frame

        frames.append(interval_frame(read_sample_scores(runs, layout), layout, resamples, seed))
    elif runs:
        frames.append(read_runs(runs, layout))
    return pd.concat(frames, ignore_index=True)


@logs.last_resort("spark-bench-report")
def main(argv: list[str] | None = None) -> None:
    from spark_bench.commandline import ArgumentParser  # a bad flag: one line, exit 2

    parser = ArgumentParser(prog="spark-bench-report", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", help="results directories, or paper:<table> for a paper table")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="ruler")
    parser.add_argument("--paper", help=f"a paper table to set beside ours: a shipped name ({', '.join(paper_tables())})"
                                        " or a CSV path; NAME@PART keeps the blocks starting with PART (e.g. "
                                        "tab_app_full_ruler@8K)")
    parser.add_argument("--check", action="store_true", help="only check that --paper resolves (prints its path)")
    parser.add_argument("--ci", action="store_true",
                        help="cells as mean ± 95%% bootstrap half-width, plus each row's paired Δ against its base")
    parser.add_argument("--claims", action="store_true", help="check the paper's claims on the runs (verdicts); with --at-bytes also "
                             "SparK, ThinK, Mustafar and LeanK against each other at equal KV bytes")
    parser.add_argument("--metric", choices=METRICS, default="score",
                        help="the per-sample number in the task cells: the task score, or how far each cache moves "
                             "the model (answer_nll, kl_full, agree_full; runs only)")
    parser.add_argument("--resamples", type=int, default=stats.RESAMPLES, help="bootstrap resamples (1000)")
    parser.add_argument("--seed", type=int, default=stats.SEED, help="bootstrap seed (0)")
    parser.add_argument("--out", type=Path, help="directory for table.md / table.csv / table.tex (and figures)")
    parser.add_argument("--name", default="table", help="file stem of the written tables")
    parser.add_argument("--figures", action="store_true", help="also write Fig. 5a/5c PNGs from the runs")
    parser.add_argument("--at-bytes", nargs="?", const="", default=None, metavar="FRACTIONS",
                        help="also set the method families side by side at equal KV bytes (at_bytes.md/.csv): "
                             "score, KL full and NLL interpolated along each family's ratio or budget at these byte "
                             "fractions (e.g. 0.3,0.5 or 30%%,50%%; default 10%%, 20%%, …, 100%%), never "
                             "extrapolated")
    logs.add_flags(parser)
    parser.add_argument("--require-complete", action="store_true",
                        help="exit 2 when a run has not computed every prediction it set out to (else: said above "
                             "the tables, its cells marked *)")
    args = parser.parse_args(argv)
    logs.configure(args.verbosity, "spark-bench-report")
    echo = print if args.verbosity > logs.QUIET else (lambda *a, **k: None)  # -q: the files only
    try:
        if args.check:
            if not args.paper:
                raise ValueError("--check needs --paper NAME")
            path = paper_table(args.paper.split("@")[0])
            print(f"spark-bench-report: paper table {args.paper} → {path} ({len(read_paper_csv(args.paper))} cells)")
            return
        if not args.inputs:
            raise ValueError("no inputs: give results directories and/or paper:<table>")
        if args.out:  # a file in its place, or an unwritable parent: refused before anything is computed
            from spark_bench.checks import check_output

            check_output(args.out, "--out")
        layout = LAYOUTS[args.layout]
        if args.at_bytes is not None:
            from spark_bench.report.at_bytes import parse_fractions

            fractions = parse_fractions(args.at_bytes)  # a bad fraction: one line, before anything is computed
        frame = build(args.inputs, layout, args.ci, args.resamples, args.seed, args.metric)
        paper = read_paper_csv(args.paper) if args.paper else None
        if paper is not None and layout.name in ("dist", "variants"):  # ablation rows carry no base-method group
            paper = paper.assign(group="")
        runs = [i for i in args.inputs if not i.startswith("paper:")]
        incomplete = [f"incomplete: {run}: {note}" for run in runs if (note := completeness(run))]
        setups, unlike, other_model = [], [], False
        if args.paper:
            from spark_bench.report.setup import describe, differences

            setups = [describe(run, args.paper) for run in runs]
            found = [differences(run, args.paper) for run in runs]
            unlike = [line for fields in found for line in fields.values()]
            other_model = any("model" in fields for fields in found)
        if incomplete and args.require_complete:
            raise ValueError(f"{incomplete[0]} (--require-complete)")
        samples = read_sample_scores(runs, layout) if runs and (args.ci or args.claims) else None
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"spark-bench-report: error: {err}", file=sys.stderr)
        sys.exit(2)
    for line in incomplete + [f"not like with like: {line}" for line in unlike]:
        LOG.warning(f"warning: {line}")
    predictions = load_predictions(runs) if runs else None
    notes = [differ] if (differ := provenance_differences(runs)) else []  # software or machine differ: said once
    if differ:
        LOG.warning(f"warning: {differ}")
    for i, run in enumerate(runs):  # each task's fewest samples in a cell, against the paper's count
        fewest = predictions[predictions.run == i].groupby(["config", "task"], sort=False).size().groupby(
            "task", sort=False).min()
        notes.append(sample_note(run, fewest.to_dict()))
        notes.append(fast_path_note(run))  # which decode paths computed its numbers
        notes.append(provenance_note(run))  # the software and machine behind them
    header = "".join(f"**{line[0].upper()}{line[1:]}**\n\n" for line in incomplete)
    header += "".join(f"{line}\n\n" for line in notes if line)
    header += "".join(f"{line}\n\n" for line in setups if line)
    header += "".join(f"**Not like with like:** {line}\n\n" for line in unlike)
    outputs = {f"{args.name}.{ext}": render(frame, layout, paper) for ext, render in FORMATS.items()}
    if other_model:  # another model: the paper column is context, not a target
        outputs[f"{args.name}.md"] = outputs[f"{args.name}.md"].replace(
            "Cells: ours (paper, ours − paper)", "Cells: ours (paper, ours − paper: NOT COMPARABLE, another model)")
    outputs[f"{args.name}.md"] = header + outputs[f"{args.name}.md"]
    echo(outputs[f"{args.name}.md"])
    if runs:
        from spark_bench.tables import cost_markdown

        from spark_bench.report.kvpress_read import is_kvpress

        kvpress = [i for i, run in enumerate(runs) if is_kvpress(run)]  # kvpress records no cost: no cost rows
        outputs["cost.md"], cost = cost_markdown(predictions[~predictions.run.isin(kvpress)])
        outputs["cost.csv"] = cost.rename_axis("config").to_csv()
        echo("What each config cost (measured):\n\n" + outputs["cost.md"])
        from spark_bench.report.compare import position_markdown

        if positions := position_markdown(predictions):  # several questions per context: by question position
            outputs["positions.md"] = positions
            echo(positions)
    if samples is not None and args.ci and layout.name != "longbench_e":
        from spark_bench.report.compare import paired_frame, paired_markdown

        paired = paired_frame(samples, layout, args.resamples, args.seed)
        outputs["paired.md"], outputs["paired.csv"] = paired_markdown(paired), paired.to_csv(index=False)
        echo("Paired with each row's base (same samples):\n\n" + outputs["paired.md"])
    if runs and args.at_bytes is not None:
        from spark_bench.report import at_bytes

        pts = at_bytes.points(predictions, args.resamples, args.seed)
        table_ = at_bytes.at_bytes(pts, fractions)
        outputs["at_bytes.md"], outputs["at_bytes.csv"] = at_bytes.to_markdown(table_, pts), table_.to_csv(index=False)
        echo("At equal KV bytes (each method family interpolated along its own curve):\n\n" + outputs["at_bytes.md"])
    if samples is not None and args.claims:
        from spark_bench.report import claims

        verdicts = claims.check(samples, layout, args.resamples, args.seed)
        if runs and args.at_bytes is not None:  # channel methods against each other at equal KV bytes
            from spark_bench.report import bytes_claims

            at = bytes_claims.check(predictions, fractions, args.resamples, args.seed)
            verdicts = pd.concat([verdicts, at], ignore_index=True) if not verdicts.empty else at
        outputs["claims.md"], outputs["claims.csv"] = claims.to_markdown(verdicts), verdicts.to_csv(index=False)
        echo("The paper's claims on these runs:\n\n" + outputs["claims.md"])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, text in outputs.items():
            (args.out / name).write_text(text, encoding="utf-8")
        if args.figures:
            from spark_bench.report.figures import figure_bytes, figure_kl_bytes, figure_ratio, figure_throughput

            figure_ratio(predictions, args.out / "fig5a_score_vs_ratio.png")
            figure_bytes(predictions, args.out / "fig5c_score_vs_bytes.png")
            figure_throughput(predictions, args.out / "fig_score_vs_throughput.png")
            if "kl_full" in predictions and pd.to_numeric(predictions.kl_full, errors="coerce").notna().any():
                figure_kl_bytes(predictions, args.out / "fig_kl_vs_bytes.png")
        LOG.info(f"wrote {', '.join(sorted(outputs))} to {args.out}")
