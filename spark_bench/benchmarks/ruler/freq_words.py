"""RULER ``fwe`` (frequent words extraction, ``scripts/data/synthetic/freq_words_extraction.py``), Zipf α = 2.

A vocabulary of random 6-letter "coded" words (size = (length − 50) // 50) ranked 1…V; rank 1 is replaced by the
noise token ``...``. Word of rank k appears ``int(N · k^−α / ζ(α))`` times, shuffled; the answer is ranks 2–4. N
starts at ``max_len // 6`` and grows by ``max_len // 32`` until the prompt no longer fits, then steps back once.
"""

from __future__ import annotations

import math
import random
import string

from transformers import PreTrainedTokenizerBase

from spark_bench.benchmarks.base import encode_prompt
from spark_bench.benchmarks.ruler.fit import make_sample

TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the "
            "dots '....'. What are the three most frequently appeared words in the above coded text?")
ANSWER_PREFIX = (" Answer: According to the coded text above, the three most frequently appeared words are:")
TOKENS_TO_GENERATE = 50
ALPHA = 2.0
WORD_LENGTH = 6


def zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann ζ(α) for α > 1: partial sum plus the Euler–Maclaurin tail (error < 1e-12 for α = 2)."""
    partial = sum(k ** -alpha for k in range(1, terms + 1))
    return partial + terms ** (1 - alpha) / (alpha - 1) - terms ** -alpha / 2


def _vocab(size: int, rng: random.Random, seed: int) -> list[str]:
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=WORD_LENGTH)))
    ordered = sorted(vocab)
    random.Random(seed).shuffle(ordered)
    ordered[0] = "..."  # the top-ranked word is noise
    return ordered


def _text(vocab: list[str], num_words: int, seed: int) -> tuple[str, list[str]]:
    z = zeta(ALPHA)
    words = [w for k, w in enumerate(vocab, 1) for _ in range(int(num_words * k ** -ALPHA / z))]
    random.Random(seed).shuffle(words)
    return TEMPLATE.format(context=" ".join(words)), vocab[1:4]


def generate_fwe(tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int,
                 chat_template: bool | str = True, max_new_tokens: int | None = None):
    max_len = length - TOKENS_TO_GENERATE
    vocab_size = max(max_len // 50, 4)
    step = max(max_len // 32, 1)

    def encode(vocab, n):
        text, answer = _text(vocab, n, seed)
        question = text.rindex("\nQuestion:") + 1
        return encode_prompt(tokenizer, text, ANSWER_PREFIX, chat_template, question), answer

    probe = _vocab(vocab_size, random.Random(f"{seed}-fwe-probe"), seed)
    num_words = max_len // WORD_LENGTH
    while len(encode(probe, num_words)[0]) < max_len:
        num_words += step
    num_words -= step
    samples = []
    for index in range(num_samples):
        vocab = _vocab(vocab_size, random.Random(f"{seed}-fwe-{index}"), seed)
        n = num_words
        ids, answer = encode(vocab, n)
        while len(ids) > max_len and n > step:
            n -= step
            ids, answer = encode(vocab, n)
        samples.append(make_sample("fwe", index, ids, answer, TOKENS_TO_GENERATE, max_new_tokens,
                                   "string_match_all", haystack="coded words", num_words=n))
    return samples
