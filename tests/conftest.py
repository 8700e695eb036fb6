from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from spark_bench.engine.prefill import QueryStatsSpec, run_prefill
from spark_bench.models import ModelConfig, load_model

ROOT = Path(__file__).resolve().parent.parent


def model_config(name: str) -> ModelConfig:
    return ModelConfig.from_dict(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")))


@pytest.fixture(scope="session")
def tiny_lm():
    return load_model(model_config("tiny-llama"), "cpu")


@pytest.fixture(scope="session")
def tiny_prefill(tiny_lm):
    ids = torch.randint(100, 5000, (1, 160), generator=torch.Generator().manual_seed(0))
    return run_prefill(tiny_lm.model, ids, window=32, query_stats=QueryStatsSpec())
