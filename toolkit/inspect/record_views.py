"""Text and HTML views of the runner's records: StepRecord, its batch table, GroupMetadata,
LayerState, Violation, InputBatch and Trace. Pure functions, object -> str.

Every view is a plain function of the object it shows; nothing here keeps state, draws, or
imports a widget or plotting library. The notebook reprs (`__repr__`, `_repr_html_`, attached by
`toolkit.inspect.reprs.install_reprs`) are thin wrappers around these functions, and the
StepInspector's panes reuse them, so a record reads the same everywhere. Special views only
arrange the generic field tables of `summaries` and add a few derived facts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from toolkit.attention.mamba_base import verify_start_slots
from toolkit.inspect import html as H
from toolkit.inspect.prefix_views import prefix_cache_table_html
from toolkit.inspect.spec_views import spec_table_html
from toolkit.inspect.step_record import DROPPED
from toolkit.inspect.summaries import (
    array_label,
    clip,
    compact_repr,
    dict_preview,
    fields_table,
    format_ms,
    is_record,
    list_preview,
    short_value,
    timings_text,
    total_seconds,
    value_preview,
    value_preview_html,
    values_table,
)

TRACE_COLUMNS = ["#", "step", "stage", "prefill rows", "decode rows", "tokens", "forward", "requests",
                 "finished", "time", "violations"]
BATCH_COLUMNS = ["row", "request", "phase", "computed before", "tokens", "state page", "KV blocks",
                 "sampled", "logprob", "rank", "kept"]


# ---- facts about a record ----------------------------------------------------------------------------
def step_name(rec: Any) -> str:
    return "warmup" if rec.step_index is None else f"step {rec.step_index}"


def why_no_rows(rec: Any) -> str:
    """Why a record has no request rows, in one sentence."""
    if not rec.is_warmup:
        return "nothing scheduled in this step: no request was waiting to run"
    if rec.input_batch is None:
        return f"no batch: {rec.stage} raised before it built one"
    b = rec.input_batch
    return (f"no request rows: {rec.stage} is a warmup stage, which runs a dummy batch "
            f"({b.num_reqs} rows, {b.num_tokens} tokens) for no request")


def why_no_metadata(rec: Any, what: str = "attention metadata") -> str:
    """Why a record has no attention metadata (or `what` is built from it: "block tables"), in
    one sentence."""
    if rec.is_warmup and rec.input_batch is None:
        return f"no {what}: {rec.stage} raised before it built any"
    if rec.is_warmup:
        return f"no {what} in this step (a profile run builds none)"
    return f"no {what}: nothing was scheduled in this step"


def request_phase(s: Any, prefill_len: int | None = None) -> str:
    """"decode" for rows the layers ran as decodes; "prefill chunk" for a prompt chunk that resumes
    a saved state or leaves prompt tokens for a later step; else "prefill" (the whole prompt)."""
    if s.runs_as_decode:
        return "decode"
    if not s.is_prefill:
        return "prefill"
    partial = prefill_len is not None and s.num_computed_before + s.num_tokens < prefill_len
    return "prefill chunk" if s.num_computed_before > 0 or partial else "prefill"


def _prefill_lens(rec: Any) -> dict[str, int]:
    b = rec.input_batch
    if b is None:
        return {}
    return {rid: int(n) for rid, n in zip(b.req_ids, b.prefill_len_np)}


def row_holdings(rec: Any, row: int) -> tuple[int | None, list[int] | None]:
    """(state page, KV block ids) of a batch row: the state index the Mamba builder handed the
    layers (its running page with prefix caching) and the attention block-table row the runner
    used (the first Mamba and attention groups); None where the model has no such group. Trailing
    null entries of a block-table row are unused columns."""
    slot, blocks = None, None
    for gm in rec.attn_metadata:
        table = gm.common.block_table_tensor
        if row >= table.shape[0]:
            continue
        if gm.kind == "mamba" and slot is None:
            md = gm.metadata                        # rows are decodes first, as the batch
            d = md.state_indices_tensor_d
            if d is not None and d.dim() == 2:      # speculative decoding: the slot a verify row starts from
                d = verify_start_slots(md)
            parts = [t for t in (d, md.state_indices_tensor_p) if t is not None]
            indices = torch.cat(parts).tolist() if parts else []
            slot = int(indices[row]) if row < len(indices) else None
        elif gm.kind == "attention" and blocks is None:
            ids = table[row].tolist()
            while ids and ids[-1] == 0:
                ids.pop()
            blocks = ids
    return slot, blocks


def forward_label(rec: Any) -> str:
    """How the step's forward ran: "eager", or "padded eager" / "graph" with the padded size."""
    padded = getattr(rec, "padded_size", None)
    graph = getattr(rec, "graph", "eager")
    return graph if padded is None else f"{graph} ({padded} rows)"


