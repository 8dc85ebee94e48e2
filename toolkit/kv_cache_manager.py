"""Scheduler-side ownership of KV blocks and Mamba state slots.

Two pools, each with id 0 reserved as the null id (dummy and padded rows point there; a real
request never gets it):
- KV blocks for attention groups: `block_size` tokens each, allocated as a request grows.
- State slots for Mamba groups: one per request in vLLM's "none" cache mode (no prefix caching).
A ledger records the owner of every id handed out, so leaks and double frees are caught.
"""
from __future__ import annotations

from dataclasses import dataclass


class BlockPool:
    """Ids 1..num_ids-1 on a free list; id 0 is the null id."""

    def __init__(self, num_ids: int, name: str):
        self.name = name
        self.num_ids = num_ids
        self._free = list(range(num_ids - 1, 0, -1))   # pop() hands out low ids first
        self.owner: dict[int, str] = {}

    @property
    def num_total(self) -> int:
        return max(self.num_ids - 1, 0)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, owner: str) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{self.name}: asked for {n}, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self.owner[i] = owner
        return ids

    def free(self, ids: list[int], owner: str) -> None:
        for i in ids:
            if self.owner.get(i) != owner:
                raise RuntimeError(f"{self.name}: id {i} freed by {owner!r} but owned by "
                                   f"{self.owner.get(i)!r}")
            del self.owner[i]
            self._free.append(i)


@dataclass(frozen=True)
class CacheGroupKind:
    kind: str                # "attention" or "mamba"
    block_size: int          # tokens per block (attention); unused for mamba


class KVCacheManager:
    def __init__(self, groups: list[CacheGroupKind], num_kv_blocks: int, num_state_slots: int):
        self.groups = groups
        has_attn = any(g.kind == "attention" for g in groups)
        has_mamba = any(g.kind == "mamba" for g in groups)
        self.kv_pool = BlockPool(num_kv_blocks if has_attn else 0, "kv blocks")
        self.state_pool = BlockPool(num_state_slots + 1 if has_mamba else 0, "state slots")
        self._ids: dict[str, tuple[list[int], ...]] = {}

    def holdings(self) -> dict[str, tuple[list[int], ...]]:
        """Every request's ids per group (a copy): the ledger."""
        return {rid: tuple(list(ids) for ids in held) for rid, held in self._ids.items()}

    def block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return self._ids.get(req_id, tuple([] for _ in self.groups))

    def ids_covering(self, req_id: str, num_tokens: int) -> tuple[list[int], ...]:
        """Per group, the request's ids that hold its first `num_tokens` tokens: the KV blocks
        covering them, and the state slot (what an n > 1 child copies from its parent)."""
        return tuple(list(ids[:-(-num_tokens // g.block_size)]) if g.kind == "attention" else list(ids)
                     for g, ids in zip(self.groups, self.block_ids(req_id)))

    def transfer(self, from_id: str, to_id: str) -> None:
        """Hand every id `from_id` holds to `to_id` (which holds none): an n > 1 parent's ids to
        its last child, which then needs no copy."""
        held = self._ids.pop(from_id, None)
        if held is None:
            return
        if to_id in self._ids:
            raise RuntimeError(f"cannot hand {from_id!r}'s ids to {to_id!r}, which holds ids already")
        for g, ids in zip(self.groups, held, strict=True):
            pool = self.kv_pool if g.kind == "attention" else self.state_pool
            for i in ids:
                if pool.owner.get(i) != from_id:
                    raise RuntimeError(f"{pool.name}: id {i} handed on by {from_id!r} but owned by "
                                       f"{pool.owner.get(i)!r}")
                pool.owner[i] = to_id
        self._ids[to_id] = held

    def _needed(self, req_id: str, num_tokens_after: int) -> list[int]:
        held = self.block_ids(req_id)
        needed = []
        for g, ids in zip(self.groups, held):
            if g.kind == "attention":
                needed.append(max(-(-num_tokens_after // g.block_size) - len(ids), 0))
            else:
                needed.append(0 if ids else 1)
        return needed

    def can_allocate(self, req_id: str, num_tokens_after: int) -> bool:
        needed = self._needed(req_id, num_tokens_after)
        kv = sum(n for g, n in zip(self.groups, needed) if g.kind == "attention")
        st = sum(n for g, n in zip(self.groups, needed) if g.kind == "mamba")
        return kv <= self.kv_pool.num_free and st <= self.state_pool.num_free

    def allocate(self, req_id: str, num_tokens_after: int) -> tuple[list[int], ...] | None:
        """Grow the request's holdings to cover `num_tokens_after` tokens. Returns the newly
        allocated ids per group, or None (nothing allocated) if a pool is short."""
        if not self.can_allocate(req_id, num_tokens_after):
            return None
        needed = self._needed(req_id, num_tokens_after)
        held = self.block_ids(req_id)
        new = tuple((self.kv_pool if g.kind == "attention" else self.state_pool).allocate(n, req_id)
                    for g, n in zip(self.groups, needed))
        self._ids[req_id] = tuple(h + n for h, n in zip(held, new))
        return new

    def free(self, req_id: str) -> None:
        held = self._ids.pop(req_id, None)
        if held is None:
            return
        for g, ids in zip(self.groups, held):
            (self.kv_pool if g.kind == "attention" else self.state_pool).free(ids, req_id)
