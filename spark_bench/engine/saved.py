"""A compressed context in one safetensors file: its compact stores as they are held (every tensor once, no dense
key or value rebuilt), and a JSON header that says how to put them back together.

The header describes the context's object tree: dataclasses (stores, recoveries, the method config) by their
``module:qualname`` inside ``spark_bench`` and their fields, tensors by their name in the file, dtypes, tuples.
Loading rebuilds the same objects, each layer's tensors on the device of the model layer that reads them (a device
map keeps working). The file holds the stores' bytes plus, when the whole prompt was compressed, the prefill's last
logits (vocab × 4 bytes: the first answer token comes from them), plus the header.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from spark_bench.engine.cache import CompressedCache, StoredLayer
from spark_bench.engine.prefill import attention_modules, model_key

FORMAT = "spark-bench-context/1"
CONTEXT_FIELDS = ("input_ids", "end", "first_logits", "dense_bytes", "method", "label", "prefill_s", "compress_s",
                  "model_key", "source")


class _Writer:
    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.names: dict[int, str] = {}

    def encode(self, value):
        if isinstance(value, torch.Tensor):
            if id(value) not in self.names:  # a tensor two objects share is written once
                name = f"t{len(self.tensors)}"
                self.names[id(value)] = name
                self.tensors[name] = value.detach().to("cpu").contiguous().clone()
            return {"tensor": self.names[id(value)]}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            cls = type(value)
            if not cls.__module__.startswith("spark_bench."):
                raise TypeError(f"cannot save a {cls.__module__}.{cls.__qualname__}")
            return {"object": f"{cls.__module__}:{cls.__qualname__}",
                    "fields": {f.name: self.encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
        if isinstance(value, tuple):
            return {"tuple": [self.encode(v) for v in value]}
        if isinstance(value, list):
            return [self.encode(v) for v in value]
        if isinstance(value, dict):
            return {"dict": {str(k): self.encode(v) for k, v in value.items()}}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"cannot save a {type(value).__name__} in a compressed context")


class _Reader:
    def __init__(self, handle):
        self.handle = handle

    def decode(self, value, device: torch.device):
        if isinstance(value, list):
            return [self.decode(v, device) for v in value]
        if not isinstance(value, dict):
            return value
        if "tensor" in value:
            return self.handle.get_tensor(value["tensor"]).to(device)
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        if "tuple" in value:
            return tuple(self.decode(v, device) for v in value["tuple"])
        if "dict" in value:
            return {k: self.decode(v, device) for k, v in value["dict"].items()}
        module, _, name = value["object"].partition(":")
        if not module.startswith("spark_bench."):
            raise ValueError(f"path: the file names a class outside spark_bench ({value['object']})")
        cls = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"path: {value['object']} is not a stored object")
        return cls(**{k: self.decode(v, device) for k, v in value["fields"].items()})


def save_context(context, path: str | Path) -> Path:
    """Write ``context`` (its stores, not a decoded tail) to ``path`` (safetensors)."""
    writer = _Writer()
    layers = []
    for layer in context.cache.layers:
        layers.append({"keys": writer.encode(layer.key_store), "values": writer.encode(layer.value_store),
                       "valid_bits": writer.encode(layer.valid_bits)})
    header = {"format": FORMAT, "attention": context.cache.attention, "layers": layers,
              "context": {name: writer.encode(getattr(context, name)) for name in CONTEXT_FIELDS}}
    path = Path(path)
    save_file(writer.tensors, str(path), metadata={"spark_bench": json.dumps(header)})
    return path


def load_context(cls: type, path: str | Path, model: nn.Module):
    """Read a context (a ``cls``, :class:`~spark_bench.engine.generate.CompressedContext`) :func:`save_context` wrote, for ``model`` (the same checkpoint's geometry and vocabulary;
    refused in one line otherwise), each layer's stores on the device of the model layer that reads them."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: {path} is not a file")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        header = json.loads((handle.metadata() or {}).get("spark_bench", "null"))
    except Exception as exc:  # noqa: BLE001 — safetensors raises its own types for damaged files
        raise ValueError(f"path: {path} is not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"path: {path} holds no spark-bench context (format {FORMAT})")
    reader = _Reader(handle)
    fields = {name: reader.decode(value, torch.device("cpu")) for name, value in header["context"].items()}
    saved, key = tuple(fields["model_key"]), model_key(model)
    if saved[1:] != key[1:]:
        raise ValueError(f"model: the context was compressed by {saved[0]!r} ({saved[1]} layers, {saved[2]} kv "
                         f"heads × {saved[3]}, vocabulary {saved[4]}); this model is {key[0]!r} ({key[1]} layers, "
                         f"{key[2]} kv heads × {key[3]}, vocabulary {key[4]})")
    devices = [m.k_proj.weight.device for m in attention_modules(model)]
    layers = [StoredLayer(reader.decode(layer["keys"], device), reader.decode(layer["values"], device),
                          None) for layer, device in zip(header["layers"], devices)]
    for stored, layer, device in zip(layers, header["layers"], devices):
        stored.valid_bits = reader.decode(layer["valid_bits"], device)
    fields["model_key"] = key
    first = fields["first_logits"]
    fields["first_logits"] = None if first is None else first.to(model.get_input_embeddings().weight.device)
    return cls(CompressedCache(layers, header["attention"]), **fields)
