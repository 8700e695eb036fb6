"""RULER (Hsieh et al., 2024): all 13 tasks generated for any tokenizer and target length.

One module per task family: ``niah`` (8 needle tasks), ``variable_tracking`` (vt), ``common_words`` (cwe),
``freq_words`` (fwe), ``qa`` (qa_1 SQuAD, qa_2 HotpotQA). Everything but qa is generated offline; qa needs the
SQuAD/HotpotQA files or the hub (cache or network); without them the run stops before it starts, naming the key.
"""

from __future__ import annotations

from spark_bench.benchmarks.base import Sample
from spark_bench.benchmarks.ruler.common_words import generate_cwe
from spark_bench.benchmarks.ruler.freq_words import generate_fwe
from spark_bench.benchmarks.ruler.niah import NIAH_TASKS, generate_niah
from spark_bench.benchmarks.ruler.qa import generate_qa, hub_source, load_qa
from spark_bench.benchmarks.ruler.variable_tracking import generate_vt
from spark_bench.models import LoadedModel

QA_TASKS = {"qa_1": "squad", "qa_2": "hotpotqa"}
RULER_TASKS = (*NIAH_TASKS, "vt", "cwe", "fwe", *QA_TASKS)


def check_qa_sources(tasks, squad_file: str | None, hotpotqa_file: str | None) -> None:
    """Before anything runs: every requested qa task has its file or a usable hub copy (else HubUnavailable)."""
    files = {"squad": squad_file, "hotpotqa": hotpotqa_file}
    for task in tasks:
        if task in QA_TASKS and files[QA_TASKS[task]] is None:
            hub_source(QA_TASKS[task])


def load_ruler(tasks, length: int, num_samples: int, seed: int, lm: LoadedModel,
               max_new_tokens: int | None = None, essay_file: str | None = None, squad_file: str | None = None,
               hotpotqa_file: str | None = None, system_prompt: bool = True, questions: int = 1) -> list[Sample]:
    """RULER samples; ``system_prompt=False`` wraps them in the chat template without its default system prompt
    (RULER's own model templates have none; the official SparK code keeps the tokenizer's default).
    ``questions`` (``ruler.questions``): the needle tasks ask that many questions of each haystack, one sample each
    (:func:`~spark_bench.benchmarks.ruler.niah.generate_niah`)."""
    unknown = [t for t in tasks if t not in RULER_TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {unknown}; valid: {', '.join(RULER_TASKS)}")
    if questions > 1 and any(t not in NIAH_TASKS for t in tasks):
        raise ValueError(f"ruler.questions={questions}: only the needle tasks (niah_*) ask several questions of one "
                         f"haystack; not {', '.join(t for t in tasks if t not in NIAH_TASKS)}")
    if length > lm.config.max_length:
        raise ValueError(f"benchmark.length={length} exceeds model {lm.config.name} max_length={lm.config.max_length}")
    common = dict(tokenizer=lm.tokenizer, length=length, num_samples=num_samples, seed=seed,
                  chat_template=(lm.config.chat_template and (True if system_prompt else "no_system")),
                  max_new_tokens=max_new_tokens)
    qa_files = {"squad": squad_file, "hotpotqa": hotpotqa_file}
    samples: list[Sample] = []
    for task in tasks:
        if task in NIAH_TASKS:
            samples += generate_niah(task, essay_file=essay_file, questions=questions, **common)
        elif task in QA_TASKS:
            dataset = QA_TASKS[task]
            source = load_qa(dataset, qa_files[dataset])
            samples += generate_qa(task, dataset, source, **common)
        else:
            samples += {"vt": generate_vt, "cwe": generate_cwe, "fwe": generate_fwe}[task](**common)
    return samples
