"""StepRecord: what one engine step did, holding the objects the runner used.

The runner writes each step into persistent buffers, so a record keeps a snapshot (a clone) of
the InputBatch and of the metadata as the step left them; nothing here is recomputed. The Recorder
keeps a step by reference (`PendingSnapshot`): the runner's per-step objects, which the step made
fresh, and a copy of the persistent buffers they view (`ModelRunner.persistent_buffers()`); the
snapshot is made from those when `input_batch` or `attn_metadata` is first read, with the same
values (tests/test_trace.py, tests/test_persistent_buffers.py). With `LLM(inspect="off")`,
`generate()` and `warmup()` build no records at all.

Shapes: B = rows in the batch (decodes first), V = vocabulary, k = `TOP_K_LOGITS`.
"""
from __future__ import annotations

import copy
import dataclasses
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from toolkit.kv_cache_manager import PrefixLookup
from toolkit.layers.state_mixer import StateShard
from toolkit.outputs import RequestOutput
from toolkit.request import TokenLogprobs
from toolkit.runner.attn_utils import GroupMetadata
from toolkit.runner.input_batch import InputBatch, runs_as_decode

TOP_K_LOGITS = 8
DROPPED = "dropped: trace budget (LLM(trace_max_bytes=...))"   # what a view says of a dropped part


def snapshot(obj: Any, host_bytes: list[int] | None = None, _clones: dict | None = None) -> Any:
    """Deep copy that clones tensors and arrays (dataclasses, dicts, lists and tuples walked); a
    tensor met twice (the same view, e.g. query_start_loc in the batch and in each group's common
    metadata) is cloned once and shared. `host_bytes`: a one-element counter the bytes of the host
    tensors and arrays made are added to (what the trace's byte budget counts, without walking the
    copy again: `record_sizes`).

    Runs on every recorded step, so it is written for speed (inspect="metadata" must cost little):
    each exact type gets its copier once (`_COPIERS`: one dict lookup per value after that); a
    dataclass's copier is made for its fields (`_dataclass_copier`) and copies its `__dict__` (no
    `copy.copy`, no `__init__`: a builder's output is not revalidated); a tensor already met as the
    same object is found by its id before its view key is built. `_clones` may be shared only by
    snapshots of objects alive together (a step's batch and metadata): an id names one live object."""
    return _snap(obj, host_bytes if host_bytes is not None else [0], {} if _clones is None else _clones)


def _snap(obj: Any, counter: list[int], clones: dict) -> Any:
    cls = type(obj)
    if cls in _LEAVES:
        return obj
    copier = _COPIERS.get(cls)
    if copier is None:
        copier = _COPIERS[cls] = _copier_for(cls, obj)
    return copier(obj, counter, clones)


def _snap_tensor(t: torch.Tensor, counter: list[int], clones: dict) -> torch.Tensor:
    out = clones.get(id(t))             # the same object met before (alive while the snapshot runs)
    if out is not None:
        return out
    key = (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)      # the same view through another object
    out = clones.get(key)
    if out is None:
        frozen = clones.get(_FROZEN)            # a pending record's copy of the runner's buffers
        at = frozen.offsets.get(t.untyped_storage().data_ptr()) if frozen else None
        if at is not None:
            # the same view of the copy taken at the step's end, cloned: a made record keeps what it
            # views (`at`, a multiple of FROZEN_ALIGN bytes, is whole elements of any dtype)
            view = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                frozen.flat.untyped_storage(), at // t.element_size() + t.storage_offset(), t.shape, t.stride())
            out = clones[key] = view.clone()
        else:
            out = clones[key] = (t.detach() if t.requires_grad else t).clone()
        if out.is_cpu:
            counter[0] += out.nbytes
    clones[id(t)] = out
    return out


def _snap_array(a: np.ndarray, counter: list[int], clones: dict) -> np.ndarray:
    counter[0] += a.nbytes
    return a.copy()


def _snap_list(obj: list, counter: list[int], clones: dict) -> list:
    return [v if type(v) in _LEAVES else _snap(v, counter, clones) for v in obj]