# ---- StepRecord --------------------------------------------------------------------------------------
def step_record_repr(rec: Any) -> str:
    """`StepRecord(step 3 'generate': 2 prefill + 1 decode rows, 37 tokens, sampled {'0': 17, …})`."""
    parts = [f"{rec.num_prefills} prefill + {rec.num_decodes} decode rows", f"{rec.num_tokens} tokens"]
    if rec.sampled_token_ids:
        parts.append(f"sampled {clip(dict_preview(rec.sampled_token_ids, compact=True), 90)}")
    if rec.finished_request_ids:
        parts.append(f"finished {clip(short_value(list(rec.finished_request_ids)), 60)}")
    if rec.violations:
        parts.append(f"{len(rec.violations)} violations")
    return f"StepRecord({step_name(rec)} {rec.stage!r}: " + ", ".join(parts) + ")"


def sampled_logprob(rec: Any, request_id: str):
    """The row's sampled token's TokenLogprobs (what its request asked, else from the record's
    logits), or None when the record has neither."""
    try:
        return rec.logprob_of(request_id)
    except (KeyError, AttributeError):
        return None


def _batch_rows(rec: Any, decode: Callable[[list[int]], str] | None = None) -> list[list[str]]:
    lens = _prefill_lens(rec)
    rows = []
    for i, s in enumerate(rec.scheduled):
        slot, blocks = row_holdings(rec, i)
        sampled = rec.sampled_token_ids.get(s.request_id)
        kept = s.request_id in rec.kept_token_ids
        shown = H.muted_none() if sampled is None else str(sampled)
        if sampled is not None and decode is not None:
            shown += " " + H.span(repr(decode([sampled])), H.SOFT)
        lp = sampled_logprob(rec, s.request_id)
        rows.append([str(i), H.escape(s.request_id), H.escape(request_phase(s, lens.get(s.request_id))),
                     str(s.num_computed_before), str(s.num_tokens),
                     H.span("-", H.MUTED) if slot is None else str(slot),
                     H.span("-", H.MUTED) if blocks is None else H.escape(value_preview(blocks)),
                     shown, H.span("-", H.MUTED) if lp is None else f"{lp.logprob:.4f}",
                     H.span("-", H.MUTED) if lp is None else str(lp.rank),
                     "yes" if kept else H.span("no (partial prefill)", H.MUTED)])
    return rows


def batch_table_html(rec: Any, decode: Callable[[list[int]], str] | None = None) -> str:
    """The step's rows in batch order; `decode` (e.g. llm.tokenizer.decode) adds token text. A
    record without rows says why."""
    if not rec.scheduled:
        return H.span(why_no_rows(rec), H.MUTED)
    return H.table(BATCH_COLUMNS, _batch_rows(rec, decode))


def _header_lines(rec: Any) -> str:
    facts = [step_name(rec).capitalize(), rec.stage, f"{rec.num_tokens} tokens",
             f"{rec.num_prefills} prefill + {rec.num_decodes} decode rows",
             f"{getattr(rec, 'backend', 'torch')} ops"]
    if getattr(rec, "padded_size", None) is not None:
        facts.append(f"{rec.graph}, padded to {rec.padded_size} rows")   # eager steps say nothing
    lines = [H.div(" · ".join(facts), H.HEADER)]
    extra = []
    if rec.timings:
        total = total_seconds(rec.timings)
        extra.append(f"timings: {timings_text(rec.timings)}" +
                     ("" if "total" in rec.timings else f" (total {format_ms(total)})"))
    if getattr(rec, "device_timings", None):
        extra.append(f"device timings: {timings_text(rec.device_timings)}")
    if rec.preempted_request_ids:
        extra.append(f"preempted: {', '.join(rec.preempted_request_ids)}")
    if rec.finished_request_ids:
        extra.append(f"finished: {', '.join(rec.finished_request_ids)}")
    lines += [H.div(e, H.SOFT) for e in extra]
    return "".join(lines)


def _output_row(o: Any) -> list[str]:
    c = o.outputs[0] if o.outputs else None
    if c is None:
        return [H.escape(o.request_id), "", "", ""]
    return [H.escape(o.request_id), H.escape(c.finish_reason), H.escape(value_preview(c.token_ids)),
            H.escape(clip(repr(c.text), 80))]


def _outputs_html(rec: Any) -> str:
    if not rec.outputs:
        return ""
    rows = [_output_row(o) for o in rec.outputs]
    return H.title("Finished outputs") + H.table(["request", "finish reason", "token ids", "text"], rows)


def step_record_html(rec: Any) -> str:
    parts = [_header_lines(rec)]
    if rec.scheduled:
        parts.append(H.title("Batch (decodes first)") + H.table(BATCH_COLUMNS, _batch_rows(rec)))
    else:
        parts.append(H.div(why_no_rows(rec), H.MUTED))
    parts.append(_outputs_html(rec))
    parts.append(prefix_cache_table_html(rec))
    parts.append(spec_table_html(rec))
    parts += [H.section(_group_summary(g), _group_body(g)) for g in rec.attn_metadata]
    parts.append(_violations_html(rec.violations))
    parts.append(_dropped_html(rec))
    parts.append(_states_html(rec.states))
    if rec.input_batch is not None:
        parts.append(H.section("InputBatch", fields_table(rec.input_batch), open_=False))
    parts.append(H.section("All record fields", fields_table(rec), open_=False))
    return H.wrap("".join(parts))


