"""StepInspector: step an LLM in a notebook and look at every step it took.

    from toolkit import LLM
    from toolkit.widgets import StepInspector
    llm = LLM("tiny-bamba", inspect="full")
    StepInspector(llm)

Controls: Step, Run N, Run to end, Reset (a new LLM from the same arguments), add a request from
a text box (text, or token ids as "5, 6, 7"); a history slider over `llm.trace` (warmup stages
included and labelled). Tabs: Batch, Metadata, Blocks (KV blocks and state slots), State, Timeline, Warmup (and
memory). The widget tree is built once; moving the slider or stepping sets values, and only the
visible tab is redrawn (the others when they are opened).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import ipywidgets as W

from toolkit.errors import ToolkitError
from toolkit.inspect import html as H
from toolkit.inspect.record_views import step_record_html
from toolkit.sampling import SamplingParams
from toolkit.widgets.views import (
    BatchView,
    BlockTableView,
    MetadataView,
    StateView,
    TimelineView,
    WarmupMemoryView,
    view_names,
)

if TYPE_CHECKING:
    from toolkit.llm import LLM


class StepInspector:
    def __init__(self, llm: LLM, max_tokens: int = 16):
        if llm.inspect == "off":
            raise ValueError("StepInspector reads llm.trace, which inspect='off' leaves empty: "
                             "build the LLM with inspect='metadata' or 'full'")
        self.llm = llm
        # controls
        self.step_button = W.Button(description="Step", button_style="primary")
        self.run_n = W.BoundedIntText(value=8, min=1, max=10_000, layout=W.Layout(width="70px"))
        self.run_n_button = W.Button(description="Run N")
        self.run_all_button = W.Button(description="Run to end")
        self.reset_button = W.Button(description="Reset", button_style="warning")
        self.prompt = W.Text(placeholder="text, or token ids: 5, 6, 7", layout=W.Layout(width="280px"))
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=100_000, description="max tokens",
                                           layout=W.Layout(width="170px"))
        self.add_button = W.Button(description="Add request")
        self.slider = W.IntSlider(min=0, max=0, value=0, description="history", continuous_update=False,
                                  layout=W.Layout(width="60%"))
        self.position = W.HTML()
        self.status = W.HTML()
        # views
        self.batch = BatchView(decode=self._decode)
        self.metadata = MetadataView()
        self.blocks = BlockTableView()
        self.state = StateView(inspect=llm.inspect)
        self.timeline = TimelineView()
        self.warmup = WarmupMemoryView()
        self._views = [self.batch, self.metadata, self.blocks, self.state, self.timeline, self.warmup]
        self.tabs = W.Tab(children=[v.widget for v in self._views])
        for i, name in enumerate(view_names()):
            self.tabs.set_title(i, name)
        self._drawn: set[int] = set()       # tabs up to date with the shown record
        self.widget = W.VBox([
            W.HBox([self.step_button, self.run_n, self.run_n_button, self.run_all_button, self.reset_button]),
            W.HBox([self.prompt, self.max_tokens, self.add_button]),
            W.HBox([self.slider, self.position]), self.status, self.tabs])
        self.step_button.on_click(lambda _: self.step())
        self.run_n_button.on_click(lambda _: self.run(self.run_n.value))
        self.run_all_button.on_click(lambda _: self.run_to_end())
        self.reset_button.on_click(lambda _: self.reset())
        self.add_button.on_click(lambda _: self.add_request())
        self.slider.observe(lambda _: self._show_selected(), names="value")
        self.tabs.observe(lambda _: self._draw_visible(), names="selected_index")
        self._follow_latest()

    # ---- actions ---------------------------------------------------------------------------
    def step(self) -> None:
        """One engine step (if anything is left to run), then show it."""
        self._guard(lambda: self.llm.step() if self.llm.has_unfinished_requests() else None,
                    idle="nothing to run: add a request first")

    def run(self, n: int) -> None:
        def go():
            for _ in range(n):
                if not self.llm.has_unfinished_requests():
                    break
                self.llm.step()
        self._guard(go, idle="nothing to run: add a request first")

    def run_to_end(self) -> None:
        def go():
            while self.llm.has_unfinished_requests():
                self.llm.step()
        self._guard(go, idle="nothing to run: add a request first")

    def add_request(self, prompt: str | None = None, max_tokens: int | None = None) -> str | None:
        text = (self.prompt.value if prompt is None else prompt).strip()
        params = SamplingParams(max_tokens=max_tokens or self.max_tokens.value, temperature=0.0)
        rid = None

        def go():
            nonlocal rid
            ids = _parse_ids(text)
            rid = self.llm.add_request({"prompt_token_ids": ids} if ids is not None else text, params)
            self.prompt.value = ""
            self.status.value = H.wrap(H.escape(f"added request {rid!r} ({params.max_tokens} tokens max)"))
        self._guard(go, follow=False)
        return rid

    def reset(self) -> None:
        """A new LLM from the same arguments (the old one is shut down)."""
        engine, args = type(self.llm), dict(self.llm.init_args)
        self.llm.shutdown()
        self.llm = engine(**args)
        self.state.inspect = self.llm.inspect
        self.status.value = H.wrap(H.escape(f"reset: a new {engine.__name__}({args['model']!r}, ...)"))
        self._follow_latest()

    def _guard(self, fn, follow: bool = True, idle: str | None = None) -> None:
        """Run an action; a toolkit error (e.g. an InvariantError) is shown, not raised, and the
        step that raised it is still in the trace."""
        if idle is not None and not self.llm.has_unfinished_requests():
            self.status.value = H.note(idle)
            return
        try:
            fn()
            if follow:
                self.status.value = ""
        except ToolkitError as err:
            self.status.value = H.wrap(H.span(f"{type(err).__name__}: {err}", H.ALERT))
        if follow:
            self._follow_latest()

    # ---- showing ---------------------------------------------------------------------------
    @property
    def record(self):
        """The record the views show (the slider's position in `llm.trace`)."""
        trace = self.llm.trace
        return trace[self.slider.value] if len(trace) else None

    def _follow_latest(self) -> None:
        n = len(self.llm.trace)
        self.slider.max = max(n - 1, 0)
        if self.slider.value != self.slider.max:
            self.slider.value = self.slider.max       # the observer redraws
        else:
            self._show_selected()

    def _show_selected(self) -> None:
        self._drawn.clear()
        rec = self.record
        if rec is None:
            self.position.value = H.escape("empty trace: add a request and Step (or call llm.warmup())")
        else:
            where = rec.stage if rec.is_warmup else f"step {rec.step_index} (by {rec.stage}())"
            bad = f", {len(rec.violations)} violation(s)" if rec.violations else ""
            self.position.value = H.escape(f"record {self.slider.value + 1}/{len(self.llm.trace)}: "
                                           f"{where}{bad}")
        self._draw_visible()

    def _draw_visible(self) -> None:
        index = self.tabs.selected_index or 0
        if index in self._drawn:
            return
        rec, trace = self.record, self.llm.trace      # no record: each view says there is none yet
        prev = trace[self.slider.value - 1] if rec is not None and self.slider.value > 0 else None
        [lambda: self.batch.show(rec), lambda: self.metadata.show(rec, prev),
         lambda: self.blocks.show(rec), lambda: self.state.show(trace, rec),
         lambda: self.timeline.show(trace),
         lambda: self.warmup.show(trace, self.llm.memory_report())][index]()
        self._drawn.add(index)

    def _decode(self, ids: list[int]) -> str:
        return self.llm.tokenizer.decode(ids)

    # ---- display -----------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs) -> dict:
        """The live widget, plus a static summary of the current step for places that cannot run
        widgets (GitHub's preview, nbconvert without widget state)."""
        bundle = self.widget._repr_mimebundle_(**kwargs) or {}
        bundle["text/html"] = self._repr_html_()
        bundle["text/plain"] = repr(self)
        return bundle

    def _repr_html_(self) -> str:
        rec = self.record
        if rec is None:
            return H.wrap(H.escape("StepInspector: empty trace"))
        return H.wrap(H.title(f"StepInspector ({self.position.value})") + step_record_html(rec))

    def __repr__(self) -> str:
        return f"StepInspector({self.llm.model_name!r}, {len(self.llm.trace)} records, showing {self.slider.value})"


def _parse_ids(text: str) -> list[int] | None:
    """"5, 6, 7" or "[5 6 7]" -> [5, 6, 7]; anything else is text (None)."""
    cleaned = text.strip().strip("[]").replace(",", " ").split()
    if cleaned and all(tok.isdigit() for tok in cleaned):
        return [int(tok) for tok in cleaned]
    return None
