"""StepInspector and its views, driven from Python (no browser): after each action the widgets
hold the values of the matching StepRecord (checked against the record, not constants)."""
from __future__ import annotations

import re
from html import unescape

import ipywidgets as W
import numpy as np
import pytest
import torch

from toolkit import LLM, MetadataContractError, SamplingParams
from toolkit.inspect import Trace, faults
from toolkit.inspect import html as H
from toolkit.widgets import (
    BatchView,
    BlockTableView,
    MetadataView,
    PrefixCacheView,
    StateView,
    StepInspector,
    TimelineView,
    WarmupMemoryView,
    plots,
)
from toolkit.widgets.views import view_names

TABS = {"Batch": 0, "Metadata": 1, "Blocks": 2, "State": 3, "Timeline": 4, "Warmup": 5, "Prefix cache": 6}


def make(preset="tiny-bamba", **kw) -> StepInspector:
    llm = LLM(preset, **(dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
                              inspect="full") | kw))
    llm.warmup(progress=False)
    ins = StepInspector(llm, max_tokens=4)
    ins.add_request("hello world")                    # 12 byte tokens: chunked over two steps
    ins.add_request("5, 6, 7")                        # token ids
    return ins


def show(ins: StepInspector, tab: str) -> None:
    ins.tabs.selected_index = TABS[tab]


def test_step_shows_the_new_record_in_batch_and_metadata():
    ins = make()
    ins.step_button.click()
    ins.step_button.click()
    rec = ins.llm.trace[-1]
    assert ins.record is rec and ins.slider.value == len(ins.llm.trace) - 1
    html = ins.batch.html.value
    for row, s in enumerate(rec.scheduled):
        assert s.request_id in html
        slot = int(rec.metadata("mamba").common.block_table_tensor[row, 0])
        assert re.search(rf">{s.num_computed_before}<.*?>{s.num_tokens}<.*?>{slot}<", html, re.S)
        token = rec.sampled_token_ids[s.request_id]
        assert f">{token} " in html and repr(ins.llm.tokenizer.decode([token])).replace("'", "&#x27;") in html
    show(ins, "Metadata")
    md = ins.metadata.html.value
    for gm in rec.attn_metadata:
        assert str(gm.common.seq_lens_cpu_upper_bound.tolist()) in md
        assert str(gm.common.query_start_loc_cpu.tolist()) in md
    assert "required int32 cpu [B] ✓" in md              # seq_lens_cpu_upper_bound's contract
    assert "changed" in md                                # seq lens moved since the previous step


def test_slider_moves_every_view_to_that_record():
    ins = make()
    ins.run(3)
    show(ins, "Metadata")
    target = len(ins.llm.trace) - 2
    ins.slider.value = target
    rec = ins.llm.trace[target]
    assert str(rec.metadata("mamba").common.seq_lens_cpu_upper_bound.tolist()) in ins.metadata.html.value
    show(ins, "Batch")
    assert all(s.request_id in ins.batch.html.value for s in rec.scheduled)
    assert f"record {target + 1}/{len(ins.llm.trace)}" in ins.position.value
    ins.slider.value = 0                                  # the profile run: no metadata, no batch rows
    assert "warmup/profile run" in ins.position.value
    show(ins, "Metadata")
    assert "profile run builds none" in ins.metadata.html.value


def test_only_the_visible_tab_is_drawn():
    ins = make()
    ins.step_button.click()
    assert bytes(ins.timeline.image.value) == b"" and ins.metadata.html.value == ""
    show(ins, "Timeline")
    assert bytes(ins.timeline.image.value).startswith(b"\x89PNG")


# Mamba2's two states; lightning's one; the mLSTM's three (C, n and m)
@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-minimax", "tiny-xlstm"])
def test_state_view_shows_the_picked_layer_and_request(preset):
    ins = make(preset)
    ins.run(3)
    show(ins, "State")
    rec = ins.record
    layers = [s.layer_name for s in rec.states]
    assert list(ins.state.layer.options) == layers
    ins.state.layer.value = layers[-1]
    rid = rec.states[-1].request_ids[-1]
    ins.state.request.value = rid
    st = rec.state(layers[-1])
    slot = st.slots[st.request_ids.index(rid)]
    assert f"state page {slot}" in ins.state.note.value and layers[-1] in ins.state.note.value
    assert len(ins.state.images.children) == len(st.state_names)
    assert all(bytes(img.value).startswith(b"\x89PNG") for img in ins.state.images.children)
    assert bytes(ins.state.norms.value).startswith(b"\x89PNG")


