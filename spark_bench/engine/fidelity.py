"""How far each compressed cache moves the model, measured teacher-forced from the same prefill as its decoding.

Three numbers per sample × method config, beside its task score:

* ``answer_nll``: the mean negative log-likelihood per token of a reference answer (token ids), teacher-forced
  through the config's compressed cache: ``−(1/m) Σ_k log p(a_k | prompt, a_<k)`` — the perplexity-under-a-compressed
  -cache measure of StreamingLLM (Xiao et al., 2024, §4.1), per answer instead of per document;
* ``kl_full``: the mean ``KL(p_full ‖ p_config)`` of the next-token distributions along the full cache's own greedy
  continuation, teacher-forced through each cache, over its first :data:`KL_TOKENS` positions (fewer when the full
  cache stopped earlier: the position where it chose its stop token is the last one compared) — the KL-to-the-full-
  model measure of quantised-cache work (e.g. KIVI, KVQuant);
* ``agree_full``: the fraction of those positions where the config's most likely token is the full cache's.

The first answer token comes from exactly the logits decoding takes it from: under ``compress_scope=prompt`` the
full-cache prefill's (every config's first position is then the full cache's, KL 0 there), else the last logits
of the suffix run through the compressed cache (:mod:`~spark_bench.engine.decode`). Every later position is one
forward over ``suffix + tokens`` through a :class:`~spark_bench.engine.cache.BatchedCache` of every row (over the
``tokens`` alone when decoding left the row its suffix's keys and values,
:func:`~spark_bench.engine.decode.prime_rows`: the suffix, most of a short answer's pass, then runs once per row,
not twice), with the attention decoding runs (stacked rows share one kernel call per layer, the same dense tail,
the same merge), only with several query tokens per row, causal among themselves. Rows are right-padded to one
length; padding comes after every position read, so under causal attention it changes nothing that is read.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from spark_bench.engine.attention import compressed_attention_enabled
from spark_bench.engine.cache import BatchedCache, CompressedCache
from spark_bench.engine.decode import fixed_groups, group_size, tail_length
from spark_bench.engine.fastpaths import FastPaths

KL_TOKENS = 16  # positions of the full cache's greedy continuation that kl_full / agree_full compare


@dataclass
class ForcedRow:
    """A continuation to teacher-force: the compressed ``cache``, the logits of its first token (``first_logits``,
    used when there is no ``suffix``), the position of its next token, the ``suffix`` to run first and the tokens
    ``fed`` after it; ``tail``: per layer, the keys and values of tokens already run through the cache (its suffix,
    :func:`~spark_bench.engine.decode.prime_rows`, which also gave ``first_logits``), which the forward starts from.
    :func:`forced_log_probs` gives ``len(fed) + 1`` distributions: before ``fed[0]``, after each."""

    cache: CompressedCache
    first_logits: torch.Tensor | None
    position: int
    suffix: tuple[int, ...]
    fed: list[int]
    tail: list | None = None  # per layer, (keys, values) already run through the cache (decode.prime_rows)


@dataclass(frozen=True)
class Fidelity:
    """One row's three numbers (None where undefined: no reference tokens, no full-cache row); ``kl_tokens``: the
    positions ``kl_full`` and ``agree_full`` average over; ``seconds``: the row's share of the pass (the forwards
    its continuations ran in, shared equally by the continuations of each forward, and their reduction to the
    numbers; wall time, read after the host has the numbers, so true on an asynchronous device too)."""

    answer_nll: float | None
    kl_full: float | None
    agree_full: float | None
    kl_tokens: int
    seconds: float = 0.0


def _output_head(model: nn.Module):
    """``(decoder, head)``: the model's forward as its decoder's hidden states and the output head applied to them
    (Llama, Qwen, Mistral: the ``lm_head`` alone), or None where the forward does more (a logit scale, a soft cap)
    or has no separate decoder: the whole forward then gives the logits."""
    config = model.config
    if any(getattr(config, k, None) not in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale",
                                                                      "logits_scaling")):
        return None
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    return None if decoder is None or decoder is model or head is None else (decoder, head)


@torch.inference_mode()
def iter_forced_log_probs(model: nn.Module, rows: list[ForcedRow], stack: bool = True,
                          checks: FastPaths | None = None, size: int | None = None, fed: int | None = None,
                          width: int = 0):
    """``(i, log_probs)`` for every row ``i``: its ``(len(fed) + 1, V)`` float32 log-probabilities of the next token,
    position 0 the one decoding takes its first token from, position ``k`` after ``fed[:k]``. Rows with equal suffix
    and tail lengths (and attention mode) run as one forward (as decoding groups them), stacked in
    :meth:`BatchedCache.order`; a group's rows are yielded in the order of ``rows`` (the groups in the order of their
    first rows), so the first row comes first; the caches are read, not consumed. The forward stops at the decoder's
    hidden states and each row's logits are made from its own positions when it is yielded (:func:`_output_head`), so
    one row's ``(positions, V)`` logits exist at a time, not the batch's. ``checks``: the run's fast-path record
    (:mod:`~spark_bench.engine.fastpaths`; default: a new one, the call a run of its own).

    ``size``: each forward holds exactly ``size`` rows (:func:`~spark_bench.engine.decode.fixed_groups`), each fed
    ``fed`` tokens (padded), over a batch of ``width`` (:class:`~spark_bench.engine.cache.BatchedCache`): every
    matrix product then has one shape and a row's numbers are the same whatever rows share its forward."""
    checks = FastPaths() if checks is None else checks
    groups: dict[tuple[int, int, str], list[int]] = {}
    for i, row in enumerate(rows):
        if not row.suffix and row.first_logits is None:
            raise ValueError("a teacher-forced row needs first_logits or a suffix to run through its cache")
        # a batch's tails start equally long and it has one attention mode
        groups.setdefault((len(row.suffix), tail_length(row.tail), row.cache.attention), []).append(i)
    device = model.get_input_embeddings().weight.device
    split = _output_head(model)
    for (n, _, _), members in groups.items():
        for chunk, real in fixed_groups(members, size) if size else [(members, len(members))]:
            longest = max(len(rows[i].fed) for i in chunk)
            if size and fed is not None:
                if longest > fed:
                    raise ValueError(f"a continuation of {longest} tokens in forwards fed {fed}")
                longest = fed
            steps = n + longest
            keep = longest + (1 if n else 0)  # the positions read: the suffix's last, then one after each fed token
            states, order = None, chunk
            if steps and keep:
                order = [chunk[j] for j in BatchedCache.order([rows[i].cache for i in chunk], stack)]
                tails = None if rows[order[0]].tail is None else [rows[i].tail for i in order]
                cache = BatchedCache([rows[i].cache for i in order], steps, stack, consume=False, fast_paths=checks,
                                     tails=tails, width=width, alone=bool(size))
                ids = torch.tensor([list(rows[i].suffix) + rows[i].fed + [0] * (longest - len(rows[i].fed))
                                    for i in order], device=device)
                # (padding: after every position read)
                positions = torch.tensor([[rows[i].position + k for k in range(steps)] for i in order], device=device)
                inputs = dict(input_ids=ids, position_ids=positions, past_key_values=cache, compressed_cache=cache,
                              use_cache=True)
                with compressed_attention_enabled(model):
                    if split is not None:
                        states = split[0](**inputs).last_hidden_state[:, steps - keep:]
                    else:
                        states = model(**inputs, logits_to_keep=keep).logits
                del cache
            at = {i: j for j, i in enumerate(order)}  # (a copy padding the chunk: its last place, never read)
            for i in chunk[:real]:  # in the order of rows (the batch's own order only inside the forward)
                row = rows[i]
                parts = [] if n else [row.first_logits.reshape(1, -1).float().to(device)]
                if states is not None:
                    mine = states[at[i], :len(row.fed) + (1 if n else 0)]
                    parts.append((split[1](mine) if split is not None else mine).float())
                yield i, torch.log_softmax(torch.cat(parts), dim=-1)


