"""LeanK (Zhang et al., EMNLP 2025): a static, learned key-channel mask per layer and kv-head.

LeanK keeps, for every older token of a kv-head, the same subset of key channels — ThinK's structured pruning —
but the subset is fixed ahead of time (learned by :mod:`spark_bench.leank`, or one of the masks the authors
release with MInference, ``minference/configs/leank/*.pth``) instead of scored from each prompt's window queries.
Heads keep different numbers of channels (LeanK's global threshold; multiples of its alignment, 32 in its code),
and some keep none.

Here the pruned keys go into ThinK's :class:`~spark_bench.storage.stores.StructuredKeyStore`, so every decode path
(the C++ stacked kernel, the fused CUDA kernel's structured member, ``attention=materialize``) reads it unchanged
and its bytes are counted as ThinK's: kept entries, one channel index per kept channel per head, the dense recent
tokens. A store holds one channel count per layer, so a layer's heads are padded to its largest count with channels
the head prunes, their stored entries zero: ``q_c · 0`` adds nothing, so the logits are exactly those of the mask
(pruned channels read as zero), and the padding is held and counted (as AdaSnapKV's ragged heads are). Where every
head of a layer keeps nothing, one zero channel is stored.

Mask files (:func:`read_mask`; what the user brings, checked whole before a model loads, one line on a problem):

* **LeanK's release format**: ``torch.save`` of a float tensor ``(layers, kv_heads, head_dim)`` of 0/1 (what
  ``minference/modules/leank.py`` ``patch_leank`` loads); a bool or integer tensor, a list of per-layer tensors and
  the numpy boolean array LeanK's ``train.py`` saves are read too. Loaded with ``weights_only``: no code runs.
* **spark-bench's format** (``spark-bench-leank`` writes it; :func:`write_mask`): JSON with ``format``,
  ``version``, ``shape``, ``ratio`` (the pruned fraction; must match the mask), ``align`` (every head's count a
  multiple of it), ``model`` and ``kept``: per layer, per kv-head, the ascending kept channel indices.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from spark_bench.engine.prefill import LayerPrefill
from spark_bench.methods.base import ChannelMethod
from spark_bench.storage.stores import StructuredKeyStore, channel_index_dtype

FORMAT = "spark-bench-leank-mask"
VERSION = 1
RELEASE_ALIGN = 32  # LeanK's ``round_to`` / ``align`` (minference models_patch, LeanK/scripts/*.yaml)
VALID = ("a LeanK mask: spark-bench-leank's mask.json, or a LeanK release .pth (torch.save of a "
         "(layers, kv_heads, head_dim) tensor of 0/1)")


class MaskFileError(ValueError):
    """A mask file that cannot be used: one line, ``<path>: <problem>``."""


@dataclass(frozen=True, eq=False)
class LeanKMask:
    """``kept``: ``(layers, kv_heads, head_dim)`` bool; ``align``: what every head's count is a multiple of (None:
    not recorded); ``meta``: the file's other fields (spark-bench's format)."""

    kept: torch.Tensor
    align: int | None = None
    meta: tuple = ()

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.kept.shape)

    @property
    def ratio(self) -> float:
        """The pruned fraction of all channel entries (LeanK's ratio: one quantile over every layer and head)."""
        return 1.0 - self.kept.float().mean().item()

    def counts(self) -> torch.Tensor:
        """Kept channels per layer and head, ``(layers, kv_heads)``."""
        return self.kept.sum(-1)

    def layer_channels(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(channels, real)``, both ``(kv_heads, T)``: each head's kept channels then, up to the layer's largest
        count T (at least 1), the lowest channels it prunes; ``real`` marks the kept ones. Ascending per head."""
        kept = self.kept[layer_idx]
        t = max(int(kept.sum(-1).max()), 1)
        d = kept.shape[-1]
        rank = torch.arange(d, device=kept.device).expand_as(kept)
        # kept channels first (in order), then the pruned ones (in order): take the first t, then sort
        order = torch.argsort(torch.where(kept, rank, rank + d), dim=-1)[:, :t]
        channels = order.sort(dim=-1).values
        return channels, kept.gather(-1, channels)

    def check_shape(self, layers: int, heads: int, head_dim: int, what: str) -> str | None:
        """Why this mask does not fit a model of that shape (None: it does)."""
        if self.shape != (layers, heads, head_dim):
            return (f"the mask is {' × '.join(map(str, self.shape))} (layers × kv-heads × head_dim) but {what} has "
                    f"{layers} × {heads} × {head_dim}; train one for it with spark-bench-leank")
        return None


def _tensor_of(obj) -> torch.Tensor:
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(x, (torch.Tensor, np.ndarray)) for x in obj):
        parts = [_tensor_of(x) for x in obj]
        if len({tuple(p.shape) for p in parts}) != 1:
            raise ValueError(f"a list of {len(parts)} per-layer tensors of different shapes")
        return torch.stack(parts)
    if isinstance(obj, torch.Tensor):
        return obj
    raise ValueError(f"holds a {type(obj).__name__}, not a tensor")


def _binary(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a bool mask (its values 0/1), or ValueError naming the dtype or the values."""
    if tensor.dtype == torch.bool:
        return tensor
    if tensor.is_complex() or not (tensor.is_floating_point() or tensor.dtype in (
            torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)):
        raise ValueError(f"dtype {str(tensor.dtype).replace('torch.', '')}; a mask is bool, integer or float of 0/1")
    odd = tensor[(tensor != 0) & (tensor != 1)]
    if odd.numel():
        raise ValueError(f"{odd.numel()} entries are neither 0 nor 1 (e.g. {odd.flatten()[0].item():g}); a mask "
                         "holds 0/1 (LeanK's scaling factors are not a mask: train stage 2, or spark-bench-leank)")
    return tensor != 0


def _checked(kept: torch.Tensor, align: int | None = None, ratio=None) -> LeanKMask:
    if kept.dim() != 3 or 0 in kept.shape:
        raise ValueError(f"a mask of shape {tuple(kept.shape)}; a mask is (layers, kv_heads, head_dim)")
    if kept.shape[-1] > 2 ** 15:
        raise ValueError(f"head_dim {kept.shape[-1]} is implausible")
    mask = LeanKMask(kept.contiguous(), align)
    if not bool(kept.any()):
        raise ValueError("the mask keeps no channel at all (ratio 1); a mask keeps at least one")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise ValueError(f"ratio {ratio!r}; the pruned fraction is a number >= 0 and < 1")
        if abs(ratio - mask.ratio) > 0.5 / kept.numel():
            raise ValueError(f"says ratio {ratio:g} but its mask prunes {mask.ratio:.6g} of the channels")
    if align is not None:
        if isinstance(align, bool) or not isinstance(align, int) or not 1 <= align <= kept.shape[-1]:
            raise ValueError(f"align {align!r}; an integer from 1 to head_dim {kept.shape[-1]}")
        bad = (mask.counts() % align).nonzero()
        if len(bad):
            layer, head = bad[0].tolist()
            raise ValueError(f"says align {align} but layer {layer}, kv-head {head} keeps "
                             f"{int(mask.counts()[layer, head])} channels (not a multiple)")
    return mask


def _read_json(path: Path) -> LeanKMask:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"not valid JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"a JSON file without \"format\": \"{FORMAT}\"")
    if data.get("version") != VERSION:
        raise ValueError(f"version {data.get('version')!r}; this spark-bench reads version {VERSION}")
    shape, kept = data.get("shape"), data.get("kept")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(n, int) and n > 0 for n in shape)):
        raise ValueError(f"shape {shape!r}; [layers, kv_heads, head_dim] of positive integers")
    layers, heads, d = shape
    if not (isinstance(kept, list) and len(kept) == layers and all(isinstance(x, list) and len(x) == heads
                                                                   for x in kept)):
        raise ValueError(f"\"kept\" is not {layers} layers of {heads} kv-heads' channel lists (shape {shape})")
    mask = torch.zeros(layers, heads, d, dtype=torch.bool, device="cpu")  # (a mask is read on the host)
    for i, layer in enumerate(kept):
        for h, channels in enumerate(layer):
            if not (isinstance(channels, list) and all(isinstance(c, int) and not isinstance(c, bool)
                                                       and 0 <= c < d for c in channels)
                    and channels == sorted(set(channels))):
                raise ValueError(f"layer {i}, kv-head {h}: the kept channels are ascending distinct integers in "
                                 f"[0, {d}); got {str(channels)[:60]}")
            mask[i, h, channels] = True
    meta = tuple(sorted((k, json.dumps(v)) for k, v in data.items() if k not in ("kept",)))
    checked = _checked(mask, data.get("align"), data.get("ratio"))
    return LeanKMask(checked.kept, checked.align, meta)


