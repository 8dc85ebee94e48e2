"""The StepInspector's views, each usable alone on a record or a (loaded) Trace:

    BatchView(record), MetadataView(record, previous), BlockTableView(record),
    StateView(trace, layer, request, record), TimelineView(trace), WarmupMemoryView(trace, memory)

A view is built once (`self.widget`, an ipywidgets box) and updated by setting values
(`show(...)`); its content comes from pure functions (`*_html`, `toolkit.widgets.plots`) that the
static `_repr_mimebundle_` shares, so a view reads the same where no widget can render. Nothing
here recomputes what the runner computed: every value is read from the records.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import base64
import dataclasses
from typing import Any, Callable, Sequence

import ipywidgets as W
import torch

from toolkit.inspect import render as R
from toolkit.inspect.serialize import equal
from toolkit.widgets import plots

VIEW_LAYOUT = W.Layout(width="100%")


def _column() -> W.Layout:
    """A column whose images keep their own width (a VBox stretches its children by default)."""
    return W.Layout(width="100%", align_items="flex-start")


def _builder_contracts() -> dict[str, dict[str, Any]]:
    """builder class name -> {field name: FieldSpec} (the contracts the builders declare)."""
    from toolkit.attention.mamba1 import Mamba1MetadataBuilder
    from toolkit.attention.mamba2 import Mamba2MetadataBuilder
    from toolkit.attention.paged_attn import PagedAttentionMetadataBuilder
    from toolkit.attention.short_conv import ShortConvMetadataBuilder
    from toolkit.attention.gdn import GDNMetadataBuilder
    return {cls.__name__: {f.name: f for f in cls.required_fields}
            for cls in (PagedAttentionMetadataBuilder, Mamba2MetadataBuilder, Mamba1MetadataBuilder,
                        ShortConvMetadataBuilder, GDNMetadataBuilder)}


def _spec_text(spec) -> str:
    parts = [str(spec.dtype).replace("torch.", "") if spec.dtype is not None else "",
             "cpu" if spec.on_cpu else "", spec.shape]
    return "required " + " ".join(p for p in parts if p)


def _img_html(png: bytes, alt: str) -> str:
    return f'<img alt="{R.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}"/>'


def _previous_group(previous, group_id: int):
    if previous is None:
        return None
    return next((g for g in previous.attn_metadata if g.group_id == group_id), None)


# ---- pure HTML renderers -------------------------------------------------------------------------
def metadata_html(record, previous=None) -> str:
    """Per layer group: every field of the common metadata and of the builder's output, with
    dtype, shape, device, a value preview, its contract status, and whether it changed since
    `previous`. Fields named by a violation of this step are highlighted with its message."""
    if not record.attn_metadata:
        return R.wrap(R.span("no attention metadata in this step (a profile run builds none)", R.MUTED))
    contracts = _builder_contracts()
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
                status = R.span(_spec_text(spec) + " ✓", "color:#1a7f37") if spec else R.span("-", R.MUTED)
                if f.name in bad:
                    status = R.span(bad[f.name].message, R.ALERT)
                    bad_rows.add(i)
                changed = ""
                if prev_obj is not None and not equal(value, getattr(prev_obj, f.name, None)):
                    changed = R.span("changed", "color:#9a6700;font-weight:600")
                rows.append([R.escape(f.name), R.escape(R.type_name(value)), R.escape(R.shape_of(value)),
                             R.escape(R.device_of(value)), R.value_preview_html(value), status, changed])
            parts.append(R.title(f"{group_label}, layers {', '.join(gm.layer_names)}: {what}"))
            parts.append(R.table(["field", "type", "shape", "device", "value", "contract",
                                  "vs previous step"], rows, bad_rows))
    others = [v for v in record.violations
              if not any(f"group {g.group_id} ({g.builder})" in v.where for g in record.attn_metadata)]
    if others:
        parts.append(R.title("other violations in this step"))
        parts += [R.violation_html(v) for v in others]
    return R.wrap("".join(parts))


def ledger_html(record) -> str:
    """The state-slot and KV-block holdings after the step, one row per request."""
    if record.ledger is None:
        return R.span("no cache ledger in this record (warmup batches have no requests)", R.MUTED)
    kinds = record.ledger.group_kinds
    rows = [[R.escape(rid)] + [R.escape(R.value_preview(ids)) for ids in held]
            for rid, held in record.ledger.holdings.items()]
    if not rows:
        return R.span("no request holds a block or slot after this step", R.MUTED)
    return R.table(["request"] + [f"group {g} ({k}) ids" for g, k in enumerate(kinds)], rows)


def block_tables_html(record) -> str:
    parts = []
    for gm in record.attn_metadata:
        table = gm.common.block_table_tensor
        labels = [s.request_id for s in record.scheduled] or [f"pad {i}" for i in range(table.shape[0])]
        if gm.kind == "mamba":
            png = plots.block_grid_png(table[:, :1].tolist(), labels,
                                       f"group {gm.group_id}: state slot per row (grey = null slot 0)")
        else:
            png = plots.block_grid_png(table.tolist(), labels,
                                       f"group {gm.group_id}: block table (grey = null block 0, "
                                       "white = unused)", used=_used_blocks(table))
        parts.append(_img_html(png, f"block table of group {gm.group_id}"))
        slots = gm.common.slot_mapping
        if gm.kind == "attention" and slots.numel():
            png = plots.block_grid_png([slots.tolist()], ["slot"], f"group {gm.group_id}: slot mapping "
                                       "per token (white = PAD_SLOT_ID, nothing written)",
                                       null_id=-2, pad_id=-1)
            parts.append(_img_html(png, "slot mapping"))
    parts.append(R.title("holdings after the step (scheduler ledger)"))
    parts.append(ledger_html(record))
    return R.wrap("".join(parts))


def _used_blocks(table: torch.Tensor) -> list[int]:
    used = []
    for row in table.tolist():
        n = len(row)
        while n and row[n - 1] == 0:
            n -= 1
        used.append(n)
    return used


def state_panels(record, layer: str, request_id: str) -> list[tuple[str, bytes]]:
    """(state name, PNG of before | after | after - before) for one layer and request."""
    st = record.state(layer)
    before, after = st.of(request_id, "before"), st.of(request_id, "after")
    return [(name, plots.heatmap_png([("before", before[name]), ("after", after[name]),
                                      ("after - before", after[name].float() - before[name].float())],
                                     f"{layer} {name}, request {request_id!r}, step {record.step_index}"))
            for name in st.state_names]


def state_norms(records, layer: str, request_id: str) -> tuple[list[str], dict[str, list[float]]]:
    """The request's state norms after each recorded step that ran it (from `after`)."""
    steps, norms = [], {}
    for rec in records:
        st = next((s for s in rec.states if s.layer_name == layer), None)
        if st is None or request_id not in st.request_ids:
            continue
        steps.append(str(rec.step_index) if rec.step_index is not None else "w")
        for name, t in st.of(request_id, "after").items():
            norms.setdefault(name, []).append(float(t.float().norm()))
    return steps, norms


