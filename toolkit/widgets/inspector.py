"""StepInspector: step an LLM in a notebook and look at every step it took.

    from toolkit import LLM
    from toolkit.widgets import StepInspector
    llm = LLM("tiny-bamba", inspect="full")
    StepInspector(llm)

Controls: Step, Run N, Run to end, Reset (a new LLM from the same arguments), add a request from
a text box (text, or token ids as "5, 6, 7"); with inspect="full", Capture: which recurrent layers
and requests the next steps record (`llm.set_inspect_filter`); a line with the trace's records and
bytes against its budget; a history slider over `llm.trace` (warmup stages included and labelled).
Tabs: Batch, Metadata, Blocks (KV blocks and state pages), State, Timeline, Warmup (and memory),
Prefix cache (the step's lookups: each admitted request's hash chain block by block, its hit and
why; where each recurrent state came from; and, on the latest record, what the cache holds now),
Speculation (each decode row's drafts against the target's tokens, the accepted run, the first
rejection and the recurrent state columns).
The widget tree is built once; moving the slider or stepping sets values, and only the visible tab
is redrawn (the others when they are opened).

Nothing a control does fails silently: whatever an action raises (or a view raises while drawing)
is shown in the status line, type, message and a toggle opening the traceback, instead of going to
JupyterLab's log console, where nobody looks and the button would seem to do nothing. Run N and
Run to end show their progress there while they run, and a kernel interrupt stops them after the
last completed step, the engine still serving.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import ipywidgets as W

from toolkit.inspect import html as H
from toolkit.inspect.memory import fmt_bytes
from toolkit.inspect.record_views import step_record_html
from toolkit.sampling import SamplingParams
from toolkit.widgets.views import (
    BatchView,
    BlockTableView,
    MetadataView,
    PrefixCacheView,
    SpecDecodeView,
    StateView,
    TimelineView,
    WarmupMemoryView,
    view_names,
)

if TYPE_CHECKING:
    from toolkit.llm import LLM

IDLE = "nothing to run: add a request first"
SHOWN = "the views show the last recorded step"
PROGRESS_EVERY_S = 0.1      # Run N / Run to end update their progress at most ~10 times a second


class StepInspector:
    """A Jupyter widget over an LLM: Step, Run N, Run to end, Reset and Add request buttons, a
    history slider over `llm.trace`, and one tab per view (batch, metadata, block tables, states,
    timeline, warmup and memory, prefix cache, speculation), each a pure render of the selected
    StepRecord. The same actions are methods (`step`, `run`, `run_to_end`, `add_request`, `reset`,
    `use`). Needs inspect="metadata" or "full"."""

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
        self.status.add_class("runnerscope-status")      # the browser tests find it by this class
        # what a full-mode step captures (llm.set_inspect_filter), and the trace against its budget
        self.capture_layers = W.Text(placeholder="layers: a regex, or names a, b (empty: all)",
                                     layout=W.Layout(width="280px"))
        self.capture_requests = W.Text(placeholder="requests: ids a, b (empty: all)", layout=W.Layout(width="200px"))
        self.capture_button = W.Button(description="Capture")
        self.capture_info = W.HTML()
        self.capture_info.add_class("runnerscope-capture")
        # views
        self.batch = BatchView(decode=self._decode)
        self.metadata = MetadataView()
        self.blocks = BlockTableView()
        self.state = StateView(inspect=llm.inspect)
        self.timeline = TimelineView()
        self.warmup = WarmupMemoryView()
        self.prefix = PrefixCacheView()
        self.speculation = SpecDecodeView()
        self._views = [self.batch, self.metadata, self.blocks, self.state, self.timeline, self.warmup,
                       self.prefix, self.speculation]
        self.tabs = W.Tab(children=[v.widget for v in self._views])
        for i, name in enumerate(view_names()):
            self.tabs.set_title(i, name)
        self._drawn: set[int] = set()       # tabs up to date with the shown record
        self._said = ""                     # the last action's status line (see _say)
        capture_row = (W.HBox([self.capture_layers, self.capture_requests, self.capture_button])
                       if llm.inspect == "full" else W.HBox([]))
        self.widget = W.VBox([
            W.HBox([self.step_button, self.run_n, self.run_n_button, self.run_all_button, self.reset_button]),
            W.HBox([self.prompt, self.max_tokens, self.add_button]), capture_row, self.capture_info,
            W.HBox([self.slider, self.position]), self.status, self.tabs])
        self.step_button.on_click(lambda _: self.step())
        self.run_n_button.on_click(lambda _: self.run(self.run_n.value))
        self.run_all_button.on_click(lambda _: self.run_to_end())
        self.reset_button.on_click(lambda _: self.reset())
        self.add_button.on_click(lambda _: self.add_request())
        self.capture_button.on_click(lambda _: self.set_capture())
        self.slider.observe(lambda _: self._show_selected(), names="value")
        self.tabs.observe(lambda _: self._draw_visible(), names="selected_index")
        self._follow_latest()

    # ---- actions ---------------------------------------------------------------------------
    def step(self) -> None:
        """One engine step (if anything is left to run), then show it."""
        def go() -> str:
            self.llm.step()
            return ""
        self._guard(go, lambda: f"raised by Step; {SHOWN}", idle=IDLE)

    def run(self, n: int) -> None:
        """Up to `n` steps (fewer if every request finishes), with progress; see `_run`."""
        self._run("Run N", n)

    def run_to_end(self) -> None:
        """Step until every request has finished, with progress; see `_run`."""
        self._run("Run to end", None)

    def _run(self, action: str, limit: int | None) -> None:
        """Step (at most `limit` times), showing steps done and requests left in the status line,
        before the first step and then at most every PROGRESS_EVERY_S seconds. A kernel interrupt
        ends the loop: the LLM put the interrupted step's requests back, so the views show the last
        completed step and the engine still serves."""
        done = 0

        def go() -> str:
            nonlocal done
            shown = float("-inf")
            try:
                while (limit is None or done < limit) and self.llm.has_unfinished_requests():
                    if time.monotonic() - shown >= PROGRESS_EVERY_S:
                        self.status.value = H.wrap(H.escape(f"{action}: {_plural(done, 'step')} done, "
                                                            f"{self._left()} (interrupt the kernel to stop)"))
                        shown = time.monotonic()
                    self.llm.step()
                    done += 1
            except KeyboardInterrupt:
                return H.wrap(H.escape(f"{action}: interrupted after {_plural(done, 'step')}, {self._left()}; "
                                       "the views show the last completed step and the engine still serves"))
            return H.wrap(H.escape(f"{action}: ran {_plural(done, 'step')}, {self._left()}"))

        self._guard(go, lambda: f"raised by {action} after {_plural(done, 'completed step')}; {SHOWN}", idle=IDLE)

    def add_request(self, prompt: str | None = None, max_tokens: int | None = None) -> str | None:
        text = (self.prompt.value if prompt is None else prompt).strip()
        params = SamplingParams(max_tokens=max_tokens or self.max_tokens.value, temperature=0.0)
        rid = None

        def go() -> str:
            nonlocal rid
            ids = _parse_ids(text)
            rid = self.llm.add_request({"prompt_token_ids": ids} if ids is not None else text, params)
            self.prompt.value = ""
            return H.wrap(H.escape(f"added request {rid!r} ({params.max_tokens} tokens max)"))
        self._guard(go, lambda: "raised by Add request", follow=False)
        return rid

    def set_capture(self, layers: str | None = None, requests: str | None = None) -> None:
        """What the next full-mode steps capture (`llm.set_inspect_filter`): layers as a regex, or
        names separated by commas; requests as ids separated by commas; empty means all. A value
        the engine refuses is shown in the status line and changes nothing."""
        layers = (self.capture_layers.value if layers is None else layers).strip()
        requests = (self.capture_requests.value if requests is None else requests).strip()

        def go() -> str:
            chosen_layers = None if not layers else _split(layers) if "," in layers else layers
            described = self.llm.set_inspect_filter(chosen_layers, _split(requests) if requests else None)
            return H.wrap(H.escape(f"capturing {described}"))
        self._guard(go, lambda: "raised by Capture: the capture is unchanged", follow=False)
        self._show_capture()

    def reset(self) -> None:
        """A new LLM from the same arguments. The old one is shut down only once the new one is
        built: if building raises, the inspector keeps the old engine as it was."""
        old = self.llm
        engine, args = type(old), dict(old.init_args)
        try:
            self.llm = engine(**args)
        except Exception as err:
            self._say(H.exception(err, "raised by Reset while building the new engine: the inspector "
                                       "keeps the old engine, unchanged"))
            return
        self._switch(old, f"reset: a new {engine.__name__}({args['model']!r}, ...)", "Reset")

    def use(self, llm: LLM) -> None:
        """Show and step another engine from now on (the one shown until now is shut down), as
        Reset does with a new engine built from the same arguments."""
        if llm.inspect == "off":
            raise ValueError("StepInspector reads llm.trace, which inspect='off' leaves empty")
        old, self.llm = self.llm, llm
        self._switch(old, f"now showing {type(llm).__name__}({llm.model_name!r}, ...)", "use()")

    def _switch(self, old: LLM, said: str, action: str) -> None:
        self.state.inspect = self.llm.inspect
        try:
            old.shutdown()
            self._say(H.wrap(H.escape(said)))
        except Exception as err:
            self._say(H.exception(err, f"raised by {action} while shutting the old engine down: the "
                                       "inspector shows the new engine"))
        self._follow_latest()

    def _guard(self, fn: Callable[[], str], where: Callable[[], str], follow: bool = True,
               idle: str | None = None) -> None:
        """Run an action; the status line shows what `fn` returns or, if it raised, the exception
        with `where()` (e.g. an InvariantError: the failed step is still in the trace and shown)."""
        if idle is not None and not self.llm.has_unfinished_requests():
            self._say(H.note(idle))
            return
        try:
            message = fn()
        except Exception as err:
            message = H.exception(err, where())
        self._say(message)
        if follow:
            self._follow_latest()

    def _left(self) -> str:
        stats = self.llm.stats()
        left = stats["num_running"] + stats["num_waiting"]
        return f"{_plural(left, 'request')} left" if left else "no request left"

    def _say(self, html: str) -> None:
        """The status line: the last action's message (a view that fails to draw adds its error)."""
        self._said = self.status.value = html

    # ---- showing ---------------------------------------------------------------------------
    @property
    def record(self):
        """The record the views show (the slider's position in `llm.trace`)."""
        trace = self.llm.trace
        return trace[self.slider.value] if len(trace) else None

    def _show_capture(self) -> None:
        """`trace: 12 records, 3.1 MiB of a 2.0 GiB budget; captures all 2 recurrent layers; every request`."""
        trace = self.llm.trace
        budget = "no byte budget" if trace.max_bytes is None else f"a {fmt_bytes(trace.max_bytes)} budget"
        line = f"trace: {_plural(len(trace), 'record')}, {fmt_bytes(trace.host_bytes)} of {budget}"
        if trace.num_trimmed:
            line += f" ({trace.num_trimmed} trimmed to it)"
        if self.llm.inspect_filter is not None:
            line += f"; captures {self.llm.inspect_filter}"
        self.capture_info.value = H.span(line, H.SOFT)

    def _follow_latest(self) -> None:
        self._show_capture()
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
        try:
            [lambda: self.batch.show(rec), lambda: self.metadata.show(rec, prev),
             lambda: self.blocks.show(rec), lambda: self.state.show(trace, rec),
             lambda: self.timeline.show(trace),
             lambda: self.warmup.show(trace, self.llm.memory_report()),
             lambda: self.prefix.show(rec, self.llm.prefix_cache, self.slider.value == len(trace) - 1),
             lambda: self.speculation.show(rec, self.llm.speculative_config is not None)][index]()
        except Exception as err:                      # not marked drawn: the next visit tries again
            self.status.value = self._said + H.exception(err, f"raised while drawing the {view_names()[index]} tab")
            return
        self.status.value = self._said
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
        hub = hub_label(self.llm)
        title = f"StepInspector {hub} ({self.position.value})" if hub else f"StepInspector ({self.position.value})"
        return H.wrap(H.title(title) + step_record_html(rec))

    def __repr__(self) -> str:
        name = hub_label(self.llm) or self.llm.model_name
        return f"StepInspector({name!r}, {len(self.llm.trace)} records, showing {self.slider.value})"


def hub_label(llm: LLM) -> str | None:
    """`org/name@<short sha>` for an engine loaded by Hub id, so that the title says which commit is on
    screen (a branch moves); None otherwise."""
    hub = getattr(llm, "hub_source", None)
    return hub.label if hub is not None else None


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _parse_ids(text: str) -> list[int] | None:
    """"5, 6, 7" or "[5 6 7]" -> [5, 6, 7]; anything else is text (None)."""
    cleaned = text.strip().strip("[]").replace(",", " ").split()
    if cleaned and all(tok.isdigit() for tok in cleaned):
        return [int(tok) for tok in cleaned]
    return None
