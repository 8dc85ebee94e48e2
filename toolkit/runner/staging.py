"""The step's host-computed inputs reach the device in one copy (MRV2 stages its inputs in
persistent pinned buffers).

Every persistent input the host computes lives in one device arena of bytes, whose regions are
int32 (query_start_loc, seq_lens, the block tables) or int64 (idx_mapping, logits_indices,
positions, the slot mappings) views. The arena has a host twin (pinned on CUDA; on a CPU the twin
*is* the arena). A step writes its values into the twin through numpy views (`host(name)`), then
`flush()` copies the byte span written since the last flush in one non_blocking copy, whatever the
regions' dtypes. The tensors the model and the builders read are views of the device arena
(`device(name)`), at fixed addresses, which is what a CUDA graph needs.

Rules that keep this right:
- a staged tensor is written only through its host twin: a device-side write would be overwritten
  by the next flush of a span that covers it (a span may cover regions the step did not write:
  their twin holds what the device holds, so copying them again changes nothing);
- no device op reads a staged tensor before the step's flush (the runner flushes right after the
  inputs, block tables and slot mappings are written, before any metadata is built);
- the host twin is never rewritten while a copy reads it: a flush records an event after its copy
  and the next write to the twin waits for it (free in a step, which has synced since; it matters
  between warmup's back-to-back dummy batches).
Regions are laid out by size, smallest first, so a decode step's span is small (the widest block
table last: the rows past the batch of the last table are not copied). Each region starts at a
multiple of 8 bytes, so that its bytes can be viewed as int32 or int64.
"""
from __future__ import annotations

import numpy as np
import torch

from toolkit.host import copy_pinned

ALIGN = 8       # bytes: every region's start, so that a uint8 view can be reinterpreted as int64


class StagedArena:
    """The persistent device buffer of bytes, its host twin, and the byte span written since the
    last flush. `regions`: name -> (dtype, shape)."""

    def __init__(self, regions: dict[str, tuple[torch.dtype, tuple[int, ...]]], device: torch.device):
        self.offsets: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        total = 0
        for name, (dtype, shape) in sorted(regions.items(), key=lambda kv: _nbytes(*kv[1])):
            self.offsets[name] = (total, dtype, shape)
            total += -(-_nbytes(dtype, shape) // ALIGN) * ALIGN
        on_cuda = device.type == "cuda"
        self.host_buffer = torch.zeros(total, dtype=torch.uint8, pin_memory=on_cuda)
        self.device_buffer = torch.zeros(total, dtype=torch.uint8, device=device) if on_cuda else self.host_buffer
        self._np = self.host_buffer.numpy()
        self._lo, self._hi = total, 0
        self._copy_done: torch.cuda.Event | None = None     # the last flush's copy (CUDA)

    def host(self, name: str) -> np.ndarray:
        if self._copy_done is not None:          # the twin is about to be written: the copy must have read it
            self._copy_done.synchronize()
            self._copy_done = None
        start, dtype, shape = self.offsets[name]
        return self._np[start:start + _nbytes(dtype, shape)].view(_NUMPY[dtype]).reshape(shape)

    def device(self, name: str) -> torch.Tensor:
        start, dtype, shape = self.offsets[name]
        return self.device_buffer[start:start + _nbytes(dtype, shape)].view(dtype).view(shape)

    def written(self, name: str, rows: int | None = None, elements: int | None = None) -> None:
        """Mark the start of `name` as written this step: its first `rows` rows, or its first
        `elements` elements (flat), or all of it."""
        start, dtype, shape = self.offsets[name]
        if elements is None:
            elements = (shape[0] if rows is None else rows) * int(np.prod(shape[1:]))
        end = start + elements * dtype.itemsize
        self._lo, self._hi = min(self._lo, start), max(self._hi, end)

    def flush(self) -> int:
        """Copy the span written since the last flush to the device; returns the copies made (0 or 1)."""
        lo, hi = self._lo, self._hi
        self._lo, self._hi = self.host_buffer.numel(), 0
        if hi <= lo:
            return 0
        copy_pinned(self.device_buffer[lo:hi], self.host_buffer[lo:hi])
        if self.device_buffer.is_cuda:
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        return 1


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64}


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape)) * dtype.itemsize


class Staging:
    """A runner's staged regions: `put(name, values, rows)` writes a region's first rows on the
    host, `device(name)` is the persistent device tensor, `flush()` sends what was written in one
    copy."""

    def __init__(self, int32: dict[str, tuple[int, ...]], int64: dict[str, tuple[int, ...]], device: torch.device):
        self.arena = StagedArena({**{n: (torch.int32, s) for n, s in int32.items()},
                                  **{n: (torch.int64, s) for n, s in int64.items()}}, device)

    def host(self, name: str) -> np.ndarray:
        """The host view of a region: write it, then call `written` (or use `put`)."""
        return self.arena.host(name)

    def written(self, name: str, rows: int | None = None, elements: int | None = None) -> None:
        self.arena.written(name, rows, elements)

    def put(self, name: str, values: np.ndarray, rows: int | None = None) -> None:
        """region[:len(values)] = values (the whole region when rows is None and values fill it)."""
        n = len(values) if rows is None else rows
        self.host(name)[:n] = values
        self.written(name, n)

    def device(self, name: str) -> torch.Tensor:
        return self.arena.device(name)

    def has(self, name: str) -> bool:
        return name in self.arena.offsets

    def flush(self) -> int:
        return self.arena.flush()

    def persistent_buffers(self) -> list[torch.Tensor]:
        """The device arena every staged tensor views (rewritten each step)."""
        return [self.arena.device_buffer]


class StagingBank:
    """One of several sets of the same regions in a Staging, seen under their plain names: region
    `name` of bank `suffix` is `name + suffix` in the staging (`banked_regions` makes them). Several
    forwards' inputs (the draft model's k per step) are written each into its own bank and sent
    together by one `flush()` of the staging: one copy."""

    def __init__(self, staging: Staging, suffix: str):
        self.staging, self.suffix = staging, suffix

    def host(self, name: str) -> np.ndarray:
        return self.staging.host(name + self.suffix)

    def written(self, name: str, rows: int | None = None, elements: int | None = None) -> None:
        self.staging.written(name + self.suffix, rows, elements)

    def put(self, name: str, values: np.ndarray, rows: int | None = None) -> None:
        self.staging.put(name + self.suffix, values, rows)

    def device(self, name: str) -> torch.Tensor:
        return self.staging.device(name + self.suffix)

    def has(self, name: str) -> bool:
        return self.staging.has(name + self.suffix)

    def flush(self) -> int:
        return self.staging.flush()


def banked_regions(regions: dict[str, tuple[int, ...]], suffix: str) -> dict[str, tuple[int, ...]]:
    """`regions` renamed for the bank `suffix` (StagingBank)."""
    return {name + suffix: shape for name, shape in regions.items()}