def warmup_html(records) -> str:
    rows = []
    for rec in records:
        if not rec.is_warmup:
            continue
        b = rec.input_batch
        shape = f"{b.num_reqs} rows x {b.num_tokens} tokens" if b is not None else "-"
        groups = ", ".join(g.builder for g in rec.attn_metadata) or (
            "- (the stage raised)" if rec.input_batch is None else "none (profile run)")
        total = R.total_seconds(rec.timings)
        bad = "; ".join(str(v) for v in rec.violations)
        rows.append([R.escape(rec.stage), R.escape(shape), R.escape(groups),
                     R.format_ms(total) if total is not None else "-",
                     R.span(bad, R.ALERT) if bad else "ok"])
    if not rows:
        return R.span("no warmup in this trace (call llm.warmup())", R.MUTED)
    return R.table(["stage", "batch", "metadata built by", "time", "checks"], rows)


# ---- widget views --------------------------------------------------------------------------------
class _View:
    """A box built once; subclasses set its children's values in `show`."""
    widget: W.Widget

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)

    def _static_html(self) -> str:
        return ""

    def _repr_mimebundle_(self, **kwargs) -> dict:
        bundle = self.widget._repr_mimebundle_(**kwargs) or {}
        bundle.setdefault("text/html", self._static_html())
        return bundle


class _HtmlView(_View, ABC):
    """A view that is one HTML pane: subclasses turn their arguments into HTML in `render`."""

    def __init__(self, *args, **kwargs):
        self.html = W.HTML(layout=VIEW_LAYOUT)
        self.widget = W.VBox([self.html], layout=VIEW_LAYOUT)
        if args and args[0] is not None:
            self.show(*args, **kwargs)

    def show(self, *args, **kwargs) -> None:
        self.html.value = self.render(*args, **kwargs)

    @abstractmethod
    def render(self, *args, **kwargs) -> str:
        """The pane's HTML for these arguments."""

    def _static_html(self) -> str:
        return self.html.value


class BatchView(_HtmlView):
    """The step's requests in batch order: phase, computed and scheduled tokens, state slot, KV
    blocks, sampled token (and its text with `decode`)."""

    def __init__(self, record=None, decode: Callable[[list[int]], str] | None = None):
        self.decode = decode
        super().__init__(record)

    def render(self, record) -> str:
        return R.wrap(R.title(R.step_record_repr(record)) + R.batch_table_html(record, self.decode))


