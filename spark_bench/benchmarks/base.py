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


def encode_prompt(tokenizer: PreTrainedTokenizerBase, user_text: str, answer_prefix: str = "",
                  chat_template: bool = True) -> list[int]:
    """Token ids of ``user_text`` (wrapped in the chat template as one user turn when asked) followed by the
    answer prefix, which RULER appends after the assistant header."""
    if chat_template and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text + answer_prefix, add_special_tokens=False)["input_ids"]
    return tokenizer(user_text + answer_prefix)["input_ids"]


def read_jsonl(path: Path, required: tuple[str, ...], what: str, check=None) -> list[dict]:
    """The records of every non-blank line; a line that is not valid JSON, lacks a ``required`` field or fails
    ``check(record) -> error text | None`` raises ``ValueError`` naming the file and line (``what`` names the
    record kind in the message)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            missing = [k for k in required if k not in record] if isinstance(record, dict) else list(required)
            if missing:
                raise ValueError(f"{path}:{lineno}: {what} lacks field(s) {missing}")
            problem = check(record) if check else None
            if problem:
                raise ValueError(f"{path}:{lineno}: {problem}")
            records.append(record)
    return records
