"""StepInspector and its views, driven from Python (no browser): after each action the widgets
hold the values of the matching StepRecord (checked against the record, not constants)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from toolkit import LLM
from toolkit.inspect import Trace, faults
from toolkit.widgets import (BatchView, BlockTableView, MetadataView, StateView, StepInspector,
                             TimelineView, WarmupMemoryView)
from toolkit.widgets import plots

TABS = {"Batch": 0, "Metadata": 1, "Blocks": 2, "State": 3, "Timeline": 4, "Warmup": 5}


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


def test_state_view_shows_the_picked_layer_and_request():
    ins = make()
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
    assert f"state slot {slot}" in ins.state.note.value and layers[-1] in ins.state.note.value
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
    assert html.count("<img") >= 3                        # attention table, slot mapping, state slots
    for rid, held in rec.ledger.holdings.items():
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