def _snap_tuple(obj: tuple, counter: list[int], clones: dict) -> tuple:
    return tuple([v if type(v) in _LEAVES else _snap(v, counter, clones) for v in obj])


def _snap_dict(obj: dict, counter: list[int], clones: dict) -> dict:
    return {k: v if type(v) in _LEAVES else _snap(v, counter, clones) for k, v in obj.items()}


def _snap_scalar(obj: Any, counter: list[int], clones: dict) -> Any:
    return obj


def _snap_other(obj: Any, counter: list[int], clones: dict) -> Any:
    """A type without a copier of its own (a subclass of list, tuple or dict, a dataclass with
    __slots__): the general way."""
    if isinstance(obj, torch.Tensor):
        return _snap_tensor(obj, counter, clones)
    if dataclasses.is_dataclass(obj):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, _snap(getattr(obj, f.name), counter, clones))
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snap(v, counter, clones) for v in obj)
    if isinstance(obj, dict):
        return {k: _snap(v, counter, clones) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return _snap_array(obj, counter, clones)
    if isinstance(obj, _SCALARS):
        return obj
    return copy.copy(obj)


def _copier_for(cls: type, obj: Any):
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return _snap_tensor
    if cls is np.ndarray:
        return _snap_array
    if cls in _EXACT:
        return _EXACT[cls]
    if dataclasses.is_dataclass(cls) and hasattr(obj, "__dict__"):
        return _dataclass_copier(cls)
    if issubclass(cls, _SCALARS):
        return _snap_scalar
    return _snap_other


def _dataclass_copier(cls: type):
    """A copier for one dataclass: its `__dict__` copied, each field that is not a leaf snapshot."""
    names = tuple(f.name for f in dataclasses.fields(cls))

    def copy_dataclass(obj: Any, counter: list[int], clones: dict) -> Any:
        values = obj.__dict__.copy()
        for name in names:
            v = values[name]
            if type(v) not in _LEAVES:
                values[name] = _snap(v, counter, clones)
        out = object.__new__(cls)
        object.__setattr__(out, "__dict__", values)
        return out
    return copy_dataclass


_SCALARS = (int, float, str, bool, bytes, type(None), np.generic, torch.dtype, torch.device)
_LEAVES = frozenset((int, float, str, bool, bytes, type(None), torch.dtype, torch.device))   # exact types
_EXACT = {list: _snap_list, tuple: _snap_tuple, dict: _snap_dict}
_COPIERS: dict[type, Any] = {}        # exact type -> its copier (filled as types are met)
_FROZEN = object()                    # the key of a PendingSnapshot's copies in a snapshot's memo


FROZEN_ALIGN = 16      # bytes: where each buffer's copy starts in a Frozen's flat tensor


@dataclass
class Frozen:
    """Copies of the runner's persistent buffers as a step left them, in one flat tensor of bytes:
    the storage whose address is k starts at byte `offsets[k]` of `flat` (`offsets` is shared by
    every step of one set of buffers). `host_bytes`: what it takes in host memory (0 on a device)."""
    flat: torch.Tensor                  # uint8 [total], on the buffers' device
    offsets: dict[int, int]             # storage data_ptr -> byte offset in flat
    host_bytes: int


class Freezer:
    """Makes each recorded step's `Frozen` in one copy, into a flat tensor used again once no record
    needs the one it held (`lend`: weakly tied to the record that reads it). Why not a fresh
    copy per buffer: every tensor object made in a step and kept across steps costs some 3-6 us a step
    (benchmarks/RESULTS.md, stop 65), and a recording keeps the trace's steps; a flat tensor used again
    is no new object. A record made (or dropped) before it is gone keeps its flat tensor unused until
    then: a copy is written again only when nothing can read it. None (nothing copied) when the
    storages take more than `max_bytes`."""

    MAX_LENT = 4096     # flat tensors followed for reuse (past it the oldest is forgotten, not freed)

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._key: tuple | None = None          # the buffers' addresses the layout below is for
        self._sources: list[torch.Tensor] = []  # uint8 views of each storage, then its padding
        self._offsets: dict[int, int] = {}
        self._total = 0
        self._on_cpu = False                    # then the copy is one numpy call (no torch dispatch)
        self._np_sources: list[np.ndarray] = []  # (on the CPU) numpy views of _sources
        self._last: tuple[torch.Tensor | None, np.ndarray | None] = (None, None)   # the flat made last
        self._lent: deque[tuple[torch.Tensor, np.ndarray | None, weakref.ref]] = deque()

    def __call__(self, buffers: list[torch.Tensor]) -> Frozen | None:
        key = tuple(b.data_ptr() for b in buffers)
        if key != self._key:
            self._layout(buffers, key)
        if self._total > self.max_bytes:
            return None
        if not self._sources:                   # no buffers: nothing to copy
            self._last = (torch.empty(0, dtype=torch.uint8), None)
            return Frozen(self._last[0], {}, 0)
        flat, lent = None, self._lent
        for _ in range(min(2, len(lent))):      # the oldest lent copy, or if its record is still held
            if lent[0][2]() is None:            # (by a caller, past the trace), the next one
                flat, flat_np, _ = lent.popleft()
                break
            lent.rotate(-1)                     # the held one waits at the back
        if flat is None:
            flat = torch.empty(self._total, dtype=torch.uint8, device=self._sources[0].device)
            flat_np = flat.numpy() if self._on_cpu else None
        if flat_np is not None:
            np.concatenate(self._np_sources, out=flat_np)
        else:
            torch.cat(self._sources, out=flat)
        self._last = (flat, flat_np)
        return Frozen(flat, self._offsets, self._total if self._on_cpu else 0)

    def lend(self, frozen: Frozen, reader: object) -> None:
        """`frozen.flat` (the last one made) may be written again once `reader` (the record that
        holds it) is gone."""
        flat, flat_np = self._last
        if flat is not frozen.flat:
            raise ValueError("Freezer.lend: lend the Frozen this Freezer made last (its flat tensor is "
                             "the one followed for reuse)")
        self._lent.append((flat, flat_np, weakref.ref(reader)))
        if len(self._lent) > self.MAX_LENT:
            self._lent.popleft()

    def _layout(self, buffers: list[torch.Tensor], key: tuple) -> None:
        storages: dict[int, torch.UntypedStorage] = {}
        for b in buffers:
            storage = b.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
        self._key, self._sources, self._offsets, self._total, self._lent = key, [], {}, 0, deque()
        for ptr, storage in storages.items():
            nbytes = storage.nbytes()
            whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))
            pad = -nbytes % FROZEN_ALIGN
            self._sources += [whole] if not pad else [whole, whole.new_zeros(pad)]
            self._offsets[ptr] = self._total
            self._total += nbytes + pad
        self._on_cpu = all(src.is_cpu for src in self._sources)
        self._np_sources = [src.numpy() for src in self._sources] if self._on_cpu else []
        self._last = (None, None)


