"""Trace: the bounded history of StepRecords an LLM keeps in `llm.trace`.

Every step taken by `step()`, `generate()` and `warmup()` lands here (unless `inspect="off"`),
oldest first; past `capacity` the oldest record is dropped. A Trace is indexable (negative
indices and slices too), iterable and sized, and filters by request id and by stage.
"""
from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Iterable, Iterator, overload

from toolkit.inspect import serialize
from toolkit.inspect.step_record import StepRecord


class Trace:
    def __init__(self, capacity: int | None = 256, records: Iterable[StepRecord] = ()):
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"trace_capacity={capacity!r}: must be an int >= 1 or None (unbounded)")
        self.capacity = capacity
        self._records: deque[StepRecord] = deque(records, maxlen=capacity)
        self.num_dropped = 0            # records pushed out by the capacity

    def append(self, record: StepRecord) -> None:
        if self.capacity is not None and len(self._records) == self.capacity:
            self.num_dropped += 1
        self._records.append(record)

    def clear(self) -> None:
        self._records.clear()

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(list(self._records))

    @overload
    def __getitem__(self, i: int) -> StepRecord: ...
    @overload
    def __getitem__(self, i: slice) -> "Trace": ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Trace(None, list(self._records)[i])
        return self._records[i]

    # ---- filters -------------------------------------------------------------------------------
    def for_request(self, request_id: str) -> "Trace":
        """Steps that scheduled the request or finished it."""
        return Trace(None, [r for r in self._records if request_id in r.request_ids
                            or request_id in r.finished_request_ids])

    def by_stage(self, stage: str) -> "Trace":
        """Steps whose stage is `stage` or starts with `stage + "/"` ("warmup" takes every warmup
        stage; "generate", "step", "warmup/requests" one each)."""
        return Trace(None, [r for r in self._records if r.stage == stage
                            or r.stage.startswith(stage + "/")])

    def user_steps(self) -> "Trace":
        """Every record that is not a warmup stage."""
        return Trace(None, [r for r in self._records if not r.is_warmup])

    # ---- save / load -------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the trace to the folder `path` (trace.json + tensors.safetensors, no pickle)."""
        return serialize.save(path, {"capacity": self.capacity, "num_dropped": self.num_dropped},
                              list(self._records))

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """Read a folder written by `save`; tensors come back on the CPU, bit-exact."""
        header, records = serialize.load(path)
        trace = cls(header.get("capacity"), records)
        trace.num_dropped = header.get("num_dropped", 0)
        return trace

    def equals(self, other: "Trace") -> bool:
        """Field by field, tensors bit-exact (devices ignored)."""
        return (self.capacity == other.capacity and len(self) == len(other)
                and all(serialize.equal(a, b) for a, b in zip(self, other)))

    @property
    def stages(self) -> list[str]:
        return [r.stage for r in self._records]

    @property
    def request_ids(self) -> list[str]:
        """Every request id that appears, in order of first appearance."""
        seen: dict[str, None] = {}
        for r in self._records:
            for rid in r.request_ids + r.finished_request_ids:
                seen.setdefault(rid)
        return list(seen)

    def __repr__(self) -> str:
        stages: dict[str, int] = {}
        for r in self._records:
            stages[r.stage.split("/")[0]] = stages.get(r.stage.split("/")[0], 0) + 1
        cap = "unbounded" if self.capacity is None else f"capacity {self.capacity}"
        parts = ", ".join(f"{n} {s}" for s, n in stages.items()) or "empty"
        return f"Trace({len(self)} records: {parts}; {cap}, {self.num_dropped} dropped)"
