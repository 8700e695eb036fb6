"""Render the long format in a paper layout as Markdown, CSV (the paper CSVs' own format) or LaTeX, optionally
with the paper's number and the delta beside each of ours."""

from __future__ import annotations

import math
import re

import pandas as pd

from spark_bench.report.layouts import Layout

AVG = "Avg."
EXTRA = ("NLL", "KL full", "Agree", "KV %", "Key ratio")  # after Avg., never averaged into it
DIGITS = {"NLL": 3, "KL full": 3, "Agree": 3}  # fidelity numbers are well below 1 apart
# a frame's other cells: 2 decimals (scores), or ``frame.attrs["digits"]`` (a fidelity number in the task cells)


def _order_rows(frame: pd.DataFrame) -> list[tuple[str, str, str]]:
    """Blocks and groups in first-appearance order; in a group the base row, then +ThinK, then +SparK rows."""
    keys = list(dict.fromkeys(zip(frame.block, frame.group, frame.method)))
    blocks = list(dict.fromkeys(k[0] for k in keys))
    ordered = []
    for block in blocks:
        groups = list(dict.fromkeys(k[1] for k in keys if k[0] == block))
        for group in groups:
            rows = [k for k in keys if k[0] == block and k[1] == group]
            rank = {m: i for i, m in enumerate(r[2] for r in rows)}
            ordered += sorted(rows, key=lambda k: (k[2].startswith("+"), "SparK" in k[2], rank[k[2]]))
    return ordered


def official_round(value: float) -> float:
    """Task scores as the official scorers print them (LongBench ``round(100·mean, 2)``, RULER likewise)."""
    return value if value is None or (isinstance(value, float) and math.isnan(value)) else round(value, 2)


def table(frame: pd.DataFrame, layout: Layout) -> tuple[list[tuple[str, str, str]], list[str], dict]:
    """(rows, columns, cells) of the layout; ``Avg.`` is taken from the frame when present, else the mean of the
    layout's columns as printed (each rounded to 2 decimals first, as the paper averages printed task scores)."""
    frame = frame.assign(column=frame.column.replace({"Avg": AVG}))
    present = set(frame.column)
    ordered = [c for c in layout.columns if c in present]
    ordered += [c for c in dict.fromkeys(frame.column) if c not in ordered and c != AVG and c not in EXTRA]
    budgets = sorted((c for c in ordered if re.fullmatch(r"KV-size \d+", c)), key=lambda c: int(c.split()[-1]))
    columns = budgets + [c for c in ordered if c not in budgets]  # budget columns (ablations) in numeric order
    cells = {(b, g, m, c): v for b, g, m, c, v in frame[["block", "group", "method", "column", "value"]]
             .itertuples(index=False)}
    rows = _order_rows(frame)
    for row in rows if layout.average else ():
        if (*row, AVG) not in cells:
            values = [official_round(cells[(*row, c)]) for c in columns if (*row, c) in cells]
            cells[(*row, AVG)] = sum(values) / len(values) if values else float("nan")
    columns += ([AVG] if layout.average else []) + [c for c in EXTRA if c in present]
    return rows, columns, cells


def _fmt(value, digits: int = 2) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def intervals(frame: pd.DataFrame) -> dict:
    """``{(block, group, method, column): half-width}`` of the cells that carry an interval (``low``/``high``)."""
    if "low" not in frame or "high" not in frame:
        return {}
    keep = frame.dropna(subset=["low", "high"])
    return {(b, g, m, c): (hi - lo) / 2 for b, g, m, c, lo, hi
            in keep[["block", "group", "method", "column", "low", "high"]].itertuples(index=False)}


def sample_counts(frame: pd.DataFrame) -> str:
    """A line saying how many samples stand behind the cells (``n``), or '' when the frame has no counts."""
    if "n" not in frame:
        return ""
    n = frame[~frame.column.isin(EXTRA + (AVG, "Avg"))].n.dropna().astype(int)
    if n.empty:
        return ""
    lo, hi = int(n.min()), int(n.max())
    return f"Samples per cell: {lo}." if lo == hi else f"Samples per cell: {lo}–{hi} (see the CSV's n column)."


def partial_cells(frame: pd.DataFrame) -> set:
    """Cells whose run stopped before all their samples were computed (marked ``*``)."""
    if "partial" not in frame:
        return set()
    flagged = frame[frame.partial.fillna(False).astype(bool)]
    return set(zip(flagged.block, flagged.group, flagged.method, flagged.column))


def _cell(ours, paper, side_by_side: bool, half_width=None, partial: bool = False, digits: int = 2) -> str:
    text = _fmt(ours, digits) if half_width is None else f"{_fmt(ours, digits)} ± {_fmt(half_width, digits)}"
    text += "*" if partial else ""
    if not side_by_side or paper is None or (isinstance(paper, float) and math.isnan(paper)):
        return text
    return f"{text} ({_fmt(paper)}, {ours - paper:+.2f})"


