"""StepInspector actions never fail silently: whatever Step, Run N, Run to end, Add request or
Reset raises is shown in the status line (type, message, a traceback toggle) instead of leaving
the button callback for JupyterLab's log console, and the engine keeps serving. Run N / Run to
end show their progress while they run, and a kernel interrupt stops them cleanly."""
from __future__ import annotations

import re
from html import unescape

import pytest

from toolkit import LLM
from toolkit.widgets import StepInspector
from toolkit.widgets import inspector as inspector_module

PROMPTS = ("hello world", "5, 6, 7")           # a prefill chunked over two steps, and token ids


def make() -> StepInspector:
    llm = LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
              inspect="full")
    ins = StepInspector(llm, max_tokens=4)
    for prompt in PROMPTS:
        ins.add_request(prompt)
    return ins


def click(button) -> None:
    """Run the button's handlers as a click does, but let an exception through (ipywidgets' own
    `click()` catches it and prints it to the log, which is what must not happen)."""
    for handler in button._click_handlers.callbacks:
        handler(button)


def tokens(llm: LLM) -> dict[str, list[int]]:
    """Output token ids of every request finished in `llm`'s steps."""
    return {out.request_id: out.outputs[0].token_ids for rec in llm.trace if not rec.is_warmup
            for out in rec.outputs}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """What an engine that never failed produces for PROMPTS."""
    ins = make()
    ins.run_to_end()
    assert sorted(tokens(ins.llm)) == ["0", "1"]
    return tokens(ins.llm)


def fail_once(monkeypatch, owner, name: str, exc: BaseException, at: int = 1) -> None:
    """`owner.name` raises `exc` on its `at`-th call and works as before on every other call."""
    real = getattr(owner, name)
    calls = 0

    def planted(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == at:
            raise exc
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, planted)


def status_text(ins: StepInspector) -> str:
    return unescape(ins.status.value)


def assert_shows_error(ins: StepInspector, context: str, error: str = "RuntimeError: planted") -> None:
    """The status line shows the exception's type and message, `context`, and a closed toggle
    holding the traceback down to the planted raise; inline styles only."""
    html, text = ins.status.value, status_text(ins)
    assert error in text and context in text, text
    assert re.search(r"<details[^>]*><summary[^>]*>traceback</summary>", html), html
    assert "<details open" not in html
    assert "Traceback (most recent call last)" in text and "in planted" in text, text
    assert "<style" not in html and "<script" not in html and "class=" not in html


def test_step_error_is_shown_and_the_next_step_works(monkeypatch, reference):
    ins = make()
    fail_once(monkeypatch, ins.llm.model_runner, "execute_model", RuntimeError("planted"))
    click(ins.step_button)                     # raises here if the callback lets it through
    assert_shows_error(ins, "raised by Step; the views show the last recorded step")
    assert len(ins.llm.trace) == 0 and "empty trace" in ins.position.value
    click(ins.step_button)                     # the step's requests were put back: it runs now
    assert ins.status.value == "" and ins.record.step_index == 0
    click(ins.run_all_button)
    assert tokens(ins.llm) == reference


@pytest.mark.parametrize("button", ["run_n_button", "run_all_button"])
def test_run_error_is_shown_after_the_completed_steps(monkeypatch, reference, button):
    ins = make()
    ins.run_n.value = 4
    fail_once(monkeypatch, ins.llm.model_runner, "execute_model", RuntimeError("planted"), at=3)
    click(getattr(ins, button))
    action = {"run_n_button": "Run N", "run_all_button": "Run to end"}[button]
    assert_shows_error(ins, f"raised by {action} after 2 completed steps")
    assert ins.record is ins.llm.trace[-1] and ins.record.step_index == 1     # the last completed step
    assert "record 2/2: step 1" in ins.position.value
    click(ins.run_all_button)
    assert tokens(ins.llm) == reference and not ins.llm.has_unfinished_requests()


def test_add_request_error_is_shown_and_queues_nothing(monkeypatch, reference):
    ins = make()
    fail_once(monkeypatch, ins.llm.tokenizer, "encode", RuntimeError("planted"))
    ins.prompt.value = "a third"
    click(ins.add_button)
    assert_shows_error(ins, "raised by Add request")
    assert ins.prompt.value == "a third"                   # kept, to try again
    assert ins.llm.stats()["num_waiting"] == len(PROMPTS)
    click(ins.add_button)
    assert "added request '2'" in status_text(ins)
    click(ins.run_all_button)
    got = tokens(ins.llm)
    assert {rid: got[rid] for rid in reference} == reference and got["2"]


def test_reset_that_fails_to_build_keeps_the_old_engine(monkeypatch, reference):
    ins = make()
    click(ins.step_button)
    old = ins.llm
    fail_once(monkeypatch, LLM, "__init__", RuntimeError("planted"))
    click(ins.reset_button)
    assert_shows_error(ins, "raised by Reset while building the new engine: the inspector keeps the old "
                            "engine, unchanged")
    assert ins.llm is old and not old._closed and ins.record is old.trace[-1]
    click(ins.run_all_button)                               # the old engine still serves
    assert tokens(old) == reference
    click(ins.reset_button)                                 # the fault is gone: a new engine
    assert ins.llm is not old and old._closed and len(ins.llm.trace) == 0
    assert "reset: a new LLM('tiny-bamba', ...)" in status_text(ins)


