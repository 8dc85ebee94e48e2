"""What the StepInspector's views show, as pure functions (records -> HTML or PNG): shared by the
live widgets and their static `_repr_mimebundle_`. Nothing here recomputes what the runner
computed: every value is read from the records. A pane with nothing to show says why in one
sentence (the `why_*` functions) and never draws an empty picture.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from toolkit.attention.gdn import GDNMetadataBuilder
from toolkit.attention.mamba1 import Mamba1MetadataBuilder
from toolkit.attention.mamba2 import Mamba2MetadataBuilder
from toolkit.attention.mlstm import MLSTMMetadataBuilder
from toolkit.attention.paged_attn import PagedAttentionMetadataBuilder
from toolkit.attention.short_conv import ShortConvMetadataBuilder
from toolkit.inspect import html as H
from toolkit.inspect.prefix_cache import prefix_cache_html
from toolkit.inspect.prefix_views import prefix_cache_step_html
from toolkit.inspect.record_views import (
    batch_table_html,
    step_name,
    step_record_repr,
    violation_html,
    why_no_metadata,
)
from toolkit.inspect.serialize import equal
from toolkit.inspect.spec_views import spec_step_html
from toolkit.inspect.step_record import DROPPED
from toolkit.inspect.summaries import (
    device_of,
    format_ms,
    shape_of,
    total_seconds,
    type_name,
    value_preview,
    value_preview_html,
)
from toolkit.widgets import plots

NO_RECORDS = "no records yet: add a request and step the engine (or call llm.warmup())"
BUILDERS = (PagedAttentionMetadataBuilder, Mamba2MetadataBuilder, Mamba1MetadataBuilder,
            ShortConvMetadataBuilder, GDNMetadataBuilder, MLSTMMetadataBuilder)


# ---- why a pane is empty -------------------------------------------------------------------------
def why_no_states(record: Any, inspect: str | None = None) -> str | None:
    """Why the State view has no state to draw for `record`, in one sentence; None when it has.
    `inspect` is the engine's mode when known (a loaded trace does not say)."""
    if record is not None and record.states:
        return None
    if record is not None and "states" in record.dropped:
        return f"states {DROPPED}: the trace kept this step's metadata and batch but not its states"
    kinds = sorted({g.kind for g in record.attn_metadata}) if record is not None else []
    if kinds and "mamba" not in kinds:
        return (f"no recurrent layer in this model (its layer groups: {', '.join(kinds)}), "
                "so there is no conv/SSM state to show")
    if inspect is not None and inspect != "full":
        return (f'states are recorded only with inspect="full" and this engine runs with inspect="{inspect}": '
                'build it with LLM(..., inspect="full") to see them')
    if record is None:
        return NO_RECORDS
    if not record.scheduled:
        return f"{record.stage} ran no requests, so it holds no request state: pick a step that ran requests"
    return ('no states in this record: they are recorded only with inspect="full", '
            'so build the LLM with LLM(..., inspect="full") to see them')


def why_no_timeline(trace: Any) -> str:
    """Why the Timeline has nothing to draw (no record ran a request), in one sentence."""
    if not len(trace):
        return NO_RECORDS
    return ("no step has run a request yet (the trace holds only warmup stages): "
            "the timeline starts with the first step that does")


# ---- Batch ---------------------------------------------------------------------------------------
def batch_html(record: Any, decode: Any = None) -> str:
    """The record's one-line summary over its batch table (token text with `decode`)."""
    if record is None:
        return H.note(NO_RECORDS)
    return H.wrap(H.title(step_record_repr(record)) + batch_table_html(record, decode))


# ---- Metadata ------------------------------------------------------------------------------------
def builder_contracts() -> dict[str, dict[str, Any]]:
    """builder class name -> {field name: FieldSpec} (the contracts the builders declare)."""
    return {cls.__name__: {f.name: f for f in cls.required_fields} for cls in BUILDERS}


def _spec_text(spec: Any) -> str:
    parts = [str(spec.dtype).replace("torch.", "") if spec.dtype is not None else "",
             "cpu" if spec.on_cpu else "", spec.shape]
    return "required " + " ".join(p for p in parts if p)


def _previous_group(previous: Any, group_id: int) -> Any:
    if previous is None:
        return None
    return next((g for g in previous.attn_metadata if g.group_id == group_id), None)