# ---- GroupMetadata, Violation, LayerState, InputBatch -----------------------------------------------
def group_metadata_repr(g: Any) -> str:
    """`GroupMetadata(group 1 mamba, Mamba2MetadataBuilder, 4 layers)`."""
    return f"GroupMetadata(group {g.group_id} {g.kind}, {g.builder}, {len(g.layer_names)} layers)"


def _group_body(g: Any) -> str:
    layers = H.span(", ".join(g.layer_names), H.MONO)
    parts = [f'<div style="{H.SOFT}">builder {H.escape(g.builder)} · layers: {layers}</div>']
    for label, obj in (("given", g.common), ("built", g.metadata)):
        parts.append(H.title(f"{label}: {type(obj).__name__}"))
        parts.append(fields_table(obj) if is_record(obj) else value_preview_html(obj))
    return "".join(parts)


def _group_summary(g: Any) -> str:
    return (f"group {g.group_id} · {g.kind} · {g.builder} → {type(g.metadata).__name__} · "
            f"{len(g.layer_names)} layers")


def group_metadata_html(g: Any) -> str:
    return H.wrap(H.title(_group_summary(g)) + _group_body(g))


def violation_html(v: Any) -> str:
    return H.div(str(v), H.VIOLATION)


def _violations_html(violations: Sequence[Any]) -> str:
    if not violations:
        return ""
    return (H.title(f"{len(violations)} violation(s)", f"{H.TITLE};color:{H.RED}")
            + "".join(violation_html(v) for v in violations))


def _state_shapes(s: Any) -> str:
    return ", ".join(f"{n} {array_label(t)}" for n, t in zip(s.state_names, s.before))


def layer_state_repr(s: Any) -> str:
    """`LayerState('model.layers.0.mamba' mamba2, 2 rows, slots [2, 1]: conv_state float32[2, 3, 64], …)`."""
    return (f"LayerState({s.layer_name!r} {s.mamba_type}, {len(s.request_ids)} rows, "
            f"slots {clip(list_preview(s.slots, compact=True), 60)}: {_state_shapes(s)})")


def _dropped_html(rec: Any) -> str:
    """`states dropped: trace budget (...)`, one line per part the trace budget dropped."""
    return "".join(H.div(f"{part} {DROPPED}", H.ALERT) for part in getattr(rec, "dropped", []))


def _states_html(states: Sequence[Any]) -> str:
    if not states:
        return ""
    rows = [[H.escape(s.layer_name), H.escape(s.mamba_type), H.escape(value_preview(s.slots)),
             H.escape(_state_shapes(s))] for s in states]
    return H.section(f"Recorded states ({len(states)} layers)",
                     H.table(["layer", "type", "slots", "states (before/after)"], rows))


def layer_state_html(s: Any) -> str:
    pairs = [("layer_name", s.layer_name), ("mamba_type", s.mamba_type), ("request_ids", s.request_ids),
             ("slots", s.slots)]
    for when in ("before", "after"):
        pairs += [(f"{when}.{n}", t) for n, t in zip(s.state_names, getattr(s, when))]
    return H.wrap(H.title(f"LayerState {s.layer_name}") + values_table(pairs))


def input_batch_repr(b: Any) -> str:
    return compact_repr(b, ["req_ids", "num_reqs", "num_tokens", "max_query_len"])


# ---- Trace -------------------------------------------------------------------------------------------
def _trace_row(i: int, rec: Any) -> list[str]:
    total = total_seconds(rec.timings)
    n_viol = len(rec.violations)
    return [str(i), H.muted_none() if rec.step_index is None else str(rec.step_index), H.escape(rec.stage),
            str(rec.num_prefills), str(rec.num_decodes), str(rec.num_tokens), H.escape(forward_label(rec)),
            H.escape(clip(", ".join(rec.request_ids), 80)),
            H.escape(clip(", ".join(rec.finished_request_ids), 80)),
            "" if total is None else H.escape(format_ms(total)),
            H.span(str(n_viol), H.ALERT) if n_viol else "0"]


def trace_html(trace: Any, max_rows: int = 200) -> str:
    """One row per record, oldest first; past `max_rows` the middle is left out."""
    records = list(trace)
    keep: list[int | None] = list(range(len(records)))
    if len(records) > max_rows:
        half = max_rows // 2
        keep = [*range(half), None, *range(len(records) - (max_rows - half), len(records))]
    rows, bad = [], set()
    for i in keep:
        if i is None:
            rows.append([H.span(f"… {len(records) - max_rows} records left out", H.MUTED)]
                        + [""] * (len(TRACE_COLUMNS) - 1))
            continue
        if records[i].violations:
            bad.add(len(rows))
        rows.append(_trace_row(i, records[i]))
    body = H.title(repr(trace))
    body += (H.table(TRACE_COLUMNS, rows, bad) if rows
             else H.div("no records yet: step the engine, generate or warm up to fill the trace", H.MUTED))
    return H.wrap(body)
