"""Inspecting a tensor-parallel engine: every rank's metadata compared, states gathered from every rank.

Each rank builds its own batch, block tables and metadata from the scheduler output rank 0
broadcasts (runner/executor.py), so a rank whose bookkeeping drifts reads other blocks or slots
without any error: its shard of the output is silently wrong. With inspection on, before each
forward every rank all-gathers a fingerprint of what it built (a digest per field of the input
batch, each group's metadata and the block tables); the check `metadata_equal_on_every_rank`
names the first field a rank differs in, and the first entry that differs.

In inspect="full", rank 0 decides what a step captures (the layers, the rows, their state pages:
`CapturePlan`) and hands the plan to the other ranks in the same collective; every rank copies
its shard of those states to the host and rank 0 gathers them (`gather_object`) into the full
state by each layer's `StateShard` index (layers/state_mixer.py). Entries several ranks hold (a
Mamba2 mixer's one group, replicated) must be equal on all of them: `replicated_state_equal_on_every_rank`.
So `StepRecord.states` holds full states, as with one rank (a record outlives the workers, and
`diff_traces` compares it with a one-rank trace), and `LayerState.of(request, when, rank=r)` cuts
rank r's shard back out of it.

The ranks' sides: rank 0's Recorder calls `RankSync`; the engine's worker processes run a
`WorkerInspector` (the runner's observer there), which takes part in the same collectives and
answers rank 0's questions (`memory`). Under torchrun every rank runs a Recorder, and ranks 1..N-1
follow rank 0's plan the same way.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from toolkit.distributed import TPGroup
from toolkit.inspect.capture import Captured, CaptureFilter, gather_states
from toolkit.inspect.checks import raise_if_any
from toolkit.inspect.memory import MemoryMarks
from toolkit.inspect.step_record import Violation
from toolkit.inspect.trace import Trace
from toolkit.layers.state_mixer import StateShard, StateSlotMixer


@dataclass(frozen=True)
class CapturePlan:
    """What a full-mode step captures, decided by rank 0: the layers, the batch rows and each
    layer's state page per row."""
    layers: tuple[str, ...]
    rows: list[int]
    slots: dict[str, list[int]]