def forced_log_probs(model: nn.Module, rows: list[ForcedRow], stack: bool = True,
                     checks: FastPaths | None = None) -> list[torch.Tensor]:
    """Every row's log-probabilities of :func:`iter_forced_log_probs`, in the order of ``rows``."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    for i, log_probs in iter_forced_log_probs(model, rows, stack, checks):
        out[i] = log_probs
    return out


def mean_nll(log_probs: torch.Tensor, targets: list[int]) -> float:
    """``−(1/m) Σ_k log p_k(targets[k])`` over the first ``m = len(targets)`` positions."""
    index = torch.tensor(targets, device=log_probs.device).unsqueeze(-1)
    return float(-log_probs[:len(targets)].gather(-1, index).mean())


def kl_agree(full: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Mean over positions of ``KL(p_full ‖ p_other) = Σ_v p_full (log p_full − log p_other)`` and the fraction
    of positions whose argmax agree (both ``(N, V)`` log-probabilities). The same tensor twice gives exactly 0 and
    1."""
    if full is other:
        return 0.0, 1.0
    kl = (full.exp() * (full - other)).sum(-1).clamp_min(0).mean()
    return float(kl), float((full.argmax(-1) == other.argmax(-1)).float().mean())


def measure(model: nn.Module, rows: list[ForcedRow], reference: list[int], greedy: list[int],
            full: int | None = None, full_log_probs: torch.Tensor | None = None, stack: bool = True,
            tokens: int = KL_TOKENS, checks: FastPaths | None = None, merge: bool = True,
            stacked: bool = True, batch: int | None = None, configs: int | None = None,
            width: int = 0) -> tuple[list[Fidelity], torch.Tensor | None]:
    """The three numbers of rows of one sample, and the full cache's log-probabilities they were compared with.

    ``rows``: one per method config (``fed`` is set here); ``reference``: the answer's token ids (empty: no
    ``answer_nll``); ``greedy``: the full row's decoded tokens (its stop token excluded); ``full``: the index of the
    full-cache row among ``rows``, whose greedy continuation is teacher-forced first, or ``full_log_probs``: that
    continuation's log-probabilities from an earlier call (a sample whose rows decode in several batches); neither:
    no ``kl_full`` / ``agree_full``. Each row gives two continuations (the reference answer, the greedy tokens).
    ``merge``: when one continuation's tokens begin the other's (the full cache answered as the reference does, for
    as far as both go), each row runs the longer one alone and reads both sets of positions from it — under causal
    attention the distributions after the same tokens are the same, so the numbers are those of the two
    continuations (to float rounding, ``tests/test_fidelity_switch.py``) for about half the tokens.

    ``stacked`` (default): the continuations of up to ``batch`` rows (None: all) run as one teacher-forced forward,
    their caches stacked as decoding stacks a step's rows (:func:`iter_forced_log_probs`; rows of another suffix
    length or attention mode in a forward of their own), the full row's continuation first, so a sample's pass is
    one forward per ``batch`` configs instead of one per config. ``stacked=False``: the reference path, one forward
    per row (its two continuations together; the full row's greedy continuation alone, first), whose numbers do not
    depend on the other rows byte for byte; the stacked path gives them to float rounding (the matmuls' shapes
    differ; ``tests/test_fidelity.py``). ``configs`` (a sweep's pass: its number of configs): the continuations in
    forwards of exactly :func:`~spark_bench.engine.decode.group_size` rows, each fed as many tokens as the sample's
    longest continuation, over a batch of ``width`` (:func:`iter_forced_log_probs`): stacked, yet each row's numbers
    byte for byte those of any other batching of the sample's rows. Each row's log-probabilities are reduced to its
    numbers as they come: only the full row's continuation (``(positions, V)``) outlives its forward. ``checks``: the
    run's fast-path record."""
    greedy_fed = list(greedy[:tokens - 1])
    answer_fed = list(reference[:-1])
    compared = full is not None or full_log_probs is not None
    positions = len(greedy_fed) + 1
    both = merge and bool(reference) and compared and \
        answer_fed[:len(greedy_fed)] == greedy_fed[:len(answer_fed)]
    longer = answer_fed if len(answer_fed) >= len(greedy_fed) else greedy_fed
    fed = {"answer": answer_fed, "greedy": greedy_fed, "both": longer}
    # each row's (row, continuation)s, the full row first; then grouped into forwards
    order = ([full] if full is not None else []) + [r for r in range(len(rows)) if r != full]
    if both:
        mine = {r: [(r, "both")] for r in order}
    else:
        mine = {r: [(r, "greedy")] * (compared and (r == full)) + [(r, "answer")] * bool(reference)
                + [(r, "greedy")] * (compared and r != full) for r in order}
    longest = max((len(fed[which]) for r in order for _, which in mine[r]), default=0)  # (the sample's, any batch)
    size = group_size(configs, longest) if configs else None
    if size:
        passes = [[item for r in order for item in mine[r]]]
    elif stacked:
        step = max(1, batch or len(order))
        passes = [[item for r in order[k:k + step] for item in mine[r]] for k in range(0, len(order), step)]
    elif both:
        passes = [mine[r] for r in order]
    else:  # the full row's greedy continuation alone, first; then each row's own
        passes = ([mine[full][:1]] if full is not None else []) + [mine[r][r == full:] for r in order]
    nll: dict[int, float] = {}
    kl: dict[int, tuple[float, float]] = {}
    seconds = [0.0] * len(rows)
    for part in filter(None, passes):
        start = time.perf_counter()
        forced = [ForcedRow(rows[r].cache, rows[r].first_logits, rows[r].position, rows[r].suffix, fed[which],
                            rows[r].tail) for r, which in part]
        for j, log_probs in iter_forced_log_probs(model, forced, stack, checks, size, longest, width):
            r, which = part[j]
            if which in ("answer", "both"):
                nll[r] = mean_nll(log_probs, reference)
            if which == "answer":
                continue
            along = log_probs[:positions]
            if r == full:  # kept until the sample's last row: only its own positions
                full_log_probs = along.clone() if len(along) < len(log_probs) else along
                kl[r] = kl_agree(full_log_probs, full_log_probs)
            else:
                kl[r] = kl_agree(full_log_probs, along)
        elapsed = (time.perf_counter() - start) / len(part)  # each number was read on the host: the work is done
        for r, _ in part:
            seconds[r] += elapsed
    return ([Fidelity(nll.get(r), *(kl[r] if r in kl else (None, None)), positions if r in kl else 0, seconds[r])
             for r in range(len(rows))], full_log_probs)


def finite(value: float | None) -> float | None:
    """``None`` for an undefined number (stored as JSON null)."""
    return None if value is None or not math.isfinite(value) else value