def _read_torch(path: Path) -> LeanKMask:
    core = getattr(np, "_core", None) or np.core  # numpy 2 / 1
    numpy_globals = [np.ndarray, np.dtype, core.multiarray._reconstruct,
                     *(getattr(np.dtypes, n) for n in ("BoolDType", "Float32DType", "Float64DType", "Int64DType",
                                                       "UInt8DType") if hasattr(np, "dtypes"))]
    try:
        with torch.serialization.safe_globals(numpy_globals):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 — a damaged zip, a pickle of something other than tensors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"torch.load (weights only) cannot read it: {first[:160]}") from None
    return _checked(_binary(_tensor_of(obj)))


def read_mask(path) -> LeanKMask:
    """The mask in ``path`` (either format, told by its content); :class:`MaskFileError` (one line) otherwise."""
    file = Path(str(path)).expanduser()
    if not file.is_file():
        what = "is a directory, not a file" if file.is_dir() else "does not exist"
        raise MaskFileError(f"leank.mask={path}: {file} {what}; give {VALID}")
    try:
        with open(file, "rb") as f:
            head = f.read(64).lstrip()
        return _read_json(file) if head.startswith(b"{") else _read_torch(file)
    except (ValueError, OSError) as err:
        raise MaskFileError(f"leank.mask={path}: {err}; give {VALID}") from None


