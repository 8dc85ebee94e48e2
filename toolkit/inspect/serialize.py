"""Save and load records without pickle: tensors and arrays in one safetensors file, everything
else as JSON that names each tensor by key. A trace made on a GPU loads on a laptop (tensors come
back on the CPU, with their dtype and values bit-exact).

Folder layout written by `Trace.save(path)`:
    path/trace.json            {"format": 1, "capacity": ..., "num_dropped": ..., "records": [...]}
    path/tensors.safetensors   key "t<N>" -> tensor

JSON encoding: a dataclass is {"__dataclass__": "module:QualName", "fields": {...}} and is rebuilt
only if its module is part of `toolkit`; a tensor is {"__tensor__": key, "device": "cuda:0"}; a
numpy array {"__ndarray__": key}; a tuple {"__tuple__": [...]}; dicts keep string keys; a dict
with int keys (a token id -> Logprob dict) is {"__intdict__": [[key, value], ...]}.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT = 1


class Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def _store(self, t: torch.Tensor) -> str:
        key = f"t{len(self.tensors)}"
        self.tensors[key] = t.detach().to("cpu").contiguous().clone()
        return key

    def encode(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, (int, float)):
            return obj
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, torch.Tensor):
            return {"__tensor__": self._store(obj), "device": str(obj.device)}
        if isinstance(obj, np.ndarray):
            return {"__ndarray__": self._store(torch.from_numpy(np.ascontiguousarray(obj)))}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            cls = type(obj)
            return {"__dataclass__": f"{cls.__module__}:{cls.__qualname__}",
                    "fields": {f.name: self.encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v) for v in obj]}
        if isinstance(obj, list):
            return [self.encode(v) for v in obj]
        if isinstance(obj, dict):
            if obj and all(isinstance(k, int) and not isinstance(k, bool) for k in obj):
                return {"__intdict__": [[k, self.encode(v)] for k, v in obj.items()]}
            if not all(isinstance(k, str) for k in obj):
                raise TypeError(f"cannot save a dict with non-string keys: {list(obj)[:5]}")
            return {k: self.encode(v) for k, v in obj.items()}
        raise TypeError(f"cannot save a {type(obj).__name__} in a trace")


class Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def decode(self, obj: Any) -> Any:
        if isinstance(obj, list):
            return [self.decode(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if "__tensor__" in obj:
            return self.tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return self.tensors[obj["__ndarray__"]].numpy()
        if "__tuple__" in obj:
            return tuple(self.decode(v) for v in obj["__tuple__"])
        if "__intdict__" in obj:
            return {int(k): self.decode(v) for k, v in obj["__intdict__"]}
        if "__dataclass__" in obj:
            cls = _toolkit_class(obj["__dataclass__"])
            values = {k: self.decode(v) for k, v in obj["fields"].items()}
            init = {f.name for f in dataclasses.fields(cls) if f.init}
            inst = cls(**{k: v for k, v in values.items() if k in init})
            for k, v in values.items():
                if k not in init:
                    object.__setattr__(inst, k, v)
            return inst
        return {k: self.decode(v) for k, v in obj.items()}


def _toolkit_class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if module != "toolkit" and not module.startswith("toolkit."):
        raise ValueError(f"refusing to rebuild {name!r}: only toolkit classes are loaded from a trace")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not dataclasses.is_dataclass(obj):
        raise ValueError(f"{name!r} is not a dataclass")
    return obj


def save(path: str | Path, header: dict, records: list) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    enc = Encoder()
    doc = {"format": FORMAT, **header, "records": [enc.encode(r) for r in records]}
    save_file(enc.tensors, str(out / "tensors.safetensors"))
    (out / "trace.json").write_text(json.dumps(doc))
    return out


def load(path: str | Path) -> tuple[dict, list]:
    folder = Path(path)
    if not (folder / "trace.json").is_file():
        raise FileNotFoundError(f"{folder} holds no trace.json (written by Trace.save)")
    doc = json.loads((folder / "trace.json").read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{folder}: trace format {doc.get('format')!r}, this toolkit reads {FORMAT}")
    tensors = load_file(str(folder / "tensors.safetensors")) if (folder / "tensors.safetensors").is_file() else {}
    dec = Decoder(tensors)
    records = [dec.decode(r) for r in doc.pop("records")]
    return doc, records


def equal(a: Any, b: Any) -> bool:
    """Field-by-field equality: tensors and arrays bit-exact (dtype, shape, values; NaN equals
    NaN), devices ignored."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(equal(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    if a.is_floating_point():
        nan_a, nan_b = a.isnan(), b.isnan()
        return torch.equal(nan_a, nan_b) and torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0))
    return torch.equal(a, b)