def to_markdown(frame: pd.DataFrame, layout: Layout, paper: pd.DataFrame | None = None) -> str:
    rows, columns, cells = table(frame, layout)
    ci = intervals(frame)
    short = partial_cells(frame)
    ref = table(paper, layout)[2] if paper is not None else {}
    lines = []
    if layout.groups:
        spans = [name for name, n in layout.groups for _ in range(n)]
        head = [spans[i] if i == 0 or spans[i] != spans[i - 1] else "" for i in range(len(spans))]
        lines.append("| | " + " | ".join(head + [""] * (len(columns) - len(head))) + " |")
    lines += ["| Method | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    block = None
    for row in rows:
        if row[0] != block:
            block = row[0]
            if block:
                lines.append(f"| **{block}** |" + " |" * len(columns))
        lines.append(f"| {row[2]} | " + " | ".join(_cell(cells.get((*row, c)), ref.get((*row, c)), paper is not None,
                                                        ci.get((*row, c)), (*row, c) in short,
                                                        DIGITS.get(c, frame.attrs.get("digits", 2)))
                                                  for c in columns) + " |")
    notes = []
    if short:
        notes.append("* The run stopped before every sample of these cells was computed (incomplete).")
    if ci:
        notes.append("Cells: mean ± half-width of a seeded 95% bootstrap interval (samples resampled within each "
                     "task; Avg. resamples every task at once).")
    if sample_counts(frame):
        notes.append(sample_counts(frame))
    if paper is not None:
        notes.append("Cells: ours (paper, ours − paper); – where a side has no number.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def to_csv(frame: pd.DataFrame, layout: Layout, paper: pd.DataFrame | None = None) -> str:
    """The paper CSVs' own long format (``block,method,column,value``) at full precision, plus ``n`` (and the
    interval's ``low,high``) when the frame has them, and ``paper,delta`` when comparing."""
    rows, columns, cells = table(frame, layout)
    extra = [c for c in ("n", "partial", "low", "high") if c in frame]
    stats = {(b, g, m, c): dict(zip(extra, values)) for (b, g, m, c), *values
             in zip(zip(frame.block, frame.group, frame.method, frame.column), *(frame[e] for e in extra))}
    ref = table(paper, layout)[2] if paper is not None else {}
    out = []
    for row in rows:
        for c in columns:
            if (*row, c) in cells:
                record = {"block": row[0], "method": row[2], "column": c, "value": cells[(*row, c)]}
                record.update(stats.get((*row, c), {}))
                if paper is not None:
                    p = ref.get((*row, c))
                    record.update(paper=p, delta=None if p is None else cells[(*row, c)] - p)
                out.append(record)
    return pd.DataFrame(out).to_csv(index=False)


LATEX_SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def latex_escape(text: str) -> str:
    """``text`` as LaTeX source that typesets it literally: every one of LaTeX's ten special characters escaped
    (labels carry ``_`` from option names, ``%`` from budgets, ``[]`` and ``=`` are safe)."""
    return "".join(LATEX_SPECIALS.get(ch, ch) for ch in str(text))


def to_latex(frame: pd.DataFrame, layout: Layout, paper: pd.DataFrame | None = None) -> str:
    rows, columns, cells = table(frame, layout)
    ci = intervals(frame)
    short = partial_cells(frame)
    ref = table(paper, layout)[2] if paper is not None else {}
    lines = [r"\begin{tabular}{l" + "c" * len(columns) + "}", r"\toprule"]
    if layout.groups:
        spans = [rf"\multicolumn{{{n}}}{{c}}{{{latex_escape(name)}}}" for name, n in layout.groups]
        rest = len(columns) - sum(n for _, n in layout.groups)
        lines.append("& " + " & ".join(spans + [""] * rest) + r" \\")
    lines += [r"\textbf{Method} & " + " & ".join(latex_escape(c) for c in columns) + r" \\", r"\midrule"]
    block = None
    for row in rows:
        if row[0] != block:
            block = row[0]
            if block:
                name = latex_escape(block)
                lines.append(rf"\midrule \multicolumn{{{len(columns) + 1}}}{{l}}{{\textit{{{name}}}}} \\")
        values = [latex_escape(_cell(cells.get((*row, c)), ref.get((*row, c)), paper is not None, ci.get((*row, c)),
                                     (*row, c) in short, DIGITS.get(c, frame.attrs.get("digits", 2))))
                  .replace("±", r"$\pm$") for c in columns]
        lines.append(latex_escape(row[2]) + " & " + " & ".join(values) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"