@lru_cache(maxsize=16)
def _cached(path: str, mtime_ns: int, size: int) -> LeanKMask:
    return read_mask(path)


def load_mask(path) -> LeanKMask:
    """:func:`read_mask`, read once per file version (path, modification time, size)."""
    file = Path(str(path)).expanduser()
    try:
        stat = file.stat()
    except OSError:
        return read_mask(path)  # says what is wrong
    return _cached(str(file.resolve()), stat.st_mtime_ns, stat.st_size)


def write_mask(mask: LeanKMask, path, **meta) -> Path:
    """Write ``mask`` to ``path``: spark-bench's JSON (``meta`` joins its fields: model, target ratio, training
    summary), or LeanK's release format for a ``.pth``/``.pt`` path (a float32 0/1 tensor; ``meta`` is dropped)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix in (".pth", ".pt"):
        torch.save(mask.kept.float(), tmp)
    else:
        data = {"format": FORMAT, "version": VERSION, "shape": list(mask.shape), "ratio": round(mask.ratio, 12),
                "align": mask.align, **meta,
                "kept": [[torch.nonzero(head).flatten().tolist() for head in layer] for layer in mask.kept]}
        tmp.write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def align_mask(scales: torch.Tensor, ratio: float, align: int) -> torch.Tensor:
    """LeanK's ``sparsify_scaling_factors`` (LeanK/leank/utils.py), step for step in numpy: the ``ratio`` quantile
    of every scale of every layer and head is the threshold; each head keeps its count of scales at or above it,
    rounded to the nearest multiple of ``align`` (half up), and keeps its largest scales (ties in numpy argsort's
    order, as there). ``scales``: ``(layers, kv_heads, head_dim)``; returns the bool mask."""
    layers, heads, d = scales.shape
    flat = scales.detach().flatten().float().cpu().numpy()
    threshold = np.quantile(flat, ratio)
    above = (flat >= threshold).astype(float)
    head_k = (above.reshape(layers, heads, d).sum(-1) + align // 2) // align * align
    ind = np.argsort(flat.reshape(layers, heads, d))[:, :, ::-1]
    rank = np.argsort(ind)
    return torch.from_numpy(np.ascontiguousarray(rank < head_k[:, :, None]))


@dataclass(frozen=True)
class LeanK(ChannelMethod):
    """Prune every older key of layer ``i``, kv-head ``h`` to the channels ``mask[i, h]`` keeps; the last ``recent``
    tokens (LeanK's ``recent_size``) stay dense. ``mask``: the mask file's path (read once per file version)."""

    mask: str | None
    recent: int = 768

    def __post_init__(self):
        if not self.mask:
            raise ValueError("leank needs leank.mask=<file>: " + VALID)

    def compress_keys(self, keys: torch.Tensor, layer: LayerPrefill, layer_idx: int = 0) -> StructuredKeyStore:
        mask = load_mask(self.mask)
        b, h, s, d = keys.shape
        if layer_idx >= mask.shape[0] or mask.shape[1:] != (h, d):
            raise ValueError(f"leank.mask={self.mask}: the mask is {' × '.join(map(str, mask.shape))} (layers × "
                             f"kv-heads × head_dim); layer {layer_idx} of this model has {h} kv-heads of {d} channels")
        n_recent = min(self.recent, s)
        old, recent = keys[..., : s - n_recent, :], keys[..., s - n_recent:, :]
        channels, real = (t.to(keys.device) for t in mask.layer_channels(layer_idx))
        index = channels.expand(b, h, -1)
        gathered = old.gather(-1, index.unsqueeze(-2).expand(b, h, old.shape[-2], -1))
        kept = torch.where(real.expand(b, h, -1).unsqueeze(-2), gathered, torch.zeros((), dtype=keys.dtype,
                                                                                       device=keys.device))
        return StructuredKeyStore(kept=kept, channels=index.to(channel_index_dtype(d)).contiguous(), recent=recent,
                                  head_dim=d)


def check_configs(configs, model) -> None:
    """Each LeanK config's mask file read and checked against the model's shape (its ``arch:`` block or
    ``config.json``) before the model loads; a config without a mask is refused. ValueError, one line."""
    from spark_bench.memory import Arch

    for c in configs:
        if c.channel_name != "leank":
            continue
        path = dict(c.leank).get("mask")
        if not path:
            raise ValueError(f"{c.name} needs leank.mask=<file>: {VALID}")
        mask = load_mask(path)
        try:
            arch = Arch.of(model)
        except ValueError:
            continue  # no shape known before loading: the method checks each layer as it prunes it
        problem = mask.check_shape(arch.num_layers, arch.num_kv_heads, arch.head_dim, f"model {model.name}")
        if problem:
            raise MaskFileError(f"leank.mask={path}: {problem}")


def label_ratio(options) -> str:
    """The pruned fraction a config's mask file holds, for its table label (``?`` where it cannot be read)."""
    path = dict(options).get("mask")
    try:
        return f"{load_mask(path).ratio:.2f}" if path else "?"
    except ValueError:
        return "?"
