"""Prefill a prompt once with a full cache and capture what every compression method needs.

Per layer we keep the post-RoPE keys and values (the full KV cache) and the last ``W`` post-RoPE queries of the
prompt (the observation window of SnapKV / ThinK / SparK). Every method configuration in a sweep compresses
from the same :class:`Prefill`, so the prompt is processed exactly once per sample.

The window queries are recomputed from the attention module's own input inside a forward pre-hook, the same
quantity the official SparK/kvpress code recomputes (``q_proj`` → optional ``q_norm`` → RoPE). The hook is
registered only for the duration of the prefill call; nothing in transformers is patched.

Under ``compress_scope`` ``question`` / ``context`` only a prefix of the prompt is compressed (the rest runs through
the compressed cache). Causal attention makes the prefix's keys and values those of the full prefill, so one prefill
still serves every scope: the hook also records the window queries (and query statistics) ending at each prefix
end, and :meth:`Prefill.at` gives the prefix's view.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from spark_bench.engine.clock import synchronize


@dataclass(frozen=True)
class LayerPrefill:
    """Full-cache state of one attention layer after the prompt.

    keys, values: ``(B, H_kv, S, D)`` post-RoPE, as stored by a dense cache.
    window_queries: ``(B, H_q, W, D)`` post-RoPE queries of the last ``W`` prompt tokens.
    """

    keys: torch.Tensor
    values: torch.Tensor
    window_queries: torch.Tensor
    query_mean: torch.Tensor | None = None  # (B, H_q, D) expected future query (ExpectedAttention), float32
    query_cov: torch.Tensor | None = None   # (B, H_q, D, D) its covariance, float32
    # what each layer hook (:func:`capture_window_queries`' ``hooks``, e.g. a kvpress press's scorer) returned for
    # this layer and prefix, by the hook's ``key``
    hooked: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    # per-sample scratch shared by every method config that compresses this layer: scores that depend only on
    # the prefill (e.g. SnapKV's pooled window attention, the same for every budget) are computed once
    memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    def grouped_window_queries(self, window_size: int) -> torch.Tensor:
        """Window queries averaged within each kv-head's query group (GQA): ``(B, H_kv, W, D)``."""
        q = self.window_queries[:, :, -window_size:]
        b, hq, w, d = q.shape
        return q.view(b, self.num_kv_heads, hq // self.num_kv_heads, w, d).mean(dim=2)


@dataclass(frozen=True)
class Prefill:
    """Everything a method config needs to build its cache and start decoding."""

    layers: tuple[LayerPrefill, ...]
    prompt_length: int
    first_logits: torch.Tensor | None  # (vocab,) float32 logits of the token after the prompt (None for a prefix)
    seconds: float
    prefixes: dict = field(default_factory=dict, compare=False, repr=False)  # (end, q_norm) → layers of a prefix
    has_q_norm: bool = False

    def at(self, end: int, q_norm: bool = True) -> "Prefill":
        """The prefill of the first ``end`` prompt tokens (the same object for the whole prompt): key/value views,
        the window queries ending at ``end`` (recorded by :func:`run_prefill` for each of its ``ends``), the first
        logits only when ``end`` is the whole prompt; with
        ``q_norm=False`` the window queries (and statistics) recomputed without Qwen3's query norm, as the official
        SparK code does (``run_prefill(raw_queries=True)``; the same as ``True`` for models without one). One object
        per (prefix, q_norm), so configs of the same scope share its memo."""
        key = (end, q_norm or not self.has_q_norm)
        if key == (self.prompt_length, True):
            return self
        if key not in self.prefixes:
            raise ValueError(f"the prefill recorded no window queries for a prefix of {end} tokens"
                             f"{'' if key[1] else ' without q_norm'} (recorded: {sorted(self.prefixes)})")
        view = self.prefixes[key]
        if not isinstance(view, Prefill):
            view = self.prefixes[key] = Prefill(
                layers=tuple(LayerPrefill(full.keys[:, :, :end], full.values[:, :, :end], *captured)
                             for full, captured in zip(self.layers, view)),
                prompt_length=end, first_logits=self.first_logits if end == self.prompt_length else None, seconds=0.0)
        return view

    @property
    def first_token(self) -> int:
        return int(self.first_logits.argmax())

    def dense_kv_bytes(self) -> int:
        return sum(t.keys.numel() * t.keys.element_size() + t.values.numel() * t.values.element_size()
                   for t in self.layers)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a decoder-only model, ordered by layer index."""
    mods = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    if not mods:
        raise ValueError(f"{type(model).__name__}: no attention modules with q_proj/layer_idx found")
    return sorted(mods, key=lambda m: m.layer_idx)


def model_key(model: nn.Module) -> tuple:
    """What a compressed context must share with the model it is used with: the checkpoint's name and the cache's
    geometry (layers, kv heads, head dim) and vocabulary."""
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (str(getattr(c, "name_or_path", "")), c.num_hidden_layers, heads, head_dim, c.vocab_size)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def pre_rope_queries(module: nn.Module, hidden: torch.Tensor, q_norm: bool = True) -> torch.Tensor:
    """``(B, H_q, n, D)`` queries before RoPE, computed exactly as the attention module does (``q_norm=False``: without
    the per-head query norm of Qwen3, as the official SparK code / kvpress 0.2.9 recompute them)."""
    b, n, _ = hidden.shape
    q = module.q_proj(hidden).view(b, n, -1, module.head_dim)
    if q_norm and hasattr(module, "q_norm"):  # Qwen3 normalises queries per head before RoPE
        q = module.q_norm(q)
    return q.transpose(1, 2)


def has_q_norm(model: nn.Module) -> bool:
    return any(hasattr(m, "q_norm") for m in attention_modules(model))


def window_queries(module: nn.Module, hidden_states: torch.Tensor, position_embeddings, window: int,
                   q_norm: bool = True) -> torch.Tensor:
    """Post-RoPE queries of the last ``window`` positions, computed exactly as the attention module does."""
    q = pre_rope_queries(module, hidden_states[:, -window:], q_norm)
    cos, sin = position_embeddings
    cos, sin = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
    return q * cos + _rotate_half(q) * sin


@dataclass(frozen=True)
class QueryStatsSpec:
    """Which query statistics ExpectedAttention needs: skip ``n_sink`` tokens, average RoPE over the next
    ``n_future`` positions."""

    n_sink: int = 4
    n_future: int = 512


def mean_rotation(model: nn.Module, start: int, n_future: int, head_dim: int, device) -> torch.Tensor:
    """``(D, D)`` RoPE rotation averaged over positions ``start … start + n_future − 1`` (kvpress' ``R``)."""
    rotary = next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))
    positions = torch.arange(start, start + n_future, device=device).unsqueeze(0)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32, device=device), positions)
    cos, sin = cos[0].float().mean(0), sin[0].float().mean(0)
    half = head_dim // 2
    rotate_half = torch.zeros(head_dim, head_dim, device=device)  # rotate_half(x) = P x
    rotate_half[:half, half:] = -torch.eye(half, device=device)
    rotate_half[half:, :half] = torch.eye(half, device=device)
    return torch.diag(cos) + torch.diag(sin) @ rotate_half


