"""What every benchmark hands the runner, and how prompts become token ids."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Sample:
    """One prompt of one task, ready to prefill. ``metric`` names a function in :mod:`.metrics`, called with
    ``metric_args``; ``stop_token_ids`` add to the model's stop tokens (samsum stops at a newline) and the first
    ``min_new_tokens`` tokens never stop."""

    task: str
    id: str
    input_ids: tuple[int, ...]
    answers: tuple[str, ...]
    max_new_tokens: int
    metric: str
    meta: dict = field(default_factory=dict)
    metric_args: dict = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    # token boundaries of the prompt's parts: [0, context_end) template head + context, [context_end, question_end)
    # the question, [question_end, len) the suffix (end of turn, assistant header, answer prefix); None = unknown
    # (only ``compress_scope=prompt`` can run such a sample)
    context_end: int | None = None
    question_end: int | None = None

    def scope_end(self, scope: str) -> int:
        """Tokens compressed under ``compress_scope=scope`` (:func:`scope_end`)."""
        return scope_end(len(self.input_ids), self.context_end, self.question_end, scope,
                         f"sample {self.id}", "re-export it")


@dataclass(frozen=True)
class Prompt:
    """Token ids of a prompt and the boundaries of its parts (see :attr:`Sample.context_end`; None = unknown)."""

    ids: list[int]
    context_end: int | None = None
    question_end: int | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def scope_end(self, scope: str) -> int:
        """Tokens compressed under ``compress_scope=scope`` (:func:`scope_end`)."""
        return scope_end(len(self.ids), self.context_end, self.question_end, scope, "the prompt",
                         "build it with spark_bench.prompt(tokenizer, context, question)")


def cut_middle(ids, keep: int, end: int | None = None, context_end: int | None = None) -> Prompt:
    """LongBench's middle truncation of token ids (the SparK fork's ``longbench.protocol=kvpress`` path): the first
    ``end`` ids (the user turn; all of them when None) cut to their first and last ``keep // 2``, the ids after
    ``end`` (end of turn, assistant header) kept. The boundaries move with the cut: ``question_end`` is the cut
    turn's end (None when ``end`` was None); ``context_end`` (where the question starts) stays only when the question
    survived whole in the kept tail, else None."""
    turn = len(ids) if end is None else end
    half = keep // 2
    if turn <= 2 * half:
        return Prompt(list(ids), context_end, end)
    removed = turn - 2 * half
    start = None if context_end is None or context_end - removed < half else context_end - removed
    return Prompt(list(ids[:half]) + list(ids[turn - half:]), start, None if end is None else 2 * half)


def scope_end(length: int, context_end: int | None, question_end: int | None, scope: str, what: str,
              fix: str) -> int:
    """Tokens compressed under ``compress_scope=scope``: ``prompt`` all ``length`` of them, ``question`` up to the
    end of the user turn, ``context`` up to the start of the question; the rest runs through the compressed cache."""
    if scope == "prompt":
        return length
    end = {"question": question_end, "context": context_end}[scope]
    if end is None:
        raise ValueError(f"{what}: compress_scope={scope} needs the prompt's context/question boundaries, which "
                         f"{what} does not carry ({fix}, or use compress_scope=prompt)")
    return end


def question_start(text: str, context: str) -> int:
    """Character offset of the question in ``text``: the first non-blank character after the last occurrence of
    ``context`` (RULER and LongBench put the question after the context; the newline between stays with it)."""
    end = text.rindex(context) + len(context)
    return end + len(text[end:]) - len(text[end:].lstrip())


def chat_text(tokenizer: PreTrainedTokenizerBase, user_text: str, system_prompt: bool = True) -> str:
    """One user turn in the tokenizer's chat template, with the generation prompt. ``system_prompt=False`` drops the
    system block a template adds by default (SmolLM2's "You are a helpful AI assistant…", Llama-3.1's date lines), as
    RULER's own model templates have none: the template is rendered with a marker system message, and everything
    from the system header to the end of that turn is cut (the BOS text before it is kept)."""
    turn = [{"role": "user", "content": user_text}]
    if system_prompt:
        return tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    mark, core = "\u2063SYSTEM\u2063", user_text.strip()
    with_mark = tokenizer.apply_chat_template([{"role": "system", "content": mark}, *turn], tokenize=False,
                                              add_generation_prompt=True)
    plain = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=False)
    end_of_turn = plain[plain.rindex(core) + len(core):]
    at = with_mark.find(mark)
    rest = with_mark[at + len(mark):] if at >= 0 else ""
    if not rest.startswith(end_of_turn) or core not in rest:
        raise ValueError("cannot remove the system prompt from this chat template")
    tail = rest[len(end_of_turn):]
    system_header = tail[:tail.index(core)].replace("user", "system")
    start = with_mark.find(system_header)
    if start < 0 or start > at:
        raise ValueError("cannot remove the system prompt from this chat template")
    return with_mark[:start] + tail


def _token_boundary(offsets: list[tuple[int, int]], char: int) -> int:
    """Number of leading tokens that end at or before character ``char`` (a token straddling ``char`` belongs to
    the later part, so nothing of the later part is in the earlier one)."""
    n = 0
    while n < len(offsets) and offsets[n][1] <= char:
        n += 1
    return n


def encode_prompt(tokenizer: PreTrainedTokenizerBase, user_text: str, answer_prefix: str = "",
                  chat_template: bool | str = True, question_at: int | None = None, bos: bool = True) -> Prompt:
    """Token ids of ``user_text`` (wrapped in the chat template as one user turn when asked) followed by the
    answer prefix, which RULER appends after the assistant header, with the part boundaries: the question starts at
    character ``question_at`` of ``user_text`` (None: no question, the user turn is all context), the user turn ends
    where its text ends; the rest (end-of-turn token, assistant header, answer prefix) is the suffix.

    The whole string is tokenized once (the ids do not depend on the boundaries); boundaries come from the
    tokenizer's character offsets. The official kvpress pipeline tokenizes context and question separately, which
    can differ by a merge at the seam; the parts themselves are the ones its ``compress_questions`` splits.
    ``bos=False``: no special tokens without a chat template (the official SparK code blanks the BOS token there).
    ``chat_template="no_system"``: the chat template without its default system prompt (:func:`chat_text`)."""
    question_at = len(user_text) if question_at is None else question_at
    if chat_template and tokenizer.chat_template:
        text = chat_text(tokenizer, user_text, system_prompt=chat_template != "no_system")
        core = user_text.strip()  # templates may trim the message
        start = text.find(core)
        if start < 0:
            raise ValueError("the chat template rewrites the user message; cannot locate the prompt's parts")
        lead = len(user_text) - len(user_text.lstrip())
        question_char = start + min(max(question_at - lead, 0), len(core))
        turn_end = start + len(core)
        encoded = tokenizer(text + answer_prefix, add_special_tokens=False, return_offsets_mapping=True)
    else:
        question_char, turn_end = question_at, len(user_text)
        encoded = tokenizer(user_text + answer_prefix, return_offsets_mapping=True, add_special_tokens=bos)
    offsets = [tuple(o) for o in encoded["offset_mapping"]]
    return Prompt(list(encoded["input_ids"]), _token_boundary(offsets, question_char),
                  _token_boundary(offsets, turn_end))


def jsonl_records(path: Path):
    """``(line number, record, None)`` for every non-blank line of a JSON-lines file, or ``(line number, None,
    problem)`` for a line that is not UTF-8 text, not valid JSON, or an object that names a key twice (a byte-order
    mark opening the file is skipped)."""
    for lineno, raw in enumerate(Path(path).read_bytes().split(b"\n"), 1):
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as err:
            yield lineno, None, (f"not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1}): is it a "
                                 f"JSON-lines file?")
            continue
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line, object_pairs_hook=_unique_keys), None
        except json.JSONDecodeError as err:
            yield lineno, None, f"not valid JSON ({err.msg} at column {err.colno})"
        except _RepeatedKey as err:
            yield lineno, None, str(err)


class _RepeatedKey(ValueError):
    """A JSON object naming one key twice (``json`` would keep the last silently)."""


def _unique_keys(pairs: list) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _RepeatedKey(f"the field {json.dumps(key)} is given twice in one object (JSON keeps only the last; "
                               "give each field once)")
        seen.add(key)
    return dict(pairs)


def read_jsonl(path: Path, required: tuple[str, ...], what: str, check=None) -> list[dict]:
    """The records of every non-blank line; a line that is not UTF-8 text or valid JSON, lacks a ``required`` field
    or fails ``check(record) -> error text | None`` raises ``ValueError`` naming the file and line (``what`` names
    the record kind in the message)."""
    records = []
    for lineno, record, problem in jsonl_records(path):
        if problem is None:
            missing = [k for k in required if k not in record] if isinstance(record, dict) else list(required)
            if missing:
                problem = f"{what} lacks field(s) {missing}"
            else:
                problem = check(record) if check else None
        if problem:
            raise ValueError(f"{path}:{lineno}: {problem}")
        records.append(record)
    return records
