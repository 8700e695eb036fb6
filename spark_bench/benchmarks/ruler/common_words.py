"""RULER ``cwe`` (common words extraction, ``scripts/data/synthetic/common_words_extraction.py``).

A numbered list of words ``1. w 2. w …`` where 10 common words appear ``freq_cw`` = 30 times and the others
``freq_ucw`` = 3 times (6 and 1 below 4K tokens); the model names the 10 common words. Vocabulary: wonderwords'
nouns, adjectives and verbs (sorted, deduplicated, shuffled by the seed), as RULER. One few-shot example (40 words,
10/3 repeats; 20 words, 3/1 below 4K) precedes the question. The largest fitting word count is searched; a sample
that comes out too long drops 10 words at a time.
"""

from __future__ import annotations

import random
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from spark_bench.benchmarks.base import encode_prompt
from spark_bench.benchmarks.ruler.fit import largest_fitting, make_sample, shrink_to_fit, too_short

TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
            "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
TOKENS_TO_GENERATE = 120
NUM_CW = 10


@lru_cache(maxsize=4)
def vocabulary(seed: int) -> tuple[str, ...]:
    from wonderwords.random_word import _get_words_from_text_file

    words = sorted(set(_get_words_from_text_file("nounlist.txt") + _get_words_from_text_file("adjectivelist.txt")
                       + _get_words_from_text_file("verblist.txt")))
    random.Random(seed).shuffle(words)
    return tuple(words)


def _example(words, num_words: int, common: int, uncommon: int, rng: random.Random, seed: int):
    chosen = rng.sample(words, num_words)
    common_words = chosen[:NUM_CW]
    listed = common_words * common + chosen[NUM_CW:] * uncommon
    random.Random(seed).shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common_words


def _text(num_words: int, length: int, seed: int, rng: random.Random) -> tuple[str, list[str]]:
    words = vocabulary(seed)
    short = length < 4096
    shot_ctx, shot_answer = _example(words, 20 if short else 40, 3 if short else 10, 1 if short else 3, rng, seed)
    context, answer = _example(words, min(num_words, len(words)), 6 if short else 30, 1 if short else 3, rng, seed)
    shot = TEMPLATE.format(context=shot_ctx) + ANSWER_PREFIX + " " + " ".join(
        f"{i + 1}. {w}" for i, w in enumerate(shot_answer))
    return shot + "\n" + TEMPLATE.format(context=context), answer


def generate_cwe(tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int,
                 chat_template: bool | str = True, max_new_tokens: int | None = None):
    step = 10
    budget = length - TOKENS_TO_GENERATE
    limit = len(vocabulary(seed))

    def encode(count: int, rng: random.Random):
        text, answer = _text(count, length, seed, rng)
        question = text.rindex("\nQuestion:") + 1
        return encode_prompt(tokenizer, text, ANSWER_PREFIX, chat_template, question), answer

    units = largest_fitting(lambda n: len(encode(n, random.Random(f"{seed}-cwe-probe"))[0]) <= budget, limit,
                            least=NUM_CW)
    if units < NUM_CW:
        raise too_short("cwe", length, len(encode(NUM_CW, random.Random(f"{seed}-cwe-probe"))[0]), TOKENS_TO_GENERATE)
    samples = []
    for index in range(num_samples):
        ids, answer, used = shrink_to_fit(lambda n: encode(n, random.Random(f"{seed}-cwe-{index}")), units, step,
                                          budget, least=NUM_CW)
        samples.append(make_sample("cwe", index, ids, answer, TOKENS_TO_GENERATE, max_new_tokens,
                                   "string_match_all", haystack="wonderwords", num_words=used))
    return samples