# ---- fingerprints ---------------------------------------------------------------------------------
def _leaves(obj: Any, path: str, out: dict[str, Any]) -> None:
    """Tensors, arrays and scalars reachable from `obj` (dataclasses, dicts, lists), keyed by path."""
    if isinstance(obj, (torch.Tensor, np.ndarray, int, float, str, bool)) or obj is None:
        out[path] = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _leaves(getattr(obj, f.name), f"{path}.{f.name}", out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _leaves(v, f"{path}[{k!r}]", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _leaves(v, f"{path}[{i}]", out)


def step_fields(state) -> dict[str, Any]:
    """The objects a rank built for a step, by path: the input batch, each group's metadata (what
    its builder was given and what it built), the block tables."""
    out: dict[str, Any] = {}
    _leaves(state.input_batch, "input_batch", out)
    for g in state.attn_metadata.groups:
        _leaves(g.common, f"group {g.group_id} ({g.kind}).common", out)
        _leaves(g.metadata, f"group {g.group_id} ({g.kind}).metadata", out)
    for i, t in enumerate(state.block_tables):
        out[f"block_tables[{i}]"] = t
    return out


def _as_numpy(value: Any) -> np.ndarray | None:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().reshape(-1) \
            if value.numel() else np.zeros(0, np.uint8)
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    return None


def fingerprint(fields: dict[str, Any]) -> dict[str, tuple[tuple[int, ...] | None, str]]:
    """Per field: (shape, a digest of dtype and bytes) for tensors and arrays, (None, the value) for scalars."""
    out = {}
    for path, value in fields.items():
        raw = _as_numpy(value)
        if raw is None:
            out[path] = (None, repr(value))
        else:
            out[path] = (tuple(value.shape),
                         f"{value.dtype} " + hashlib.blake2b(raw.tobytes(), digest_size=8).hexdigest())
    return out


def _sizes_differ(a: dict, b: dict) -> bool:
    """Two ranks built batches of other sizes (a field's shape, or the fields themselves, differ): their
    forwards' collectives would not match, and on gloo a size mismatch aborts a process."""
    return a.keys() != b.keys() or any(a[path][0] != b[path][0] for path in a)


def _first_difference(a: Any, b: Any) -> str:
    """`[0, 3]: 7 vs 5` (b's value first), or the shapes / values when they do not compare entrywise."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    if isinstance(b, torch.Tensor):
        b = b.detach().cpu().numpy()
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.shape != b.shape:
            return f"shape {list(b.shape)} vs {list(a.shape)}"
        where = np.argwhere(a != b)
        if len(where) == 0:
            return f"dtype {b.dtype} vs {a.dtype}"
        i = tuple(int(v) for v in where[0])
        return f"first at {list(i)}: {b[i]} vs {a[i]} ({len(where)} entries differ)"
    return f"{b!r} vs {a!r}"


def _owner(path: str) -> str:
    """What a field belongs to, in words: `group 0 (attention)`, `group 1` or `the input batch`."""
    if path.startswith("group "):
        return path.split(".")[0]
    if path.startswith("block_tables["):
        return f"group {path[len('block_tables['):].split(']')[0]}"
    return "the input batch"


# ---- the collectives ------------------------------------------------------------------------------
class RankSync:
    """One rank's side of the inspection collectives (every rank calls them in the same order)."""

    def __init__(self, runner, tp: TPGroup) -> None:
        self.tp = tp
        self.shards: dict[str, tuple[StateShard, ...]] = {
            m.layer_name: m.state_shards for m in runner.model.modules()
            if isinstance(m, StateSlotMixer) and m.state_shards is not None}
        self._rank_shards: list[dict[str, tuple[StateShard, ...]]] | None = None    # rank 0: every rank's

    def _all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.tp.world_size
        dist.all_gather_object(out, obj, group=self.tp.group)
        return out

    def exchange(self, state, checks: bool, plan: CapturePlan | None, where: str
                 ) -> tuple[list[Violation], CapturePlan | None]:
        """Before a forward: compare every rank's fingerprint (when `checks`), and hand rank 0's
        capture plan to every rank. Returns (violations, on rank 0; rank 0's plan)."""
        fields = step_fields(state) if checks else {}
        mine = fingerprint(fields) if checks else None
        replies = self._all_gather((mine, plan if self.tp.rank == 0 else None))
        plan = replies[0][1]
        if not checks:
            return [], plan
        prints = [r[0] for r in replies]
        differing = sorted({path for p in prints[1:] for path in set(p) | set(prints[0])
                            if p.get(path) != prints[0].get(path)})
        if not differing:
            return [], plan
        # a second round, only when a rank differs: the values of the differing fields, to say where
        values = self._all_gather({path: fields.get(path) for path in differing})
        out = []
        stop = any(_sizes_differ(prints[0], p) for p in prints[1:])
        if self.tp.rank != 0 and stop:
            raise_if_any([Violation("metadata_equal_on_every_rank", f"{where}, rank {self.tp.rank}", "the batch",
                                    "this rank's batch has other sizes than rank 0's: stopped before the forward")])
        if self.tp.rank == 0:
            for rank in range(1, self.tp.world_size):
                for path in differing:
                    if prints[rank].get(path) != prints[0].get(path):
                        out.append(Violation(
                            "metadata_equal_on_every_rank", f"{where}, rank {rank}, {_owner(path)}", path,
                            f"rank {rank} built a different value from rank 0's: "
                            f"{_first_difference(values[0][path], values[rank][path])} (rank {rank} vs rank 0)"
                            + ("; stopped before the forward (its collectives would not match)" if stop else "")))
            if stop:             # every rank stops here (each saw the sizes): no forward, no mismatched collective
                raise_if_any(out)
        return out, plan

    def gather(self, runner, state, plan: CapturePlan, slots: dict[str, list[int]], where: str
               ) -> tuple[Captured | None, list[Violation]]:
        """Every rank copies its shard of the plan's states at `slots`; rank 0 gets the full states
        (None elsewhere) and a violation per replicated entry that differs between ranks."""
        capture = CaptureFilter(plan.layers, None, len(plan.layers))
        local = gather_states(runner, state, capture, plan.rows, slots)
        if runner.device.type == "cuda":        # the host copies are issued without blocking: let them land
            torch.cuda.current_stream(runner.device).synchronize()
        first = self._rank_shards is None
        parts: list[Any] = [None] * self.tp.world_size if self.tp.rank == 0 else None
        dist.gather_object((local, self.shards if first else None), parts, dst=0, group=self.tp.group)
        if self.tp.rank != 0:
            self._rank_shards = []          # sent: later gathers carry the states only
            return None, []
        if first:
            self._rank_shards = [p[1] for p in parts]
        return assemble([p[0] for p in parts], self._rank_shards, where)

    def rank_shards(self, layer: str) -> list[tuple[StateShard, ...]] | None:
        """Rank 0: each rank's StateShard of `layer`'s state tensors (None before the first gather)."""
        if not self._rank_shards:
            return None
        return [shards[layer] for shards in self._rank_shards]


def assemble(parts: list[Captured], shards: list[dict[str, tuple[StateShard, ...]]], where: str
             ) -> tuple[Captured, list[Violation]]:
    """The full states from every rank's shards (rank order); entries held by more than one rank
    are taken from the lowest rank and compared with the others'."""
    out, violations = [], []
    for i, (layer, tensors) in enumerate(parts[0].states):
        full_tensors = []
        for s, local in enumerate(tensors):
            layout = [shards[r][layer][s] for r in range(len(parts))]
            dim = layout[0].dim + 1                    # the captured tensors are [B, *per-slot shape]
            shape = list(local.shape)
            shape[dim] = layout[0].full
            full = local.new_zeros(shape)
            held = torch.zeros(layout[0].full, dtype=torch.bool)
            for rank, part in enumerate(parts):
                piece, index = part.states[i][1][s], layout[rank].index
                again = held[index]
                if bool(again.any()):
                    before = full.index_select(dim, index[again])
                    mine = piece.index_select(dim, torch.nonzero(again).flatten())
                    if not torch.equal(before, mine):
                        violations.append(Violation(
                            "replicated_state_equal_on_every_rank", f"{where}, {layer}, rank {rank}",
                            f"state {s}",
                            f"entries every rank holds (a replicated section) differ from a lower rank's by "
                            f"{(before.float() - mine.float()).abs().max().item():.3g}"))
                new = torch.nonzero(~again).flatten()
                full.index_copy_(dim, index[new], piece.index_select(dim, new))
                held[index] = True
            full_tensors.append(full)
        out.append((layer, full_tensors))
    return Captured(parts[0].request_ids, parts[0].slots, out), violations


# ---- the worker's side ----------------------------------------------------------------------------
class WorkerInspector:
    """Ranks 1..N-1 of an engine that started its workers: the runner's observer when rank 0
    inspects (`inspecting`), taking part in each step's collectives (`RankSync`), and the answers
    to rank 0's questions (`memory`, `state_at`: `executor.ask(name, ...)`). `checks` must be rank 0's."""

    def __init__(self, runner, tp: TPGroup, inspecting: bool, checks: bool) -> None:
        self.runner, self.checks = runner, checks
        self.sync = RankSync(runner, tp)
        self.marks = MemoryMarks(runner, Trace(1), runner.device)
        self.marks.mark("load")
        self._plan: CapturePlan | None = None
        if inspecting:
            runner.observer = self

    def before_forward(self, runner, state) -> None:
        _, self._plan = self.sync.exchange(state, self.checks, None, "")
        if self._plan is not None:
            self.sync.gather(runner, state, self._plan, self._plan.slots, "")

    def after_forward(self, runner, state) -> None:
        if self._plan is not None:
            self.sync.gather(runner, state, self._plan, self._plan.slots, "")
            self._plan = None

    def after_logits(self, runner, state) -> None:
        pass

    def state_at(self, layer: str, slot: int) -> list[torch.Tensor]:
        """This rank's state tensors of recurrent layer `layer` at state page `slot` now (host copies)."""
        return [t[slot].detach().cpu().clone() for t in self.runner.kv_caches[layer]]

    def memory(self, mark: str | None = None) -> dict[str, int]:
        """Bytes by category on this rank now (`mark`: also keep them under that name)."""
        if mark is not None:
            self.marks.mark(mark)
        return self.marks.measure()


@dataclass(frozen=True)
class WorkerInspectorFactory:
    """What the executor calls in each worker once its runner is built: picklable, so the engine
    hands it to the processes it spawns. `inspecting`: rank 0 has a Recorder; `checks`: rank 0's."""
    inspecting: bool
    checks: bool

    def __call__(self, runner, tp: TPGroup) -> WorkerInspector:
        return WorkerInspector(runner, tp, self.inspecting, self.checks)


def gather_memory(executor, here: dict[str, int]) -> list[dict[str, int]]:
    """Every rank's bytes by category now, in rank order (`here`: rank 0's). From the workers an
    engine started (`executor`), or under torchrun from every rank (each calls memory_report())."""
    if executor is not None:
        return executor.ask("memory", here)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, here)
    return out
