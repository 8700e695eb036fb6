"""Option types and ranges, declared once: every option a user can set is checked against its :class:`Option`
before anything loads, and a bad value gives one line naming the key, the value and what is valid.

:class:`~spark_bench.methods.MethodConfig` checks its fields against ``OPTION_TYPES``
(``methods/config.py``); the command line's run, benchmark and data options are checked against
:data:`RUN_OPTIONS` by :func:`spark_bench.cli.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """``kind``: ``int`` | ``number`` | ``bool`` | ``str`` | ``list`` | ``dict`` (a JSON object: a data file's
    ``meta``); ``low`` / ``high`` bounds (``open_low`` / ``open_high``: strict); ``choices``: the allowed values;
    ``odd``: odd integers only; ``nullable``: null allowed (and what null means, in ``null``); ``nonempty``: a list
    or string must not be empty."""

    kind: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    choices: tuple | None = None
    odd: bool = False
    nullable: bool = False
    null: str = ""
    nonempty: bool = False
    items: "Option | None" = None  # a list's elements
    whole_from: float | None = None  # numbers at or above this must be whole (a budget: a fraction, or tokens)

    def valid(self) -> str:
        """What is valid, in words."""
        if self.choices is not None:
            text = f"one of {', '.join(map(str, self.choices))}"
        elif self.kind == "bool":
            text = "true or false"
        elif self.kind == "list":
            text = "a non-empty list" if self.nonempty else "a list"
            text += f" ({self.items.valid()} each)" if self.items else ""
        elif self.kind == "str":
            text = "a non-empty string" if self.nonempty else "a string"
        elif self.kind == "dict":
            text = "an object (a mapping of names to values)"
        else:
            noun = "an odd integer" if self.odd else "an integer" if self.kind == "int" else "a number"
            bounds = []
            if self.low is not None:
                bounds.append(f"{'>' if self.open_low else '>='} {self.low:g}")
            if self.high is not None:
                bounds.append(f"{'<' if self.open_high else '<='} {self.high:g}")
            text = noun + (" " + " and ".join(bounds) if bounds else "")
            if self.whole_from is not None:
                text += f", whole at or above {self.whole_from:g}"
        return text + (f", or null ({self.null})" if self.nullable else "")

    def accepts(self, value) -> bool:
        if value is None:
            return self.nullable
        if self.choices is not None:
            return value in self.choices and not (isinstance(value, bool) and True not in self.choices)
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str) and (bool(value) or not self.nonempty)
        if self.kind == "dict":
            return isinstance(value, dict)
        if self.kind == "list":
            return (isinstance(value, (list, tuple)) and (bool(value) or not self.nonempty)
                    and (self.items is None or all(self.items.accepts(v) for v in value)))
        if isinstance(value, bool) or not isinstance(value, int if self.kind == "int" else (int, float)):
            return False
        if self.odd and value % 2 == 0:
            return False
        if self.whole_from is not None and value >= self.whole_from and value != int(value):
            return False
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.open_high else value > self.high))


def check(key: str, value, option: Option) -> None:
    """Raise ``ValueError`` (one line: key, value, what is valid) unless ``option`` accepts ``value``."""
    if not option.accepts(value):
        raise ValueError(f"{key} must be {option.valid()}; got {value!r}")


def check_all(values: dict, options: dict[str, Option], prefix: str = "") -> None:
    for key, option in options.items():
        if key in values:
            check(prefix + key, values[key], option)


FRACTION = Option("number", 0, 1, open_high=True)
POSITIVE_INT = Option("int", 1)

# what the command line sets besides the method options (``conf/config.yaml``, ``conf/benchmark/*.yaml``)
RUN_OPTIONS = {
    "dry_run": Option("bool"), "progress": Option("bool"), "decode_stack": Option("bool"), "decode_graph": Option("bool"),
    "decode_batch": Option("int", 1, nullable=True, null="all rows of a decode group together"),
    "decode_samples": POSITIVE_INT,
    "output_root": Option("str", nonempty=True), "run": Option("str", nonempty=True),
    "wait_lock": Option("bool"), "repair": Option("bool"),
    "fidelity": Option("bool"),  # the teacher-forced fidelity pass (answer NLL, KL to full; engine/fidelity.py)
    "hub_timeout_s": Option("number", 0, open_low=True),
    "tracking": Option("str", choices=("none", "wandb", "mlflow")),
}
BENCHMARK_OPTIONS = {
    "tasks": Option("list", nonempty=True, nullable=True, null="LongBench: all 16 tasks"),
    "num_samples": Option("int", 1, nullable=True, null="every record"),
    "length": POSITIVE_INT, "seed": Option("int"),
    "max_new_tokens": Option("int", 1, nullable=True, null="the task's own"),
    "data_file": Option("str", nonempty=True, nullable=True, null="generate or load the benchmark"),
    # a data file's sample longer than the model's context (prompt + max_new_tokens > model.max_length):
    # refused, cut in the middle as LongBench cuts, or run as it is (spark_bench/benchmarks/records.py)
    "truncate": Option("str", choices=("refuse", "middle", "keep")),
}
LONGBENCH_OPTIONS = {
    "e": Option("bool"), "max_length": Option("int", 1, nullable=True, null="the model's longbench_max_length"),
    "rouge_backend": Option("str", choices=("rouge", "rouge_score")),
}
RULER_OPTIONS = {"system_prompt": Option("bool"), "questions": POSITIVE_INT}  # questions: per haystack (niah_*)
MODEL_OPTIONS = {  # conf/model/*.yaml keys a user overrides (ModelConfig checks its placement keys itself)
    "dtype": Option("str", choices=("float32", "bfloat16", "float16")), "max_length": POSITIVE_INT,
    "longbench_max_length": Option("int", 1, nullable=True, null="max_length − 500"),
    "chat_template": Option("bool"), "seed": Option("int"),
    "attn_implementation": Option("str", choices=("sdpa", "eager", "flash_attention_2")),
}
MEMORY_OPTIONS = {
    "check": Option("bool"),
    "limit_gib": Option("number", 0, open_low=True, nullable=True, null="each device's free memory"),
    "seq_len": Option("int", 1, nullable=True, null="the run's longest prompt"),
    "gen_len": Option("int", 0), "cap_gib": Option("number", 0, open_low=True),
    "overhead_gib": Option("number", 0),
}
ANALYSIS_OPTIONS = {  # spark-bench-saliency (spark_bench/analysis)
    "query": Option("str", choices=("window_mean", "last")), "window": POSITIVE_INT,
    "layer": Option("int", 0, nullable=True, null="the paper's 18 when the model has it, else the middle layer"),
    "head": Option("int", 0), "ratios": Option("list", nonempty=True, items=FRACTION),
    "samples": Option("int", 1, nullable=True, null="every sample of the benchmark"),
    "out": Option("str", nonempty=True, nullable=True, null="results/<run>/saliency"),
}
LEANK_OPTIONS = {  # method=leank / <eviction>+leank: the ``leank`` mapping (spark_bench/methods/channel/leank.py)
    "mask": Option("str", nonempty=True, nullable=True, null="none: method=leank refuses to run without one"),
    "recent": Option("int", 0),  # the last tokens kept dense (LeanK's recent_size, 768)
}
LEANK_TRAIN_OPTIONS = {  # spark-bench-leank (spark_bench/leank): LeanK's two-stage training
    "ratio": FRACTION, "align": POSITIVE_INT,
    "stage1_steps": Option("int", 0), "stage2_steps": Option("int", 0),
    "stage1_lr": Option("number", 0, open_low=True), "stage2_lr": Option("number", 0, open_low=True),
    "reg_weight": Option("number", 0), "stage2_reg_weight": Option("number", 0),
    "initial_value": Option("number", 0, 1), "sink": Option("int", 0), "recent": Option("int", 0),
    "save_steps": POSITIVE_INT, "seed": Option("int"), "cache_teacher": Option("bool"),
    "out": Option("str", nonempty=True, nullable=True, null="results/<run>/leank"),
    "stage1": Option("str", nonempty=True, nullable=True, null="train stage 1 here"),  # another run's checkpoint.pt
}