def test_blocks_timeline_and_warmup_views():
    ins = make()
    ins.run_all_button.click()
    assert not ins.llm.has_unfinished_requests()
    ins.slider.value = ins.slider.max - 1
    show(ins, "Blocks")
    rec = ins.record
    html = ins.blocks.html.value
    assert html.count("<img") >= 3                        # attention table, slot mapping, state pages
    for rid in rec.ledger.holdings:
        assert rid in html
    show(ins, "Warmup")
    wm = ins.warmup.html.value
    for stage in [r.stage for r in ins.llm.trace.by_stage("warmup")][:4]:
        assert stage in wm
    assert "state_cache" in wm and "weights" in wm


def test_violations_are_shown_highlighted():
    with faults.inject("state_index_off_by_one"):
        llm = LLM("tiny-mamba2", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=8)
        ins = StepInspector(llm)
        ins.add_request("5, 6, 7")
        ins.step_button.click()
    assert "InvariantError" in ins.status.value and "state_indices_match_ledger" in ins.status.value
    rec = ins.record
    assert rec.violations and "1 violation" in ins.position.value
    show(ins, "Metadata")
    assert "#ffebe9" in ins.metadata.html.value            # the highlighted row
    assert rec.violations[0].message.split(",")[0] in ins.metadata.html.value.replace("&#x27;", "'")


def test_add_request_errors_and_reset():
    ins = make()
    ins.add_request("99999")                             # out of the vocabulary
    assert "InvalidRequestError" in ins.status.value
    before = ins.llm
    ins.reset_button.click()
    assert ins.llm is not before and before._closed and ins.llm.init_args == before.init_args
    assert len(ins.llm.trace) == 0 and "empty trace" in ins.position.value
    with pytest.raises(ValueError, match="inspect"):
        StepInspector(LLM("tiny-mamba2", device="cpu", inspect="off"))


def test_views_work_alone_on_a_loaded_trace(tmp_path):
    ins = make()
    ins.run(4)
    ins.llm.trace.save(tmp_path)
    loaded = Trace.load(tmp_path)
    a, b = ins.llm.trace[-1], loaded[-1]
    assert MetadataView(a, ins.llm.trace[-2]).html.value == MetadataView(b, loaded[-2]).html.value
    assert BlockTableView(a).html.value == BlockTableView(b).html.value
    assert BatchView(b).html.value
    sv = StateView(loaded, record=b)
    assert sv.layer.value == b.states[0].layer_name and len(sv.images.children) == 2
    assert TimelineView(loaded).png.startswith(b"\x89PNG")
    assert "warmup/profile run" in WarmupMemoryView(loaded).html.value
    bundle = MetadataView(b)._repr_mimebundle_()
    assert "text/html" in bundle and "seq_lens_cpu_upper_bound" in bundle["text/html"]


def test_inspector_static_fallback_html():
    ins = make()
    ins.step_button.click()
    bundle = ins._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "query_start_loc" in bundle["text/html"] and "<script" not in bundle["text/html"]


def test_plots_downsample_and_mark_non_finite():
    idx = plots.pick_indices(1000)
    assert len(idx) <= plots.MAX_PER_AXIS and idx[0] == 0 and idx[-1] == 999
    t = torch.randn(300, 500)
    t[0, 0] = float("nan")
    t[1, 1] = float("inf")
    png = plots.heatmap_png([("a", t), ("b", t), ("d", t - t)])
    assert png.startswith(b"\x89PNG")
    a2d, fold = plots.as_2d(torch.zeros(8, 16, 4))
    assert a2d.shape == (128, 4) and "folded" in fold
    grid = plots.block_grid_png([[3, 4, 0], [5, 0, 0]], ["a", "b"], "t", used=[2, 1])
    assert grid.startswith(b"\x89PNG")
    assert np.array_equal(plots.pick_indices(5), np.arange(5))


# ---- views with nothing to show say why, and show no image --------------------------------------
def shown_images(widget: W.Widget) -> list[W.Image]:
    """Every image of the widget tree that the page would draw (hidden ones left out)."""
    out = [widget] if isinstance(widget, W.Image) and widget.layout.display != "none" else []
    for child in getattr(widget, "children", ()):
        out += shown_images(child)
    return out


