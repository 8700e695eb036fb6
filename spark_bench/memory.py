"""Memory planner: what a sweep holds at its peak, predicted before the model loads.

Two questions, both answered from the model's ``arch:`` block (every ``conf/model`` file has one) and the real
stores, never from the model's weights:

* :func:`plan` — one sequence: KV bytes per sequence and the largest batch under a cap, for one method config.
* :func:`predict_run` — a whole run: the peak of one decode batch of a sweep (:class:`Footprint`), per device.

Store bytes come from the real stores, not from a formula: one synthetic layer (the model's kv-heads, head_dim and
dtype, Gaussian keys/values, random window queries) is compressed by each config's pipeline at two prompt lengths
with eviction off (:func:`store_bytes`); the difference gives the key and value bytes per stored token per kv-head,
the intercept the per-head constants (query statistics). Eviction then sets how many prompt tokens each layer stores
(:meth:`~spark_bench.methods.base.EvictionMethod.stored_tokens`: the method's own budget rule, PyramidKV's ramp and
its fallbacks included; AdaKV's padded heads as an upper bound).

A run (``runner.run_samples``) holds at once, at its peak, the largest of three moments of a decode batch:

1. *prefill*: the dense keys and values of the longest prompt and one decoder layer's activations
   (:func:`prefill_work`: the residual stream, q/k/v with their RoPE temporaries and GQA copies, or the MLP's three
   intermediate tensors; the query statistics of ExpectedAttention);
2. *compression*: the prefill, the per-sample token scores every SnapKV-family config shares (``layer.memo``), the
   compressed caches of the batch's rows built so far (tensors shared by configs with the same eviction counted
   once, as the pipeline shares them), and one layer's scoring temporaries;
3. *decode*: the batch's caches, its preallocated decoded tail (rows × capacity) and one layer's step temporaries
   (the padded scores and softmax of every row, the keys the per-row path rebuilds); the prefill too while a row
   still reads it (a ``full`` row, or rows of the sample in a later batch).

Weights are ``num_params × bytes`` on one device, or split as Accelerate's device map places them
(:func:`placement`); per-layer memory goes where its layer lives. On the CPU the measured peak is the process's
resident set, so the prediction adds the process's resident memory when it is made (torch, transformers, the
tokenizer). ``make bench`` compares predictions with measured peaks (``scripts/bench/memory.py``).

``spark-bench-memory model=llama3.1-8b method=snapkv+spark ratio=0.8 budget=0.2 memory.seq_len=8192``
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from spark_bench.engine.decode import group_size
from spark_bench.engine.fidelity import KL_TOKENS
from spark_bench.engine.prefill import LayerPrefill, Prefill
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.methods.eviction.adasnapkv import AdaSnapKV
from spark_bench.methods.eviction.snapkv import SnapKV
from spark_bench.models import ModelConfig
from spark_bench.storage.walk_layout import PROGRAM_ROWS, head_floats, tiled, walks

LOG = logging.getLogger(__name__)

GIB = 1024 ** 3
ARCH_KEYS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "num_params", "hidden_size",
             "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class Arch:
    """The model's shape, from its ``arch:`` block (the values of its ``config.json``)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    model_type: str = "llama"          # transformers' model type (the module tree Accelerate places)
    tie_word_embeddings: bool = False  # the output layer shares the input embeddings (SmolLM2)

    @classmethod
    def of(cls, model: ModelConfig) -> "Arch":
        """The shape of the checkpoint itself when its ``config.json`` is on disk (``model.path`` a directory, as
        after :func:`~spark_bench.models.resolve_sources`), else the model config's ``arch:`` block."""
        local = Path(model.path) / "config.json" if model.source == "hub" and model.path else None
        if local is not None and local.is_file():
            return _from_config_json(local, model.dtype)
        missing = [k for k in ARCH_KEYS if k not in (model.arch or {})]
        if missing:
            raise ValueError(f"model {model.name}: its conf/model `arch:` block lacks {', '.join(missing)} (the "
                             f"memory planner needs {', '.join(ARCH_KEYS)})")
        extra = {k: model.arch[k] for k in ("model_type", "tie_word_embeddings") if k in model.arch}
        return cls(**{k: model.arch[k] for k in ARCH_KEYS}, **extra)

    def empty_model(self, dtype: str):
        """A model of this shape with its weights on the meta device (no memory, no download): the module tree
        and parameter sizes of the real one, for placing it before it loads."""
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(
            self.model_type, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings)
        with init_empty_weights():
            return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))


