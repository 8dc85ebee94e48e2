"""Checkpoint tensors named without being read, then read by the slices a parameter keeps.

`open_checkpoint` lists every tensor of the safetensors files as a `Stored` (its file handle, name,
shape and dtype; nothing read). An architecture's checkpoint conversion (`checkpoint_to_state_dict`:
per-expert tensors concatenated and stacked into a fused [E, ...] one, a shared block's tensors
copied under more names) runs on these as on tensors: `torch.cat` / `torch.stack` of lazy tensors
make a `Joined` that records the join. `read(t, selection)` then reads only the entries a sharded
parameter keeps (`toolkit.layers.parallel.SourceSlice`), mapped through any join onto the stored
tensors, each read by contiguous runs of indices: one `get_slice` read per run, so only those bytes
come off the disk. A tensor whose every entry is kept is read whole (`get_tensor`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from functools import reduce
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from toolkit.errors import CheckpointError
from toolkit.layers.parallel import SourceSlice

# safetensors dtype codes -> torch dtypes
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

Index = tuple[torch.Tensor | None, ...]      # per dim: indices to keep (all >= 0), None for all


class LazyTensor(ABC):
    """A checkpoint tensor not read yet: its shape and dtype, `take` to read entries of it."""
    shape: torch.Size
    dtype: torch.dtype

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    @abstractmethod
    def take(self, index: Index) -> torch.Tensor:
        """The entries `index` (per dim), read."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Sequence = (), kwargs: dict | None = None) -> Any:
        """`torch.cat` / `torch.stack` of lazy tensors (what the checkpoint conversions do) record the
        join; any other function would need the values, which are not read here."""
        kwargs = dict(kwargs or {})
        if func not in (torch.cat, torch.stack):
            raise TypeError(f"{func.__name__} on checkpoint tensors read lazily: only torch.cat and torch.stack "
                            "are recorded (toolkit/models/lazy_checkpoint.py)")
        parts, dim = args[0], (args[1] if len(args) > 1 else kwargs.pop("dim", 0))
        if kwargs or not all(isinstance(p, LazyTensor) for p in parts):
            raise TypeError(f"{func.__name__}: only lazy checkpoint tensors and `dim` are recorded")
        return Joined(list(parts), dim, stacked=func is torch.stack)


class Stored(LazyTensor):
    """A tensor in an open safetensors file."""

    def __init__(self, handle: Any, name: str) -> None:
        view = handle.get_slice(name)
        self.handle, self.name = handle, name
        self.shape = torch.Size(view.get_shape())
        self.dtype = _DTYPES[view.get_dtype()]

    def take(self, index: Index) -> torch.Tensor:
        if all(i is None for i in index):
            return self.handle.get_tensor(self.name)
        view = self.handle.get_slice(self.name)
        spans = [[slice(None)] if i is None else [slice(a, b) for a, b in runs(i)] for i in index]

        def block(d: int, chosen: tuple[slice, ...]) -> torch.Tensor:
            if d == len(spans):
                return view[chosen]
            parts = [block(d + 1, chosen + (s,)) for s in spans[d]]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)

        return block(0, ())


class Joined(LazyTensor):
    """`torch.cat(parts, dim)` or (`stacked`) `torch.stack(parts, dim)` of lazy tensors."""

    def __init__(self, parts: list[LazyTensor], dim: int, stacked: bool) -> None:
        first = parts[0].shape
        d = self.axis = dim % (len(first) + stacked)
        self.parts, self.stacked = parts, stacked
        size = len(parts) if stacked else sum(p.shape[d] for p in parts)
        self.shape = torch.Size((*first[:d], size, *first[d + (not stacked):]))
        self.dtype = reduce(torch.promote_types, (p.dtype for p in parts))

    def take(self, index: Index) -> torch.Tensor:
        d, sel = self.axis, index[self.axis]
        if self.stacked:
            rest = index[:d] + index[d + 1:]
            picks = range(len(self.parts)) if sel is None else sel.tolist()
            return torch.stack([self.parts[i].take(rest) for i in picks], dim=d).to(self.dtype)
        if sel is None:
            return torch.cat([p.take(index) for p in self.parts], dim=d).to(self.dtype)
        ends = torch.tensor([p.shape[d] for p in self.parts]).cumsum(0)
        which = torch.bucketize(sel, ends, right=True)         # the part each kept entry lies in
        starts = torch.cat([torch.zeros(1, dtype=ends.dtype), ends[:-1]])
        out = []
        for a, b in runs(which, step=0):                       # consecutive entries of one part: one take
            part = int(which[a])
            out.append(self.parts[part].take(index[:d] + (sel[a:b] - starts[part],) + index[d + 1:]))
        return torch.cat(out, dim=d).to(self.dtype)


def runs(index: torch.Tensor, step: int = 1) -> list[tuple[int, int]]:
    """Maximal runs of `index` whose entries go up by `step`: as [start, stop) values (step 1: each a
    slice to read), or (step 0) as [start, stop) positions of equal entries."""
    if index.numel() == 0:
        return []
    breaks = (torch.nonzero(index[1:] - index[:-1] != step).flatten() + 1).tolist()
    bounds = list(zip([0, *breaks], [*breaks, index.numel()]))
    if step == 0:
        return bounds
    return [(int(index[a]), int(index[b - 1]) + 1) for a, b in bounds]


def read(t: LazyTensor, selection: SourceSlice | None) -> torch.Tensor:
    """What a parameter with this `selection` (None: all) holds of `t`, reading only that: zeros
    (nothing read) for a zeros selection and for padding entries (-1)."""
    if selection is None:
        return t.take((None,) * t.dim())
    shape = [s if i is None else len(i) for s, i in zip(t.shape, selection.index)]
    if selection.zeros or 0 in shape:
        return torch.zeros(shape, dtype=t.dtype)
    out = t.take(tuple(None if i is None else i[i >= 0] for i in selection.index))
    for d, i in enumerate(selection.index):
        if i is not None and bool((i < 0).any()):      # place the real entries among zero padding
            padded = out.new_zeros((*out.shape[:d], len(i), *out.shape[d + 1:]))
            out = padded.index_copy_(d, torch.nonzero(i >= 0).flatten(), out)
    return out


def open_checkpoint(files: list[Path], stack: ExitStack) -> dict[str, LazyTensor]:
    """Every tensor of `files` by name, unread; the files stay open until `stack` closes."""
    out: dict[str, LazyTensor] = {}
    for f in files:
        try:
            handle = stack.enter_context(safe_open(str(f), framework="pt"))
            out.update({k: Stored(handle, k) for k in handle.keys()})
        except Exception as e:
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
    return out
