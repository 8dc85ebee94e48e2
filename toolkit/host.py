"""Host data to the device without blocking the host (MRV2 stages its inputs the same way).

A copy from pageable host memory to a CUDA device first synchronises the stream. Host arrays are
therefore copied through pinned memory: `Tensor.pin_memory()` takes a block from PyTorch's caching
host allocator, which does not reuse it until the non_blocking copy that reads it has run. On the
CPU nothing is copied: the tensor shares the array's memory, as `torch.from_numpy` does.
"""
from __future__ import annotations

import numpy as np
import torch


def staged(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array or CPU tensor, readable by a non_blocking copy to `device`."""
    t = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    return t.pin_memory() if device.type == "cuda" else t


def to_device(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor on `device` holding `host`, copied without blocking the host."""
    return staged(host, device).to(device, non_blocking=True)


def copy_to(dst: torch.Tensor, host: np.ndarray | torch.Tensor) -> None:
    """dst[...] = host, copied without blocking the host."""
    dst.copy_(staged(host, dst.device), non_blocking=True)
