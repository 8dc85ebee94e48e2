"""Trace: the bounded history of StepRecords an LLM keeps in `llm.trace`.

Every step taken by `step()`, `generate()` and `warmup()` lands here (unless `inspect="off"`),
oldest first. Two bounds:
- `capacity` (`LLM(trace_capacity=...)`): a count of records; past it the oldest record is dropped;
- `max_bytes` (`LLM(trace_max_bytes=...)`): the host bytes the records may hold. A record's size
  depends on the model (a full-mode step of a 130M Mamba2 holds ~37 MiB of states per request),
  so when an append passes it, the oldest records lose their recurrent states first, then their
  logits (each marked in `record.dropped`, which the views show), keeping their metadata and
  batch, which are small; whole records go only if those alone pass it. The first time, a
  TraceBudgetWarning says so, with the two ways out.
A Trace is indexable (negative indices and slices too), iterable and sized, and filters by
request id and by stage.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import overload

import torch

from toolkit.errors import TraceBudgetWarning
from toolkit.host import release_free_memory
from toolkit.inspect import serialize
from toolkit.inspect.memory import fmt_bytes, object_bytes
from toolkit.inspect.step_record import StepRecord

STATES, LOGITS, REST = 0, 1, 2      # the parts of a record's size, in the order the budget drops them


def record_sizes(record: StepRecord) -> list[int]:
    """Host bytes of a record: [states, logits (with the top-k), the rest]. The input batch and
    metadata snapshots, most of the rest, were counted as they were taken (snapshot_host_bytes):
    only the other fields are walked. The common record of inspect="metadata" (no states, no top-k,
    no logprobs) walks nothing: the other fields it would walk hold no tensor or array (_FAST_OK)."""
    if (_FAST_OK and record.snapshot_host_bytes is not None and not record.holds("states")
            and record.top_logit_values is None and record.top_logit_ids is None
            and not record.holds("logprobs") and not record.holds("prompt_logprobs")):
        logits = record.logits
        return [0, logits.nbytes if type(logits) is torch.Tensor and logits.is_cpu else object_bytes(logits, "host"),
                record.snapshot_host_bytes]
    return _walked_sizes(record)


def _walked_sizes(record: StepRecord) -> list[int]:
    seen: set[int] = set()                 # one walk: the rest skips what states and logits counted
    states = object_bytes(record.states, "host", seen)
    logits = object_bytes([record.logits, record.top_logit_values, record.top_logit_ids], "host", seen)
    if record.snapshot_host_bytes is None:
        return [states, logits, object_bytes(record, "host", seen)]
    seen.update((id(record.__dict__.get("input_batch")), id(record.__dict__.get("attn_metadata"))))   # not made
    rest = record.snapshot_host_bytes + sum(object_bytes(getattr(record, name), "host", seen)
                                            for name in _WALKED if name not in _COUNTED)
    return [states, logits, rest]


_WALKED = tuple(f.name for f in dataclasses.fields(StepRecord))
_COUNTED = {"input_batch", "attn_metadata", "states", "logits", "top_logit_values", "top_logit_ids",
            "scheduled", "timings", "device_timings", "sampled_token_ids", "kept_token_ids",
            "finished_request_ids", "preempted_request_ids", "prefix_hits", "proposed_drafts", "violations",
            "dropped", "ledger", "state_copies", "checkpoint_copies", "spec",
            "prefix_lookups", "outputs"}   # counted above, or holding no tensor or array by their types
# record_sizes' shortcut holds while the fields the walk would visit are these: scalars and strings, and
# the two logprob dicts it tests empty (a new StepRecord field turns the shortcut off until listed here)
_FAST_OK = {n for n in _WALKED if n not in _COUNTED} == {
    "step_index", "stage", "backend", "graph", "padded_size", "snapshot_host_bytes", "logprobs", "prompt_logprobs"}


class Trace:
    """The engine's recent StepRecords (`llm.trace`), oldest first, at most `capacity` of them and,
    with `max_bytes`, within a host-memory budget (older records' states, then logits, are dropped
    first, never a record's metadata). Indexable and sliceable; `for_request`, `by_stage` and
    `user_steps` filter it; `save` / `load` keep it on disk; `equals` compares two."""

    def __init__(self, capacity: int | None = 256, records: Iterable[StepRecord] = (),
                 max_bytes: int | None = None):
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"trace_capacity={capacity!r}: must be an int >= 1 or None (unbounded)")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"trace_max_bytes={max_bytes!r}: must be an int >= 1 or None (no byte bound)")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._records: deque[StepRecord] = deque(records, maxlen=capacity)
        self._sizes: deque[list[int]] = deque((record_sizes(r) for r in self._records), maxlen=capacity)
        self._total = sum(sum(size) for size in self._sizes)     # host_bytes, kept as records come and go
        self.num_dropped = 0            # whole records dropped (by the capacity, or the budget)
        self.num_trimmed = 0            # records whose states or logits the budget dropped
        self._checked = [0, 0]          # per part: the leading records whose part is already gone
        self._made = 0                  # the leading records not kept by reference (see _fit)
        self._warned = False

    @property
    def host_bytes(self) -> int:
        """Host bytes the records hold (what `max_bytes` bounds); a running total, so an append costs
        the same however many records the trace holds."""
        return self._total

    def make_room(self) -> None:
        """Drop the oldest record if the trace is full (as `append` would): the Recorder calls it
        before it makes a step's record, so that what the dropped record held serves the new one
        (inspect/step_record.py, Freezer)."""
        if self.capacity is not None and len(self._records) >= self.capacity:
            self._pop_oldest()

    def append(self, record: StepRecord) -> None:
        if self.capacity is not None and len(self._records) == self.capacity:
            self._pop_oldest()
        self._records.append(record)
        self._sizes.append(record_sizes(record))
        self._total += sum(self._sizes[-1])
        if record.holds("dropped"):             # its states were not even gathered (see reserve)
            self.num_trimmed += 1
        if self.max_bytes is not None and self.host_bytes > self.max_bytes:
            self._fit()

    def _pop_oldest(self) -> None:
        self._records.popleft()
        self._total -= sum(self._sizes.popleft())
        self.num_dropped += 1
        self._checked = [max(0, c - 1) for c in self._checked]
        self._made = max(0, self._made - 1)

    def materialize(self) -> None:
        """Make the batch and metadata of every record kept by reference (StepRecord.materialize):
        after this the records hold nothing of the runner's (the engine calls it at shutdown), and
        host_bytes counts what they keep."""
        for i, record in enumerate(self._records):
            if record.is_pending:
                self._make(i)
        self._made = len(self._records)

    def _make(self, i: int) -> None:
        """Make record i (StepRecord.materialize) and count its bytes again."""
        self._records[i].materialize()
        sizes = record_sizes(self._records[i])
        self._total += sum(sizes) - sum(self._sizes[i])
        self._sizes[i] = sizes

    @property
    def last_record_bytes(self) -> int:
        """Host bytes of the newest record's logits and metadata: what the next record will about
        take besides its states (a step's batch and vocabulary change little from one to the next)."""
        return sum(self._sizes[-1][LOGITS:]) if self._sizes else 0

    def reserve(self, nbytes: int) -> bool:
        """Make room for `nbytes` about to be recorded (a full-mode step's states, before they are
        gathered), so that the process never holds more than the budget: older records' states,
        then logits, go. False when that is not enough (the records' metadata and `nbytes` pass the
        budget): the caller gathers nothing."""
        if self.max_bytes is None:
            return True
        if self.host_bytes + nbytes > self.max_bytes:
            self._fit(reserve=nbytes)           # older states and logits go; never a record's metadata
        if self.host_bytes + nbytes > self.max_bytes:
            self._warn_once(self.host_bytes, [f"the states of this step ({fmt_bytes(nbytes)}: with the records' "
                                              "metadata, more than the budget; not gathered at all)"])
            return False
        return True

    def _fit(self, reserve: int = 0) -> None:
        """Drop states, then logits, oldest first, then whole records, oldest first, until the
        records (and `reserve` more bytes) fit in max_bytes. The record just appended gives up its
        states and logits after every older one has: the step just taken is the one most looked at."""
        before = self.host_bytes
        # first, what drops nothing: a record kept by reference holds whole copies of the runner's
        # buffers until its batch and metadata are made, which keep only what they view
        while self.host_bytes + reserve > self.max_bytes and self._made < len(self._records):
            self._make(self._made)          # (a record already made by a reader: counted again)
            self._made += 1
        total = self.host_bytes + reserve
        dropped: dict[str, int] = {}
        older = len(self._records) - (0 if reserve else 1)      # records before the newest
        for part, name in ((STATES, "states"), (LOGITS, "logits")):
            i = self._checked[part]
            while total > self.max_bytes and i < older:
                if self._sizes[i][part]:
                    total -= self._drop(i, part, name, dropped)
                i += 1
            self._checked[part] = i
        if not reserve and self._records:
            for part, name in ((STATES, "states"), (LOGITS, "logits")):
                if total > self.max_bytes and self._sizes[-1][part]:
                    total -= self._drop(len(self._records) - 1, part, name, dropped)
        while not reserve and total > self.max_bytes and self._records:   # metadata alone passes it
            total -= sum(self._sizes[0])
            self._pop_oldest()
            dropped["records"] = dropped.get("records", 0) + 1
        if dropped:
            release_free_memory()
        self._warn_once(before, [f"{n} whole record{'s' * (n > 1)}" if k == "records" else
                                 f"the {k} of {n} record{'s' * (n > 1)}" for k, n in dropped.items()])

    def _drop(self, i: int, part: int, name: str, dropped: dict[str, int]) -> int:
        """Drop part `part` of record i; returns the bytes freed."""
        freed = self._sizes[i][part]
        self._drop_part(self._records[i], name)
        self._sizes[i][part] = 0
        self._total -= freed
        dropped[name] = dropped.get(name, 0) + 1
        return freed

    def _drop_part(self, record: StepRecord, name: str) -> None:
        if name == "states":
            record.states = []
        else:
            record.logits = record.top_logit_values = record.top_logit_ids = None
        if not record.dropped:
            self.num_trimmed += 1
        record.dropped = [*record.dropped, name]

    def _warn_once(self, before: int, dropped: list[str]) -> None:
        if self._warned or not dropped:
            return
        self._warned = True
        newest = self._records[-1] if self._records else None
        size = self._sizes[-1] if self._sizes else [0, 0, 0]
        what = ", ".join(dropped)
        where = f"step {newest.step_index}" if newest is not None and newest.step_index is not None else (
            newest.stage if newest is not None else "the last append")
        warnings.warn(
            f"llm.trace passed its budget of {fmt_bytes(self.max_bytes)} of host memory at {where} "
            f"({fmt_bytes(before)}; the newest record holds {fmt_bytes(sum(size))}, "
            f"{fmt_bytes(size[STATES])} of it recurrent states): dropped {what}, oldest first, keeping "
            "their metadata and batch (record.dropped says what went). Two ways out: a larger budget, "
            "LLM(..., trace_max_bytes=...), or a narrower capture: LLM(..., inspect_layers=..., "
            "inspect_requests=...) or llm.set_inspect_filter(...) (or inspect='metadata'). "
            "This warning is shown once per trace.", TraceBudgetWarning, stacklevel=2)

    def clear(self) -> None:
        self._records.clear()
        self._sizes.clear()
        self._total = 0
        self._checked = [0, 0]
        self._made = 0

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(list(self._records))

    @overload
    def __getitem__(self, i: int) -> StepRecord: ...
    @overload
    def __getitem__(self, i: slice) -> Trace: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Trace(None, list(self._records)[i])
        return self._records[i]

    # ---- filters -------------------------------------------------------------------------------
    def for_request(self, request_id: str) -> Trace:
        """Steps that scheduled the request or finished it."""
        return Trace(None, [r for r in self._records if request_id in r.request_ids
                            or request_id in r.finished_request_ids])

    def by_stage(self, stage: str) -> Trace:
        """Steps whose stage is `stage` or starts with `stage + "/"` ("warmup" takes every warmup
        stage; "generate", "step", "warmup/requests" one each)."""
        return Trace(None, [r for r in self._records if r.stage == stage
                            or r.stage.startswith(stage + "/")])

    def user_steps(self) -> Trace:
        """Every record that is not a warmup stage."""
        return Trace(None, [r for r in self._records if not r.is_warmup])

    # ---- save / load -------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the trace to the folder `path` (trace.json + tensors.safetensors, no pickle)."""
        return serialize.save(path, {"capacity": self.capacity, "num_dropped": self.num_dropped,
                                     "max_bytes": self.max_bytes, "num_trimmed": self.num_trimmed},
                              list(self._records))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a folder written by `save`; tensors come back on the CPU, bit-exact."""
        header, records = serialize.load(path)
        trace = cls(header.get("capacity"), records, header.get("max_bytes"))
        trace.num_dropped = header.get("num_dropped", 0)
        trace.num_trimmed = header.get("num_trimmed", 0)
        return trace

    def equals(self, other: Trace) -> bool:
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
        trimmed = f", {self.num_trimmed} trimmed to the byte budget" if self.num_trimmed else ""
        return f"Trace({len(self)} records: {parts}; {cap}, {self.num_dropped} dropped{trimmed})"
