"""The paper's tables, transcribed as CSV (``block,method,column,value``) and shipped inside the package
(``report/paper_tables/``), so a clone or an installed wheel can compare with the paper without the paper's sources.

``tab_main`` (Table 1, LongBench, LLaMA-3-8B), ``tab_main_ruler`` (Table 2, RULER), ``tab_ab_dist`` /
``tab_ab_var`` (Tables 4–5), ``tab_app_kv_llama3-8b`` (joint key+value pruning), ``tab_full_<model>`` and
``tab_app_full_ruler`` (the appendix's full tables).
"""

from __future__ import annotations

from pathlib import Path

PAPER_DIR = Path(__file__).resolve().parent / "paper_tables"


def paper_tables() -> list[str]:
    return sorted(p.stem for p in PAPER_DIR.glob("*.csv"))


def paper_table(name_or_path: str | Path) -> Path:
    """A paper table by name (``tab_main``, ``tab_main.csv``) or by a CSV path; a path that does not exist (e.g. a
    path into the paper's sources, absent from a fresh clone) falls back to the shipped table of that name."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = PAPER_DIR / f"{path.name.removesuffix('.csv')}.csv"
    if shipped.is_file():
        return shipped
    raise FileNotFoundError(f"paper table {str(name_or_path)!r}: not a file and not a shipped table; "
                            f"shipped: {', '.join(paper_tables())}")