@dataclass
class PendingSnapshot:
    """A step's batch and metadata recorded by reference: the runner's own per-step objects (made
    fresh by the step, never written after it) and a copy of the persistent buffers they view
    (`Freezer`). `materialize` makes the snapshot `snapshot` would have made at the step's end: the
    views of the buffers become the same views of the copy, everything else is copied."""
    input_batch: InputBatch
    groups: list[GroupMetadata]
    frozen: Frozen

    def materialize(self) -> tuple[InputBatch, list[GroupMetadata], int]:
        """(the batch's snapshot, the metadata's, the host bytes they hold)."""
        counter, clones = [0], {_FROZEN: self.frozen}
        return snapshot(self.input_batch, counter, clones), snapshot(self.groups, counter, clones), counter[0]


@dataclass(slots=True)       # no __dict__: a record keeps one per row for the trace's life
class ScheduledRequest:
    request_id: str
    num_tokens: int             # tokens scheduled this step
    num_computed_before: int    # tokens already in the cache/state before the step
    is_prefill: bool            # still consuming prompt tokens
    runs_as_decode: bool        # one token on existing state: the layers ran it as a decode (a
                                # one-token prompt chunk too); the rest ran as prefills


def scheduled_rows(batch: InputBatch) -> list[ScheduledRequest]:
    """The batch's rows as the runner ran them (batch order). On Python ints (tolist): `runs_as_decode`
    per row costs less than its numpy form on a step's few rows."""
    return [ScheduledRequest(r, n, c, p, runs_as_decode(n, c, d)) for r, n, c, p, d in zip(
        batch.req_ids, batch.num_scheduled_tokens.tolist(), batch.num_computed_tokens_np.tolist(),
        batch.is_prefilling_np.tolist(), batch.num_drafts_np.tolist())]


