"""Recorder: turns what the runner did in a step into a StepRecord, and runs the runtime checks.

`LLM(inspect=...)`:
- "off": no Recorder; the runner's observer hook is None, so a step pays one `if` per hook.
  `step()` still returns a StepRecord (built from the runner's objects after the step).
- "metadata": every step (step(), generate(), warmup()) becomes a StepRecord in `llm.trace`:
  batch, metadata, logits, the scheduler's decision, per-stage timings, the cache ledger.
- "full": also every recurrent layer's state for every row, before and after the forward,
  gathered from the state cache at the request's slot; and the top-k logits per row.

Everything recorded is a copy of what the runner used (`snapshot`), taken after it used it.
"""
from __future__ import annotations

import torch

from toolkit.inspect import checks
from toolkit.inspect.step_record import TOP_K_LOGITS, LayerState, StepRecord, Violation, snapshot
from toolkit.layers.state_mixer import StateSlotMixer

MODES = ("off", "metadata", "full")


def gather_states(runner, state) -> list[tuple[str, list[torch.Tensor]]]:
    """(layer name, one [B, *shape] copy per state tensor) for every recurrent layer, at the
    slots of the batch's rows (column 0 of the Mamba group's block table)."""
    out = []
    for group in runner.kv_cache_groups:
        if group.kind != "mamba":
            continue
        slots = state.block_tables[group.group_id][:, 0].long()
        for name in group.layer_names:
            out.append((name, [t.index_select(0, slots) for t in runner.kv_caches[name]]))
    return out


class Recorder:
    """The runner's StepObserver while inspection is on; the LLM asks it for records."""

    def __init__(self, mode: str, checks_on: bool):
        if mode not in MODES:
            raise ValueError(f"inspect={mode!r}: use one of {MODES}")
        self.mode = mode
        self.checks_on = checks_on
        self.where = ""
        self._before: list | None = None
        self._after: list | None = None
        self._pending: list[Violation] = []
        self._layer_info: dict[str, tuple[str, list[str]]] = {}

    def attach(self, runner) -> None:
        """Learn each recurrent layer's kind and state names; hook into the runner."""
        specs = {n: g.spec for g in runner.kv_cache_groups if g.kind == "mamba" for n in g.layer_names}
        for module in runner.model.modules():
            if isinstance(module, StateSlotMixer) and module.layer_name in specs:
                self._layer_info[module.layer_name] = (specs[module.layer_name].mamba_type,
                                                       list(module.state_names))
        runner.observer = self if (self.mode == "full" or self.checks_on) else None

    # ---- StepObserver hooks ---------------------------------------------------------------
    def begin(self, where: str) -> None:
        self.where, self._before, self._after, self._pending = where, None, None, []

    def before_forward(self, runner, state) -> None:
        if self.mode == "full":
            self._before = gather_states(runner, state)
        if self.checks_on:
            names = {layer: info[1] for layer, info in self._layer_info.items()}
            self._pending += checks.check_fresh_slots(runner, state, self.where, names)

    def after_forward(self, runner, state) -> None:
        if self.mode == "full":
            self._after = gather_states(runner, state)

    # ---- records ----------------------------------------------------------------------------
    def layer_states(self, request_ids: list[str], slots_by_layer: dict[str, list[int]]) -> list[LayerState]:
        if self._before is None or self._after is None:
            return []
        out = []
        for (name, before), (_, after) in zip(self._before, self._after):
            mamba_type, names = self._layer_info.get(name, ("?", [f"state{i}" for i in range(len(before))]))
            out.append(LayerState(name, mamba_type, names, list(request_ids), slots_by_layer[name],
                                  before, after))
        return out

    def finish_record(self, record: StepRecord, runner, exec_state, ledger_at_schedule) -> list[Violation]:
        """Fill the full-mode fields and run the post-step checks; returns the violations."""
        if exec_state is not None and self.mode == "full":
            slots = {n: exec_state.block_tables[g.group_id][:, 0].tolist()
                     for g in runner.kv_cache_groups if g.kind == "mamba" for n in g.layer_names}
            record.states = self.layer_states(exec_state.input_batch.req_ids, slots)
            if exec_state.logits is not None:
                top = exec_state.logits.topk(min(TOP_K_LOGITS, exec_state.logits.shape[-1]), dim=-1)
                record.top_logit_values, record.top_logit_ids = top.values.clone(), top.indices.clone()
        violations = list(self._pending)
        if self.checks_on and exec_state is not None:
            violations += checks.check_metadata(record.attn_metadata, record.scheduled,
                                                ledger_at_schedule, self.where)
            if exec_state.logits is not None:
                violations += checks.check_logits(exec_state.logits, exec_state.input_batch.req_ids,
                                                  self.where)
        self._before = self._after = None
        self._pending = []
        return violations


def warmup_record(stage: str, exec_state, checks_on: bool) -> StepRecord:
    """A record of a profile run or a dummy batch (no scheduler, no requests)."""
    groups = snapshot(exec_state.attn_metadata.groups)
    record = StepRecord(step_index=None, scheduled=[], preempted_request_ids=[],
                        input_batch=snapshot(exec_state.input_batch), attn_metadata=groups,
                        logits=None, sampled_token_ids={}, kept_token_ids={}, outputs=[], stage=stage)
    if checks_on:
        record.violations = checks.check_dummy_metadata(groups, stage)
    return record


def failed_stage_record(stage: str, err: Exception) -> StepRecord:
    """A warmup stage that raised before it had a batch to show: the record carries the error as a
    violation (field and builder of a MetadataContractError where it has them)."""
    field = getattr(err, "field", "") or type(err).__name__
    where = f"{stage}, {getattr(err, 'builder', '') or 'the stage'}"
    return StepRecord(step_index=None, scheduled=[], preempted_request_ids=[], input_batch=None,
                      attn_metadata=[], logits=None, sampled_token_ids={}, kept_token_ids={},
                      outputs=[], stage=stage,
                      violations=[Violation(type(err).__name__, where, field, str(err))])