def view_text(view) -> str:
    """What a view shows, as text with the HTML entities decoded."""
    value = view.html.value if hasattr(view, "html") else view.note.value
    return unescape(value)


def assert_says_why(view, sentence: str) -> None:
    """The view shows `sentence`, live and in its static HTML, and no image at all."""
    assert sentence in view_text(view), view_text(view)
    assert "<img" not in view_text(view)
    assert not shown_images(view.widget), [len(bytes(i.value)) for i in shown_images(view.widget)]
    static = view._repr_mimebundle_()["text/html"]
    assert sentence in unescape(static) and "<img" not in static


INSPECT_FULL = 'states are recorded only with inspect="full" and this engine runs with inspect="metadata"'


def test_state_tab_of_a_metadata_engine_says_states_need_inspect_full():
    """Notebook 01's case: a hybrid model, inspect="metadata" (the default). The State tab names
    the real reason, says how to turn states on, and shows no (broken) image."""
    llm = LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=8)
    assert llm.inspect == "metadata"
    ins = StepInspector(llm, max_tokens=4)
    ins.add_request("5, 6, 7")
    ins.step_button.click()
    rec = ins.record
    assert rec.scheduled and "mamba" in [g.kind for g in rec.attn_metadata] and not rec.states
    show(ins, "State")
    assert_says_why(ins.state, INSPECT_FULL)
    assert 'LLM(..., inspect="full")' in view_text(ins.state)
    assert "no recurrent layer" not in view_text(ins.state)
    assert ins.state.images.children == () and bytes(ins.state.norms.value) == b""
    alone = StateView(llm.trace)                 # a trace alone does not know the engine's mode
    assert_says_why(alone, 'no states in this record: they are recorded only with inspect="full"')
    assert "no recurrent layer" not in view_text(alone)


def test_state_view_of_a_model_without_recurrent_layers():
    with LLM("tiny-llama", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=8,
             inspect="full") as llm:
        llm.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, temperature=0.0))
        llm.step()
        assert [g.kind for g in llm.trace[-1].attn_metadata] == ["attention"]
        view = StateView(llm.trace, inspect="full")
    assert_says_why(view, "no recurrent layer in this model (its layer groups: attention)")
    assert "inspect=" not in view_text(view)


def test_every_tab_of_an_empty_trace_says_there_are_no_records():
    llm = LLM("tiny-mamba2", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=8,
              inspect="full")
    ins = StepInspector(llm)
    views = {"Batch": ins.batch, "Metadata": ins.metadata, "Blocks": ins.blocks, "State": ins.state,
             "Timeline": ins.timeline, "Prefix cache": ins.prefix}
    for tab, view in views.items():
        show(ins, tab)
        assert_says_why(view, "no records yet: add a request and step the engine")
    show(ins, "Warmup")
    assert "no warmup in this trace (call llm.warmup())" in view_text(ins.warmup)
    ins.add_request("5, 6, 7")                   # a step, then Reset: the views drop the old records
    ins.step_button.click()
    for tab in ("Batch", "Timeline"):
        show(ins, tab)
    assert "no records yet" not in view_text(ins.batch) and shown_images(ins.timeline.widget)
    ins.reset_button.click()
    assert_says_why(ins.timeline, "no records yet")
    show(ins, "Batch")
    assert_says_why(ins.batch, "no records yet")


def test_warmup_records_say_why_they_have_no_rows_states_or_metadata():
    with LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
             inspect="full") as llm:
        llm.warmup(progress=False)
    profile, dummy = llm.trace[0], llm.trace[1]
    assert profile.stage == "warmup/profile run" and dummy.stage.startswith("warmup/dummy batch")
    assert_says_why(BatchView(dummy), f"no request rows: {dummy.stage} is a warmup stage, which runs a dummy "
                                      f"batch ({dummy.input_batch.num_reqs} rows, "
                                      f"{dummy.input_batch.num_tokens} tokens) for no request")
    assert_says_why(StateView(llm.trace, record=dummy, inspect="full"),
                    f"{dummy.stage} ran no requests, so it holds no request state")
    assert_says_why(MetadataView(profile), "no attention metadata in this step (a profile run builds none)")
    assert_says_why(BlockTableView(profile), "no block tables in this step (a profile run builds none)")
    warmup_only = Trace(None, [r for r in llm.trace if not r.scheduled])
    assert len(warmup_only) == 4
    assert_says_why(TimelineView(warmup_only), "no step has run a request yet (the trace holds only warmup stages)")


