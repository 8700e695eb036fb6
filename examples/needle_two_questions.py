"""Compress a RULER needle prompt once with SnapKV+SparK (λ = 0.8) and ask two questions over it, offline, on the
embedded SmolLM2-135M-Instruct; print the answers and the bytes held against a dense cache (the full cache and
SparK alone beside it, compressed from the same prefill).

    python examples/needle_two_questions.py [--length 2048] [--ratio 0.8] [--budget 0.2]
"""

import argparse
import re

import spark_bench
from spark_bench.benchmarks.ruler import load_ruler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048, help="prompt + answer tokens (RULER's length)")
    parser.add_argument("--ratio", type=float, default=0.8, help="key-channel pruning ratio λ")
    parser.add_argument("--budget", type=float, default=0.2, help="SnapKV budget (fraction of the prompt)")
    args = parser.parse_args()
    run(spark_bench.load("smollm2-135m", device="cpu"), args.length, args.ratio, args.budget)


def run(lm, length: int = 2048, ratio: float = 0.8, budget: float = 0.2) -> None:
    """``lm``: a loaded model (``spark_bench.load(...)``); the prompt is RULER's niah_multikey_1 at ``length``."""
    sample = load_ruler(["niah_multikey_1"], length, 1, seed=0, lm=lm)[0]  # four needles, one asked
    ids = list(sample.input_ids)
    context, question = ids[:sample.context_end], ids[sample.context_end:]  # question + end of turn + answer prefix
    needles = dict(re.findall(r"special magic numbers? for ([\w-]+) is: (\d+)", lm.tokenizer.decode(context)))
    asked = next(key for key in needles if key in lm.tokenizer.decode(question))
    other = next(key for key in needles if key != asked)
    second = lm.tokenizer(lm.tokenizer.decode(question).replace(asked, other), add_special_tokens=False).input_ids

    configs = [spark_bench.method("full"),  # protocol=official, as on the command line
               spark_bench.method("spark", ratio=ratio),  # channels pruned, every token kept
               spark_bench.method("snapkv+spark", ratio=ratio, budget=budget)]
    contexts = spark_bench.compress(lm.model, context, configs)  # one prefill, then each config's compact stores
    print(f"prompt: {len(context)} context tokens; questions of {len(question)} and {len(second)} tokens run "
          "through the compressed context")
    for compressed in contexts:
        answers = spark_bench.ask(lm.model, compressed, [question, second], tokenizer=lm.tokenizer,
                                  max_new_tokens=16, eos_token_id=sorted(lm.stop_token_ids))
        print(f"\n{compressed.label}: {compressed.nbytes:,} KV bytes held vs {compressed.dense_nbytes:,} for a dense "
              f"cache ({compressed.nbytes / compressed.dense_nbytes:.3f}x; achieved key ratio "
              f"{compressed.key_ratio:.3f})")
        for key, answer in zip((asked, other), answers):
            print(f"  magic number for {key}? expected {needles[key]}, answer: {answer.strip()!r}")


if __name__ == "__main__":
    main()
