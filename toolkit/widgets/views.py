"""The StepInspector's views, each usable alone on a record or a (loaded) Trace:

    BatchView(record), MetadataView(record, previous), BlockTableView(record),
    StateView(trace, layer, request, record, inspect), TimelineView(trace), WarmupMemoryView(trace, memory),
    PrefixCacheView(record, report, latest)
    SpecDecodeView(record, enabled)

A view is built once (`self.widget`, an ipywidgets box) and updated by setting values
(`show(...)`); its content comes from pure functions (`toolkit.widgets.panes`,
`toolkit.widgets.plots`) that the static `_repr_mimebundle_` shares, so a view reads the same
where no widget can render. A view with nothing to show says why, and shows no image.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as W

from toolkit.inspect import html as H
from toolkit.widgets import panes, plots

VIEW_LAYOUT = W.Layout(width="100%")


def _column() -> W.Layout:
    """A column whose images keep their own width (a VBox stretches its children by default)."""
    return W.Layout(width="100%", align_items="flex-start")


def _show_png(image: W.Image, png: bytes) -> None:
    """Set an image; an image without a picture is hidden, not drawn as a broken one."""
    image.value = png
    image.layout.display = None if png else "none"


def _image() -> W.Image:
    image = W.Image(format="png")
    _show_png(image, b"")
    return image


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
    """The step's requests in batch order: phase, computed and scheduled tokens, state page, KV
    blocks, sampled token (and its text with `decode`)."""

    def __init__(self, record=None, decode: Callable[[list[int]], str] | None = None):
        self.decode = decode
        super().__init__(record)

    def render(self, record) -> str:
        return panes.batch_html(record, self.decode)


class MetadataView(_HtmlView):
    def __init__(self, record=None, previous=None):
        super().__init__(record, previous)

    def render(self, record, previous=None) -> str:
        return panes.metadata_html(record, previous)


class BlockTableView(_HtmlView):
    def render(self, record) -> str:
        return panes.block_tables_html(record)


class StateView(_View):
    """Pick a recurrent layer and a request: conv / SSM state before, after and their difference
    at the shown step, and the state's norm over the request's steps (needs inspect="full").
    `inspect`: the engine's mode when known, so an engine that records no states says so."""

    def __init__(self, trace=None, layer: str | None = None, request: str | None = None, record=None,
                 inspect: str | None = None):
        self.inspect = inspect
        self.layer = W.Dropdown(description="layer", layout=W.Layout(width="360px"))
        self.request = W.Dropdown(description="request", layout=W.Layout(width="240px"))
        # tensor parallelism: the gathered state or one rank's shard (hidden for one rank)
        self.rank = W.Dropdown(description="rank", options=[("gathered", None)], value=None,
                               layout=W.Layout(width="200px", display="none"))
        self.note = W.HTML()
        self.images = W.VBox()
        self.norms = _image()
        self.images.layout = _column()
        self.widget = W.VBox([W.HBox([self.layer, self.request, self.rank]), self.note, self.images, self.norms],
                             layout=_column())
        self.trace, self.record = trace, None
        self._updating = False
        self.layer.observe(lambda _: self._redraw(), names="value")
        self.request.observe(lambda _: self._redraw(), names="value")
        self.rank.observe(lambda _: self._redraw(), names="value")
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
            ranks = panes.state_ranks(record)
            keep = self.rank.value if self.rank.value is None or self.rank.value < ranks else None
            self.rank.options = [("gathered", None)] + [(f"rank {r}", r) for r in range(ranks)] if ranks > 1 \
                else [("gathered", None)]
            self.rank.value = keep
            self.rank.layout.display = None if ranks > 1 else "none"
        finally:
            self._updating = False
        self._redraw()

    @property
    def empty_reason(self) -> str | None:
        """Why there is no state to draw (one sentence), or None."""
        return panes.why_no_states(self.record, self.inspect)

    def _redraw(self) -> None:
        if self._updating:
            return
        rec, why = self.record, self.empty_reason
        if why is not None:
            self.note.value = H.note(why)
            self.images.children = ()
            _show_png(self.norms, b"")
            return
        layer, rid = self.layer.value, self.request.value
        if layer is None or rid is None:
            return
        rank = self.rank.value
        panels = panes.state_panels(rec, layer, rid, rank)
        self.note.value = H.wrap(H.escape(panes.state_caption(rec, layer, rid, rank)))
        self.images.children = tuple(W.Image(value=png, format="png") for _, png in panels)
        steps, norms = panes.state_norms(self.trace if self.trace is not None else [rec], layer, rid, rank)
        _show_png(self.norms, plots.norms_png(steps, norms, f"{layer}, request {rid!r}") if steps else b"")

    def _static_html(self) -> str:
        if self.empty_reason is not None or self.layer.value is None:
            return self.note.value
        return H.wrap("".join(H.img(png, name) for name, png in
                              panes.state_panels(self.record, self.layer.value, self.request.value)))


class TimelineView(_View):
    def __init__(self, trace=None):
        self.image = _image()
        self.note = W.HTML()
        self.widget = W.VBox([self.note, self.image], layout=_column())
        self.png = b""
        if trace is not None:
            self.show(trace)

    def show(self, trace) -> None:
        records = [r for r in trace if r.scheduled]
        if not records:
            self.note.value = H.note(panes.why_no_timeline(trace))
            self.png = b""
        else:
            self.note.value = ""
            self.png = plots.timeline_png(records)
        _show_png(self.image, self.png)

    def _static_html(self) -> str:
        return H.img(self.png, "timeline") if self.png else self.note.value


class PrefixCacheView(_HtmlView):
    """Prefix caching at the record's step: each admitted request's lookup (its hash chain, block
    by block: hit, cached but unused, missing, past the cap; checkpoints and the junction marked),
    the hit and why, where each recurrent state came from; and, when `latest`, what the cache holds
    now (`report`: llm.prefix_cache)."""

    def __init__(self, record=None, report=None, latest: bool = True):
        super().__init__(record, report, latest)

    def render(self, record, report=None, latest: bool = True) -> str:
        return panes.prefix_cache_pane_html(record, report, latest)


class SpecDecodeView(_HtmlView):
    """Speculative decoding at the record's step: each decode row's drafts against the tokens the
    target sampled, the accepted run, the first rejection, and the recurrent state columns (where
    the step started, where the next one starts). `enabled`: whether the engine speculates."""

    def __init__(self, record=None, enabled: bool | None = None):
        super().__init__(record, enabled)

    def render(self, record, enabled: bool | None = None) -> str:
        return panes.speculation_pane_html(record, enabled)


class WarmupMemoryView(_HtmlView):
    def __init__(self, trace=None, memory: Any = None):
        super().__init__(trace, memory)

    def render(self, trace, memory=None) -> str:
        return panes.warmup_memory_html(trace, memory)


def view_names() -> Sequence[str]:
    return ("Batch", "Metadata", "Blocks", "State", "Timeline", "Warmup", "Prefix cache", "Speculation")
