"""Haystack text for RULER's essay-type needle tasks.

RULER uses Paul Graham's essays: pass RULER's ``PaulGrahamEssays.json`` (``{"text": ...}``, written by RULER's
``download_paulgraham_essay.py``) or any plain-text file as ``ruler.essay_file``. Without one, the corpus is the
prose of the Python standard library's ``pydoc_data.topics`` (the language reference topics), available offline on
every CPython install; samples record which corpus was used in ``meta["haystack"]``.

Sentences are split with a punctuation regex instead of NLTK's punkt model (which needs a download); for prose
like this both split at ``. ``/``! ``/``? `` boundaries.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


ESSAY_CORPUS = "pydoc_data.topics"


@lru_cache(maxsize=4)
def essay_words(path: str | None = None) -> tuple[str, ...]:
    """The essay corpus as whitespace-separated words (``re.sub(r'\\s+', ' ', text).split(' ')`` as RULER)."""
    if path is None:
        from pydoc_data.topics import topics

        text = " ".join(topics[key] for key in sorted(topics))
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"ruler.essay_file: {path} does not exist")
        raw = file.read_text(encoding="utf-8")
        text = json.loads(raw)["text"] if file.suffix == ".json" else raw
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


def corpus_name(path: str | None) -> str:
    return ESSAY_CORPUS if path is None else Path(path).name


def split_sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text.strip()) if s]