@lru_cache(maxsize=16)
def _from_config_json(path: Path, dtype: str) -> Arch:
    config = json.loads(path.read_text(encoding="utf-8"))
    heads = config["num_attention_heads"]
    shape = dict(num_layers=config["num_hidden_layers"], num_heads=heads,
                 num_kv_heads=config.get("num_key_value_heads") or heads,
                 head_dim=config.get("head_dim") or config["hidden_size"] // heads, num_params=0.0,
                 hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
                 vocab_size=config["vocab_size"], model_type=config.get("model_type", "llama"),
                 tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))
    empty = Arch(**shape).empty_model(dtype)  # the parameter count of the real module tree
    return Arch(**{**shape, "num_params": float(sum(p.numel() for p in empty.parameters()))})


# --------------------------------------------------------------------------------------------- store bytes


@dataclass(frozen=True)
class StoreBytes:
    """One config's stores per kv-head and layer: bytes = ``per_token · stored tokens + const``."""

    key_per_token: float
    key_const: float
    value_per_token: float
    value_const: float
    stacks: bool  # a compact kernel serves its stores (decode reads them in place; else it rebuilds its keys per step)

    @property
    def per_token(self) -> float:
        return self.key_per_token + self.value_per_token

    @property
    def const(self) -> float:
        return self.key_const + self.value_const


def _synthetic_layer(cfg: MethodConfig, arch: Arch, dtype: torch.dtype, seq: int):
    g = torch.Generator().manual_seed(seq)
    shape = (1, arch.num_kv_heads, seq, arch.head_dim)
    keys, values = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    window = torch.randn(1, arch.num_heads, min(cfg.observation_window, seq), arch.head_dim, generator=g).to(dtype)
    prefill = Prefill((LayerPrefill(keys, values, window),), seq, torch.zeros(1), 0.0)
    return Pipeline.from_config(cfg).build_cache(prefill)[0].layers[0]  # cfg: the channel method alone


def store_bytes(cfg: MethodConfig, arch: Arch, dtype: str) -> StoreBytes:
    """Key and value bytes per stored token and per kv-head (and the constants), measured on the real stores of
    ``cfg``'s channel method (the eviction's own options change which tokens are stored, not their bytes: configs
    that differ only there share one measurement)."""
    channel = dataclasses.replace(cfg, name=cfg.channel_name or "full", **{
        k: MethodConfig.__dataclass_fields__[k].default
        for k in ("budget", "budget_rounding", "kernel_size", "pooling", "compress_scope")})
    return _store_bytes(channel, arch, dtype)


@lru_cache(maxsize=512)
def _store_bytes(cfg: MethodConfig, arch: Arch, dtype: str) -> StoreBytes:
    from spark_bench.engine.cache import stackable
    from spark_bench.storage.dispatch import compact_backend

    short, long = 1024, 2048
    a = _synthetic_layer(cfg, arch, getattr(torch, dtype), short)
    b = _synthetic_layer(cfg, arch, getattr(torch, dtype), long)
    h = arch.num_kv_heads

    def fit(x_short: int, x_long: int) -> tuple[float, float]:
        per = (x_long - x_short) / (long - short) / h
        return per, (x_short - per * short * h) / h

    kp, kc = fit(a.key_store.nbytes(), b.key_store.nbytes())
    vp, vc = fit(a.value_store.nbytes(), b.value_store.nbytes())
    return StoreBytes(kp, kc, vp, vc, stackable(a, compact_backend(torch.device("cpu"))) is None)


def stored_tokens(cfg: MethodConfig, arch: Arch, seq_len: int) -> list[int]:
    """Prompt tokens each layer stores under ``cfg``'s eviction (all of them without one)."""
    eviction = Pipeline.from_config(cfg).eviction
    if eviction is None:
        return [seq_len] * arch.num_layers
    return [eviction.stored_tokens(seq_len, i, arch.num_layers, arch.num_kv_heads) for i in range(arch.num_layers)]


# --------------------------------------------------------------------------------------------- one sequence


@dataclass(frozen=True)
class Plan:
    method: str
    bytes_per_token_per_kv_head: float   # keys + values of one stored prompt token, one kv-head, one layer
    bytes_per_head_const: float          # per kv-head per layer, independent of length (query statistics)
    stored_prompt_tokens: int            # averaged over the layers (PyramidKV's differ)
    kv_bytes_per_sequence: float
    weights_bytes: float
    max_batch: int

    def as_row(self) -> dict:
        return {"method": self.method, "bytes/token/kv-head": round(self.bytes_per_token_per_kv_head, 2),
                "stored prompt tokens": self.stored_prompt_tokens,
                "KV GiB/sequence": round(self.kv_bytes_per_sequence / GIB, 4), "max batch": self.max_batch}


