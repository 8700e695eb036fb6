"""SparK in lm-evaluation-harness (the optional extra ``pip install 'spark-bench[lm-eval]'``, lm-eval 0.4.x).

``spark-bench-lm-eval`` is ``lm_eval`` with one more model type, ``spark-bench`` (lm-eval 0.4 finds models only in
its own registry, so the command registers it, then runs lm-eval's own command line)::

    .venv/bin/spark-bench-lm-eval --model spark-bench \\
        --model_args pretrained=smollm2-135m,method=snapkv+spark,ratio=0.8,budget=0.2 --tasks arc_easy

``pretrained``: a model of ``conf/model/`` (``path=`` overrides its checkpoint); the other arguments are
:func:`spark_bench.method`'s (``method`` is its name; ``protocol`` defaults to ``official``).

* ``generate_until``: each request's context (the whole prompt lm-eval builds, few-shot examples included) is
  compressed under the method, then generation runs from the compact stores (:func:`spark_bench.generate`) up to
  ``max_gen_toks`` and the ``until`` strings (cut at the first, as lm-eval's HF model does).
* ``loglikelihood``: the context is compressed, the continuation runs through the compressed cache and is scored
  (its first token from the full prefill's logits, the rest over the compact stores).
* ``loglikelihood_rolling`` (perplexity tasks) has no context to compress: refused in one line.

Requests run one at a time (a compressed context serves one prompt).
"""

from __future__ import annotations

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

import spark_bench
from spark_bench.engine.attention import compressed_attention_enabled
from spark_bench.engine.fastpaths import FastPaths

NAME = "spark-bench"


@register_model(NAME)
class SparkBenchLM(LM):
    """lm-eval's model interface over spark-bench's compressed caches (module docstring)."""

    def __init__(self, pretrained: str = "smollm2-135m", method: str = "full", protocol: str = "official",
                 device: str | None = None, path: str | None = None, dtype: str | None = None,
                 max_gen_toks: int = 256, batch_size=1, max_batch_size=None, lm=None, **options):
        """``lm``: an already loaded :func:`spark_bench.load` model (in Python, e.g. for
        ``lm_eval.simple_evaluate(model=SparkBenchLM(lm=..., method=...))``); else ``pretrained`` is loaded."""
        super().__init__()
        overrides = {k: v for k, v in (("path", path), ("dtype", dtype)) if v is not None}
        self.config = spark_bench.method(method, protocol, **options)
        self.lm = lm if lm is not None else spark_bench.load(str(pretrained), device=device or "auto", **overrides)
        self.model, self.tokenizer = self.lm.model, self.lm.tokenizer
        self.max_gen_toks = int(max_gen_toks)
        self.checks = FastPaths()  # the evaluation is one run: each fast-path variant checked once over its requests

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        answers = []
        for request in requests:
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            ids = self._ids(context)
            compressed = spark_bench.compress(self.model, ids, self.config)
            out = spark_bench.generate(self.model, compressed, max_new_tokens=max_new,
                                       eos_token_id=sorted(self.lm.stop_token_ids),
                                       stop_strings=until or None, tokenizer=self.tokenizer if until else None,
                                       do_sample=bool(kwargs.pop("do_sample", False)), checks=self.checks, **kwargs)
            text = self.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            answers.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return answers

    @torch.no_grad()
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results = []
        for request in requests:
            context, continuation = request.args
            head = self._ids(context) or [self.tokenizer.bos_token_id or self.tokenizer.eos_token_id]
            whole = self._ids(context + continuation)
            tail = whole[len(head):] if whole[:len(head)] == head else self._ids(continuation)
            if not tail:
                raise ValueError(f"loglikelihood: the continuation {continuation!r} has no tokens")
            compressed = spark_bench.compress(self.model, head, self.config)
            logits = [compressed.first_logits.float().reshape(1, -1)]
            if len(tail) > 1:
                cache = compressed.as_cache(max_new_tokens=len(tail), checks=self.checks)
                device = self.model.get_input_embeddings().weight.device
                ids = torch.tensor([tail[:-1]], device=device)
                positions = torch.arange(len(head), len(head) + len(tail) - 1, device=device)[None]
                with compressed_attention_enabled(self.model):
                    out = self.model(input_ids=ids, position_ids=positions, past_key_values=cache)
                logits.append(out.logits[0].float())
            logprobs = torch.cat(logits).log_softmax(dim=-1)
            target = torch.tensor(tail, device=logprobs.device)
            total = float(logprobs.gather(1, target[:, None]).sum())
            greedy = bool((logprobs.argmax(dim=-1) == target).all())
            results.append((total, greedy))
            self.cache_hook.add_partial("loglikelihood", request.args, (total, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise ValueError("loglikelihood_rolling: perplexity tasks score a text with no context to compress; "
                         "spark-bench runs generate_until and loglikelihood tasks")


def main() -> None:
    """``spark-bench-lm-eval``: lm-eval's command line with the ``spark-bench`` model type registered. What
    spark-bench refuses (a model not on disk with the hub unusable, a missing GPU, a bad method option: a
    ``ValueError`` or a missing file) ends in one line, exit 2, as every spark-bench command; anything else is
    an internal error (:class:`spark_bench.logs.last_resort`: one line, exit 1, the traceback in a file;
    ``-v`` / ``--verbose`` prints it too)."""
    import sys

    from spark_bench import logs

    verbose, sys.argv[1:] = _take_verbose(sys.argv[1:])
    logs.configure(logs.VERBOSE if verbose else logs.NORMAL, "spark-bench-lm-eval")
    with logs.last_resort("spark-bench-lm-eval"):
        _evaluate()


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _take_verbose(argv: list[str]) -> tuple[bool, list[str]]:
    """spark-bench's ``-v`` / ``--verbose`` (tracebacks printed) and ``argv`` without it. lm-eval's own
    ``-v LEVEL`` / ``--verbosity LEVEL`` stays lm-eval's (``DEBUG`` counts as verbose here too)."""
    verbose, kept = False, []
    for i, arg in enumerate(argv):
        level = argv[i + 1].upper() if i + 1 < len(argv) else ""
        if arg == "--verbose" or (arg == "-v" and level not in LOG_LEVELS):
            verbose = True
            continue
        verbose = verbose or (arg in ("-v", "--verbosity") and level == "DEBUG")
        kept.append(arg)
    return verbose, kept


def _evaluate() -> None:
    import sys

    from lm_eval.__main__ import cli_evaluate

    if not any(a == "--device" or a.startswith("--device=") for a in sys.argv[1:]):
        sys.argv.append("--device=auto")  # lm-eval's own default is cuda:0; spark-bench's is a GPU when there is one
    try:
        cli_evaluate()
    except (ValueError, FileNotFoundError) as err:
        lines = str(err).strip().splitlines() or [type(err).__name__]
        print(f"spark-bench-lm-eval: error: {lines[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
