"""Shared fixtures. ``SPARK_BENCH_TEST_DEVICE=cuda`` (``make test-gpu``) puts the tiny model and its prefill on that
device, so the method matrix, batched decoding and the engine tests check the product's device handling on a GPU;
CI and ``make test`` use the CPU."""

from __future__ import annotations

import os
from pathlib import Path

# Triton's interpreter runs its kernels on CPU tensors; it is chosen when triton is first imported (transformers may
# import it), so it is set before anything else. On a GPU run (make test-gpu) the kernels compile for the device.
if os.environ.get("SPARK_BENCH_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from omegaconf import OmegaConf

from spark_bench.cli import CONF_DIR
from spark_bench.engine.prefill import QueryStatsSpec, run_prefill
from spark_bench.models import ModelConfig, load_model

ROOT = Path(__file__).resolve().parent.parent
DEVICE = torch.device(os.environ.get("SPARK_BENCH_TEST_DEVICE", "cpu"))


def model_config(name: str) -> ModelConfig:
    return ModelConfig.from_dict(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")))


@pytest.fixture(scope="session")
def tiny_lm():
    if DEVICE.type == "cuda":  # float32 matmuls as on the CPU: TF32 would change greedy tokens, not the product
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return load_model(model_config("tiny-llama"), str(DEVICE))


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2 (GGUF), loaded once per session: its loader takes about 12 s on this CPU."""
    import spark_bench

    return spark_bench.load("smollm2-135m", device=str(DEVICE))


@pytest.fixture(scope="session")
def tiny_prefill(tiny_lm):
    ids = torch.randint(100, 5000, (1, 160), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    return run_prefill(tiny_lm.model, ids, window=32, query_stats=QueryStatsSpec())


def cli_env() -> dict[str, str]:
    """The environment of a ``spark-bench`` child process as a user's shell gives it: without the variables that
    quieten third-party progress bars (tests/test_logs.py checks that spark-bench itself keeps them off)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("TQDM_", "HF_HUB_DISABLE", "TRANSFORMERS_VERB"))}


@pytest.fixture
def console(monkeypatch, capsys):
    """A console script run in this process from its own entry (``-q``/``-v``, the command-line checks, Hydra, the
    run): ``console(args)`` for ``spark-bench``, ``console(args, "spark-bench-merge")``; gives ``(exit code, stdout,
    stderr)``. For the commands whose own process is not the point (refusals, resumes, merges): each saves a fresh
    interpreter's imports (about 3 s on 2 cores). Where the exit code and the one line are the point, one test per
    console script keeps a real process (tests/test_durability.py's malformed record, for ``spark-bench``)."""
    import sys

    import spark_bench.cli as cli
    from spark_bench import tools

    entries = {"spark-bench": cli.main, "spark-bench-merge": lambda: tools.merge(sys.argv[1:])}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    def run(args, tool="spark-bench"):
        monkeypatch.setattr(sys, "argv", [tool, *map(str, args)])
        capsys.readouterr()
        code = 0
        try:
            entries[tool]()
        except SystemExit as exit_:
            code = exit_.code
        finally:  # Hydra's run leaves its config behind in this process: a later compose would read its choices
            from hydra.core.global_hydra import GlobalHydra
            from hydra.core.hydra_config import HydraConfig

            HydraConfig.instance().cfg = None
            GlobalHydra.instance().clear()
        said = capsys.readouterr()
        return code, said.out, said.err

    return run


SMOLLM2_RUN = ["benchmark.tasks=[niah_single_1]", "benchmark.num_samples=1", "benchmark.length=2048",
               "benchmark.max_new_tokens=8"]  # the demo's model and default sweep, one 2K needle


@pytest.fixture(scope="session")
def smollm2_run(tmp_path_factory):
    """One ``spark-bench`` run of the embedded SmolLM2 in a fresh process without a terminal (the default sweep, one
    2K needle): ``(completed process, run directory)``. Its stderr is what tests/test_logs.py reads, its
    ``memory.json`` what the peak-memory test in tests/test_placement_and_memory.py reads — one SmolLM2 command-line
    run (a load, a 2K prefill, six configs decoded) for both, instead of one each."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("smollm2_run")
    proc = subprocess.run([sys.executable, "-m", "spark_bench.cli", *SMOLLM2_RUN, f"output_root={root}", "run=r"],
                          capture_output=True, text=True, timeout=600, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, root / "r"


MEASURED = {"scores.csv": ("prefill_s", "compress_s", "decode_s", "decode_tok_s", "peak_mem_bytes", "answer_s",
                           "fidelity_s"),
            "table.md": ("Prefill s", "Compress s", "Decode tok/s", "Peak MiB", "s/answer", "Fidelity s")}


def reproducible(path: Path) -> bytes:
    """A run file without its measured columns (times, peak memory: they differ from run to run): predictions
    byte for byte, scores.csv and table.md without the cost measurements; what must be byte-identical across
    batchings, resumes and shards."""
    drop = MEASURED.get(path.name)
    if drop is None:
        return path.read_bytes()
    rows = [line.split(",") if path.suffix == ".csv" else line.split(" | ")
            for line in path.read_text().splitlines()]
    keep = [i for i, name in enumerate(rows[0]) if name.strip("| ") not in drop]
    sep = "," if path.suffix == ".csv" else " | "
    return "\n".join(sep.join(row[i] for i in keep if i < len(row)) for row in rows).encode()


@pytest.fixture
def spark_log():
    """The ``spark_bench`` loggers' messages during the test (INFO and up), as a list of strings."""
    import logging

    seen: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("spark_bench")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level or logging.INFO, logging.INFO))
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(level)
