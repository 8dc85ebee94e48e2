"""Trace: recording in every mode, capacity, filters, stage tags, save/load in a fresh process,
the memory ledger, and what inspect="off" leaves out."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from toolkit import LLM, SamplingParams
from toolkit.inspect import Trace
from toolkit.inspect.serialize import equal

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(3, 15))}, {"prompt_token_ids": [4, 5]}]


def small(preset="tiny-bamba", **kw) -> LLM:
    return LLM(preset, **(dict(device="cpu", dtype="float32", max_num_seqs=4,
                               max_num_batched_tokens=8) | kw))


def test_every_step_is_recorded_with_its_stage():
    with small() as llm:
        llm.warmup(progress=False)
        outs = llm.generate(PROMPTS, GREEDY)
        rid = llm.add_request({"prompt_token_ids": [7, 8, 9]}, GREEDY)
        stepped = []
        while llm.has_unfinished_requests():
            stepped.append(llm.step())
        stages = llm.trace.stages
        assert stages[:4] == ["warmup/profile run", "warmup/dummy batch 1 reqs x 1 tokens",
                              "warmup/dummy batch 4 reqs x 4 tokens", "warmup/dummy batch 4 reqs x 8 tokens"]
        assert set(stages[4:]) == {"warmup/requests", "generate", "step"}
        assert len(llm.trace.by_stage("warmup")) == stages.count("warmup/requests") + 4
        assert all(r.step_index is None for r in llm.trace.by_stage("warmup"))
        user = llm.trace.user_steps()
        assert [r.step_index for r in user] == list(range(len(user)))
        assert llm.trace[-len(stepped):][0] is stepped[0]          # step() returns the traced record
        for out in outs:
            mine = llm.trace.for_request(out.request_id)
            kept = [r.kept_token_ids[out.request_id] for r in mine if out.request_id in r.kept_token_ids]
            assert kept == out.outputs[0].token_ids
            assert mine[-1].finished_request_ids == [out.request_id] or out.request_id in mine[-1].finished_request_ids
        rec = llm.trace.for_request(rid)[0]
        assert set(rec.timings) == {"schedule", "prepare_inputs", "build_metadata", "forward", "sample", "wait",
                                    "update"}
        assert rec.ledger.state_page(rid) == int(rec.metadata("mamba").common.block_table_tensor[0, 0])
        assert rec.ledger.kv_blocks(rid) == rec.metadata("attention").common.block_table_tensor[0, :1].tolist()


def test_capacity_drops_the_oldest_and_off_records_nothing():
    with small(trace_capacity=3) as llm:
        llm.generate(PROMPTS, GREEDY)
        assert len(llm.trace) == 3 and llm.trace.num_dropped > 0
        assert llm.trace[-1].finished_request_ids
    with small(inspect="off") as off:
        off.warmup(progress=False)
        off.generate(PROMPTS, GREEDY)
        assert len(off.trace) == 0 and off.model_runner.observer is None
        off.add_request({"prompt_token_ids": [5]}, GREEDY)
        assert off.step().input_batch is not None            # step() still returns its record
        assert len(off.trace) == 0
    with pytest.raises(ValueError, match="inspect"):
        small(inspect="everything")
    with pytest.raises(ValueError, match="trace_capacity"):
        small(trace_capacity=0)


def test_full_mode_records_states_and_top_logits():
    with small("tiny-mamba2", inspect="full") as llm:
        llm.generate(PROMPTS, GREEDY)
        rec = llm.trace[-1]
        layers = {s.layer_name for s in rec.states}
        assert layers == {f"backbone.layers.{i}.mixer" for i in range(4)}
        st = rec.states[0]
        assert st.state_names == ["conv_state", "ssm_state"] and st.mamba_type == "mamba2"
        assert st.before[1].shape == (len(rec.scheduled), 8, 16, 16)
        assert not torch.equal(st.before[1], st.after[1])
        assert torch.equal(rec.top_logit_ids[:, 0], rec.logits.argmax(-1))
    with small("tiny-mamba2") as meta:                            # metadata mode: no states
        meta.generate(PROMPTS, GREEDY)
        assert meta.trace[-1].states == [] and meta.trace[-1].top_logit_ids is None


def test_record_sizes_shortcut_counts_what_the_walk_counts():
    """The trace's byte budget sizes a plain metadata record without walking it: the same sizes as
    the walk, for such records and (through the walk) for records with logprobs and full-mode states."""
    from toolkit.inspect import trace as trace_module
    assert trace_module._FAST_OK, "a new StepRecord field: list it in trace._FAST_OK's set, or in _COUNTED"
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    for mode, params in (("metadata", GREEDY), ("metadata", sp), ("full", GREEDY)):
        with small("tiny-mamba2", inspect=mode) as llm:
            llm.generate(PROMPTS, params)
            for rec in llm.trace:
                assert trace_module.record_sizes(rec) == trace_module._walked_sizes(rec), (mode, rec.stage)
            assert sum(trace_module.record_sizes(rec)[1] for rec in llm.trace) > 0


SAVE_AND_COMPARE = """
import sys, torch
from toolkit.inspect import Trace
from toolkit.inspect.serialize import equal
a, b = Trace.load(sys.argv[1]), Trace.load(sys.argv[2])
assert a.equals(b) and len(a) > 5, (len(a), len(b))
print("equal", len(a))
"""


def test_trace_saved_and_loaded_in_a_fresh_process_is_equal(tmp_path):
    with small(inspect="full") as llm:
        llm.warmup(progress=False)
        llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.8, seed=3))
        llm.trace.save(tmp_path / "a")
        loaded = Trace.load(tmp_path / "a")
        assert loaded.equals(llm.trace)
        rec, back = llm.trace[-1], loaded[-1]
        assert type(back.attn_metadata[1].metadata) is type(rec.attn_metadata[1].metadata)
        assert back.input_batch.query_start_loc_np.dtype == rec.input_batch.query_start_loc_np.dtype
        assert equal(back.states[0].after[1], rec.states[0].after[1])
        llm.trace.save(tmp_path / "b")
    proc = subprocess.run([sys.executable, "-c", SAVE_AND_COMPARE, str(tmp_path / "a"), str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("equal"), proc.stderr
    changed = Trace.load(tmp_path / "b")
    changed[-1].logits[0, 0] += 1e-6
    assert not changed.equals(llm.trace)
    assert not list(tmp_path.glob("**/*.pkl")) and not list(tmp_path.glob("**/*.pt"))


def test_loading_refuses_foreign_classes(tmp_path):
    import json
    with small() as llm:
        llm.generate(PROMPTS[:1], GREEDY)
        llm.trace.save(tmp_path)
    doc = json.loads((tmp_path / "trace.json").read_text())
    doc["records"][0]["__dataclass__"] = "os:system"
    (tmp_path / "trace.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="only toolkit classes"):
        Trace.load(tmp_path)


def test_memory_report_at_load_warmup_and_shutdown():
    llm = small()
    llm.warmup(progress=False)
    llm.generate(PROMPTS, GREEDY)
    llm.shutdown()
    report = llm.memory_report()
    load, after = report.marks["load"], report.marks["shutdown"]
    with LLM("tiny-bamba", device="cpu", dtype="float32") as fresh:
        weights = sum(p.numel() * 4 for p in fresh.model.parameters())
    assert load["weights"] == weights
    assert load["kv_cache"] > 0 and load["state_cache"] > 0 and load["persistent_buffers"] > 0
    for cat in ("weights", "kv_cache", "state_cache", "persistent_buffers", "graphs"):
        assert after[cat] == 0, cat
    assert report.marks["warmup"]["trace_host"] > 0 and report.marks["warmup"]["trace_device"] == 0
    assert "state_cache" in repr(report) and "<table" in report._repr_html_()


def test_memory_report_counts_the_draft_model_and_shutdown_frees_it():
    """method "draft_model": the draft's weights, KV pages, state pages and buffers are the engine's
    (named "draft.*"), warmup's profile run includes the draft, and shutdown frees all of it."""
    spec = {"method": "draft_model", "model": "tiny-jamba", "num_speculative_tokens": 2}
    llm = LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=16,
              max_model_len=64, inspect="off", speculative_config=spec)
    plain = LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=16,
                max_model_len=64, inspect="off", speculative_config={**spec, "method": "ngram", "model": None})
    names = [name for _, name, _ in llm._memory.watch.alive()]
    assert any(n.startswith("draft.") and "layers" in n for n in names)          # weights and caches
    assert any(n.startswith("draft.input_buffers[0].") for n in names)
    with_draft, without = llm.memory_report().marks["load"], plain.memory_report().marks["load"]
    plain.shutdown()
    draft_weights = sum(p.numel() * 4 for p in llm.model_runner.draft.model.parameters())
    assert with_draft["weights"] == without["weights"] + draft_weights
    for cat in ("kv_cache", "state_cache", "persistent_buffers"):
        assert with_draft[cat] > without[cat], cat
    llm.warmup(progress=False)
    assert llm.stats()["draft_forwards"] > 0          # warmup's real requests ran the draft too
    llm.generate(PROMPTS, GREEDY)
    llm.shutdown()
    after = llm.memory_report().marks["shutdown"]
    for cat in ("weights", "kv_cache", "state_cache", "persistent_buffers"):
        assert after[cat] == 0, cat


