"""``scripts/bench/member_layouts.py`` (alternative key layouts of the SparK member loop, measured in sm_90 machine
code): the scores of layouts C, W (today's layout, restructured), M (signs in channel positions) and T (M's bytes as
tensor-core tiles) under Triton's interpreter match a float64 reference at a tiny shape (2 members, one partial
20-token block, 4 masks with empty words), and a layout compiles for sm_90 on this CPU without spilling, its member
loop found in the SASS. The full measurement (every layout, the real kernel's baseline) →
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
    for layout, (err, scale) in layouts.check(("C", "W", "M", "T"), n_tok=20, count=2).items():
        assert err < 1e-5 * scale, (layout, err, scale)
    report = layouts.measure("A", 90)  # compiled in a child process without the interpreter
    assert report["spill_bytes"] == 0, report
    assert 0 < report["member_instructions"] < 400, report
