"""Haystack text for RULER's essay-type needle tasks.

RULER uses Paul Graham's essays. Offline, the fallback corpus is the prose of the Python standard library's
``pydoc_data.topics`` (the language reference topics), available on every CPython install; samples record which
corpus was used in ``meta["haystack"]``.

Sentences are split with a punctuation regex instead of NLTK's punkt model (which needs a download); for prose
like this both split at ``. ``/``! ``/``? `` boundaries.
"""

from __future__ import annotations

import re
from functools import lru_cache

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The essay corpus as whitespace-separated words (``re.sub(r'\\s+', ' ', text).split(' ')`` as RULER)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[key] for key in sorted(topics))
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


ESSAY_CORPUS = "pydoc_data.topics"


def split_sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text.strip()) if s]
