"""Memory planner: KV bytes per sequence and the largest batch under a memory cap, for any model × method.

Bytes come from the real stores, not from a formula: one synthetic layer (the model's kv-heads, head_dim and
dtype, Gaussian keys/values, random window queries) is compressed by the method's pipeline at two prompt
lengths with eviction off; the difference gives the bytes per stored token per kv-head and the intercept the
per-head constants (query statistics). Eviction then sets how many prompt tokens each layer stores
(``budget``: tokens or a fraction; PyramidKV's layers average to it); decoded tokens are stored densely.

``spark-bench-memory model=llama3.1-8b method=snapkv+spark ratio=0.8 budget=0.2 memory.seq_len=8192``
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import torch

from spark_bench.engine.prefill import LayerPrefill, Prefill
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.eviction.snapkv import resolve_budget
from spark_bench.models import ModelConfig

GIB = 1024 ** 3


@dataclass(frozen=True)
class Arch:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float

    @classmethod
    def of(cls, model: ModelConfig) -> "Arch":
        if not model.arch:
            raise ValueError(f"model {model.name} has no `arch:` block (num_layers, num_heads, num_kv_heads, "
                             f"head_dim, num_params) in its conf/model file")
        return cls(**model.arch)


def _layer_bytes(cfg: MethodConfig, arch: Arch, dtype: torch.dtype, seq: int) -> int:
    g = torch.Generator().manual_seed(seq)
    shape = (1, arch.num_kv_heads, seq, arch.head_dim)
    keys, values = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    window = torch.randn(1, arch.num_heads, min(cfg.observation_window, seq), arch.head_dim, generator=g).to(dtype)
    prefill = Prefill((LayerPrefill(keys, values, window),), seq, torch.zeros(1), 0.0)
    no_eviction = dataclasses.replace(cfg, name=cfg.channel_name or "full")
    cache, _ = Pipeline.from_config(no_eviction).build_cache(prefill)
    return cache.nbytes()


@dataclass(frozen=True)
class Plan:
    method: str
    bytes_per_token_per_kv_head: float   # keys + values of one stored prompt token, one kv-head, one layer
    bytes_per_head_const: float          # per kv-head per layer, independent of length (query statistics)
    stored_prompt_tokens: int
    kv_bytes_per_sequence: float
    weights_bytes: float
    max_batch: int

    def as_row(self) -> dict:
        return {"method": self.method, "bytes/token/kv-head": round(self.bytes_per_token_per_kv_head, 2),
                "stored prompt tokens": self.stored_prompt_tokens,
                "KV GiB/sequence": round(self.kv_bytes_per_sequence / GIB, 4), "max batch": self.max_batch}


def plan(cfg: MethodConfig, model: ModelConfig, seq_len: int, gen_len: int, cap_gib: float,
         overhead_gib: float = 0.0) -> Plan:
    arch, dtype = Arch.of(model), getattr(torch, model.dtype)
    short, long = 1024, 2048
    b_short, b_long = _layer_bytes(cfg, arch, dtype, short), _layer_bytes(cfg, arch, dtype, long)
    per_token = (b_long - b_short) / (long - short) / arch.num_kv_heads
    const = (b_short - per_token * short * arch.num_kv_heads) / arch.num_kv_heads
    stored = resolve_budget(cfg.budget, seq_len) if cfg.eviction_name else seq_len
    dense_token = 2 * arch.head_dim * dtype.itemsize  # a decoded token: dense key + value
    per_layer = arch.num_kv_heads * (const + per_token * stored + dense_token * gen_len)
    per_seq = arch.num_layers * per_layer
    weights = arch.num_params * dtype.itemsize
    free = cap_gib * GIB - weights - overhead_gib * GIB
    return Plan(cfg.label, per_token, const, stored, per_seq, weights, max(0, math.floor(free / per_seq)))


def render(plans: list[Plan], model: ModelConfig, seq_len: int, gen_len: int, cap_gib: float) -> str:
    lines = [f"{model.name}: prompt {seq_len} + {gen_len} generated tokens, cap {cap_gib:g} GiB, weights "
             f"{plans[0].weights_bytes / GIB:.2f} GiB", "",
             "| " + " | ".join(plans[0].as_row()) + " |", "|" + "---|" * len(plans[0].as_row())]
    lines += ["| " + " | ".join(str(v) for v in p.as_row().values()) + " |" for p in plans]
    return "\n".join(lines)


def to_json(plans: list[Plan]) -> str:
    return json.dumps([dataclasses.asdict(p) for p in plans], indent=1)