def test_a_stage_that_raised_and_an_idle_step_say_why_they_are_empty():
    with faults.inject("missing_seq_lens_cpu_upper_bound"):
        llm = LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=8)
        with pytest.raises(MetadataContractError):
            llm.warmup(progress=False)
    failed = llm.trace[-1]
    assert failed.input_batch is None and failed.violations
    assert_says_why(BatchView(failed), f"no batch: {failed.stage} raised before it built one")
    assert_says_why(MetadataView(failed), f"no attention metadata: {failed.stage} raised before it built any")
    assert_says_why(BlockTableView(failed), f"no block tables: {failed.stage} raised before it built any")
    with LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=8) as idle:
        rec = idle.step()                        # nothing to run: the step schedules nothing
    assert rec.stage == "step" and not rec.scheduled
    assert_says_why(BatchView(rec), "nothing scheduled in this step: no request was waiting to run")
    assert_says_why(MetadataView(rec), "no attention metadata: nothing was scheduled in this step")
    assert_says_why(StateView(Trace(None, [rec]), inspect="full"), "step ran no requests")


def test_an_image_needs_a_picture():
    with pytest.raises(ValueError, match="no PNG data"):
        H.img(b"", "nothing")
    assert H.img(b"\x89PNG", "x").startswith('<img alt="x" src="data:image/png;base64,')


# ---- the Prefix cache tab ------------------------------------------------------------------------------
REPEATED = ", ".join(str(t) for t in range(5, 25))        # 20 token ids: one full block of 16


def test_prefix_cache_tab_shows_the_steps_lookup_and_the_cache_now():
    """A prompt served twice with the cache on: the step admitting the second shows its hash chain
    (block 0 hit, the checkpoint at 16 marked), its hit and why, where its state came from, and what
    the cache holds now; on an older record, the step part alone, saying why."""
    ins = make(enable_prefix_caching=True)
    assert list(view_names()) == [ins.tabs.get_title(i) for i in range(len(ins.tabs.children))]
    assert view_names()[TABS["Prefix cache"]] == "Prefix cache"
    first = ins.add_request(REPEATED)
    ins.run_all_button.click()
    second = ins.add_request(REPEATED)
    ins.step_button.click()
    rec = ins.record
    lookup = rec.prefix_lookups[second]
    assert ins.prefix.html.value == ""                           # not drawn until its tab is shown
    show(ins, "Prefix cache")
    text = view_text(ins.prefix)
    assert lookup.hit_tokens == 16 and first != second
    assert f"request {second!r}: 20 tokens, 1 full block of 16; hit 16 tokens (1 block, cap 1)" in text
    assert "hit 16 of 20 tokens: every full block before the last token is cached" in text
    assert re.findall(r'class="pc-block pc-(\w+) pc-checkpoint" title="block (\d+)', ins.prefix.html.value) == \
        [("hit", "0")]
    (copy,) = rec.state_copies
    assert f"page {copy.src_page} (the checkpoint after 16 tokens, its prefix hit) -> page {copy.dst_page}" in text
    assert "below, what the prefix cache holds now" in text and "eviction rank" in text
    st = ins.llm.stats()                          # warmup's requests and make()'s two were looked up too
    assert (st["prefix_cache_hits"], st["prompt_tokens_skipped"]) == (1, 16)
    assert (f"1 of {st['prefix_cache_queries']} requests hit, 16 of {st['prompt_tokens_queried']} prompt "
            "tokens skipped") in text
    ins.slider.value = ins.slider.max - 1                        # an older record: no report of now
    text = view_text(ins.prefix)
    assert "what the cache holds now is left out" in text and "eviction rank" not in text
    assert PrefixCacheView(rec).html.value == PrefixCacheView(rec, None, False).html.value


def test_prefix_cache_tab_of_an_engine_without_the_cache():
    ins = make()
    ins.step_button.click()
    show(ins, "Prefix cache")
    assert_says_why(ins.prefix, "prefix caching is off: build the engine with LLM(..., enable_prefix_caching=True)")