@dataclass
class CacheLedger:
    """Who holds which ids, per KV-cache group: KV block ids for an attention group, the one
    state page for a Mamba group (with prefix caching, its position-indexed row of state pages: 0
    where a column has none, the last one the running page). Taken from the scheduler's pools."""
    group_kinds: list[str]                          # per group: "attention" or "mamba"
    holdings: dict[str, list[list[int]]]            # request id -> per group, the ids it holds

    def state_page(self, request_id: str) -> int | None:
        for kind, ids in zip(self.group_kinds, self.holdings.get(request_id, [])):
            if kind == "mamba" and any(ids):
                return [i for i in ids if i][-1]
        return None

    def kv_blocks(self, request_id: str) -> list[int]:
        for kind, ids in zip(self.group_kinds, self.holdings.get(request_id, [])):
            if kind == "attention":
                return list(ids)
        return []


@dataclass
class LayerState:
    """One recurrent layer's state for the rows of a step, gathered from the state cache at each
    request's slot: `before` as the forward read it, `after` as it wrote it. Each tensor is
    [B, *per-slot shape] in batch order (conv: [B, K-1, conv_dim]; Mamba2 ssm: [B, H, P, N];
    Mamba1 ssm: [B, d_inner, N]). With tensor parallelism the tensors are the full states, gathered
    from every rank at the step, and `rank_shards` says where each rank's shard sits in them."""
    layer_name: str
    mamba_type: str                     # "mamba1", "mamba2" or "short_conv"
    state_names: list[str]              # e.g. ["conv_state", "ssm_state"]
    request_ids: list[str]              # batch order
    slots: list[int]
    before: list[torch.Tensor]
    after: list[torch.Tensor]
    rank_shards: list[tuple[StateShard, ...]] | None = None     # per rank, per state; None: one rank

    def of(self, request_id: str, when: str = "after", rank: int | None = None) -> dict[str, torch.Tensor]:
        """{state name: tensor} of one request, `when` = "before" or "after"; `rank`: that rank's
        shard of it (tensor parallelism), as the rank held it."""
        row = self.request_ids.index(request_id)
        if rank is None:
            return {n: t[row] for n, t in zip(self.state_names, getattr(self, when))}
        if self.rank_shards is None or not 0 <= rank < len(self.rank_shards):
            ranks = "one rank" if self.rank_shards is None else f"ranks 0..{len(self.rank_shards) - 1}"
            raise ValueError(f"rank={rank}: {self.layer_name}'s states were recorded from {ranks}")
        return {n: t[row].index_select(sh.dim, sh.index)
                for n, t, sh in zip(self.state_names, getattr(self, when), self.rank_shards[rank])}

    @property
    def num_ranks(self) -> int:
        return 1 if self.rank_shards is None else len(self.rank_shards)


@dataclass
class Violation:
    """One failed runtime check; `InvariantError` carries a list of these."""
    check: str                          # e.g. "state_indices_match_ledger"
    where: str                          # step / request / group or layer, in words
    field: str                          # the field or object that is wrong
    message: str                        # the values seen

    def __str__(self) -> str:
        return f"[{self.check}] {self.where}, {self.field}: {self.message}"


@dataclass
class StateCopy:
    """One row's running state moved to a new page before the forward (prefix caching)."""
    request_id: str
    from_tokens: int      # tokens the source state covers (the row's computed tokens); 0: zeroed
    src_page: int         # 0 when zeroed (the request starts from scratch)
    dst_page: int


@dataclass
class CheckpointCopy:
    """Prefix caching + speculative decoding: a verify row's accepted tokens reached a block
    boundary; the state there, left in its state column `position`, was copied after sampling into
    the page of the block that boundary ends: the checkpoint a later request may hit (MRV2's
    boundary copy)."""
    request_id: str
    boundary: int         # tokens the checkpoint covers (a block multiple)
    position: int         # the verify position whose state it is (its state column; 0 = the last sample)
    src_page: int
    dst_page: int         # == src_page: the checkpoint's column is the running column itself


