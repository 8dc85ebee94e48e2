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
    sampled ids' copy). On the CPU, a plain clone."""
    if t.device.type == "cpu":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
