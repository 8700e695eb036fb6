"""The paper's table layouts: column order, column names and category groups (Tables 1–5, Appendix)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    name: str
    columns: tuple[str, ...]                       # data columns in paper order (Avg added after them)
    groups: tuple[tuple[str, int], ...] = ()       # (category header, number of columns) spans
    task_names: dict | None = None                 # our task name → paper column name
    average: bool = True


LONGBENCH = Layout(
    "longbench",
    ("NrtvQA", "Qasper", "MF-en", "HotpotQA", "2WikiMQA", "Musique", "GovReport", "QMSum", "MultiNews", "TREC",
     "TriviaQA", "SAMSum", "PCount", "PRe", "Lcc", "RB-P"),
    (("Single-Doc QA", 3), ("Multi-Doc QA", 3), ("Summarization", 3), ("Few-shot", 3), ("Synthetic", 2),
     ("Code", 2)),
    {"narrativeqa": "NrtvQA", "qasper": "Qasper", "multifieldqa_en": "MF-en", "hotpotqa": "HotpotQA",
     "2wikimqa": "2WikiMQA", "musique": "Musique", "gov_report": "GovReport", "qmsum": "QMSum",
     "multi_news": "MultiNews", "trec": "TREC", "triviaqa": "TriviaQA", "samsum": "SAMSum",
     "passage_count": "PCount", "passage_retrieval_en": "PRe", "lcc": "Lcc", "repobench-p": "RB-P"},
)
RULER = Layout(
    "ruler",
    ("Niah1", "Niah2", "Niah3", "MKey1", "MKey2", "MKey3", "MValue", "MQuery", "VT", "CWE", "FWE", "QA1", "QA2"),
    (),
    {"niah_single_1": "Niah1", "niah_single_2": "Niah2", "niah_single_3": "Niah3", "niah_multikey_1": "MKey1",
     "niah_multikey_2": "MKey2", "niah_multikey_3": "MKey3", "niah_multivalue": "MValue",
     "niah_multiquery": "MQuery", "vt": "VT", "cwe": "CWE", "fwe": "FWE", "qa_1": "QA1", "qa_2": "QA2"},
)
BUDGETS = ("KV-size 128", "KV-size 512", "KV-size 1024", "KV-size 2048")
# ablations (Tables 4–5): one row per setting, one column per KV budget holding the task average
DIST = Layout("dist", BUDGETS, average=False)
VARIANTS = Layout("variants", (*BUDGETS, "Overall ratio"), average=False)
# LongBench-E: each row's score per length bucket of the records (LongBench's `scorer_e`), and over all records
LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")
LONGBENCH_E = Layout("longbench_e", (*LENGTH_BUCKETS, "All"), average=False, task_names=LONGBENCH.task_names)
LAYOUTS = {"longbench": LONGBENCH, "longbench_e": LONGBENCH_E, "ruler": RULER, "dist": DIST, "variants": VARIANTS}


def length_bucket(length) -> str:
    """LongBench's bucket of a record by its ``length`` field (words): < 4000, < 8000, the rest."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
