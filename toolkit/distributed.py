"""The tensor-parallel group a sharded model runs in (vLLM `parallel_state`, cut down to TP).

A `TPGroup` is this process's rank among `world_size` ranks and the collectives the parallel layers
need: `all_reduce` (a row-parallel projection's partial sums, a vocab-parallel embedding's rows) and
`all_gather` (a vocab-parallel LM head's logits). With one rank they return their input untouched,
so an unsharded model pays nothing. With more, they run on a `torch.distributed` process group
(gloo on CPUs, NCCL on GPUs); every rank must call them in the same order with tensors of the
same shapes (on gloo a size mismatch aborts a process).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: Any = field(default=None, compare=False)     # a torch.distributed ProcessGroup (None: the default)

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `t` (in place; returned)."""
        if self.sharded:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (same shape on every rank) concatenated along `dim` in rank order."""
        if not self.sharded:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TPGroup()


def launched_group(world_size: int) -> TPGroup | None:
    """The group of `LLM(tensor_parallel_size=world_size)` when a launcher started the ranks
    (torchrun, or a test that spawns them, initialised torch.distributed with that many ranks):
    every rank runs the same engine on the same requests (vLLM's external-launcher mode). SINGLE
    for one rank; None when torch.distributed is not initialised: the engine starts its workers
    (runner/executor.py)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size={world_size!r}: must be an int >= 1")
    if world_size == 1:
        return SINGLE
    if not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size() != world_size:
        raise ValueError(f"tensor_parallel_size={world_size}, but torch.distributed was initialised with "
                         f"world_size={dist.get_world_size()}")
    return TPGroup(dist.get_rank(), world_size)