def test_snapshot_copies_every_tensor_and_array_once_and_shares_views_met_twice():
    """What a record holds is a copy: the runner rewrites its buffers in place next step."""
    import dataclasses

    import numpy as np

    from toolkit.inspect.step_record import snapshot

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        t: torch.Tensor
        scalar: np.int64

        def __post_init__(self):            # a builder's validation: not run again by the copy
            if self.t.numel() > 100:
                raise AssertionError("revalidated")

    @dataclasses.dataclass(slots=True)
    class Slotted:
        a: np.ndarray
        names: list

    buffer = torch.arange(10, dtype=torch.int32)
    view = buffer[2:6]
    array = np.arange(4)
    same_view_again = buffer[2:6]                                  # another object, the same view
    obj = {"x": [Frozen(view, np.int64(3)), Frozen(view, np.int64(4)), Frozen(same_view_again, np.int64(5))],
           "y": (Slotted(array, ["a"]), 7, None)}
    counter = [0]
    copy = snapshot(obj, counter)
    buffer.zero_()
    array[:] = -1
    x0, x1, x2 = copy["x"]
    assert x0.t.tolist() == [2, 3, 4, 5] and x0.t is x1.t is x2.t   # one clone for the view met three times
    assert x0.scalar == 3 and type(x0) is Frozen
    slotted, seven, none = copy["y"]
    assert slotted.a.tolist() == [0, 1, 2, 3] and slotted.names == ["a"] and slotted.names is not obj["y"][0].names
    assert (seven, none) == (7, None) and type(copy["y"]) is tuple
    assert counter[0] == view.nbytes + array.nbytes


