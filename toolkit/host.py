"""Host data to the device, and device data to the host, without blocking the host (MRV2 stages
its inputs the same way).

A copy from pageable host memory to a CUDA device first synchronises the stream. Host arrays are
therefore copied through pinned memory: `Tensor.pin_memory()` takes a block from PyTorch's caching
host allocator, which does not reuse it until the non_blocking copy that reads it has run. On the
CPU nothing is copied: the tensor shares the array's memory, as `torch.from_numpy` does.

`TRANSFERS` counts the host-to-device transfers issued through this module (on a CPU: the ones a
GPU would make), by function: what a decode step costs besides its kernels (tests pin it).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
from collections import Counter

import numpy as np
import torch

TRANSFERS: Counter[str] = Counter()


def staged(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array or CPU tensor, readable by a non_blocking copy to `device`."""
    t = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    return t.pin_memory() if device.type == "cuda" else t


def to_device(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor on `device` holding `host`, copied without blocking the host."""
    TRANSFERS["to_device"] += 1
    return staged(host, device).to(device, non_blocking=True)


def copy_to(dst: torch.Tensor, host: np.ndarray | torch.Tensor) -> None:
    """dst[...] = host, copied without blocking the host."""
    TRANSFERS["copy_to"] += 1
    dst.copy_(staged(host, dst.device), non_blocking=True)


def copy_pinned(dst: torch.Tensor, pinned: torch.Tensor) -> None:
    """dst[...] = pinned (a host tensor already in pinned memory: a persistent staging buffer),
    without blocking the host. On a CPU runner dst is that same memory: the copy is then a no-op,
    kept so that a step's ops (and their count, toolkit/inspect/launches.py) match a GPU's."""
    TRANSFERS["copy_pinned"] += 1
    dst.copy_(pinned, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`. From a CUDA device the copy lands in pinned memory without blocking the
    host: read it only after the stream has passed the copy (e.g. after the step's one sync, the
    sampled ids' copy). On the CPU, a copy in memory of its own (`mapped_empty`: recorded data
    lives long; below MAPPED_MIN_BYTES a clone, one op where an empty tensor and a copy are two)."""
    if t.device.type == "cpu":
        if t.nbytes < MAPPED_MIN_BYTES:
            return t.clone(memory_format=torch.contiguous_format)
        return mapped_empty(tuple(t.shape), t.dtype).copy_(t)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


MAPPED_MIN_BYTES = 1 << 20
# Linux: fault the pages in with the mapping, in one go (the data is written at once anyway)
_MAP_FLAGS = ({"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE}
              if hasattr(mmap, "MAP_POPULATE") else {})


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for data kept a long time (recorded states): from MAPPED_MIN_BYTES
    up, in memory mapped for it alone, which goes back to the OS the moment the tensor dies. From
    the heap, large blocks that live long between short-lived ones fragment it: the process then
    keeps memory it no longer uses (measured: 2 GiB over a 1 GiB trace budget), which a bound on
    the trace's bytes must not allow."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MAPPED_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    buffer = np.frombuffer(mmap.mmap(-1, nbytes, **_MAP_FLAGS), dtype=np.uint8)
    return torch.from_numpy(buffer).view(dtype).view(shape)


def _libc_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):          # not glibc (macOS, Windows, musl)
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere). After a
    large drop of recorded data, the heap's freed blocks sit between live ones and would otherwise
    stay in the process's resident memory."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
