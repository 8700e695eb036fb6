"""RULER ``qa_1`` (SQuAD v2) and ``qa_2`` (HotpotQA), ``scripts/data/synthetic/qa.py``.

The question's gold documents are mixed with distractor documents (first the other paragraphs of the same
article for SQuAD, then random ones) as ``Document i:\\n…`` blocks, shuffled by the seed, as many as fit (a
sample that comes out too long drops RULER's increment of 10 documents at a time, single documents below 10);
scored with ``string_match_part``. Data: the official files RULER downloads (``ruler.squad_file``: SQuAD v2
``dev-v2.0.json``; ``ruler.hotpotqa_file``: ``hotpot_dev_distractor_v1.json``), or the same sets from the hub
(``rajpurkar/squad_v2``, ``hotpotqa/hotpot_qa`` distractor: a local copy in the hub cache, else a download) when
no file is given. With neither, the run stops before the model loads with one line naming ``ruler.<set>_file``
(:func:`hub_source`), rather than reporting an average over fewer tasks than asked for.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from spark_bench.benchmarks.base import encode_prompt
from spark_bench.benchmarks.ruler.fit import largest_fitting, make_sample, too_short

TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
            "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
            "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}")
ANSWER_PREFIX = " Answer:"
TOKENS_TO_GENERATE = 32
DOCS_STEP = 10  # RULER qa.py: documents dropped per retry when a sample is too long
DOCUMENT = "Document {i}:\n{document}"


HUB_SETS = {"squad": ("rajpurkar/squad_v2", None), "hotpotqa": ("hotpotqa/hotpot_qa", "distractor")}
OFFICIAL_FILES = {"squad": "dev-v2.0.json", "hotpotqa": "hotpot_dev_distractor_v1.json"}


def hub_source(dataset: str) -> str:
    """Where the hub copy of ``dataset`` is read from (the hub cache's snapshot directory, or the hub id); raises
    :class:`~spark_bench.hub.HubUnavailable` naming ``ruler.<dataset>_file`` when neither is usable."""
    from spark_bench import hub

    repo = HUB_SETS[dataset][0]
    return hub.resolve(repo, "dataset", f"RULER {dataset} data (qa_{1 if dataset == 'squad' else 2})",
                       f"set ruler.{dataset}_file=/path/to/{OFFICIAL_FILES[dataset]} (the file RULER's "
                       f"download_qa_dataset.sh fetches), or download the set once with "
                       f"`hf download {repo} --repo-type dataset`, or drop the task from benchmark.tasks")


def parse_squad(data: dict) -> tuple[list[dict], list[str]]:
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        article = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa.get("is_impossible", False):
                    qas.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                "context": [index[p["context"]]],
                                "more_context": [i for i in article if i != index[p["context"]]]})
    return qas, docs


def parse_hotpotqa(data: list) -> tuple[list[dict], list[str]]:
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [{"query": d["question"], "outputs": [d["answer"]],
            "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]]} for d in data]
    return qas, docs


def _from_hub(dataset: str):
    from datasets import load_dataset

    location, config = hub_source(dataset), HUB_SETS[dataset][1]
    if dataset == "squad":
        rows = load_dataset(location, split="validation")
        articles: dict[str, dict] = {}
        for r in rows:
            art = articles.setdefault(r["title"], {"paragraphs": {}})
            para = art["paragraphs"].setdefault(r["context"], {"context": r["context"], "qas": []})
            para["qas"].append({"question": r["question"], "answers": [{"text": t} for t in r["answers"]["text"]],
                                "is_impossible": not r["answers"]["text"]})
        return parse_squad({"data": [{"paragraphs": list(a["paragraphs"].values())} for a in articles.values()]})
    rows = load_dataset(location, config, split="validation")
    return parse_hotpotqa([{"question": r["question"], "answer": r["answer"],
                            "context": list(zip(r["context"]["title"], r["context"]["sentences"]))} for r in rows])


def load_qa(dataset: str, path: str | None):
    """``(qas, docs)`` from the official file at ``path`` or, without one, from the hub copy (:func:`hub_source`)."""
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"ruler.{dataset}_file: {path} does not exist")
        data = json.loads(file.read_text(encoding="utf-8"))
        return parse_squad(data) if dataset == "squad" else parse_hotpotqa(data)
    return _from_hub(dataset)


def _text(qas, docs, index: int, num_docs: int, rng: random.Random, seed: int) -> tuple[str, list[str]]:
    qa = qas[index % len(qas)]
    gold, more = qa["context"], qa.get("more_context", [])
    if num_docs < len(docs):
        if num_docs - len(gold) > len(more):
            others = [i for i in range(len(docs)) if i not in set(gold + more)]
            chosen = gold + more + rng.sample(others, max(0, num_docs - len(gold) - len(more)))
        else:
            chosen = gold + rng.sample(more, max(0, num_docs - len(gold)))
        documents = [docs[i] for i in chosen]
    else:
        documents = (docs * (num_docs // len(docs) + 1))[:num_docs]
    random.Random(seed).shuffle(documents)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(documents))
    return TEMPLATE.format(context=context, query=qa["query"]), qa["outputs"]


def generate_qa(task: str, dataset: str, source, tokenizer: PreTrainedTokenizerBase, length: int,
                num_samples: int, seed: int, chat_template: bool | str = True, max_new_tokens: int | None = None):
    qas, docs = source
    budget = length - TOKENS_TO_GENERATE

    def encode(index: int, num_docs: int):
        text, answers = _text(qas, docs, index, num_docs, random.Random(f"{seed}-{task}-{index}"), seed)
        question = text.rindex("\n\nAnswer the question based on the given documents.") + 2
        return encode_prompt(tokenizer, text, ANSWER_PREFIX, chat_template, question), answers

    num_docs = largest_fitting(lambda n: len(encode(0, n)[0]) <= budget, 4 * len(docs))
    if num_docs == 0:
        raise too_short(task, length, len(encode(0, 1)[0]), TOKENS_TO_GENERATE)
    samples = []
    for index in range(num_samples):
        used = num_docs
        ids, answers = encode(index, used)
        while len(ids) > budget and used > 1:
            used -= DOCS_STEP if used > DOCS_STEP else 1
            ids, answers = encode(index, used)
        samples.append(make_sample(task, index, ids, answers, TOKENS_TO_GENERATE, max_new_tokens,
                                   "string_match_part", haystack=dataset, num_docs=used))
    return samples