@pytest.mark.parametrize("preset, kwargs", [
    ("tiny-bamba", dict(max_num_batched_tokens=16)),                  # chunked prefills, mixed steps
    ("tiny-lfm2", dict(enable_prefix_caching=True, block_size=4,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 2})),
    ("tiny-mamba2", dict(enable_prefix_caching=True, block_size=4, cudagraph_mode="padded_eager",   # the builders'
                         speculative_config={"method": "ngram", "num_speculative_tokens": 2})),   # own buffers
])
def test_records_read_late_equal_the_batch_and_metadata_the_step_used(preset, kwargs, monkeypatch):
    """Every record's batch and metadata, read after the run (later steps rewrote the runner's
    buffers), equal an eager copy of the live objects taken at the step's end."""
    import toolkit.inspect.recorder as recorder_module
    from toolkit.inspect.serialize import equal
    from toolkit.inspect.step_record import scheduled_rows, snapshot

    eager = []
    real = recorder_module.step_record

    def step_record_and_copy(step, *args, **kw):
        if step.exec_state is not None:
            eager.append((snapshot(step.exec_state.input_batch), snapshot(step.exec_state.attn_metadata.groups),
                          scheduled_rows(step.exec_state.input_batch)))
        return real(step, *args, **kw)
    monkeypatch.setattr(recorder_module, "step_record", step_record_and_copy)
    llm = LLM(preset, inspect="metadata", trace_capacity=None, **kwargs)
    prompts = [{"prompt_token_ids": [3, 4, 5, 6] * 5}, {"prompt_token_ids": list(range(3, 14))},
               {"prompt_token_ids": [7, 8]}]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    records = [r for r in llm.trace if r.stage == "generate"]
    assert len(records) == len(eager) > 5
    assert all(r.is_pending for r in records)       # kept by reference: made below, after every step ran
    if "speculative_config" not in kwargs:     # the rows of a decode step too: made from its batch when read
        assert sum("scheduled" not in vars(r) for r in records) > 5     # (the speculative checks read them)
    for i, (record, (batch, groups, rows)) in enumerate(zip(records, eager)):
        if i % 2:                                   # the rows read first (from the step's batch), or made
            assert record.scheduled == rows and record.is_pending, f"step {i}: rows"     # with the rest
        assert equal(record.input_batch, batch), f"step {i}: input batch"
        assert equal(record.attn_metadata, groups), f"step {i}: metadata"
        assert record.scheduled == rows, f"step {i}: rows"
    llm.shutdown()


