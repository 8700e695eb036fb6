"""LongBench v1 metrics, number for number with the official ``metrics.py`` / ``eval.py`` (THUDM/LongBench).

Quirks kept on purpose, because the published numbers contain them:

* ``classification_score``: the official code tests ``em_match_list != 0`` (a list against 0, always true), so the
  difflib fallback never runs: a prediction naming no class scores 0. Matched class names contained in the ground
  truth are removed while iterating the same list, which skips the element after each removal.
* ``rouge_score``: ROUGE-L F from the ``rouge`` package (``Rouge().get_scores(..., avg=True)``), 0 when it raises
  (e.g. an empty prediction). ``backend="rouge_score"`` uses Google's ``rouge-score`` instead (not the default).
* ``code_sim_score``: the first line of the prediction (leading newlines stripped) that contains none of
  `` ` ``, ``#``, ``//``, compared with ``fuzzywuzzy.fuzz.ratio``. fuzzywuzzy's ratio depends on its backend:
  with ``python-Levenshtein`` installed it uses Levenshtein's ratio, without it ``difflib.SequenceMatcher``. The
  official environment does not install python-Levenshtein, so neither does spark-bench (``FUZZ_BACKEND``, tested).
* ``count_score`` / ``retrieval_score``: the share of numbers in the prediction equal to the answer.
"""

from __future__ import annotations

import re
import string
import warnings
from collections import Counter

with warnings.catch_warnings():  # "Using slow pure-python SequenceMatcher": that backend is the official one
    warnings.simplefilter("ignore")
    from fuzzywuzzy import fuzz

FUZZ_BACKEND = fuzz.SequenceMatcher.__module__  # "difflib" without python-Levenshtein (official), else "Levenshtein…"


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD normalisation)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _token_f1(prediction: list[str], ground_truth: list[str]) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(prediction), num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def rouge_score(prediction: str, ground_truth: str, backend: str = "rouge", **_) -> float:
    if backend == "rouge_score":
        from rouge_score import rouge_scorer

        return rouge_scorer.RougeScorer(["rougeL"]).score(ground_truth, prediction)["rougeL"].fmeasure
    from rouge import Rouge

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # the official scorer's bare except: empty hypothesis, ...
        return 0.0
    return scores["rouge-l"]["f"]


def classification_score(prediction: str, ground_truth: str, all_classes=(), **_) -> float:
    matched = _official_prune([name for name in all_classes if name in prediction], ground_truth)
    return 1.0 / len(matched) if ground_truth in matched else 0.0


def _official_prune(matched: list[str], ground_truth: str) -> list[str]:
    """Replays the official loop that removes from the list it iterates (so it skips the next element)."""
    out = list(matched)
    i = 0
    while i < len(out):
        term = out[i]
        if term in ground_truth and term != ground_truth:
            out.remove(term)  # removes the first occurrence, the iterator index still advances
        i += 1
    return out


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    target = re.findall(r"Paragraph (\d+)", ground_truth)[0]
    numbers = re.findall(r"\d+", prediction)
    return 0.0 if not numbers else sum(n == target for n in numbers) / len(numbers)


def count_score(prediction: str, ground_truth: str, **_) -> float:
    numbers = re.findall(r"\d+", prediction)
    return 0.0 if not numbers else sum(n == str(ground_truth) for n in numbers) / len(numbers)


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz.ratio(line, ground_truth) / 100


ANSWER_METRICS = {"qa_f1": qa_f1_score, "rouge": rouge_score, "classification": classification_score,
                  "retrieval": retrieval_score, "count": count_score, "code_sim": code_sim_score}


def longbench_score(metric: str, prediction: str, answers, first_line: bool = False, all_classes=(),
                    rouge_backend: str = "rouge") -> float:
    """One sample's score × 100: max over the reference answers (official ``scorer``). ``first_line`` applies the
    trec/triviaqa/samsum rule (keep the first line of the prediction after leading newlines)."""
    if first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = ANSWER_METRICS[metric]
    return 100.0 * max([fn(prediction, gt, all_classes=all_classes, backend=rouge_backend) for gt in answers],
                       default=0.0)