@dataclass
class SpecRow:
    """One decode row of a speculative engine's step (a verify row; d = 0 drafts is possible):
    what it verified and decided, and (recurrent layers) where its states are."""
    drafts: list[int]                  # x1..xd, the drafts it ran after its last sampled token
    target: list[int]                  # s0..sd, the target's token at each of its 1 + d positions
    num_accepted: int                  # tokens kept: accepted drafts + 1 (vLLM num_accepted_tokens)
    start_column: int | None           # the state column this step started from (num_accepted_tokens - 1
                                       # in the step's Mamba metadata); None without recurrent layers
    columns: list[int] | None          # its 1 + k state pages (state_indices_tensor_d row); None likewise
    columns_read: bool = True          # False: inspection was off and the columns were not read (a
                                       # device read would sync the step); start_column and columns None

    @property
    def accepted_drafts(self) -> int:
        return self.num_accepted - 1

    @property
    def next_column(self) -> int:
        """The state column its next step starts from (the state after its last kept position)."""
        return self.num_accepted - 1

    @property
    def target_at_rejection(self) -> int | None:
        """The target's own token where the first draft was rejected (None: every draft accepted)."""
        return self.target[self.accepted_drafts] if self.accepted_drafts < len(self.drafts) else None


@dataclass
class StepRecord:
    """What one engine step did, as the runner saw it (`llm.step()` returns it; `llm.trace` keeps
    the recent ones): snapshots of the InputBatch and the per-group metadata the runner used, the
    logits, the sampled and kept tokens, the scheduler's ledger, timings, and the violations of
    the runtime checks; in inspect="full" also each recurrent layer's state before and after.
    `metadata(kind)`, `kept_logits(request_id)` and `logprob_of(request_id)` read it; in Jupyter it
    shows as tables."""
    step_index: int | None                       # the user's step counter; None for warmup
    scheduled: list[ScheduledRequest]            # in batch order (decodes first)
    preempted_request_ids: list[str]
    input_batch: InputBatch | None               # None when nothing was scheduled
    attn_metadata: list[GroupMetadata]           # per layer group: common + builder output
    logits: torch.Tensor | None                  # float32 [B, V] in batch order
    sampled_token_ids: dict[str, int]            # every row's sample
    kept_token_ids: dict[str, int]               # samples appended to outputs (not partial prefills)
    outputs: list[RequestOutput]                 # requests that finished in this step (or in a
                                                 # generate() call since the last step)
    stage: str = "step"                          # "step", "generate", "warmup/profile run",
                                                 # "warmup/dummy batch RxT", "warmup/requests"
    finished_request_ids: list[str] = field(default_factory=list)   # finished in this step
    timings: dict[str, float] = field(default_factory=dict)         # host seconds per stage
    device_timings: dict[str, float] = field(default_factory=dict)  # CUDA: device seconds per runner stage
    ledger: CacheLedger | None = None            # cache holdings after the step
    states: list[LayerState] = field(default_factory=list)          # inspect="full" only
    top_logit_ids: torch.Tensor | None = None    # int64 [B, k], inspect="full" only
    top_logit_values: torch.Tensor | None = None  # float32 [B, k]
    violations: list[Violation] = field(default_factory=list)       # runtime checks that failed
    backend: str = "torch"                       # the ops that ran: "torch" or "triton"
    graph: str = "eager"                         # the forward: "eager", "padded eager" or "graph"
    padded_size: int | None = None               # rows it ran (a padded decode batch), else None
    dropped: list[str] = field(default_factory=list)  # parts the trace budget dropped: "states", "logits"
    # per row whose request asked (SamplingParams.logprobs): its sampled token with that token's
    # logprob and rank, and the top k it asked for (`logprob_of` has the other rows' from the logits)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # per prefill row whose request asked (SamplingParams.prompt_logprobs): the prompt tokens its
    # chunk predicts, with their logprobs, ranks and top k
    prompt_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # prefix caching: per request admitted this step with a hit, the prompt tokens it took from the
    # cache; and the state copies before the forward (a row entering a new block: page src -> dst)
    prefix_hits: dict[str, int] = field(default_factory=dict)
    state_copies: list[StateCopy] = field(default_factory=list)
    # with speculative decoding, also the boundary copies after sampling (a checkpoint reached inside
    # a verify row, copied from its state column into its block's column)
    checkpoint_copies: list[CheckpointCopy] = field(default_factory=list)
    # per request admitted this step (new, or resumed after a preemption): the scheduler's lookup of
    # its prefix, the object it made at admission (not recomputed): per full block whether its
    # attention KV block and a recurrent checkpoint were cached, the N - 1 cap, the hit, the
    # shared-prefix junction and why the hit is what it is (`.reason`). With prefix caching off,
    # a lookup that says so (`not_searched`).
    prefix_lookups: dict[str, PrefixLookup] = field(default_factory=dict)
    # speculative decoding: per decode row (request id), what it verified (SpecRow), and the drafts
    # proposed after the step for each row's next step
    spec: dict[str, SpecRow] = field(default_factory=dict)
    proposed_drafts: dict[str, list[int]] = field(default_factory=dict)
    # host bytes of the input_batch and attn_metadata snapshots, counted as they were taken (the
    # trace's budget then need not walk them); None: not counted (a record loaded from a file)
    snapshot_host_bytes: int | None = field(default=None, repr=False, compare=False)

    # ---- a record by reference (Recorder, inspect="metadata" / "full"): `input_batch` and
    # `attn_metadata` are left out of the instance until first read, and made from `_pending` then;
    # `scheduled` too, made from the step's batch alone (no snapshot); a record of `from_fields` also
    # lacks the list and dict fields its step left empty, made empty when first read
    def __getattr__(self, name: str):            # called only for an attribute the instance lacks
        values = self.__dict__
        if "_pending" in values:
            if name == "scheduled":                 # the rows from the step's batch (its own arrays), as made
                value = values[name] = scheduled_rows(values["_pending"].input_batch)    # then
                return value
            if name in _PENDING_FIELDS:
                self.materialize()
                return values[name]
        empty = _MADE_WHEN_READ.get(name)           # a record of `from_fields`: an empty list or dict
        if empty is not None:
            value = values[name] = empty()
            return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> StepRecord:
        """A record of `values` (taken as its `__dict__`, not copied); each list or dict field left out
        is made empty when first read, every other field left out is at its default. The Recorder makes
        one record a step and the trace keeps hundreds: a decode step's record then holds a dozen empty
        lists and dicts fewer, objects the step would make, the trace keep and a later step free
        (`holds` tests a field without making it). `values` holds `step_index`, `sampled_token_ids`,
        `kept_token_ids`, `logits` and, unless the record is then kept by reference (`keep_by_reference`:
        made from the step's batch when read), `scheduled`, `input_batch` and `attn_metadata`."""
        record = object.__new__(cls)
        object.__setattr__(record, "__dict__", values)
        return record

    def holds(self, name: str) -> bool:
        """Whether the list or dict field `name` holds anything, without making an empty one."""
        return bool(self.__dict__.get(name))

    def materialize(self) -> None:
        """Make the batch and metadata of a record kept by reference (nothing when they are made)."""
        values = self.__dict__
        pending = values.get("_pending")
        if pending is not None:
            if "scheduled" not in values:
                values["scheduled"] = scheduled_rows(pending.input_batch)
            del values["_pending"]
            values["input_batch"], values["attn_metadata"], nbytes = pending.materialize()
            self.snapshot_host_bytes = nbytes

    @property
    def is_pending(self) -> bool:
        """Its batch and metadata are kept by reference, not yet made (`materialize`)."""
        return "_pending" in self.__dict__

    def keep_by_reference(self, pending: PendingSnapshot) -> None:
        self.__dict__.pop("input_batch", None)
        self.__dict__.pop("attn_metadata", None)
        self.__dict__["_pending"] = pending

    def __getstate__(self) -> dict:              # pickle / copy: the made snapshot, not the runner's objects
        self.materialize()
        return self.__dict__

    @property
    def is_warmup(self) -> bool:
        return self.stage.startswith("warmup")

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.scheduled]

    @property
    def num_decodes(self) -> int:
        """Rows the layers ran as decodes (the Mamba metadata's `num_decodes`)."""
        return sum(s.runs_as_decode for s in self.scheduled)

    @property
    def num_prefills(self) -> int:
        return len(self.scheduled) - self.num_decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def logits_of(self, request_id: str) -> torch.Tensor:
        """float32 [V]: the logits this request's row was sampled from (a verify row: the logits of
        its last kept token; `kept_logits` has one row per kept token)."""
        return self.kept_logits(request_id)[-1]

    def kept_logits(self, request_id: str) -> torch.Tensor:
        """float32 [n, V]: the logits of each token this request's row kept (n = 1, or a verify
        row's accepted drafts + 1). The record's `logits` hold one row per sampled position,
        `input_batch.cu_num_logits_np` delimiting each batch row's."""
        if self.logits is None:
            why = DROPPED if "logits" in self.dropped else "this record holds no logits"
            raise KeyError(f"no logits for request {request_id!r} in this step: {why}")
        row = self.input_batch.req_ids.index(request_id)
        first = int(self.input_batch.cu_num_logits_np[row])
        n = self.spec[request_id].num_accepted if request_id in self.spec else 1
        return self.logits[first:first + n]

    def logprob_of(self, request_id: str) -> TokenLogprobs:
        """The sampled token of this request's row with its logprob and rank (raw logprobs:
        log_softmax of the fp32 logits), and the top k its request asked for. A row whose request
        asked nothing has them from the recorded logits, on demand (the runner computes logprobs
        only for the rows that ask: recording costs no log_softmax per step)."""
        if request_id in self.logprobs:
            return self.logprobs[request_id]
        if request_id not in self.request_ids:
            why = "its row was not in this step"
        elif self.logits is None:
            why = (DROPPED if "logits" in self.dropped else "this record holds no logits (inspect='off' "
                   "records only what requests asked for: SamplingParams(logprobs=k))")
        else:
            return self._logprobs_from_logits(request_id)
        raise KeyError(f"no logprobs for request {request_id!r} in this step: {why}")

    def _logprobs_from_logits(self, request_id: str) -> TokenLogprobs:
        from toolkit.runner.sampler import compute_logprobs
        row = self.input_batch.req_ids.index(request_id)
        kept = (self.spec[request_id].target[:self.spec[request_id].num_accepted] if request_id in self.spec
                else [self.sampled_token_ids[request_id]])
        ids, values, ranks = compute_logprobs(self.kept_logits(request_id), torch.tensor(kept), 0)
        first = int(self.input_batch.seq_lens_cpu_upper_bound[row]) - int(self.input_batch.num_drafts_np[row])
        return TokenLogprobs(first, ids.numpy(), values.numpy(), ranks.numpy())

    def metadata(self, kind: str) -> GroupMetadata:
        """The first group of a kind ("attention" or "mamba")."""
        for g in self.attn_metadata:
            if g.kind == kind:
                return g
        raise KeyError(f"no {kind!r} layer group in this step (groups: "
                       f"{[g.kind for g in self.attn_metadata]})")

    def state(self, layer_name: str) -> LayerState:
        for s in self.states:
            if s.layer_name == layer_name:
                return s
        if "states" in self.dropped:
            raise KeyError(f"no recorded state for layer {layer_name!r} in this step: states {DROPPED}")
        recorded = [s.layer_name for s in self.states] or "none; states need inspect='full'"
        raise KeyError(f"no recorded state for layer {layer_name!r} in this step (recorded: {recorded})")


_PENDING_FIELDS = ("input_batch", "attn_metadata")
# the fields `from_fields` may leave out that `__getattr__` makes when first read: every list or dict field
_MADE_WHEN_READ = {f.name: f.default_factory for f in dataclasses.fields(StepRecord)
                   if f.default_factory is not dataclasses.MISSING}
_MADE_WHEN_READ.update(preempted_request_ids=list, outputs=list)