def metadata_html(record: Any, previous: Any = None) -> str:
    """Per layer group: every field of the common metadata and of the builder's output, with
    dtype, shape, device, a value preview, its contract status, and whether it changed since
    `previous`. Fields named by a violation of this step are highlighted with its message."""
    if record is None:
        return H.note(NO_RECORDS)
    if not record.attn_metadata:
        return H.note(why_no_metadata(record))
    contracts = builder_contracts()
    parts = []
    for gm in record.attn_metadata:
        group_label = f"group {gm.group_id} ({gm.builder})"
        bad = {v.field: v for v in record.violations if group_label in v.where}
        prev = _previous_group(previous, gm.group_id)
        for what, obj, prev_obj, specs in (
                ("common metadata (given to the builder)", gm.common, prev and prev.common,
                 contracts.get(gm.builder, {})),
                (f"{type(gm.metadata).__name__} (built)", gm.metadata, prev and prev.metadata, {})):
            rows, bad_rows = [], set()
            for i, f in enumerate(dataclasses.fields(obj)):
                value = getattr(obj, f.name)
                spec = specs.get(f.name)
                status = H.span(_spec_text(spec) + " ✓", H.GOOD) if spec else H.span("-", H.MUTED)
                if f.name in bad:
                    status = H.span(bad[f.name].message, H.ALERT)
                    bad_rows.add(i)
                changed = ""
                if prev_obj is not None and not equal(value, getattr(prev_obj, f.name, None)):
                    changed = H.span("changed", H.CHANGED)
                rows.append([H.escape(f.name), H.escape(type_name(value)), H.escape(shape_of(value)),
                             H.escape(device_of(value)), value_preview_html(value), status, changed])
            parts.append(H.title(f"{group_label}, layers {', '.join(gm.layer_names)}: {what}"))
            parts.append(H.table(["field", "type", "shape", "device", "value", "contract",
                                  "vs previous step"], rows, bad_rows))
    others = [v for v in record.violations
              if not any(f"group {g.group_id} ({g.builder})" in v.where for g in record.attn_metadata)]
    if others:
        parts.append(H.title("other violations in this step"))
        parts += [violation_html(v) for v in others]
    return H.wrap("".join(parts))


# ---- Blocks --------------------------------------------------------------------------------------
def ledger_html(record: Any) -> str:
    """The state-slot and KV-block holdings after the step, one row per request."""
    if record.ledger is None:
        return H.span("no cache ledger in this record (warmup batches have no requests)", H.MUTED)
    kinds = record.ledger.group_kinds
    rows = [[H.escape(rid)] + [H.escape(value_preview(ids)) for ids in held]
            for rid, held in record.ledger.holdings.items()]
    if not rows:
        return H.span("no request holds a block or slot after this step", H.MUTED)
    return H.table(["request"] + [f"group {g} ({k}) ids" for g, k in enumerate(kinds)], rows)


def _used_blocks(table: torch.Tensor) -> list[int]:
    used = []
    for row in table.tolist():
        n = len(row)
        while n and row[n - 1] == 0:
            n -= 1
        used.append(n)
    return used


def block_tables_html(record: Any) -> str:
    """Per layer group, the block table (or state page per row) as a picture; the slot mapping of
    attention groups; then the scheduler's ledger."""
    if record is None:
        return H.note(NO_RECORDS)
    if not record.attn_metadata:
        return H.note(why_no_metadata(record, "block tables"))
    parts = []
    for gm in record.attn_metadata:
        table = gm.common.block_table_tensor
        labels = [s.request_id for s in record.scheduled] or [f"pad {i}" for i in range(table.shape[0])]
        if gm.kind == "mamba" and gm.common.num_accepted_tokens is not None:
            png = plots.block_grid_png(table.tolist(), labels,
                                       f"group {gm.group_id}: state pages per row, column j = the state after "
                                       "verify position j (speculative decoding)")
        elif gm.kind == "mamba" and table.shape[1] == 1:
            png = plots.block_grid_png(table.tolist(), labels,
                                       f"group {gm.group_id}: state page per row (grey = null page 0)")
        elif gm.kind == "mamba":                    # prefix caching: a page per block column
            png = plots.block_grid_png(table.tolist(), labels,
                                       f"group {gm.group_id}: state pages by block column, the last one running "
                                       "(grey = no page)", used=_used_blocks(table))
        else:
            png = plots.block_grid_png(table.tolist(), labels,
                                       f"group {gm.group_id}: block table (grey = null block 0, "
                                       "white = unused)", used=_used_blocks(table))
        parts.append(H.img(png, f"block table of group {gm.group_id}"))
        slots = gm.common.slot_mapping
        if gm.kind == "attention" and slots.numel():
            png = plots.block_grid_png([slots.tolist()], ["slot"], f"group {gm.group_id}: slot mapping "
                                       "per token (white = PAD_SLOT_ID, nothing written)",
                                       null_id=-2, pad_id=-1)
            parts.append(H.img(png, "slot mapping"))
    parts.append(H.title("holdings after the step (scheduler ledger)"))
    parts.append(ledger_html(record))
    return H.wrap("".join(parts))


# ---- State ---------------------------------------------------------------------------------------
def state_panels(record: Any, layer: str, request_id: str, rank: int | None = None) -> list[tuple[str, bytes]]:
    """(state name, PNG of before | after | after - before) for one layer and request; `rank`: that
    tensor-parallel rank's shard (None: the full state, gathered from every rank)."""
    st = record.state(layer)
    before, after = st.of(request_id, "before", rank), st.of(request_id, "after", rank)
    whose = "" if rank is None else f", rank {rank}'s shard"
    return [(name, plots.heatmap_png([("before", before[name]), ("after", after[name]),
                                      ("after - before", after[name].float() - before[name].float())],
                                     f"{layer} {name}, request {request_id!r}, step {record.step_index}{whose}"))
            for name in st.state_names]


