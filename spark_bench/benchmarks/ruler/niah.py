"""RULER needle-in-a-haystack tasks (``scripts/data/synthetic/niah.py`` and ``synthetic.yaml`` of RULER).

Each task fixes the haystack type (``repeat`` noise sentences, ``essay`` prose, or ``needle`` distractor
needles), the key/value types (``words`` adjective-noun pairs from wonderwords' lists, 7-digit ``numbers``,
``uuids``) and the needle counts. Needles read ``One of the special magic {type} for {key} is: {value}.``; essay
needles go between sentences at depths drawn from 40 evenly spaced percentages, the others at random sentence
slots. The haystack is grown in RULER's increments until the prompt plus the tokens to generate reaches the target
length (measured with the model's own tokenizer and chat template). Samples are deterministic given the seed.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from transformers import PreTrainedTokenizerBase

from spark_bench.benchmarks.base import Sample, encode_prompt, question_start
from spark_bench.benchmarks.ruler.fit import largest_fitting, shrink_to_fit, too_short
from spark_bench.benchmarks.ruler.haystack import NOISE, corpus_name, essay_words, split_sentences

TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
TOKENS_TO_GENERATE = 128
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]


@dataclass(frozen=True)
class NiahTask:
    haystack: str
    key_type: str = "words"
    value_type: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


NIAH_TASKS = {
    "niah_single_1": NiahTask("repeat"),
    "niah_single_2": NiahTask("essay"),
    "niah_single_3": NiahTask("essay", value_type="uuids"),
    "niah_multikey_1": NiahTask("essay", num_keys=4),
    "niah_multikey_2": NiahTask("needle"),
    "niah_multikey_3": NiahTask("needle", key_type="uuids", value_type="uuids"),
    "niah_multivalue": NiahTask("essay", num_values=4),
    "niah_multiquery": NiahTask("essay", num_queries=4),
}


@lru_cache(maxsize=1)
def _word_lists() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """wonderwords' adjective and noun lists (RULER's key vocabulary is every ``adjective-noun`` pair)."""
    from wonderwords.random_word import _get_words_from_text_file

    return (tuple(sorted(set(_get_words_from_text_file("adjectivelist.txt")))),
            tuple(sorted(set(_get_words_from_text_file("nounlist.txt")))))


def _random_item(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":  # uniform over adjective-noun pairs, without materialising the ~9M-pair list
        adjs, nouns = _word_lists()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _texts(task: NiahTask, num_haystack: int, rng: random.Random, essay_file: str | None = None,
           questions: int = 1) -> list[tuple[str, int, str, list[str]]]:
    """(user text, where its question starts, answer prefix, answers) of each of ``questions`` questions asked of
    one haystack of ``num_haystack`` units: each question asks for ``num_queries`` keys none of the others asks for
    (the haystack holds needles for at least that many keys; one question draws exactly as RULER does)."""
    num_keys = max(task.num_keys, task.num_queries * questions)
    keys, values, needles = [], [], []
    for _ in range(num_keys):
        keys.append(_random_item(task.key_type, rng))
        values.append([_random_item(task.value_type, rng) for _ in range(task.num_values)])
        needles += [NEEDLE.format(type_needle_v=task.value_type, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)

    if task.haystack == "essay":
        words = essay_words(essay_file)  # RULER repeats the essays when more words are needed
        words = words * (-(-num_haystack // len(words))) if num_haystack > len(words) else words
        sentences = split_sentences(" ".join(words[:num_haystack]))
        cuts = [0] + sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
        cuts.append(len(sentences))
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    else:
        if task.haystack == "repeat":
            sentences = [NOISE] * num_haystack
        else:
            sentences = [NEEDLE.format(type_needle_v=task.value_type, key=_random_item(task.key_type, rng),
                                       value=_random_item(task.value_type, rng)) for _ in range(num_haystack)]
        for index, needle in zip(sorted(rng.sample(range(num_haystack), len(needles)), reverse=True), needles):
            sentences.insert(index, needle)
        context = "\n".join(sentences)

    drawn = rng.sample(range(num_keys), task.num_queries * questions)
    template, prefix, type_v = TEMPLATE, ANSWER_PREFIX, task.value_type
    if task.num_queries * task.num_values == 1:  # RULER's singular rewrite
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        type_v = type_v[:-1]
    out = []
    for k in range(questions):
        chosen = drawn[k * task.num_queries:(k + 1) * task.num_queries]
        queries = [keys[i] for i in chosen]
        answers = [v for i in chosen for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        text = template.format(type_needle_v=type_v, context=context, query=query)
        out.append((text, question_start(text, context), prefix.format(type_needle_v=type_v, query=query), answers))
    return out


def _increment(task: NiahTask, length: int) -> int:
    if task.haystack == "essay":
        return 500
    return 25 if length >= 4096 else 5


def generate_niah(name: str, tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int,
                  chat_template: bool | str = True, max_new_tokens: int | None = None,
                  essay_file: str | None = None, questions: int = 1) -> list[Sample]:
    """``num_samples`` samples of task ``name`` whose prompt + generation budget fits in ``length`` tokens.
    ``questions`` > 1: that many questions of each haystack (different needles), one sample per question, ids
    ``<task>-<index>/q<k>``, each prompt the same context ids followed by its own question
    (``meta.context``, ``meta.question``); every question's prompt fits the length."""
    task = NIAH_TASKS[name]
    step = _increment(task, length)
    budget = length - TOKENS_TO_GENERATE

    def encode(num_haystack: int, rng: random.Random):
        """The longest question's prompt (the one the length must fit) and every question's (prompt, answers)."""
        asked = [(encode_prompt(tokenizer, text, prefix, chat_template, question), answers)
                 for text, question, prefix, answers in _texts(task, num_haystack, rng, essay_file, questions)]
        return max((p for p, _ in asked), key=len), asked

    def fits(count: int) -> bool:
        return len(encode(count, random.Random(f"{seed}-{name}-probe"))[0]) <= budget

    # RULER's search: the largest raw haystack size whose probe prompt fits; samples that come out longer
    # (their needles differ) shrink by one increment at a time
    limit = 1 << 24  # words (essay, repeated as needed) or sentences: the prompt budget stops the search first
    # sentence haystacks need a slot per needle (one for RULER's own tasks; more when several questions are asked)
    least = 1 if task.haystack == "essay" else max(task.num_keys, task.num_queries * questions) * task.num_values
    found = largest_fitting(fits, limit, least)
    if found < least:
        smallest = len(encode(least, random.Random(f"{seed}-{name}-probe"))[0])
        raise too_short(name, length, smallest, TOKENS_TO_GENERATE)

    samples = []
    for index in range(num_samples):
        _, asked, units = shrink_to_fit(lambda n: encode(n, random.Random(f"{seed}-{name}-{index}")), found,
                                        step, budget, least)
        meta = {"haystack": corpus_name(essay_file) if task.haystack == "essay" else task.haystack,
                "haystack_units": units}
        heads = {tuple(p.ids[:p.context_end]) for p, _ in asked}
        if len(heads) > 1:  # the tokenizer merged across the context's end differently per question
            raise ValueError(f"ruler.questions={questions}: {name}'s questions do not share their context's tokens "
                             f"with this tokenizer (a merge across the context's end); set ruler.questions=1")
        for k, (prompt, answers) in enumerate(asked, 1):
            many = {"context": f"{name}-{index}", "question": k} if questions > 1 else {}
            samples.append(Sample(task=name, id=f"{name}-{index}" + (f"/q{k}" if many else ""),
                                  input_ids=tuple(prompt.ids), answers=tuple(answers),
                                  max_new_tokens=max_new_tokens or TOKENS_TO_GENERATE, metric="string_match_all",
                                  meta={**meta, **many}, context_end=prompt.context_end,
                                  question_end=prompt.question_end))
    return samples