def test_reset_whose_old_engine_fails_to_shut_down_shows_the_new_one(monkeypatch):
    ins = make()
    old = ins.llm
    fail_once(monkeypatch, old, "shutdown", RuntimeError("planted"))
    click(ins.reset_button)
    assert_shows_error(ins, "raised by Reset while shutting the old engine down: the inspector shows the new "
                            "engine")
    assert ins.llm is not old and len(ins.llm.trace) == 0 and "empty trace" in ins.position.value


def progress_values(ins: StepInspector) -> list[str]:
    """The status line's values as they are sent to the page, from now on."""
    seen: list[str] = []
    ins.status.observe(lambda change: seen.append(unescape(change["new"])), names="value")
    return seen


def test_run_n_shows_progress_while_it_runs(monkeypatch):
    monkeypatch.setattr(inspector_module, "PROGRESS_EVERY_S", 0.0)         # every step
    ins = make()
    seen = progress_values(ins)
    ins.run_n.value = 3
    click(ins.run_n_button)
    done = [int(m.group(1)) for v in seen if (m := re.search(r"Run N: (\d+) steps? done, \d+ requests? left", v))]
    assert done == [0, 1, 2], seen
    assert "interrupt the kernel to stop" in seen[0]
    left = ins.llm.stats()["num_running"] + ins.llm.stats()["num_waiting"]
    assert f"Run N: ran 3 steps, {left} requests left" in seen[-1] and left == 2, seen[-1]

    monkeypatch.setattr(inspector_module, "PROGRESS_EVERY_S", 3600.0)      # a slow rate: one update
    seen.clear()
    ins.run_to_end()
    assert [v for v in seen if "done," in v] == [seen[0]] and "Run to end: 0 steps done" in seen[0], seen
    assert "Run to end: ran" in seen[-1] and "no request left" in seen[-1]


def test_a_kernel_interrupt_stops_run_to_end_cleanly(monkeypatch, reference):
    ins = make()
    fail_once(monkeypatch, ins.llm.model_runner, "execute_model", KeyboardInterrupt(), at=3)
    try:
        click(ins.run_all_button)
    except KeyboardInterrupt:              # fail this test, not end the pytest session
        pytest.fail("the kernel interrupt left Run to end's loop")
    text = status_text(ins)
    assert "Run to end: interrupted after 2 steps, 2 requests left" in text, text
    assert ins.record is ins.llm.trace[-1] and ins.record.step_index == 1
    click(ins.run_all_button)
    assert "Run to end: ran" in status_text(ins) and tokens(ins.llm) == reference


def test_a_kernel_interrupt_outside_the_run_loops_is_not_swallowed(monkeypatch):
    ins = make()
    fail_once(monkeypatch, ins.llm.model_runner, "execute_model", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        ins.step()
    ins.step()
    assert ins.record.step_index == 0


def test_a_view_that_fails_to_draw_says_so_and_is_drawn_again(monkeypatch):
    ins = make()
    click(ins.step_button)
    fail_once(monkeypatch, ins.metadata, "show", RuntimeError("planted"))
    ins.tabs.selected_index = 1                             # Metadata
    assert_shows_error(ins, "raised while drawing the Metadata tab")
    ins.tabs.selected_index = 0
    ins.tabs.selected_index = 1
    assert ins.status.value == "" and "seq_lens_cpu_upper_bound" in ins.metadata.html.value


def test_capture_chooses_what_full_mode_records_and_refuses_bad_values():
    ins = make()
    ins.capture_layers.value, ins.capture_requests.value = r"layers\.2\.", "0"
    click(ins.capture_button)
    assert ins.llm.inspect_filter == "1 of 2 recurrent layers (model.layers.2.mamba); requests '0'"
    assert "capturing 1 of 2 recurrent layers" in unescape(ins.status.value)
    assert "captures 1 of 2 recurrent layers (model.layers.2.mamba); requests '0'" in unescape(ins.capture_info.value)
    click(ins.step_button)
    (st,) = ins.llm.trace[-1].states
    assert st.layer_name == "model.layers.2.mamba" and st.request_ids == ["0"]
    ins.capture_layers.value = "model.layers.1.self_attn, model.layers.0.mamba"     # names, not a regex
    click(ins.capture_button)
    status = unescape(ins.status.value)
    assert "ValueError" in status and "is not a recurrent layer" in status and "capture is unchanged" in status
    assert ins.llm.inspect_filter == "1 of 2 recurrent layers (model.layers.2.mamba); requests '0'"
    ins.set_capture("", "")
    assert ins.llm.inspect_filter == "all 2 recurrent layers; every request"
    assert re.search(r"trace: \d+ records?, [\d.]+ \w*B of a [\d.]+ \w*B budget", unescape(ins.capture_info.value))


def test_capture_controls_only_with_full_mode():
    llm = LLM("tiny-bamba", device="cpu", dtype="float32", inspect="metadata", trace_max_bytes=None)
    ins = StepInspector(llm)
    assert ins.capture_button not in ins.widget.children[2].children
    assert "no byte budget" in unescape(ins.capture_info.value) and "captures" not in ins.capture_info.value