def state_norms(records: Any, layer: str, request_id: str, rank: int | None = None
                ) -> tuple[list[str], dict[str, list[float]]]:
    """The request's state norms after each recorded step that ran it (from `after`; `rank`: of
    that rank's shard)."""
    steps, norms = [], {}
    for rec in records:
        st = next((s for s in rec.states if s.layer_name == layer), None)
        if st is None or request_id not in st.request_ids or (rank is not None and rank >= st.num_ranks):
            continue
        steps.append(str(rec.step_index) if rec.step_index is not None else "w")
        for name, t in st.of(request_id, "after", rank).items():
            norms.setdefault(name, []).append(float(t.float().norm()))
    return steps, norms


def state_ranks(record: Any) -> int:
    """Tensor-parallel ranks the record's states were gathered from (1: not sharded, or no states)."""
    return record.states[0].num_ranks if record is not None and record.states else 1


def state_caption(record: Any, layer: str, request_id: str, rank: int | None = None) -> str:
    """`model.layers.0.mamba, request '0', step 3 (step): state page 2` (and, sharded, whose state:
    gathered from N ranks, or rank r's shard with its shape)."""
    st = record.state(layer)
    text = (f"{layer}, request {request_id!r}, step {record.step_index} ({record.stage}): "
            f"state page {st.slots[st.request_ids.index(request_id)]}")
    if st.num_ranks > 1 and rank is None:
        text += f"; the full state, gathered from {st.num_ranks} tensor-parallel ranks"
    elif rank is not None:
        shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in st.of(request_id, "after", rank).items())
        text += f"; rank {rank}'s shard ({shapes})"
    return text


# ---- Prefix cache --------------------------------------------------------------------------------
def prefix_cache_caption(record: Any, latest: bool) -> str:
    """Which moment the Prefix cache tab shows: the record's step, and what the cache holds now
    only when the record is the latest one (the report is of now, not of an older step)."""
    if latest:
        return (f"{step_name(record)}: the lookups of the requests it admitted and where its recurrent "
                "states came from; below, what the prefix cache holds now, after it (llm.prefix_cache)")
    return (f"{step_name(record)}: the lookups of the requests it admitted and where its recurrent states "
            "came from; what the cache holds now is left out, as it belongs to the latest record, not "
            "to this older one (move the slider to the end to see it)")


def prefix_cache_pane_html(record: Any, report: Any = None, latest: bool = True) -> str:
    """The Prefix cache tab: the record's prefix-cache facts (`prefix_cache_step_html`) and, when
    the record is the latest one, `report` (llm.prefix_cache: what is cached now) below them."""
    if record is None:
        return H.note(NO_RECORDS)
    enabled = None if report is None else report.enabled
    step = prefix_cache_step_html(record, enabled)
    if report is None or not report.enabled:
        return step
    caption = H.wrap(H.span(prefix_cache_caption(record, latest), H.SOFT))
    return caption + step + (prefix_cache_html(report) if latest else "")


# ---- Warmup --------------------------------------------------------------------------------------
def warmup_html(records: Sequence[Any]) -> str:
    """One row per warmup stage: its batch, the builders that ran, its time, its checks."""
    rows = []
    for rec in records:
        if not rec.is_warmup:
            continue
        b = rec.input_batch
        shape = f"{b.num_reqs} rows x {b.num_tokens} tokens" if b is not None else "-"
        groups = ", ".join(g.builder for g in rec.attn_metadata) or (
            "- (the stage raised)" if rec.input_batch is None else "none (profile run)")
        total = total_seconds(rec.timings)
        bad = "; ".join(str(v) for v in rec.violations)
        rows.append([H.escape(rec.stage), H.escape(shape), H.escape(groups),
                     format_ms(total) if total is not None else "-",
                     H.span(bad, H.ALERT) if bad else "ok"])
    if not rows:
        return H.span("no warmup in this trace (call llm.warmup())", H.MUTED)
    return H.table(["stage", "batch", "metadata built by", "time", "checks"], rows)


def warmup_memory_html(trace: Any, memory: Any = None) -> str:
    """The warmup stages, then the memory ledger when one is given."""
    body = H.title("warmup stages") + warmup_html(trace)
    if memory is not None:
        body += H.title("memory ledger") + memory.table_html()
    return H.wrap(body)


# ---- Speculation ---------------------------------------------------------------------------------
def speculation_pane_html(record: Any, enabled: bool | None = None) -> str:
    """The Speculation tab: each decode row's drafts against the target's tokens, its accepted run
    and its state columns (`spec_step_html`)."""
    if record is None:
        return H.note(NO_RECORDS)
    return spec_step_html(record, enabled)
