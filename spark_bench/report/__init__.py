"""``spark-bench-report``: any set of runs (or a paper CSV) in the paper's table layouts, as Markdown, CSV and
LaTeX, optionally beside the paper's numbers; plus the Fig. 5 plots.

    spark-bench-report results/table1 --layout longbench --paper ../shared/paper/tables/tab_main.csv --out out/
    spark-bench-report paper:../shared/paper/tables/tab_main.csv --layout longbench     # the paper's own table
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from spark_bench.report.frame import read_paper_csv, read_runs
from spark_bench.report.layouts import LAYOUTS, Layout
from spark_bench.report.render import to_csv, to_latex, to_markdown

FORMATS = {"md": to_markdown, "csv": to_csv, "tex": to_latex}


def build(inputs: list[str], layout: Layout) -> pd.DataFrame:
    """Runs (directories) and paper tables (``paper:<csv>``) in one long frame."""
    frames = [read_paper_csv(i[len("paper:"):]) for i in inputs if i.startswith("paper:")]
    runs = [i for i in inputs if not i.startswith("paper:")]
    if runs:
        frames.append(read_runs(runs, layout))
    return pd.concat(frames, ignore_index=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="spark-bench-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="results directories, or paper:<csv> for a transcribed table")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="ruler")
    parser.add_argument("--paper", help="a paper CSV (../shared/paper/tables/*.csv) to set beside ours")
    parser.add_argument("--out", type=Path, help="directory for table.md / table.csv / table.tex (and figures)")
    parser.add_argument("--name", default="table", help="file stem of the written tables")
    parser.add_argument("--figures", action="store_true", help="also write Fig. 5a/5c PNGs from the runs")
    args = parser.parse_args(argv)
    try:
        layout = LAYOUTS[args.layout]
        frame = build(args.inputs, layout)
        paper = read_paper_csv(args.paper) if args.paper else None
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"spark-bench-report: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(to_markdown(frame, layout, paper))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for ext, render in FORMATS.items():
            (args.out / f"{args.name}.{ext}").write_text(render(frame, layout, paper), encoding="utf-8")
        if args.figures:
            from spark_bench.report.figures import figure_bytes, figure_ratio, load_predictions

            runs = [i for i in args.inputs if not i.startswith("paper:")]
            preds = load_predictions(runs)
            figure_ratio(preds, args.out / "fig5a_score_vs_ratio.png")
            figure_bytes(preds, args.out / "fig5c_score_vs_bytes.png")
        print(f"spark-bench-report: wrote {args.out}/{args.name}.{{md,csv,tex}}")
