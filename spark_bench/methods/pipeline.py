"""From a method configuration to a compressed cache: evict tokens, then prune key channels, per layer."""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, fields

from spark_bench.engine.cache import CompressedCache, StoredLayer
from spark_bench.engine.prefill import LayerPrefill, Prefill
from spark_bench.methods.base import ChannelMethod, EvictionMethod, gather_tokens
from spark_bench.methods.channel.spark import SparK
from spark_bench.methods.channel.think import ThinK
from spark_bench.methods.eviction.snapkv import SnapKV
from spark_bench.methods.eviction.streamingllm import StreamingLLM
from spark_bench.storage.stores import DenseKeyStore

# method name → builder from a MethodConfig (one entry per method module)
EVICTION_METHODS = {
    "snapkv": lambda c: SnapKV(budget=c.budget, window_size=c.window_size, kernel_size=c.kernel_size,
                               pooling=c.pooling),
    "streamingllm": lambda c: StreamingLLM(budget=c.budget, n_sink=c.n_sink),
}
CHANNEL_METHODS = {
    "think": lambda c: ThinK(ratio=c.ratio, window_size=c.window_size, keep_window=c.think_keep_window),
    "spark": lambda c: SparK(ratio=c.ratio, window_size=c.window_size, saliency=c.saliency, recovery=c.recovery),
}
DISPLAY = {"full": "Full", "snapkv": "SnapKV", "streamingllm": "StreamingLLM", "think": "ThinK", "spark": "SparK"}
METHOD_NAMES = ("full", *EVICTION_METHODS, *CHANNEL_METHODS,
                *(f"{e}+{c}" for e, c in itertools.product(EVICTION_METHODS, CHANNEL_METHODS)))



@dataclass(frozen=True)
class MethodConfig:
    """One point of a sweep. ``budget``: KV size in tokens (≥ 1) or a fraction of the prompt (< 1);
    ``ratio``: key-channel pruning ratio λ. Every field except ``name`` is also a top-level config key."""

    name: str = "full"
    budget: float = 0.2
    ratio: float = 0.0
    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    saliency: str = "official"
    recovery: str = "degenerate"
    think_keep_window: bool = True
    n_sink: int = 4

    def __post_init__(self):
        if self.name not in METHOD_NAMES:
            raise ValueError(f"unknown method {self.name!r}; valid: {', '.join(METHOD_NAMES)}")
        if not 0 <= self.ratio < 1:
            raise ValueError(f"ratio must be in [0, 1), got {self.ratio}")

    @classmethod
    def from_dict(cls, values: dict) -> "MethodConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown method option(s) {unknown}; valid: {sorted(known)}")
        return cls(**values)

    @property
    def eviction_name(self) -> str | None:
        head = self.name.split("+")[0]
        return head if head in EVICTION_METHODS else None

    @property
    def channel_name(self) -> str | None:
        tail = self.name.split("+")[-1]
        return tail if tail in CHANNEL_METHODS else None

    @property
    def label(self) -> str:
        """Row label in tables, e.g. ``SnapKV+SparK(0.8) @128``."""
        text = "+".join(DISPLAY[p] for p in self.name.split("+"))
        if self.channel_name:
            text += f"({self.ratio:g})"
        if self.eviction_name:
            text += f" @{self.budget:g}"
        return text

    def to_dict(self) -> dict:
        return asdict(self)


def build_eviction(cfg: MethodConfig) -> EvictionMethod | None:
    return EVICTION_METHODS[cfg.eviction_name](cfg) if cfg.eviction_name else None


def build_channel(cfg: MethodConfig) -> ChannelMethod | None:
    return CHANNEL_METHODS[cfg.channel_name](cfg) if cfg.channel_name else None


@dataclass(frozen=True)
class Pipeline:
    """Eviction (optional) followed by channel pruning (optional) for every layer of a prefill."""

    config: MethodConfig
    eviction: EvictionMethod | None
    channel: ChannelMethod | None

    @classmethod
    def from_config(cls, cfg: MethodConfig) -> "Pipeline":
        return cls(config=cfg, eviction=build_eviction(cfg), channel=build_channel(cfg))

    def compress_layer(self, layer: LayerPrefill, layer_idx: int, num_layers: int) -> StoredLayer:
        keys, values = layer.keys, layer.values
        if self.eviction is not None:
            keep = self.eviction.keep_indices(layer, layer_idx, num_layers)
            if keep is not None:
                keys, values = gather_tokens(keys, keep), gather_tokens(values, keep)
        store = self.channel.compress_keys(keys, layer) if self.channel is not None else DenseKeyStore(keys)
        return StoredLayer(store, values)

    def build_cache(self, prefill: Prefill) -> tuple[CompressedCache, float]:
        """The compressed cache for this config (never modifies ``prefill``) and the seconds it took."""
        start = time.perf_counter()
        n = len(prefill.layers)
        cache = CompressedCache([self.compress_layer(layer, i, n) for i, layer in enumerate(prefill.layers)])
        return cache, time.perf_counter() - start
