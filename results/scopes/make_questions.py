"""Builds results/scopes/questions.jsonl: two contexts, three questions each, in the data file's `questions`
format (token ids of the embedded SmolLM2's tokenizer and chat template)."""
import json
import random
import sys

import spark_bench

out = sys.argv[1]
lm = spark_bench.load("smollm2-135m")
tok = lm.tokenizer
records = []
for c, (thing, unit) in enumerate((("room", "boxes"), ("locker", "keys"))):
    rng = random.Random(c)
    counts = {i: rng.randint(10, 99) for i in range(1, 41)}
    context = " ".join(f"The {thing} number {i} holds {n} {unit}." for i, n in counts.items())
    asked = rng.sample(sorted(counts), 3)
    prompts = [spark_bench.prompt(tok, context, f"How many {unit} does {thing} number {i} hold?",
                                  f" {thing.capitalize()} number {i} holds") for i in asked]
    heads = {tuple(p.ids[:p.context_end]) for p in prompts}
    assert len(heads) == 1, "the questions must share the context's ids"
    end = prompts[0].context_end
    records.append({"task": f"count_{unit}", "id": f"{thing}s", "input_ids": prompts[0].ids[:end],
                    "max_new_tokens": 8, "metric": "string_match_all",
                    "questions": [{"input_ids": p.ids[end:], "answers": [str(counts[i])],
                                   "question_end": p.question_end - end} for p, i in zip(prompts, asked)]})
with open(out, "w") as f:
    for r in records:
        f.write(json.dumps(r) + "\n")
print(out, [len(r["input_ids"]) for r in records])