def query_statistics(module: nn.Module, hidden: torch.Tensor, spec: QueryStatsSpec, rotation: torch.Tensor,
                     q_norm: bool = True):
    """Mean ``(B, H_q, D)`` and covariance ``(B, H_q, D, D)`` of the prompt's queries after the mean rotation (a
    prompt no longer than the sinks: of all its queries; ExpectedAttention keeps such a prompt whole anyway)."""
    skip = spec.n_sink if hidden.shape[1] > spec.n_sink else 0
    q = pre_rope_queries(module, hidden[:, skip:], q_norm).float()
    mean = q.mean(dim=2)
    centred = q - mean.unsqueeze(2)
    cov = centred.transpose(-1, -2) @ centred / q.shape[2]
    return mean @ rotation.T, rotation @ cov @ rotation.T


@contextmanager
def capture_window_queries(model: nn.Module, window: int, query_stats: QueryStatsSpec | None = None,
                           prompt_length: int = 0, ends: tuple[int, ...] = (), raw: bool = False, hooks: tuple = ()):
    """Within the block, record each layer's window queries into the yielded dict ``{layer_idx: tensor}``
    (and, with ``query_stats``, ``{("stats", layer_idx): (mean, cov)}``); for each prefix end in ``ends``, the same
    quantities of the prompt's first ``end`` tokens under ``{(end, True, layer_idx): (window queries, mean, cov)}``;
    with ``raw``, also without the query norm under ``{(end, False, layer_idx): …}`` (whole prompt included).

    ``hooks``: layer hooks called after each attention forward, as kvpress calls a press's ``forward_hook``: ``hook(
    module, hidden_states, keys, values, attentions, kwargs)`` with the layer's input, its cached keys and values,
    its attention weights (None unless the model returns them) and the forward's keyword arguments, all cut to the
    whole prompt and to each prefix end; what it returns is kept under ``{("hook", hook.key, end, layer_idx): …}``
    (:attr:`LayerPrefill.hooked`). A hook with an ``attached(model)`` context manager holds it around the block."""
    captured: dict = {}
    handles = []
    rotations: dict = {}

    def record(module, hidden, position_embeddings, end, q_norm=True):
        cos, sin = position_embeddings
        queries = window_queries(module, hidden[:, :end], (cos[:, :end], sin[:, :end]), min(window, end), q_norm)
        if query_stats is None:
            return queries, None, None
        if end not in rotations:
            rotations[end] = mean_rotation(model, end, query_stats.n_future, module.head_dim, hidden.device)
        return (queries, *query_statistics(module, hidden[:, :end], query_stats, rotations[end], q_norm))

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        length = prompt_length or hidden.shape[1]
        queries, *stats = record(module, hidden, kwargs["position_embeddings"], length)
        captured[module.layer_idx] = queries
        if query_stats is not None:
            captured["stats", module.layer_idx] = tuple(stats)
        for end in ends:
            captured[end, True, module.layer_idx] = record(module, hidden, kwargs["position_embeddings"], end)
        for end in (*ends, length) if raw else ():
            captured[end, False, module.layer_idx] = record(module, hidden, kwargs["position_embeddings"], end,
                                                            q_norm=False)

    def after(module, args, kwargs, output):
        cache = kwargs.get("past_key_values")
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        layer = cache.layers[module.layer_idx]
        attentions = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        length = prompt_length or hidden.shape[1]
        for end in (length, *ends):
            cut = kwargs if end == length else _prefix_kwargs(kwargs, end)
            for h in hooks:
                captured["hook", h.key, end, module.layer_idx] = h(
                    module, hidden[:, :end], layer.keys[:, :, :end], layer.values[:, :, :end],
                    None if attentions is None else attentions[..., :end, :end], cut)

    for mod in attention_modules(model):
        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
        if hooks:
            handles.append(mod.register_forward_hook(after, with_kwargs=True))
    with ExitStack() as attached:
        for h in hooks:
            if hasattr(h, "attached"):
                attached.enter_context(h.attached(model))
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()


