"""From a method configuration to a compressed cache: evict tokens, then prune key (and value) channels, per layer.

The configuration itself (:class:`~spark_bench.methods.config.MethodConfig`, its names, options and labels) is
:mod:`spark_bench.methods.config`; its names are also importable from here, as before the two were apart."""

from __future__ import annotations

import time
from dataclasses import dataclass

from spark_bench.engine.clock import synchronize
from spark_bench.engine.cache import CompressedCache, StoredLayer
from spark_bench.engine.prefill import LayerPrefill, Prefill, QueryStatsSpec
from spark_bench import usercode
from spark_bench.methods import registry
from spark_bench.methods.base import ChannelMethod, EvictionMethod, gather_tokens, selection_problem
from spark_bench.methods.builtin import (
    CHANNEL_METHODS, DISPLAY, EVICTION_METHODS, METHOD_NAMES, METHOD_OPTIONS, VALUE_METHODS,
)
from spark_bench.methods.channel.value_norm import ValueNorm
from spark_bench.methods.config import (
    CHOICES, COMPRESS_SCOPES, MORE_NAMES, OPTION_TYPES, MethodConfig, _option_text, build_part, check_name, display,
    option_names, option_readers, part_kind, ratio_needed, relevant_options, sweep_labels, tell_apart, unread_option,
)
from spark_bench.storage.stores import DenseStore

__all__ = [  # the pipeline, and the configuration's names at their path from before the split
    "CHANNEL_METHODS", "CHOICES", "COMPRESS_SCOPES", "DISPLAY", "EVICTION_METHODS", "METHOD_NAMES", "METHOD_OPTIONS",
    "MORE_NAMES", "OPTION_TYPES", "MethodConfig", "Pipeline", "_option_text", "build_channel", "build_eviction",
    "build_part", "check_name", "display", "option_names", "option_readers", "part_kind", "ratio_needed",
    "relevant_options", "sweep_labels", "tell_apart", "unread_option",
]


def build_eviction(cfg: MethodConfig) -> EvictionMethod | None:
    return build_part(cfg.eviction_name, cfg) if cfg.eviction_name else None


def build_channel(cfg: MethodConfig) -> ChannelMethod | None:
    return build_part(cfg.channel_name, cfg) if cfg.channel_name else None


