"""The LaTeX tables compile: every shipped ``results/*/report/*.tex`` and every paper table freshly rendered in its
layout (and one with every LaTeX special character in its labels) goes through ``pdflatex`` inside a minimal
document. ``.ci/run`` installs Debian's ``texlive-latex-base``; the test skips, saying so, only where no engine is."""

import shutil
import subprocess

import pytest
from conftest import ROOT

from spark_bench.report.frame import read_paper_csv
from spark_bench.report.layouts import LAYOUTS
from spark_bench.report.render import to_latex

PDFLATEX = shutil.which("pdflatex")
pytestmark = pytest.mark.skipif(PDFLATEX is None, reason="no pdflatex here (.ci/run installs texlive-latex-base)")

PAPER_LAYOUTS = {"tab_main": "longbench", "tab_main_ruler": "ruler", "tab_app_full_ruler": "ruler",
                 "tab_ab_dist": "dist", "tab_ab_var": "variants", "tab_app_kv_llama3-8b": "longbench",
                 **{f"tab_full_{m}": "longbench" for m in ("llama3-8b", "llama3.1-8b", "llama3.1-70b", "qwen3-8b",
                                                            "qwen3-32b")}}
# booktabs where installed (texlive-latex-recommended); texlive-latex-base alone gets \hline for its three rules
DOCUMENT = r"""\documentclass{article}
\usepackage[a3paper,landscape,margin=1cm]{geometry}
\IfFileExists{booktabs.sty}{\usepackage{booktabs}}{%
  \newcommand\toprule{\hline}\newcommand\midrule{\hline}\newcommand\bottomrule{\hline}}
\begin{document}
TABLE
\end{document}
"""


def tables() -> dict[str, str]:
    sources = {f"{p.parent.parent.name}/{p.name}": p.read_text() for p in sorted(ROOT.glob("results/*/report/*.tex"))}
    for name, layout in PAPER_LAYOUTS.items():
        frame = read_paper_csv(name)
        if layout in ("dist", "variants"):
            frame = frame.assign(group="")
        sources[f"paper:{name}"] = to_latex(frame, LAYOUTS[layout])
    nasty = read_paper_csv("tab_main_ruler")
    nasty.loc[nasty.method == nasty.method.iloc[-1], "method"] = r"+SparK (0.8) [a_b=1] #1 ~^{&}$\ 50%"
    sources["escaped labels"] = to_latex(nasty, LAYOUTS["ruler"])
    return sources


def test_every_table_compiles(tmp_path):
    sources = tables()
    assert len(sources) >= len(PAPER_LAYOUTS) + 2
    failed = []
    for i, (name, source) in enumerate(sources.items()):
        tex = tmp_path / f"t{i}.tex"
        tex.write_text(DOCUMENT.replace("TABLE", source))
        out = subprocess.run([PDFLATEX, "-interaction=nonstopmode", "-halt-on-error", tex.name], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0 or not (tmp_path / f"t{i}.pdf").exists():
            errors = [line for line in out.stdout.splitlines() if line.startswith("!")]
            failed.append(f"{name}: {errors[:2]}")
    assert not failed, failed
