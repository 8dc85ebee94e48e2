"""Recorder: turns what the runner did in a step into a StepRecord, runs the runtime checks and
keeps the records in the trace. The LLM facade hands it each step's outcome (`StepOutcome`) and
each warmup stage; it is None with `inspect="off"` and checks off.

`LLM(inspect=...)`:
- "off": no Recorder; the runner's observer hook is None, so a step pays one `if` per hook.
  `step()` still returns a StepRecord (`step_record`, built from the runner's objects after the step).
- "metadata": every step (step(), generate(), warmup()) becomes a StepRecord in `llm.trace`:
  batch, metadata, logits, the scheduler's decision, per-stage timings, the cache ledger.
- "full": also every recurrent layer's state for every row, before and after the forward,
  gathered from the state cache at the request's slot (only the layers and requests the capture
  filter chooses: inspect/capture.py); and the top-k logits per row.

Everything recorded is a copy of what the runner used (`snapshot`), taken after it used it (the
batch and metadata by reference while the runner's persistent buffers are small: copies of those
buffers, the snapshot made when first read, StepRecord.materialize); states
and logits are copied to host memory inside the step, before its one sync, so that on a GPU they
leave the device's memory alone and cost no extra sync. The trace keeps records within its byte
budget (inspect/trace.py).
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.attention.mamba_base import verify_start_slots
from toolkit.distributed import SINGLE
from toolkit.host import MAPPED_MIN_BYTES, to_host
from toolkit.inspect import checks
from toolkit.inspect.capture import (
    Captured,
    CaptureFilter,
    LayerSpec,
    RequestSpec,
    capture_rows,
    gather_states,
    resolve_layers,
    resolve_requests,
)
from toolkit.inspect.cold_state import ColdReplay, check_hit_states, check_spec_start_states
from toolkit.inspect.ledger_book import LedgerBook
from toolkit.inspect.ranks import CapturePlan, RankSync
from toolkit.inspect.step_record import (
    TOP_K_LOGITS,
    CheckpointCopy,
    Freezer,
    Frozen,
    LayerState,
    PendingSnapshot,
    SpecRow,
    StateCopy,
    StepRecord,
    Violation,
    scheduled_rows,
    snapshot,
)
from toolkit.inspect.trace import Trace
from toolkit.layers.state_mixer import StateSlotMixer
from toolkit.outputs import RequestOutput
from toolkit.request import Request
from toolkit.runner.cudagraph import CaptureReport
from toolkit.runner.model_runner import ExecuteModelState, ModelRunner
from toolkit.scheduler import Scheduler, SchedulerOutput

MODES = ("off", "metadata", "full")
# a step is recorded by reference (its batch and metadata made when first read, the runner's persistent
# buffers copied whole) while those buffers take at most this many bytes; above it (large batches and
# contexts: wide block tables) the batch and metadata are snapshot in the step as before
BY_REFERENCE_MAX_BYTES = 256 * 1024


@dataclass
class StepOutcome:
    """What one engine step did, as the facade saw it: the scheduler's decision, the runner's
    execute state (None when nothing was scheduled), the samples and what finished."""
    step_index: int | None              # the user's step counter; None for warmup
    stage: str                          # "step", "generate" or "warmup/requests"
    sched_out: SchedulerOutput
    exec_state: ExecuteModelState | None
    sampled: dict[str, int]
    kept: dict[str, int]
    finished: list[Request]
    outputs: list[RequestOutput]
    timings: dict[str, float]           # seconds: "schedule", "update" (the runner adds its own)


def step_record(step: StepOutcome, backend: str, logits: torch.Tensor | None = None,
                read_device: bool = True, frozen: Frozen | None = None) -> StepRecord:
    """The StepRecord of a step: snapshots of the objects the runner used, taken after the step
    (`logits`: a copy already taken, else the step's logits are snapshot here). `read_device=False`
    (inspection off): nothing is read from the device (a read would sync it), so speculative rows
    carry no state columns. `frozen`: the copy of the runner's persistent buffers (`Freezer`): the
    batch and metadata are then kept by reference and made when first read (PendingSnapshot: no
    walk in the step)."""
    state = step.exec_state
    if state is not None and frozen is not None:
        record = _step_record(step, backend, logits, read_device, [frozen.host_bytes], None)
        record.keep_by_reference(PendingSnapshot(state.input_batch, state.attn_metadata.groups, frozen))
        return record
    return _step_record(step, backend, logits, read_device, [0], {})


def _step_record(step: StepOutcome, backend: str, logits: torch.Tensor | None, read_device: bool,
                 host_bytes: list[int], clones: dict | None) -> StepRecord:
    """`clones` None: the batch and metadata are left out (the caller keeps them by reference);
    else the memo of their snapshots (a view in both is cloned once). `host_bytes`: what the trace's
    budget counts for them (record_sizes). A list or dict field the step leaves empty is left out
    (StepRecord.from_fields: made when first read)."""
    state = step.exec_state
    values: dict = {"step_index": step.step_index, "stage": step.stage, "backend": backend,
                    "sampled_token_ids": step.sampled, "kept_token_ids": step.kept}
    if clones is not None or state is None:     # (kept by reference: the rows made from the batch when read)
        values["scheduled"] = scheduled_rows(state.input_batch) if state else []
        values["input_batch"] = snapshot(state.input_batch, host_bytes, clones) if state else None
        values["attn_metadata"] = snapshot(state.attn_metadata.groups, host_bytes, clones) if state else []
    values["logits"] = logits if logits is not None else snapshot(state.logits) if state else None
    values["snapshot_host_bytes"] = host_bytes[0]
    values["timings"] = {"schedule": step.timings["schedule"], **(state.timings if state else {}),
                         "update": step.timings["update"]}
    if step.sched_out.preempted_req_ids:
        values["preempted_request_ids"] = list(step.sched_out.preempted_req_ids)
    if step.finished:
        values["finished_request_ids"] = [r.request_id for r in step.finished]
    if step.outputs:
        values["outputs"] = list(step.outputs)
    new_reqs = step.sched_out.scheduled_new_reqs
    if new_reqs:
        values["prefix_hits"] = {new.req_id: new.num_cached_tokens for new in new_reqs if new.num_cached_tokens}
        values["prefix_lookups"] = {new.req_id: new.prefix_lookup for new in new_reqs
                                    if new.prefix_lookup is not None}
    if state is None:
        return StepRecord.from_fields(values)
    if state.graph != "eager":
        values["graph"] = state.graph
    if state.padded_size is not None:
        values["padded_size"] = state.padded_size
    for name, held in (("device_timings", state.device_timings), ("logprobs", state.sampled_logprobs),
                       ("prompt_logprobs", state.prompt_logprobs)):
        if held:
            values[name] = dict(held)
    if state.state_copies is not None:
        values["state_copies"] = state_copies(state.state_copies)
    if state.checkpoint_copies is not None:
        values["checkpoint_copies"] = checkpoint_copies(state.checkpoint_copies)
    spec = spec_rows(state, step.sampled, read_device)
    if spec:
        values["spec"] = spec
    if state.proposed_drafts:
        finished = {r.request_id for r in step.finished}
        values["proposed_drafts"] = {rid: d for rid, d in state.proposed_drafts.items()   # requests still running
                                     if rid not in finished}
    return StepRecord.from_fields(values)


def spec_rows(state: ExecuteModelState, sampled: dict[str, int], read_device: bool = True) -> dict[str, SpecRow]:
    """Per decode row of a speculative step: the verification's outcome (`state.verification`) and, when
    `read_device`, the state columns from the step's Mamba metadata (what the layers read)."""
    batch = state.input_batch
    if state.verification is None and batch.num_draft_tokens is None and not any(
            getattr(g.metadata, "num_accepted_tokens", None) is not None for g in state.attn_metadata.groups):
        return {}
    mamba = next((g.metadata for g in state.attn_metadata.groups
                  if getattr(g.metadata, "num_accepted_tokens", None) is not None), None)
    read = mamba is not None and read_device
    accepted = mamba.num_accepted_tokens.tolist() if read else None
    columns = mamba.state_indices_tensor_d.tolist() if read else None
    verification = state.verification
    verified = {rid: i for i, rid in enumerate(verification.req_ids)} if verification else {}
    out = {}
    for row in np.nonzero(batch.runs_as_decode_np)[0]:
        rid = batch.req_ids[row]
        if rid in verified:
            i = verified[rid]
            drafts, target, kept = verification.drafts[i], verification.target[i], int(verification.num_accepted[i])
        else:
            drafts, target, kept = [], [sampled[rid]], 1
        out[rid] = SpecRow(drafts, target, kept, accepted[row] - 1 if accepted else None,
                           columns[row] if columns else None, columns_read=read_device)
    return out


def state_copies(copies) -> list[StateCopy]:
    if copies is None:
        return []
    return [StateCopy(r, int(n), int(s), int(d))
            for r, n, s, d in zip(copies.request_ids, copies.from_tokens, copies.src, copies.dst)]


def checkpoint_copies(copies) -> list[CheckpointCopy]:
    if copies is None:
        return []
    return [CheckpointCopy(r, int(b), int(j), int(s), int(d)) for r, b, j, s, d in
            zip(copies.request_ids, copies.boundary, copies.position, copies.src, copies.dst)]


class Recorder:
    """The runner's StepObserver while inspection (or checking) is on, and the keeper of the
    trace: the facade calls `begin` after scheduling, `record_step` after the step, and
    `record_stage` / `record_failed_stage` for warmup stages."""

    def __init__(self, mode: str, checks_on: bool, runner: ModelRunner, scheduler: Scheduler, trace: Trace,
                 backend: str, layers: LayerSpec = None, requests: RequestSpec = None):
        if mode not in MODES:
            raise ValueError(f"inspect={mode!r}: use one of {MODES}")
        self.mode = mode
        self.checks_on = checks_on
        self.runner = runner
        self.scheduler = scheduler
        self.trace = trace
        self.backend = backend
        self.where = ""
        self._ledger_at_schedule = None
        # the ledger kept from step to step (unchanged rows shared between records) and, with checks,
        # its audit of what each step changed (inspect/ledger_book.py)
        self.book = LedgerBook(scheduler, runner, audit=checks_on)
        self.freezer = Freezer(BY_REFERENCE_MAX_BYTES)       # each step's copy of the runner's buffers
        self._rows: list[int] = []
        self._host_slots: dict[str, list[int]] = {}
        self._before: Captured | None = None
        self._after: Captured | None = None
        self._logits: torch.Tensor | None = None
        self._top: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: list[Violation] = []
        self._layer_info: dict[str, tuple[str, list[str]]] = {}     # recurrent layer -> (kind, state names)
        specs = {n: g.spec for g in runner.kv_cache_groups if g.kind == "mamba" for n in g.layer_names}
        for module in runner.model.modules():
            if isinstance(module, StateSlotMixer) and module.layer_name in specs:
                self._layer_info[module.layer_name] = (specs[module.layer_name].mamba_type,
                                                       list(module.state_names))
        self._state_names = {layer: info[1] for layer, info in self._layer_info.items()}   # for check messages
        # tensor parallelism: the inspection collectives (every rank's metadata, gathered states)
        tp = getattr(runner.model, "tp", SINGLE)
        self.ranks = RankSync(runner, tp) if tp.sharded else None
        self._plan: CapturePlan | None = None
        # host bytes one row's full state takes, per recurrent layer (what reserving room for a step
        # counts; a rank's shard scaled to the full state, which a sharded record holds)
        self._slot_bytes = {n: sum(t[0].nbytes * sh.full // len(sh.index) if sh is not None else t[0].nbytes
                                   for t, sh in zip(runner.kv_caches[n], self._shards_of(n)))
                            for n in specs}
        self._states_refused = False
        self.capture = self.make_filter(layers, requests)
        # prefix caching in full mode: the oracle of `checkpoint_equals_cold_state`
        self.spec = runner.cfg.num_speculative_tokens > 0
        self.cold = ColdReplay(runner) if mode == "full" and (scheduler.kv.caching or self.spec) else None
        # speculative decoding: the tokens each request kept at its last step (what its next step's
        # num_accepted_tokens must say; a request (re)admitted starts at 1)
        self._kept_last_step: dict[str, int] = {}
        self._column_last_step: dict[str, int] = {}      # prefix caching: each request's running column
        # what check_metadata needs of the engine's groups, fixed for its life: group id -> block size of
        # the position-indexed Mamba rows (prefix caching, "align"), group id -> W of the sliding windows
        self._aligned = {g.group_id: g.block_size for g in runner.kv_cache_groups
                         if g.kind == "mamba" and runner.block_tables.aligned[g.group_id]}
        self._windows = {g.group_id: g.sliding_window for g in runner.kv_cache_groups if g.sliding_window}
        runner.observer = self

    def _shards_of(self, layer: str) -> list:
        shards = self.ranks.shards.get(layer) if self.ranks is not None else None
        return list(shards) if shards is not None else [None] * len(self.runner.kv_caches[layer])

    def make_filter(self, layers: LayerSpec = None, requests: RequestSpec = None,
                    finished: Collection[str] = ()) -> CaptureFilter:
        """A capture filter for this engine's layers (see inspect/capture.py); bad values raise."""
        recurrent = [n for g in self.runner.kv_cache_groups if g.kind == "mamba" for n in g.layer_names]
        attention = [n for g in self.runner.kv_cache_groups if g.kind == "attention" for n in g.layer_names]
        return CaptureFilter(resolve_layers(layers, recurrent, attention),
                             resolve_requests(requests, self.scheduler.requests, finished),
                             len(recurrent))

    # ---- a step -------------------------------------------------------------------------------
    def begin(self, where: str, sched_out: SchedulerOutput | None = None) -> None:
        """Called after scheduling: the ledger `check_metadata` compares the step with, and (prefix
        caching) whether each hit admitted holds what it claims."""
        self.where, self._before, self._after, self._pending = where, None, None, []
        self._logits = self._top = None
        self._states_refused = False
        self._ledger_at_schedule = self.book.refresh() if self.checks_on else None
        if self.checks_on and self.scheduler.kv.caching and sched_out is not None:
            self._pending += checks.check_hits_backed(self.scheduler, sched_out, where)
            # a page held when the step runs must not wait in the free queue (the next allocation could
            # evict it): checked here too, as a hit's pages may be released again by the step's end
            self._pending += self.book.held_not_free(f"{where}, at scheduling")
        if self.spec and sched_out is not None:
            for rid in sched_out.finished_req_ids:
                self._kept_last_step.pop(rid, None)
                self._column_last_step.pop(rid, None)
            for new in sched_out.scheduled_new_reqs:
                self._kept_last_step.pop(new.req_id, None)
                self._column_last_step.pop(new.req_id, None)

    def before_forward(self, runner, state) -> None:
        plan = None
        if self.mode == "full" and self.capture.layers:
            batch = state.input_batch
            self._rows = capture_rows(batch.req_ids, self.capture)
            idx = batch.idx_mapping_np[self._rows]
            chosen = set(self.capture.layers)
            seq_lens = (batch.num_computed_tokens_np + batch.num_scheduled_tokens)[self._rows]
            self._host_slots = {n: runner.block_tables.state_pages(g.group_id, idx, seq_lens).tolist()
                                for g in runner.kv_cache_groups if g.kind == "mamba"
                                for n in g.layer_names if n in chosen}
            if self.spec:               # a verify row starts from the column its accepted count points at
                starts = self._spec_start_slots(state)
                self._host_slots = {n: [starts.get(r, slot) for r, slot in zip(self._rows, slots)]
                                    for n, slots in self._host_slots.items()}
            # room in the trace first (before and after, every chosen row and layer), so that the
            # process never holds more than the budget; a step larger than the budget gathers nothing
            need = 2 * len(self._rows) * sum(self._slot_bytes[n] for n in self._host_slots)
            if not self.trace.reserve(need + self.trace.last_record_bytes):      # the record's logits too
                self._states_refused = True
            elif self.ranks is None:
                self._before = gather_states(runner, state, self.capture, self._rows, self._host_slots)
            else:
                plan = CapturePlan(self.capture.layers, self._rows, self._host_slots)
        if self.ranks is not None:      # every rank's metadata compared; states gathered by rank 0's plan
            violations, self._plan = self.ranks.exchange(state, self.checks_on, plan, self.where)
            self._pending += violations
            if self._plan is not None:
                self._before, violations = self.ranks.gather(runner, state, self._plan, self._plan.slots, self.where)
                self._pending += violations
        names = self._state_names
        if self.checks_on:
            self._pending += checks.check_fresh_slots(runner, state, self.where, names)
            if self.scheduler.kv.caching:
                self._pending += checks.check_cached_not_written(self.scheduler, runner, state, self.where)
                self._pending += checks.check_state_copies(runner, state, self.where, names)
        if self.cold is not None and self.scheduler.kv.caching and self.checks_on:
            self._pending += check_hit_states(self.cold, self.scheduler, runner, state, self.where, names)
        if self.cold is not None and self.spec and self.checks_on:
            self._pending += check_spec_start_states(self.cold, self.scheduler, runner, state, self.where, names)

    def after_forward(self, runner, state) -> None:
        if self.ranks is not None:
            if self._plan is not None:
                self._after, violations = self.ranks.gather(runner, state, self._plan, self._plan.slots, self.where)
                self._pending += violations
                self._plan = None
            return
        if self._before is not None and not self.spec:      # speculative decoding: after sampling (record_step)
            self._after = gather_states(runner, state, self.capture, self._rows, self._host_slots)

    @staticmethod
    def _spec_start_slots(state) -> dict[int, int]:
        """Batch row -> the slot a verify row's first position reads (its Mamba metadata)."""
        for gm in state.attn_metadata.groups:
            md = gm.metadata
            starts = verify_start_slots(md) if hasattr(md, "num_accepted_tokens") else None
            if starts is not None:
                return dict(enumerate(starts.tolist()))
        return {}

    def after_logits(self, runner, state) -> None:
        logits = state.logits
        # the LM head's output is made fresh by each step and nothing writes it after (the sampler and
        # the logprobs read it raw): on the CPU a small one is kept as it is, not copied; a large one
        # is copied into memory of its own (to_host: recorded data lives long), from a device to the host
        self._logits = logits if logits.is_cpu and logits.nbytes < MAPPED_MIN_BYTES else to_host(logits)
        if self.mode == "full":
            top = state.logits.topk(min(TOP_K_LOGITS, state.logits.shape[-1]), dim=-1)
            self._top = to_host(top.values), to_host(top.indices)

    def record_step(self, step: StepOutcome) -> StepRecord:
        """The step's record, with the full-mode fields and the checks' violations, appended to
        the trace; raises InvariantError (after recording) if a check failed."""
        self.trace.make_room()          # first: the record it drops frees its copy for this step's
        frozen = self.freezer(self.runner.persistent_buffers()) if step.exec_state else None
        record = step_record(step, self.backend, self._logits, frozen=frozen)
        if frozen is not None:
            self.freezer.lend(frozen, record)       # its copy is written again once the record is gone
        if self.spec and self._before is not None and step.exec_state is not None:
            # the state each verify row kept: the column of its last kept position (the cache is as the
            # forward left it: sampling and the update write no state)
            rids = step.exec_state.input_batch.req_ids
            kept = {row: record.spec[rids[row]] for row in self._rows if rids[row] in record.spec}
            after = {n: [kept[row].columns[kept[row].next_column] if row in kept and kept[row].columns else slot
                         for row, slot in zip(self._rows, slots)] for n, slots in self._host_slots.items()}
            self._after = gather_states(self.runner, step.exec_state, self.capture, self._rows, after)
        states = self._layer_states()
        if states:
            record.states = states
        if self._states_refused:
            record.dropped = ["states"]
        if self._top is not None:
            record.top_logit_values, record.top_logit_ids = self._top
        violations = self._pending
        state = step.exec_state
        if self.checks_on and state is not None:
            groups = state.attn_metadata.groups     # the live objects, as the step left them (not the record's:
            # one kept by reference is made when first read)
            # (the record's rows, made from the batch, only where a row's counts are read)
            violations += checks.check_metadata(groups, lambda: record.scheduled, self._ledger_at_schedule,
                                                self.where, self._aligned, self._windows, book=self.book,
                                                request_ids=state.input_batch.req_ids)
            if state.logits is not None:      # the host copy when recorded (no device read, numpy-fast)
                logits = record.logits if record.logits is not None else state.logits
                batch = state.input_batch
                violations += checks.check_logits(logits, batch.req_ids, self.where, lambda: batch.cu_num_logits_np)
            if self.spec:
                violations += checks.check_spec_columns(groups, record.scheduled,
                                                        self._accepted_expected(record), self.where)
                if self.scheduler.kv.caching:
                    violations += checks.check_spec_checkpoints(self.runner, state, record.spec, self.where)
            if self.scheduler.kv.caching:
                violations += checks.check_checkpoints_at_block_end(self.scheduler, self.runner, state, self.where)
        # the ledger after the step (after check_metadata: the book's arrays are the ledger at scheduling
        # until this refresh)
        record.ledger = self.book.refresh()
        if self.checks_on:
            violations += self.book.audit(self.where)
        if violations:
            record.violations = violations
        if self.spec and state is not None:
            bs = self._aligned_block_size()
            for sc in record.scheduled:
                rid = sc.request_id
                kept = record.spec[rid].num_accepted if rid in record.spec else 1
                if bs is not None:     # "align": the running column, and a checkpoint landing in it
                    col = -(-(sc.num_computed_before + sc.num_tokens) // bs) - 1
                    boundary = (sc.num_computed_before + kept) // bs * bs
                    if boundary > sc.num_computed_before and boundary // bs - 1 == col:
                        kept = 1
                    self._column_last_step[rid] = col
                self._kept_last_step[rid] = kept
        self._before = self._after = self._logits = self._top = None
        self._pending = []
        self.trace.append(record)
        checks.raise_if_any(violations)
        return record

    def _aligned_block_size(self) -> int | None:
        """The block size of the position-indexed Mamba rows (prefix caching), else None."""
        return next(iter(self._aligned.values()), None)

    def _accepted_expected(self, record: StepRecord) -> dict[str, int]:
        """Request -> the num_accepted_tokens its row should carry this step: what it kept at its last
        step (vLLM MRV2 `postprocess_state`), or 1 for a request new to its row, for one whose running
        column moved ("align": the pre-copy put its state in column 0) and for one whose last step's
        checkpoint landed in its running column."""
        expected = dict(self._kept_last_step)
        bs = self._aligned_block_size()
        if bs is not None:
            for sc in record.scheduled:
                col = -(-(sc.num_computed_before + sc.num_tokens) // bs) - 1
                if self._column_last_step.get(sc.request_id, col) != col:
                    expected[sc.request_id] = 1
        return expected

    def _layer_states(self) -> list[LayerState]:
        if self._before is None or self._after is None:
            return []
        out = []
        for (name, before), (_, after) in zip(self._before.states, self._after.states):
            mamba_type, names = self._layer_info.get(name, ("?", [f"state{i}" for i in range(len(before))]))
            out.append(LayerState(name, mamba_type, names, list(self._before.request_ids),
                                  self._before.slots[name], before, after,
                                  self.ranks.rank_shards(name) if self.ranks is not None else None))
        return out

    # ---- warmup stages -------------------------------------------------------------------------
    def record_stage(self, stage: str, exec_state: ExecuteModelState, seconds: float) -> None:
        """A profile run or a dummy batch (no scheduler, no requests); raises InvariantError
        (after recording) if its metadata breaks a check."""
        groups = snapshot(exec_state.attn_metadata.groups)
        record = StepRecord(step_index=None, scheduled=[], preempted_request_ids=[],
                            input_batch=snapshot(exec_state.input_batch), attn_metadata=groups,
                            logits=None, sampled_token_ids={}, kept_token_ids={}, outputs=[], stage=stage,
                            timings={"total": seconds}, backend=self.backend)
        if self.checks_on:
            record.violations = checks.check_dummy_metadata(groups, stage)
        self.trace.append(record)
        checks.raise_if_any(record.violations)

    def record_capture(self, stage: str, report: CaptureReport) -> None:
        """Warmup's CUDA-graph capture: its time (and the replay checks'), and each size whose
        graph replayed differently from the eager forward (dropped to eager, cudagraph.py) as a
        violation. Not raised: the engine runs those sizes eagerly and has warned once."""
        violations = [Violation("graph_replays_as_eager", f"{stage}, size {size}", "graph", why)
                      for size, why in sorted(report.failed.items())]
        self.trace.append(StepRecord(step_index=None, scheduled=[], preempted_request_ids=[], input_batch=None,
                                     attn_metadata=[], logits=None, sampled_token_ids={}, kept_token_ids={},
                                     outputs=[], stage=stage, backend=self.backend, violations=violations,
                                     timings={"total": report.seconds, "check": report.check_seconds}))

    def record_failed_stage(self, stage: str, err: Exception) -> None:
        """A warmup stage that raised before it had a batch to show: the record carries the error
        as a violation (field and builder of a MetadataContractError where it has them)."""
        field = getattr(err, "field", "") or type(err).__name__
        where = f"{stage}, {getattr(err, 'builder', '') or 'the stage'}"
        self.trace.append(StepRecord(step_index=None, scheduled=[], preempted_request_ids=[], input_batch=None,
                                     attn_metadata=[], logits=None, sampled_token_ids={}, kept_token_ids={},
                                     outputs=[], stage=stage, backend=self.backend,
                                     violations=[Violation(type(err).__name__, where, field, str(err))]))