class MetadataView(_HtmlView):
    def __init__(self, record=None, previous=None):
        super().__init__(record, previous)

    def render(self, record, previous=None) -> str:
        return metadata_html(record, previous)


class BlockTableView(_HtmlView):
    def render(self, record) -> str:
        return block_tables_html(record) if record.attn_metadata else \
            R.wrap(R.span("no block tables in this step", R.MUTED))


class StateView(_View):
    """Pick a recurrent layer and a request: conv / SSM state before, after and their difference
    at the shown step, and the state's norm over the request's steps (needs inspect="full")."""

    def __init__(self, trace=None, layer: str | None = None, request: str | None = None, record=None):
        self.layer = W.Dropdown(description="layer", layout=W.Layout(width="360px"))
        self.request = W.Dropdown(description="request", layout=W.Layout(width="240px"))
        self.note = W.HTML()
        self.images = W.VBox()
        self.norms = W.Image(format="png")
        self.images.layout = _column()
        self.widget = W.VBox([W.HBox([self.layer, self.request]), self.note, self.images, self.norms],
                             layout=_column())
        self.trace, self.record = trace, None
        self._updating = False
        self.layer.observe(lambda _: self._redraw(), names="value")
        self.request.observe(lambda _: self._redraw(), names="value")
        if trace is not None:
            self.show(trace, record if record is not None else (trace[-1] if len(trace) else None),
                      layer, request)

    def show(self, trace, record, layer: str | None = None, request: str | None = None) -> None:
        self.trace, self.record = trace, record
        self._updating = True
        try:
            layers = [s.layer_name for s in record.states] if record is not None else []
            requests = record.states[0].request_ids if record is not None and record.states else []
            self.layer.options = layers
            if layers:
                self.layer.value = layer if layer in layers else (self.layer.value if self.layer.value in layers
                                                                  else layers[0])
            self.request.options = requests
            if requests:
                self.request.value = request if request in requests else (
                    self.request.value if self.request.value in requests else requests[0])
        finally:
            self._updating = False
        self._redraw()

    def _redraw(self) -> None:
        if self._updating:
            return
        rec = self.record
        if rec is None or not rec.states:
            why = "no recurrent layer in this step" if rec is not None and rec.scheduled else \
                "no states recorded: build the LLM with inspect='full'"
            self.note.value = R.wrap(R.span(why, R.MUTED))
            self.images.children = ()
            self.norms.value = b""
            return
        layer, rid = self.layer.value, self.request.value
        if layer is None or rid is None:
            return
        panels = state_panels(rec, layer, rid)
        self.note.value = R.wrap(R.escape(f"{layer}, request {rid!r}, step {rec.step_index} ({rec.stage}): "
                                          f"state slot {rec.state(layer).slots[rec.state(layer).request_ids.index(rid)]}"))
        self.images.children = tuple(W.Image(value=png, format="png") for _, png in panels)
        steps, norms = state_norms(self.trace if self.trace is not None else [rec], layer, rid)
        self.norms.value = plots.norms_png(steps, norms, f"{layer}, request {rid!r}") if steps else b""

    def _static_html(self) -> str:
        if self.record is None or not self.record.states or self.layer.value is None:
            return self.note.value
        return R.wrap("".join(_img_html(png, name) for name, png in
                              state_panels(self.record, self.layer.value, self.request.value)))


class TimelineView(_View):
    def __init__(self, trace=None):
        self.image = W.Image(format="png")
        self.note = W.HTML()
        self.widget = W.VBox([self.note, self.image], layout=_column())
        self.png = b""
        if trace is not None:
            self.show(trace)

    def show(self, trace) -> None:
        records = [r for r in trace if r.scheduled]
        if not records:
            self.note.value = R.wrap(R.span("no steps with requests yet", R.MUTED))
            self.image.value = self.png = b""
            return
        self.note.value = ""
        self.png = plots.timeline_png(records)
        self.image.value = self.png

    def _static_html(self) -> str:
        return _img_html(self.png, "timeline") if self.png else self.note.value


class WarmupMemoryView(_HtmlView):
    def __init__(self, trace=None, memory=None):
        super().__init__(trace, memory)

    def render(self, trace, memory=None) -> str:
        body = R.title("warmup stages") + warmup_html(trace)
        if memory is not None:
            body += R.title("memory ledger") + memory._repr_html_()
        return R.wrap(body)


def view_names() -> Sequence[str]:
    return ("Batch", "Metadata", "Blocks", "State", "Timeline", "Warmup")
