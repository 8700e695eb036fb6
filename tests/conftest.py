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


MEASURED = {"scores.csv": ("prefill_s", "compress_s", "decode_s", "decode_tok_s", "peak_mem_bytes"),
            "table.md": ("Prefill s", "Compress s", "Decode tok/s", "Peak MiB")}


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