def plan(cfg: MethodConfig, model: ModelConfig, seq_len: int, gen_len: int, cap_gib: float,
         overhead_gib: float = 0.0) -> Plan:
    """One sequence of ``seq_len`` prompt + ``gen_len`` decoded tokens under ``cfg``: KV bytes (this config's own
    stores, shared tensors included) and the largest batch of such sequences under ``cap_gib`` after the weights."""
    arch, dtype = Arch.of(model), getattr(torch, model.dtype)
    sb = store_bytes(cfg, arch, model.dtype)
    stored = stored_tokens(cfg, arch, seq_len)
    dense_token = 2 * arch.head_dim * dtype.itemsize  # a decoded token: dense key + value
    per_seq = sum(arch.num_kv_heads * (sb.const + sb.per_token * n + dense_token * gen_len) for n in stored)
    weights = arch.num_params * dtype.itemsize
    free = cap_gib * GIB - weights - overhead_gib * GIB
    return Plan(cfg.label, sb.per_token, sb.const, round(sum(stored) / len(stored)), per_seq, weights,
                max(0, math.floor(free / per_seq)))


def render(plans: list[Plan], model: ModelConfig, seq_len: int, gen_len: int, cap_gib: float) -> str:
    lines = [f"{model.name}: prompt {seq_len} + {gen_len} generated tokens, cap {cap_gib:g} GiB, weights "
             f"{plans[0].weights_bytes / GIB:.2f} GiB", "",
             "| " + " | ".join(plans[0].as_row()) + " |", "|" + "---|" * len(plans[0].as_row())]
    lines += ["| " + " | ".join(str(v) for v in p.as_row().values()) + " |" for p in plans]
    return "\n".join(lines)




# --------------------------------------------------------------------------------------------- a run


def prefill_work(arch: Arch, seq_len: int, itemsize: int, query_stats: bool) -> int:
    """Bytes of one decoder layer's temporaries during the prefill of ``seq_len`` tokens: the larger of attention
    (residual + normed input; q, k, v and their RoPE temporaries, and the GQA copies of k, v the attention function
    makes: 4·(H_q + H_kv)·D per token) and the MLP (residual + normed input; gate, up and their product: 3·I per
    token), plus ExpectedAttention's float32 queries of the whole prompt and their centred copy."""
    attention = 2 * arch.hidden_size + 4 * (arch.num_heads + arch.num_kv_heads) * arch.head_dim
    mlp = 2 * arch.hidden_size + 3 * arch.intermediate_size
    stats = 2 * arch.num_heads * arch.head_dim * 4 if query_stats else 0
    return seq_len * (max(attention, mlp) * itemsize + stats)


STEP_WORK_BOUND = 256 * 2 ** 20  # engine.cache.BatchedLayer.work_bytes: a suffix's query rows go in chunks under it
CUDA_WORKSPACE = 320 * 2 ** 20  # per CUDA device: cuBLAS and cuBLASLt workspaces (PyTorch's defaults, ≤ 32 MiB each
#                                 per stream) and what the runtime loads after the start-up check reads free memory
#                                 (the kernels' modules, library handles): an allowance, not a measurement
FRAGMENTATION = 0.05  # per CUDA device: of the peak above the weights, reserved by the allocator but not handed out
#                       (block rounding; the allocator runs with expandable_segments, engine/clock.py): an allowance


CPU_RUNTIME_PER_LAYER = 2 ** 20  # CPU: resident memory a process's decode batch holds per decoder layer besides its
#                                 tensors (the heap's small blocks; measured on this CPU: SmolLM2's 2K batch 11 MiB
#                                 over 30 layers, since every pass but the decode steps maps its large temporaries —
#                                 runner.run_samples; before that, the heap's holes made it 60–270 MiB, run to run)


def cpu_overhead(arch: Arch, device: Device, batch: int, footprint: Footprint) -> int:
    """CPU: what the process's resident set holds at its peak besides the baseline, the weights and the tensors the
    moments count — the runtime's and the allocator's own memory of a decode batch (the heap glibc keeps for the
    step's many small blocks, which decoding does not map apart: ``engine.clock.mapped_large_blocks``), counted per
    decoder layer on the device (:data:`CPU_RUNTIME_PER_LAYER`, a measured allowance, not a model of the
    allocator)."""
    return device.layers * CPU_RUNTIME_PER_LAYER


