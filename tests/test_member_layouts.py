"""``scripts/bench/member_layouts.py`` (alternative key layouts of the SparK member loop, measured in sm_90 machine
code): the scores of layouts C, W (today's layout, restructured), M (signs in channel positions), T (M's bytes as
tensor-core tiles), P (those tiles placed by byte permutes) and Q (P on today's bytes) under Triton's interpreter
match a float64 reference at a tiny shape (2 members of 4 query rows, and of 8 for W, P and Q; one partial 20-token
block, 4 masks with empty words), and a layout compiles for sm_90 on this CPU without spilling, its member loop
found in the SASS. The full measurement (every layout, the real kernel's baseline, GQA 4 and 8) →
``results/bench/member_layouts.json``."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("member_layouts", ROOT / "scripts/bench/member_layouts.py")
layouts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layouts)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # √μ at μ = 0: rsqrt(0) = inf, inf · 0 …
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")   # … = nan, then selected away (numpy warns)
def test_trit_layout_scores_and_compiles():
    for rows, names in ((4, ("C", "W", "M", "T", "P", "Q")), (8, ("W", "P", "Q"))):
        for layout, (err, scale) in layouts.check(names, n_tok=20, count=2, rows=rows).items():
            assert err < 1e-5 * scale, (rows, layout, err, scale)
    report = layouts.measure("A", 90)  # compiled in a child process without the interpreter
    assert report["spill_bytes"] == 0, report
    assert 0 < report["member_instructions"] < 400, report
