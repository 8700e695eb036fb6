"""RULER ``vt`` (variable tracking, ``scripts/data/synthetic/variable_tracking.py``): 1 chain of 4 hops.

A chain ``VAR A = 12345, VAR B = VAR A, …`` (5-letter upper-case names, a random 5-digit value) is hidden at random
lines of the noise haystack; the model lists every variable holding the value. As in RULER, a one-shot example
built the same way (3-letter names, value 12345, ≤ 500 tokens) is prepended to every sample with a blank line
between, its names and value re-drawn per sample (RULER's ``randomize_icl``); the largest fitting number of noise
sentences is searched, and a sample that comes out too long shrinks by RULER's increment (10 noise sentences, 5
below 4K tokens).
"""

from __future__ import annotations

import random
import string

from transformers import PreTrainedTokenizerBase

from spark_bench.benchmarks.base import encode_prompt
from spark_bench.benchmarks.ruler.fit import largest_fitting, make_sample, shrink_to_fit, too_short
from spark_bench.benchmarks.ruler.haystack import NOISE

TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
            "Question: Find all variables that are assigned the value {query} in the text above.")
ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                 "are assigned the value {query}, they are: ")
TOKENS_TO_GENERATE = 30
NUM_CHAINS, NUM_HOPS = 1, 4


def _chains(rng: random.Random, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
    k = 3 if is_icl else 5
    names: list[str] = []
    while len(set(names)) < NUM_CHAINS * (NUM_HOPS + 1):
        names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
    names = list(dict.fromkeys(names))
    variables, chains = [], []
    for c in range(NUM_CHAINS):
        v = names[c * (NUM_HOPS + 1):(c + 1) * (NUM_HOPS + 1)]
        value = "12345" if is_icl else str(rng.randint(10000, 99998))
        chain = [f"VAR {v[0]} = {value}"] + [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(NUM_HOPS)]
        variables.append(v)
        chains.append(chain)
    return variables, chains


def _text(num_noises: int, rng: random.Random, is_icl: bool) -> tuple[str, str, list[str]]:
    variables, chains = _chains(rng, is_icl)
    value = chains[0][0].split("=")[-1].strip()
    sentences = [NOISE] * num_noises
    for chain in chains:  # each hop at a random line, in chain order
        positions = sorted(rng.sample(range(len(sentences)), len(chain)))
        for offset, (pos, line) in enumerate(zip(positions, chain)):
            sentences.insert(pos + offset, line)
    context = "\n".join(sentences).replace(". \n", ".\n")
    num_v = NUM_HOPS + 1
    return (TEMPLATE.format(context=context, query=value),
            ANSWER_PREFIX.format(num_v=num_v, query=value), variables[0])


def _icl_example(tokenizer: PreTrainedTokenizerBase, rng: random.Random) -> str:
    """RULER's one-shot example: ≤ 500 tokens, its answer appended, root value ``12345`` (each sample re-draws the
    names and the value, :func:`randomize_icl`)."""
    least = NUM_HOPS + 1

    def fits(count: int) -> bool:
        text, prefix, _ = _text(count, random.Random(rng.random()), True)
        return len(tokenizer(text + prefix)["input_ids"]) <= 500

    text, prefix, answer = _text(max(largest_fitting(fits, 1000 + least - 1, least), least), rng, True)
    return text + prefix + " " + " ".join(answer) + "\n"


def randomize_icl(example: str, rng: random.Random) -> str:
    """RULER's ``randomize_icl``, once per sample: the answer's variable names re-drawn, the root value replaced."""
    for name in example.strip().split()[-NUM_HOPS - 1:]:
        example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    return example.replace("12345", str(rng.randint(10000, 99998)))


def generate_vt(tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int,
                chat_template: bool | str = True, max_new_tokens: int | None = None):
    step = 10 if length >= 4096 else 5
    budget = length - TOKENS_TO_GENERATE
    icl = _icl_example(tokenizer, random.Random(f"{seed}-vt-icl"))

    def encode(count: int, rng: random.Random):
        text, prefix, answer = _text(count, rng, False)
        shot = randomize_icl(icl, rng) + "\n"  # RULER: example + "\n" + input, the example ending in a newline
        question = len(shot) + text.rindex("\nQuestion:") + 1
        return encode_prompt(tokenizer, shot + text, prefix, chat_template, question), answer

    least = NUM_HOPS + 1  # the chain needs that many noise lines to sit between
    units = largest_fitting(lambda n: len(encode(n, random.Random(f"{seed}-vt-probe"))[0]) <= budget, least=least)
    if units < least:
        raise too_short("vt", length, len(encode(least, random.Random(f"{seed}-vt-probe"))[0]), TOKENS_TO_GENERATE)
    samples = []
    for index in range(num_samples):
        ids, answer, used = shrink_to_fit(lambda n: encode(n, random.Random(f"{seed}-vt-{index}")), units, step,
                                          budget, least=least)
        samples.append(make_sample("vt", index, ids, answer, TOKENS_TO_GENERATE, max_new_tokens,
                                   "string_match_all", haystack="noise", haystack_units=used))
    return samples