def _prefix_kwargs(kwargs: dict, end: int) -> dict:
    """An attention forward's keyword arguments as a forward of the prompt's first ``end`` tokens would see them."""
    out = dict(kwargs)
    cos, sin = kwargs["position_embeddings"]
    out["position_embeddings"] = (cos[:, :end], sin[:, :end])
    for name in ("cache_position", "position_ids"):
        if isinstance(kwargs.get(name), torch.Tensor):
            out[name] = kwargs[name][..., :end]
    if isinstance(kwargs.get("attention_mask"), torch.Tensor):
        out["attention_mask"] = kwargs["attention_mask"][..., :end, :end]
    return out


@torch.inference_mode()
def run_prefill(model: nn.Module, input_ids: torch.Tensor, window: int,
                query_stats: QueryStatsSpec | None = None, ends: tuple[int, ...] = (),
                raw_queries: bool = False, hooks: tuple = ()) -> Prefill:
    """Process the whole prompt once with a full dense cache; capture keys, values and window queries
    (and the query statistics ExpectedAttention needs, when asked), also for the prefixes ending at ``ends`` and,
    with ``raw_queries`` on a model with a query norm, without it (:meth:`Prefill.at`); and what each layer hook
    returns (:func:`capture_window_queries`)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"run_prefill expects input_ids of shape (1, S), got {tuple(input_ids.shape)}")
    start = time.perf_counter()
    length = input_ids.shape[1]
    ends = tuple(sorted({e for e in ends if e != length}))
    if any(not 0 < e < length for e in ends):
        raise ValueError(f"prefix ends {ends} must lie in 1 … {length - 1} (prompt of {length} tokens)")
    window = min(window, length)
    cache = DynamicCache(config=model.config)
    normed = has_q_norm(model)
    raw = raw_queries and normed
    with capture_window_queries(model, window, query_stats, length, ends, raw, hooks) as queries:
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return assemble_prefill(cache, queries, out.logits[0, -1].float(), ends, raw, normed, start)


def assemble_prefill(cache: DynamicCache, queries: dict, first_logits: torch.Tensor, ends: tuple[int, ...],
                     raw: bool, normed: bool, start: float) -> Prefill:
    """The :class:`Prefill` of a finished forward: its dense cache's keys and values, the window queries (and
    statistics) :func:`capture_window_queries` recorded, its last logits; timed from ``start`` (perf_counter)."""
    length = cache.get_seq_length()
    hook_keys = {k[1] for k in queries if isinstance(k, tuple) and k[0] == "hook"}

    def hooked(end: int, i: int) -> dict:
        return {h: queries["hook", h, end, i] for h in hook_keys}

    layers = tuple(
        LayerPrefill(layer.keys, layer.values, queries[i], *queries.get(("stats", i), (None, None)), hooked(length, i))
        for i, layer in enumerate(cache.layers)
    )
    keys = [(end, True) for end in ends] + ([(end, False) for end in (*ends, length)] if raw else [])
    prefixes = {key: tuple((*queries[(*key, i)], hooked(key[0], i)) for i in range(len(layers))) for key in keys}
    synchronize(first_logits.device)  # the prefill's device time, not its launch time
    return Prefill(layers=layers, prompt_length=length, first_logits=first_logits,
                   seconds=time.perf_counter() - start, prefixes=prefixes, has_q_norm=normed)