def test_a_record_of_some_fields_reads_as_one_made_whole():
    """StepRecord.from_fields (the Recorder's records): a list or dict field left out reads as an
    empty one, made once and kept (what is appended to it stays), and compares equal to a record made
    with every field."""
    from toolkit.inspect.step_record import StepRecord, Violation

    given = dict(step_index=3, scheduled=[], input_batch=None, attn_metadata=[], logits=None,
                 sampled_token_ids={"a": 5}, kept_token_ids={"a": 5})
    lean = StepRecord.from_fields(dict(given, graph="graph"))
    whole = StepRecord(**given, preempted_request_ids=[], outputs=[], graph="graph")
    assert not lean.holds("violations") and "violations" not in vars(lean)
    assert lean.violations == [] and lean.violations is lean.violations
    lean.violations.append(Violation("c", "w", "f", "m"))
    assert lean.holds("violations") and len(lean.violations) == 1
    whole.violations.append(Violation("c", "w", "f", "m"))
    assert lean == whole and lean.stage == "step" and lean.dropped == [] and lean.prefix_lookups == {}
    with pytest.raises(AttributeError, match="no attribute 'not_a_field'"):
        getattr(lean, "not_a_field")  # noqa: B009


def test_a_record_held_past_the_trace_keeps_its_copy_and_freed_copies_are_written_again(monkeypatch):
    """The copies of the runner's buffers (Freezer) are used again once their record is gone, and
    only then: records the trace pushed out but the caller kept (every other one here) still read
    as the step left them, while the dropped ones' copies serve later steps (fewer flat tensors
    made than steps)."""
    import toolkit.inspect.recorder as recorder_module
    from toolkit.inspect.step_record import snapshot

    eager = {}
    real = recorder_module.step_record

    def step_record_and_copy(step, *args, **kw):
        if step.exec_state is not None:
            eager[step.step_index] = (snapshot(step.exec_state.input_batch),
                                      snapshot(step.exec_state.attn_metadata.groups))
        return real(step, *args, **kw)
    monkeypatch.setattr(recorder_module, "step_record", step_record_and_copy)
    llm = small(inspect="metadata", trace_capacity=2, max_num_batched_tokens=16)
    for prompt in PROMPTS:
        llm.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    held, flats = [], {}                            # the flat copies seen (kept: their ids stay theirs)
    while llm.has_unfinished_requests():
        record = llm.step()
        flat = record._pending.frozen.flat
        flats[id(flat)] = flat
        if record.step_index % 2 == 0:
            held.append(record)
        del record
    steps = len(eager)
    assert steps > 8 and len(held) > 4
    # the held records' copies, and a few that the dropped records' steps took in turn (trace_capacity 2)
    assert len(flats) <= len(held) + 3 < steps
    for record in held:
        assert record.is_pending                    # not made until read here, many steps later
        batch, groups = eager[record.step_index]
        assert equal(record.input_batch, batch), f"step {record.step_index}: input batch"
        assert equal(record.attn_metadata, groups), f"step {record.step_index}: metadata"
    llm.shutdown()


def test_freezer_copies_the_buffers_and_writes_a_copy_again_only_once_its_reader_is_gone():
    import gc

    from toolkit.inspect.step_record import FROZEN_ALIGN, Freezer

    a, b = torch.arange(5, dtype=torch.int32), torch.arange(3, dtype=torch.int64)      # 20 and 24 bytes
    freezer = Freezer(max_bytes=1024)

    class Reader:                                   # stands for the record that reads the copy
        pass

    first, reader = freezer([a, b[1:]]), Reader()   # a view of b: its whole storage is copied
    freezer.lend(first, reader)
    offsets = [first.offsets[t.untyped_storage().data_ptr()] for t in (a, b)]
    assert offsets == [0, 32] and all(o % FROZEN_ALIGN == 0 for o in offsets)
    assert first.host_bytes == first.flat.numel() == 64             # each copy padded to 16 bytes
    a += 10
    assert first.flat[:20].view(torch.int32).tolist() == [0, 1, 2, 3, 4]       # as it was when copied
    assert first.flat[32:56].view(torch.int64).tolist() == [0, 1, 2]
    second = freezer([a, b[1:]])                    # the first one's reader is alive: a new flat tensor
    assert second.flat is not first.flat and first.flat[:20].view(torch.int32).tolist() == [0, 1, 2, 3, 4]
    assert second.flat[:20].view(torch.int32).tolist() == [10, 11, 12, 13, 14]
    freezer.lend(second, Reader())                  # (that reader is gone at once)
    del reader
    gc.collect()
    third = freezer([a, b[1:]])
    assert third.flat is first.flat or third.flat is second.flat                # one written again
    assert freezer([torch.zeros(2048, dtype=torch.uint8)]) is None              # over max_bytes
    with pytest.raises(ValueError, match="lend the Frozen this Freezer made last"):
        freezer.lend(first, Reader())