@dataclass(frozen=True)
class Pipeline:
    """Eviction (optional), then key-channel pruning (optional) and value pruning (optional), for every layer."""

    config: MethodConfig
    eviction: EvictionMethod | None
    channel: ChannelMethod | None
    values: ValueNorm | None  # or a channel method's own value pruning (builtin.VALUE_METHODS: Mustafar's)
    label: str = ""  # the table row (from :func:`sweep_labels` in a sweep; the config's own label alone)

    @classmethod
    def from_config(cls, cfg: MethodConfig, label: str | None = None) -> "Pipeline":
        own_values = VALUE_METHODS.get(cfg.channel_name)
        values = None if not cfg.value_ratio else own_values(cfg) if own_values else ValueNorm(
            cfg.value_ratio, cfg.value_score, cfg.value_fill)
        return cls(config=cfg, eviction=build_eviction(cfg), channel=build_channel(cfg), values=values,
                   label=label or cfg.label)

    @property
    def prefill_hooks(self) -> tuple:
        """Layer hooks its methods run during the prefill (a kvpress press's scorer: ``prefill_hooks``)."""
        return (*getattr(self.eviction, "prefill_hooks", ()), *getattr(self.channel, "prefill_hooks", ()))

    @property
    def query_stats(self) -> QueryStatsSpec | None:
        """What the prefill must capture for this pipeline beyond keys, values and window queries."""
        if self.eviction is not None and self.eviction.needs_query_stats:
            return QueryStatsSpec(n_sink=self.config.n_sink)
        return None

    def evict(self, prefill: Prefill, selections: dict | None = None) -> tuple[list[tuple], float]:
        """Per layer, the keys and values the eviction method keeps and their validity mask (the prefill's own
        tensors without eviction), and the seconds the selection took. ``selections`` memoises this across the
        pipelines of one sample: configs that share an eviction method (``snapkv``, ``snapkv+think``,
        ``snapkv+spark``, … at one budget) score tokens once and hold the same evicted key/value tensors (one copy in
        memory; batched decoding reads shared values once). The seconds are those of the one computation, so each
        config that reuses it still reports what compressing under it alone costs."""
        if self.eviction is None:
            return [(layer.keys, layer.values, None) for layer in prefill.layers], 0.0
        if selections is not None and self.eviction in selections:
            return selections[self.eviction]
        start, n = time.perf_counter(), len(prefill.layers)
        evicted = []
        own = registry.is_own(self.eviction)
        for i, layer in enumerate(prefill.layers):
            selection = self._checked_select(layer, i, n) if own else self.eviction.select(layer, i, n)
            evicted.append((layer.keys, layer.values, None) if selection is None else (
                gather_tokens(layer.keys, selection.indices), gather_tokens(layer.values, selection.indices),
                selection.valid))
        synchronize([layer.keys.device for layer in prefill.layers])  # the selection's device time
        result = (evicted, time.perf_counter() - start)
        if selections is not None:
            selections[self.eviction] = result
        return result

    def _checked_select(self, layer: LayerPrefill, layer_idx: int, num_layers: int):
        """A method of one's own's ``select`` through the user-code boundary (:func:`spark_bench.usercode.call`):
        what it raises, or a selection that is not a valid :class:`~spark_bench.methods.base.TokenSelection`
        (:func:`~spark_bench.methods.base.selection_problem`), is one :class:`~spark_bench.usercode.UserCodeError`
        line naming the method, the layer and what was wrong (the runner adds the sample). The paper's methods are
        not checked on this hot path (their tests check them by the same rule)."""
        name, what = self.config.eviction_name, f"select() in layer {layer_idx}"
        selection = usercode.call(name, what, self.eviction.select, layer, layer_idx, num_layers)
        b, h, s = layer.keys.shape[:3]
        problem = selection_problem(selection, b, h, s, layer.keys.device)
        if problem:
            raise usercode.UserCodeError(f"{what} {problem} (TokenSelection, spark_bench/methods/base.py)", name)
        return selection

    def _checked_keys(self, keys, layer: LayerPrefill, layer_idx: int):
        """A channel method of one's own's ``compress_keys`` through the boundary: what it raises, or a result
        that is not a store of the keys' shape, is one :class:`~spark_bench.usercode.UserCodeError` line."""
        name, what = self.config.channel_name, f"compress_keys() in layer {layer_idx}"
        store = usercode.call(name, what, self.channel.compress_keys, keys, layer, layer_idx)
        missing = [a for a in ("shape", "materialize", "logits", "nbytes") if not hasattr(store, a)]
        if missing or isinstance(store, type):
            lacks = f"it lacks {', '.join(missing)}" if missing else "a class, not an object"
            raise usercode.UserCodeError(f"{what} returned {type(store).__name__}, not a key store ({lacks}; "
                                         "spark_bench/storage/stores.py)", name)
        shape = usercode.call(name, f"{what}: the store's shape", lambda: tuple(store.shape))
        if shape != tuple(keys.shape):
            raise usercode.UserCodeError(f"{what} returned a store of shape {shape} for keys of shape "
                                         f"{tuple(keys.shape)}; a store holds every key it is given", name)
        return store

    def compress_layer(self, layer: LayerPrefill, layer_idx: int, keys, values, valid) -> StoredLayer:
        """Prune the key channels (and values) of one layer's evicted ``keys`` / ``values`` (a channel method of
        one's own through :meth:`_checked_keys`)."""
        if self.channel is not None and registry.is_own(self.channel):
            key_store = self._checked_keys(keys, layer, layer_idx)
        else:
            key_store = self.channel.compress_keys(keys, layer, layer_idx) if self.channel else DenseStore(keys)
        value_store = self.values.compress_values(values) if self.values else DenseStore(values)
        return StoredLayer(key_store, value_store, valid)

    def build_cache(self, prefill: Prefill, attention: str = "compact",
                    selections: dict | None = None) -> tuple[CompressedCache, float]:
        """The compressed cache for this config (never modifies ``prefill``) and the seconds compressing under it
        alone takes: its token selection (shared through ``selections``, counted in every config that uses it)
        plus its own channel and value pruning."""
        evicted, select_s = self.evict(prefill, selections)
        start = time.perf_counter()
        layers = [self.compress_layer(layer, i, *kept)
                  for i, (layer, kept) in enumerate(zip(prefill.layers, evicted))]
        synchronize([layer.keys.device for layer in prefill.layers])  # the pruning's device time
        return CompressedCache(layers, attention), select_s + time.perf_counter() - start