def check_work(arch: Arch, prompt: int, suffix: int = 0) -> int:
    """Bytes of the run-time check of a kernel variant (:mod:`spark_bench.engine.fastpaths`), once per variant at
    the decode moment of the run's first batch, one row at a time: the row's keys rebuilt in float32 with their mask
    unpacked, its values in float32 (``9·H_kv·S·D``), and its scores with their exponentials, query rows in chunks
    under :data:`STEP_WORK_BOUND` (``2·H_q·q·S·4``)."""
    h, hq, d = arch.num_kv_heads, arch.num_heads, arch.head_dim
    q_rows = max(1, suffix)
    return 9 * h * prompt * d + 2 * min(hq * q_rows * prompt * 4, max(STEP_WORK_BOUND, hq * prompt * 4))


def step_work(arch: Arch, rows: int, prompt: int, capacity: int, itemsize: int, loose: int, ada: int,
              suffix: int = 0) -> tuple[int, int]:
    """Bytes of one layer's decode-step temporaries for ``rows`` rows, ``(CPU, CUDA)``.

    Both: float32 queries and outputs (and the outputs cast to the model dtype); the per-row path of ``loose`` rows (their keys rebuilt in the model dtype,
    then as float32 for the scores, their values as float32); the decoded tail's float32 copy. CPU (the C++ kernels):
    the padded float32 scores, their softmax and the prompt/tail concatenation of every row, ``3·R·H_q·(S + cap)·4``,
    and AdaKV's unpacked validity (one byte per entry). CUDA (the fused kernel): its partial softmax, ``(D + 2)·4``
    bytes per query row per chunk of at least 512 tokens (:meth:`~spark_bench.storage.segments.FusedTables.chunk_of`),
    no score tensor, and at a decode step the signed walk's per-step tables, one per row and kv-head
    (:func:`~spark_bench.storage.walk_layout.head_floats`; counted whatever the rows' methods, where the walk serves
    the head_dim and the tiles, which need none, do not serve the step: :func:`~spark_bench.storage.walk_layout.tiled`).
    A suffix of ``suffix`` tokens multiplies the query rows, its chunks bounded by :data:`STEP_WORK_BOUND`."""
    h, hq, d = arch.num_kv_heads, arch.num_heads, arch.head_dim
    q_rows = max(1, suffix)
    common = rows * hq * q_rows * d * (8 + (itemsize if itemsize < 4 else 0)) + loose * h * prompt * d * (itemsize + 8) \
        + 2 * rows * h * capacity * d * 4 * (loose > 0)
    cpu = min(3 * rows * hq * q_rows * (prompt + capacity) * 4,
              max(STEP_WORK_BOUND, 3 * rows * hq * (prompt + capacity) * 4))
    cpu += ada * h * prompt
    chunks = -(-prompt // max(512, min(1024, prompt // 8)))
    cuda = min(rows * hq * q_rows * chunks * (d + 2) * 4, max(STEP_WORK_BOUND, rows * hq * chunks * (d + 2) * 4))
    rpm = min(1 << (hq // h - 1).bit_length(), PROGRAM_ROWS)  # (triton_decode.launch_shape)
    if suffix <= 1 and walks(d) and not tiled(PROGRAM_ROWS // rpm, itemsize):
        cuda += rows * h * head_floats(d, rpm) * 4
    return common + cpu, common + cuda


@dataclass(frozen=True)
class Footprint:
    """Predicted bytes of one run's peak (one decode batch), for one device (``layers`` of the model's layers)."""

    device: str
    layers: int
    weights: int
    prefill_kv: int      # the dense keys and values of the longest prompt
    prefill_work: int    # one layer's prefill temporaries (+ captured window queries)
    memo: int            # the sample's shared token scores
    caches: int          # the compressed caches of the largest decode batch
    compress_work: int   # one layer's scoring temporaries
    tail: int            # the batch's decoded tail
    step_work: int       # one layer's decode-step temporaries
    holds_prefill: bool  # the prefill is alive while the batch decodes
    baseline: int = 0    # CPU: the process's resident memory when predicted (what the measured peak starts from)
    check_work: int = 0  # the run-time check of a kernel variant: one row's keys and values rebuilt in float32
    fidelity: int | None = 0  # the teacher-forced fidelity pass after decoding, a fixed group of rows at a time:
    # their tails, one layer's temporaries, one row's logits and log-probabilities, every row's primed suffix
    # (engine/fidelity.py; the decode tail is gone by then);
    # None: the run skips the pass (fidelity=false), no such moment
    overhead: int = 0    # CPU: runtime and allocator overhead the resident set holds besides the tensors
    graph_pool: int = 0  # CUDA: the captured step's private memory pool (its temporaries, not reusable eagerly)
    workspace: int = 0   # CUDA: cuBLAS/cuBLASLt workspaces and the runtime's modules loaded after the check
    fragmentation: int = 0  # CUDA: memory the allocator reserves but cannot hand out (FRAGMENTATION of the peak)

    @property
    def moments(self) -> dict[str, int]:
        held = self.prefill_kv if self.holds_prefill else 0
        out = {"prefill": self.prefill_kv + self.prefill_work,
               "compression": self.prefill_kv + self.memo + self.caches + self.compress_work,
               "decode": held + self.caches + self.tail + max(self.step_work, self.check_work)}
        if self.fidelity is not None:
            out["fidelity"] = held + self.caches + self.fidelity
        return out

    @property
    def peak(self) -> int:
        """What the run's measured peak is compared with: CUDA ``max_memory_allocated``, CPU the resident set."""
        return self.baseline + self.overhead + self.weights + max(self.moments.values())

    @property
    def margin(self) -> int:
        """Memory the device must have besides :attr:`peak`: graph pool, workspaces, fragmentation (CUDA)."""
        return self.graph_pool + self.workspace + self.fragmentation

    @property
    def needed(self) -> int:
        """:attr:`peak` plus :attr:`margin`: what the start-up check compares with the device's free memory."""
        return self.peak + self.margin

    def line(self) -> str:
        moment = max(self.moments, key=self.moments.get)
        base = f"process {self.baseline / GIB:.2f} + " if self.baseline else ""
        base += f"runtime {self.overhead / GIB:.2f} + " if self.overhead else ""
        step = (f" + step work {self.step_work / GIB:.2f}" if self.step_work >= self.check_work else
                f" + check work {self.check_work / GIB:.2f}")
        margin = (f"; + margin {self.margin / GIB:.2f} (graph pool {self.graph_pool / GIB:.2f}, workspaces "
                  f"{self.workspace / GIB:.2f}, fragmentation {self.fragmentation / GIB:.2f}) = "
                  f"{self.needed / GIB:.2f} GiB needed" if self.margin else "")
        return (f"{self.device}: peak {self.peak / GIB:.2f} GiB at {moment} = {base}weights {self.weights / GIB:.2f}"
                f" + prefill KV {self.prefill_kv / GIB:.2f}" + (
                    f" + prefill work {self.prefill_work / GIB:.2f}" if moment == "prefill" else
                    f" + scores {self.memo / GIB:.2f} + caches {self.caches / GIB:.2f} + work "
                    f"{self.compress_work / GIB:.2f}" if moment == "compression" else
                    f" (held: {self.holds_prefill}) + caches {self.caches / GIB:.2f} + fidelity pass "
                    f"{self.fidelity / GIB:.2f}" if moment == "fidelity" else
                    f" (held: {self.holds_prefill}) + caches {self.caches / GIB:.2f} + tail {self.tail / GIB:.2f}"
                    + step) + margin)


@dataclass(frozen=True)
class RunPrediction:
    prompt_tokens: int
    new_tokens: int
    rows: int                  # method configs × decode_samples: the rows a decode batch could hold
    decode_batch: int          # rows per decode batch this prediction is for
    devices: list[Footprint] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return sum(d.peak for d in self.devices)

    @property
    def margin(self) -> int:
        return sum(d.margin for d in self.devices)

    def lines(self) -> list[str]:
        head = (f"memory: prompts ≤ {self.prompt_tokens} tokens, ≤ {self.new_tokens} new; decode batches of "
                f"{self.decode_batch} of {self.rows} rows; predicted peak {self.peak / GIB:.2f} GiB" +
                (f" + margin {self.margin / GIB:.2f} GiB" if self.margin else ""))
        return [head] + [f"memory: {d.line()}" for d in self.devices]


@dataclass(frozen=True)
class Device:
    """Where part of the model lives: its weights' bytes and how many decoder layers."""

    name: str
    weights: int
    layers: int
    first: bool = True  # takes the input embeddings (the decode step's logits land on the last)
    last: bool = True


def _row_groups(configs: list[MethodConfig], arch: Arch, seq_len: int, dtype: str) -> dict:
    """Per-layer bytes the rows of one sample hold, shared tensors once: ``{eviction: [bytes per layer]}``."""
    pipelines = [Pipeline.from_config(c) for c in configs]
    groups: dict = {}
    for cfg, pipeline in zip(configs, pipelines):
        groups.setdefault(pipeline.eviction, []).append(cfg)
    h, d, itemsize = arch.num_kv_heads, arch.head_dim, getattr(torch, dtype).itemsize
    out = {}
    for eviction, members in groups.items():
        stored = stored_tokens(members[0], arch, seq_len)
        per_layer = []
        for n in stored:
            shared = 0 if eviction is None else h * n * d * itemsize  # the gathered tensors, one copy each
            total = shared if any(c.value_ratio == 0 for c in members) else 0
            total += shared if any(c.channel_name is None for c in members) else 0
            if isinstance(eviction, AdaSnapKV):
                total += h * n // 8  # AdaKV's validity bits
            for c in members:
                sb = store_bytes(c, arch, dtype)
                if c.channel_name is not None:
                    total += h * (sb.key_per_token * n + sb.key_const)
                if c.value_ratio:
                    total += h * (sb.value_per_token * n + sb.value_const)
            per_layer.append(total)
        out[eviction] = per_layer
    return out


def predict_run(model: ModelConfig, configs: list[MethodConfig], prompt_tokens: int, new_tokens: int,
                decode_batch: int | None, decode_samples: int, devices: list[Device] | None = None,
                baseline: int = 0, suffix: int | None = None, graph: bool = True,
                answer: int | None = None, fidelity: bool = True) -> RunPrediction:
    """The peak of a run of ``configs`` (``decode_samples`` samples per decode group, ``decode_batch`` rows per
    batch, None = all) on prompts of at most ``prompt_tokens`` tokens and at most ``new_tokens`` decoded ones
    (suffixes included), on ``devices`` (default: one device with every layer). ``baseline``: resident bytes
    already held (CPU). ``suffix``: the most tokens a row runs through its cache in one forward before decoding
    (:func:`~spark_bench.plan.bounds`; None: ``new_tokens`` when a config compresses less than the prompt).
    ``graph``: decode steps may be captured in CUDA graphs (``decode_graph``; their pool is in the margin).
    ``answer``: the most reference-answer tokens the fidelity pass feeds (:func:`~spark_bench.plan.bounds`;
    None: the decoded tokens, ``new_tokens − suffix``). ``fidelity=False``: the run skips that pass (no such moment).

    Besides the tensors, per CUDA device: the run-time check of each kernel variant (:data:`check_work`, at the
    decode moment), and a margin the start-up check adds (:attr:`Footprint.needed`): the captured step's pool (its
    step temporaries again, where the batch can be graphed), :data:`CUDA_WORKSPACE` and :data:`FRAGMENTATION` of
    the peak above the weights. On the CPU the resident set also holds the runtime's and the allocator's own memory
    (:func:`cpu_overhead`), counted in the peak."""
    arch, dtype = Arch.of(model), getattr(torch, model.dtype)
    e = dtype.itemsize
    s, lay = prompt_tokens, arch.num_layers
    rows_total = len(configs) * decode_samples
    batch = min(decode_batch or rows_total, rows_total)
    devices = devices or [Device("cpu", int(arch.num_params * e), lay)]
    # the worst batch: the rows of the plan (sample-major, config order) in chunks of `batch`; a batch's caches go
    # once its rows' fidelity passes are done (runner.run_samples)
    plan_rows = [(k, c) for k in range(decode_samples) for c in configs]
    worst = 0
    for start in range(0, len(plan_rows), batch):
        chunk = plan_rows[start:start + batch]
        total = 0
        for k in {k for k, _ in chunk}:  # per sample, the groups its rows in this chunk use
            mine = [c for kk, c in chunk if kk == k]
            total += sum(sum(b) for b in _row_groups(mine, arch, s, model.dtype).values())
        worst = max(worst, total)
    pipelines = [Pipeline.from_config(c) for c in configs]
    holds = any(p.eviction is None for p in pipelines) or batch < len(configs)
    h, hq, d = arch.num_kv_heads, arch.num_heads, arch.head_dim
    window = max(c.observation_window for c in configs)
    prefill_kv = lay * 2 * h * s * d * e
    captured = lay * hq * window * d * e * (1 + len({c.compress_scope for c in configs}))
    stats = any(p.query_stats for p in pipelines)
    memo = lay * h * s * 4 * len({(ev.window_size, ev.kernel_size, ev.pooling)  # SnapKV.token_scores' memo, one
                                  for ev in (p.eviction for p in pipelines) if isinstance(ev, SnapKV)})  # per key
    compress_work = max([0] + [2 * hq * min(c.observation_window, s) * s * 4 + 2 * h * s * 4 for c in configs
                               if c.eviction_name] + [3 * h * s * d * 4 for c in configs if c.channel_name])
    capacity = new_tokens
    tail = batch * lay * 2 * h * capacity * d * e
    loose = sum(1 for _, c in plan_rows[:batch] if not store_bytes(c, arch, model.dtype).stacks)
    ada = sum(1 for _, c in plan_rows[:batch] if isinstance(Pipeline.from_config(c).eviction, AdaSnapKV))
    scoped = any(c.compress_scope != "prompt" for c in configs)
    suffix = (capacity if scoped else 0) if suffix is None else suffix  # ≤ new tokens (suffix included)
    work = step_work(arch, batch, s, capacity, e, loose, ada, suffix)
    if fidelity and suffix > 1:  # the suffix runs group_size(configs) rows at a time (decode.prime_rows), the steps
        primed = min(batch, group_size(len(configs), suffix))
        steps_work = step_work(arch, batch, s, capacity, e, loose, ada)
        work = tuple(max(a, b) for a, b in zip(steps_work, step_work(arch, primed, s, capacity, e, min(loose, primed),
                                                                     min(ada, primed), suffix)))
    logits = 2 * batch * arch.vocab_size * 4
    check = check_work(arch, s, suffix) if any(store_bytes(c, arch, model.dtype).stacks for c in configs) else 0
    # the teacher-forced fidelity pass (engine/fidelity.py): forwards of group_size(configs) continuations (the
    # reference answer or KL_TOKENS of the full row's tokens) from each row's suffix, which every row of the batch
    # keeps from its priming (decode.prime_rows): their tails, one layer's temporaries with that many query rows and
    # the hidden states read; one continuation's logits at a time (model dtype, float32, log-probabilities); the
    # KL's temporaries and each open sample's full-row log-probabilities
    keep = max(capacity - suffix if answer is None else answer, KL_TOKENS)  # positions read per continuation
    forced = group_size(len(configs), keep)
    steps = suffix + keep
    forced_work = step_work(arch, forced, s, steps, e, min(loose, 1), min(ada, forced), keep)  # (query rows: the
    # fed tokens, the suffix already in the tail; loose rows alone, one row's keys rebuilt at a time: cache.py)
    forced_bytes = forced * lay * 2 * h * steps * d * e + forced * keep * arch.hidden_size * e \
        + batch * lay * 2 * h * suffix * d * e
    open_samples = min(decode_samples, -(-batch // len(configs)) + 1)  # each keeps its full row's log-probabilities
    forced_logits = keep * arch.vocab_size * (e + 4 * (e < 4) + 4) + (open_samples + 3) * KL_TOKENS * \
        arch.vocab_size * 4
    cuda = [dev for dev in devices if dev.name.startswith("cuda") and dev.layers]
    graphed = graph and loose == 0 and len(cuda) == 1  # decode.StepGraph: every row stacked, one device
    out = []
    for dev in devices:
        f = dev.layers / lay
        on_cuda = dev.name.startswith("cuda")
        step = (work[on_cuda] if dev.layers else 0) + (logits if dev.last else 0)
        footprint = Footprint(
            dev.name, dev.layers, dev.weights, int(f * prefill_kv),
            (prefill_work(arch, s, e, stats) if dev.layers else 0) + int(f * captured), int(f * memo), int(f * worst),
            compress_work if dev.layers else 0, int(f * tail), step, holds,
            baseline if dev.name == "cpu" else 0, check if dev.layers else 0,
            fidelity=int(f * forced_bytes) + (forced_work[on_cuda] if dev.layers else 0)
            + (forced_logits if dev.last else 0) if fidelity else None)
        if on_cuda:
            footprint = dataclasses.replace(
                footprint, graph_pool=step if graphed and dev in cuda else 0, workspace=CUDA_WORKSPACE,
                fragmentation=int(FRAGMENTATION * max(footprint.moments.values())))
        elif dev.name == "cpu":
            footprint = dataclasses.replace(footprint, overhead=cpu_overhead(arch, dev, batch, footprint))
        out.append(footprint)
    return RunPrediction(s, new_tokens, rows_total, batch, out)


def placement(model: ModelConfig, device: str) -> list[Device]:
    """Where the weights and layers go: all on ``device`` without a device map; else Accelerate's placement
    (:func:`~spark_bench.models.infer_device_map`) of an empty model of the ``arch`` shape (:meth:`Arch.empty_model`),
    each module's bytes on its device. ``disk`` weights take no device memory; their layers run on the CPU."""
    import re

    from accelerate.utils import compute_module_sizes

    arch = Arch.of(model)
    if model.device_map is None:
        return [Device(str(device), int(arch.num_params * getattr(torch, model.dtype).itemsize), arch.num_layers)]
    from spark_bench.models import infer_device_map

    empty = arch.empty_model(model.dtype)
    device_map = infer_device_map(empty, model)
    sizes = compute_module_sizes(empty)
    name = {k: ("cpu" if v == "disk" else f"cuda:{v}" if isinstance(v, int) else str(v)) for k, v in device_map.items()}
    weights: dict[str, int] = {}
    layers: dict[str, int] = {}
    for module, where in device_map.items():
        weights.setdefault(name[module], 0)
        layers.setdefault(name[module], 0)
        if where != "disk":
            weights[name[module]] += sizes.get(module, 0)
        for key in sizes:  # decoder layers inside this module (or the module itself)
            if (key == module or key.startswith(module + ".") or module == "") and re.search(r"\.layers\.\d+$", key):
                layers[name[module]] += 1
    first = next((name[m] for m in device_map if "embed_tokens" in m or m == ""), None)
    last = next((name[m] for m in device_map if "lm_head" in m or m == ""), None)
    return [Device(d, weights[d], layers[d], d == first, d == last) for d in weights]


def over_limit(prediction: RunPrediction, limits: dict[str, int]) -> list[tuple[Footprint, int]]:
    """The devices whose predicted peak (less the CPU's resident baseline, already in use) exceeds ``limits``."""
    return [(d, limits[d.device]) for d in prediction.devices if d.needed - d.baseline > limits[d.device]]


def choose_decode_batch(model: ModelConfig, configs: list[MethodConfig], prompt_tokens: int, new_tokens: int,
                        decode_batch: int | None, decode_samples: int, devices: list[Device], limits: dict[str, int],
                        baseline: int = 0, suffix: int | None = None, graph: bool = True,
                        answer: int | None = None, fidelity: bool = True
                        ) -> tuple[RunPrediction, list[tuple[Footprint, int]]]:
    """The prediction for ``decode_batch`` rows per batch when the user set it; else for the largest batch whose
    prediction plus margin (:attr:`Footprint.needed`) fits ``limits`` (bytes per device). Also the devices that do
    not fit (empty: it fits)."""
    def at(batch: int) -> tuple[RunPrediction, list]:
        prediction = predict_run(model, configs, prompt_tokens, new_tokens, batch, decode_samples, devices, baseline,
                                 suffix, graph, answer, fidelity)
        return prediction, over_limit(prediction, limits)

    rows = len(configs) * decode_samples
    if decode_batch:
        return at(decode_batch)
    best = at(rows)
    if not best[1]:
        return best
    low, high = 0, rows  # the peak grows with the batch: bisect for the largest batch that fits
    fit = None
    while high - low > 1:
        middle = (low + high) // 2
        tried = at(middle)
        low, high, fit = (middle, high, tried) if not tried[1] else (low, middle, fit)
    return fit if fit is not None else at(1)


def write_report(path: Path, prediction, predictions, loaded: int) -> None:
    """``memory.json``: the peak predicted before the model loaded next to the largest peak measured per decode
    batch (``peak_mem_bytes``: CUDA max allocated over the model's devices, CPU peak resident set), the process's
    resident memory once the model had loaded (``loaded``: checks the baseline + weights part on the CPU), and a
    line."""
    measured = int(predictions.peak_mem_bytes.max()) if len(predictions) else 0
    report = {"predicted_peak_bytes": prediction.peak, "measured_peak_bytes": measured,
              "measured_over_predicted": round(measured / prediction.peak, 4) if prediction.peak else None,
              "resident_after_load_bytes": loaded,
              "prediction": dataclasses.asdict(prediction)}
    path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    LOG.info(f"memory: measured peak {measured / GIB:.2f} GiB, predicted {prediction.peak / GIB:.2f} GiB "
             f"({report['measured_over_predicted']}×)")
