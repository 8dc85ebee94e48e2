"""Inspection that cannot take the notebook down: the trace's byte budget (states, then logits,
then whole records go, oldest first, marked and shown), capture of only the layers and requests
asked for (nothing else is gathered), states copied to host memory, clear refusals of bad values."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit import LLM, SamplingParams, TraceBudgetWarning
from toolkit.host import to_host
from toolkit.inspect import Trace
from toolkit.inspect import memory as memory_module
from toolkit.inspect.memory import resolve_trace_budget
from toolkit.inspect.record_views import step_record_html
from toolkit.widgets.panes import why_no_states

F32 = dict(device="cpu", dtype="float32")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [7, 8]}]
MAMBA_LAYERS = ["model.layers.0.mamba", "model.layers.2.mamba"]       # tiny-bamba's recurrent layers


def full(**kw) -> LLM:
    return LLM("tiny-bamba", inspect="full", **F32, **kw)


def run(llm: LLM) -> list[list[int]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceBudgetWarning)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def unbounded():
    """The same workload with no byte bound: the reference for what a budget keeps (its records
    made: a budget makes a record kept by reference before it drops anything of it)."""
    llm = full(trace_max_bytes=None)
    tokens = run(llm)
    llm.trace.materialize()
    yield llm, tokens
    llm.shutdown()


def gathers_and_record(**kw):
    """(index_select calls, record) of the second step of two requests on a tiny-bamba engine."""
    llm = LLM("tiny-bamba", **F32, **kw)
    llm.add_request(PROMPTS[0], GREEDY, request_id="a")
    llm.add_request(PROMPTS[1], GREEDY, request_id="b")
    llm.step()
    with IndexSelects() as mode:
        rec = llm.step()
    llm.shutdown()
    return mode.count, rec


class IndexSelects(TorchDispatchMode):
    """Counts the index_select calls of a step: the recorder gathers states with one per tensor."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.index_select:
            self.count += 1
        return func(*args, **(kwargs or {}))


# ---- the byte budget ---------------------------------------------------------------------------------
def test_budget_drops_the_oldest_states_first_and_keeps_metadata(unbounded):
    ref, ref_tokens = unbounded
    sizes = [sum(s) for s in ref.trace._sizes]
    budget = sum(sizes) // 2
    llm = full(trace_max_bytes=budget)
    with pytest.warns(TraceBudgetWarning) as caught:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert tokens == ref_tokens                         # recording never changes what runs
    assert len(caught) == 1                             # once per trace
    message = str(caught[0].message)
    assert "trace_max_bytes" in message and "inspect_layers" in message and "set_inspect_filter" in message
    assert llm.trace.host_bytes <= budget
    records = list(llm.trace)
    assert len(records) == len(ref.trace)               # no whole record went: only states
    dropped = [("states" in r.dropped) for r in records]
    assert dropped[0] and not dropped[-1]
    assert dropped == sorted(dropped, reverse=True)     # the oldest first, then none
    assert all(r.logits is not None for r in records)
    for r, kept in zip(records, ref.trace):
        if "states" in r.dropped:
            assert r.states == [] and r.input_batch is not None and r.attn_metadata
            assert r.request_ids == kept.request_ids
        else:
            assert [s.layer_name for s in r.states] == [s.layer_name for s in kept.states]
            assert torch.equal(r.states[0].after[1], kept.states[0].after[1])
    oldest = records[0]
    assert "states dropped: trace budget" in step_record_html(oldest)
    assert "states dropped: trace budget" in why_no_states(oldest, "full")
    with pytest.raises(KeyError, match="trace budget"):
        oldest.state(MAMBA_LAYERS[0])
    assert "trimmed to the byte budget" in repr(llm.trace)
    llm.shutdown()


def test_then_logits_then_whole_records_go(unbounded):
    ref, _ = unbounded
    rest = [s[2] for s in ref.trace._sizes]
    # room for the metadata of every record but not one record's states or logits
    llm = full(trace_max_bytes=sum(rest) + 1)
    run(llm)
    records = list(llm.trace)
    assert len(records) == len(ref.trace)
    assert all(r.states == [] and r.logits is None and r.top_logit_ids is None for r in records
               if r.scheduled)
    assert all(r.dropped == ["states", "logits"] for r in records if r.scheduled)
    with pytest.raises(KeyError, match="trace budget"):
        records[-1].logits_of(records[-1].request_ids[0])
    assert llm.trace.host_bytes <= sum(rest) + 1
    tiny = full(trace_max_bytes=max(rest) + 1)             # one record's metadata, not two
    run(tiny)
    assert len(tiny.trace) == 1 and tiny.trace.num_dropped == len(ref.trace) - 1
    for engine in (llm, tiny):        # the running total equals the records' sizes after drops and pops
        assert engine.trace.host_bytes == sum(sum(size) for size in engine.trace._sizes) > 0
        engine.shutdown()


def test_the_newest_record_keeps_its_states_while_older_logits_can_go(unbounded):
    """A large vocabulary makes the logits of many steps weigh more than one step's states: the
    trace then drops older records' logits before the newest record's states (the step just taken
    is the one looked at), and keeps every record's metadata."""
    ref, _ = unbounded
    sizes = list(ref.trace._sizes)
    # every record's metadata, the newest's states and logits, and not quite all the older logits
    budget = sum(s[2] for s in sizes) + sum(sizes[-1][:2]) + sum(s[1] for s in sizes[:-1]) // 2
    llm = full(trace_max_bytes=budget)
    run(llm)
    records = list(llm.trace)
    assert len(records) == len(ref.trace)
    assert records[-1].states and records[-1].logits is not None and records[-1].dropped == []
    assert all(r.states == [] for r in records[:-1] if r.scheduled)
    assert any(r.logits is None for r in records[:-1]) and llm.trace.host_bytes <= budget
    llm.shutdown()


def test_room_is_made_before_a_step_gathers_and_a_step_larger_than_the_budget_gathers_nothing():
    with pytest.warns(TraceBudgetWarning, match="more than the budget; not gathered at all"):
        # two rows' states (~80 KiB a step) never fit 24 KiB
        count, rec = gathers_and_record(inspect="full", trace_max_bytes="24 KiB")
    assert count == gathers_per_step(inspect="metadata")      # nothing gathered
    assert rec.dropped == ["states"] and rec.states == [] and rec.logits is not None
    assert "states dropped: trace budget" in why_no_states(rec, "full")
    roomy = full(trace_max_bytes="200 KiB")      # a step fits: room is made first
    run(roomy)
    assert all(r.states or r.dropped or not r.scheduled for r in roomy.trace)
    assert roomy.trace.host_bytes <= 200 * 1024
    roomy.shutdown()


def test_budget_is_shown_and_trace_bytes_are_split_by_place():
    llm = LLM("tiny-mamba2", **F32, trace_max_bytes="3 MiB")
    run(llm)
    report = llm.memory_report()
    assert report.trace_budget == 3 * 2**20
    assert report.marks["now"]["trace_host"] > 0 and report.marks["now"]["trace_device"] == 0
    assert "trace budget: 3.0 MiB" in repr(report) and "trace budget: 3.0 MiB" in report._repr_html_()
    llm.shutdown()


def test_auto_budget_is_a_quarter_of_available_memory_at_most_2_gib(monkeypatch):
    monkeypatch.setattr(memory_module, "available_host_memory", lambda: 4 * 2**30)
    assert resolve_trace_budget("auto") == 2**30
    monkeypatch.setattr(memory_module, "available_host_memory", lambda: 64 * 2**30)
    assert resolve_trace_budget("auto") == 2 * 2**30
    monkeypatch.setattr(memory_module, "available_host_memory", lambda: None)
    assert resolve_trace_budget("auto") == 2 * 2**30
    assert resolve_trace_budget("1.5 GB") == 1_500_000_000 and resolve_trace_budget("512MiB") == 2**29
    assert resolve_trace_budget(None) is None and resolve_trace_budget(4096) == 4096


@pytest.mark.parametrize("bad", [0, -5, "lots", "0 MiB", True, 1.5])
def test_bad_budgets_are_refused_before_the_model_loads(bad, monkeypatch):
    monkeypatch.setattr("toolkit.llm.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match="trace_max_bytes"):
        LLM("tiny-bamba", **F32, trace_max_bytes=bad)


def test_dropped_parts_survive_save_and_load(tmp_path, unbounded):
    ref, _ = unbounded
    llm = full(trace_max_bytes=sum(sum(s) for s in ref.trace._sizes) // 2)
    run(llm)
    loaded = Trace.load(llm.trace.save(tmp_path / "t"))
    assert [r.dropped for r in loaded] == [r.dropped for r in llm.trace]
    assert loaded.max_bytes == llm.trace.max_bytes and loaded.num_trimmed == llm.trace.num_trimmed
    llm.shutdown()


# ---- capture only what is asked for ------------------------------------------------------------------
def gathers_per_step(**kw) -> int:
    return gathers_and_record(**kw)[0]


def test_only_the_chosen_layers_and_rows_are_gathered():
    base = gathers_per_step(inspect="metadata")
    every = gathers_per_step(inspect="full") - base
    one_layer = gathers_per_step(inspect="full", inspect_layers=[MAMBA_LAYERS[1]]) - base
    by_regex = gathers_per_step(inspect="full", inspect_layers=r"layers\.2\.") - base
    nobody = gathers_per_step(inspect="full", inspect_requests=["nobody"]) - base
    # per layer: conv and ssm state, each gathered before and after the forward
    assert every == 2 * 2 * len(MAMBA_LAYERS)
    assert one_layer == by_regex == 2 * 2
    assert nobody == 0


def test_chosen_requests_get_their_own_rows(unbounded):
    ref, _ = unbounded
    llm = full(inspect_layers=MAMBA_LAYERS[:1], inspect_requests=lambda rid: rid == "1")
    assert llm.inspect_filter == "1 of 2 recurrent layers (model.layers.0.mamba); requests chosen by <lambda>"
    run(llm)
    for rec, kept in zip(llm.trace, ref.trace):
        if "1" not in rec.request_ids:
            assert rec.states == [] or rec.states[0].request_ids == []
            continue
        (st,) = rec.states
        assert st.layer_name == MAMBA_LAYERS[0] and st.request_ids == ["1"]
        want = kept.state(MAMBA_LAYERS[0])
        row = want.request_ids.index("1")
        assert st.slots == [want.slots[row]]
        for mine, theirs in zip(st.after, want.after):
            assert torch.equal(mine[0], theirs[row])
    llm.shutdown()


def test_set_inspect_filter_changes_the_next_steps_and_refuses_bad_values():
    llm = full()
    llm.add_request(PROMPTS[0], GREEDY, request_id="a")
    described = llm.set_inspect_filter(layers=r"layers\.0\.")
    assert described == "1 of 2 recurrent layers (model.layers.0.mamba); every request"
    assert [s.layer_name for s in llm.step().states] == [MAMBA_LAYERS[0]]
    before = llm.inspect_filter
    listing = "matches no recurrent layer; they are: model.layers.0.mamba, model.layers.2.mamba"
    with pytest.raises(ValueError, match=listing):
        llm.set_inspect_filter(layers="mixer")
    with pytest.raises(ValueError, match="'model.layers.1.self_attn' is not a recurrent layer .an attention layer"):
        llm.set_inspect_filter(layers=["model.layers.1.self_attn"])
    with pytest.raises(ValueError, match="not a valid regex"):
        llm.set_inspect_filter(layers="(")
    assert llm.inspect_filter == before                 # a refused filter changes nothing
    with pytest.warns(UserWarning, match="no running or waiting request has id 'z' .they are: a."):
        llm.set_inspect_filter(requests=["z"])
    assert llm.step().states == []                      # no row of the batch is chosen
    llm.set_inspect_filter()
    while llm.has_unfinished_requests():
        llm.step()
    with pytest.warns(UserWarning, match="request 'a' has finished"):
        llm.set_inspect_filter(requests="a")
    llm.shutdown()


def test_capture_choices_belong_to_full_mode(monkeypatch):
    monkeypatch.setattr("toolkit.llm.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match="inspect='full'"):
        LLM("tiny-bamba", **F32, inspect="metadata", inspect_layers=".*")
    with pytest.raises(ValueError, match="inspect_requests=\\[\\]"):
        LLM("tiny-bamba", **F32, inspect="full", inspect_requests=[])


def test_metadata_engine_refuses_a_capture_filter():
    llm = LLM("tiny-bamba", **F32)
    with pytest.raises(ValueError, match="inspect='full'"):
        llm.set_inspect_filter(layers=".*")
    assert llm.inspect_filter is None
    llm.shutdown()


def test_states_are_host_copies_not_views_of_the_cache():
    cache = torch.arange(12.0).view(3, 4)
    copy = to_host(cache[1])
    cache.zero_()
    assert copy.tolist() == [4.0, 5.0, 6.0, 7.0]
    llm = full()
    llm.add_request(PROMPTS[0], GREEDY, request_id="a")
    st = llm.step().states[0]
    slot = st.slots[0]
    cache_ptrs = {t.untyped_storage().data_ptr() for t in llm.model_runner.kv_caches[st.layer_name]}
    assert all(t.device.type == "cpu" and t.untyped_storage().data_ptr() not in cache_ptrs for t in st.after)
    assert torch.equal(st.after[1][0], llm.model_runner.kv_caches[st.layer_name][1][slot])
    llm.shutdown()


def test_recorded_data_lives_in_memory_of_its_own_that_returns_to_the_os():
    import sys

    from toolkit import host
    rows = host.MAPPED_MIN_BYTES // 4096                # 1 MiB of float32: from here up, mapped
    held = host.mapped_empty((rows, 1024), torch.float32)
    held.fill_(2.0)
    assert held.shape == (rows, 1024) and float(held.sum()) == 2.0 * held.numel()
    assert host.mapped_empty((2, 3), torch.bfloat16).shape == (2, 3)   # small ones from the heap
    if sys.platform.startswith("linux"):
        # its own mapping: freeing it unmaps it, whatever the heap around it holds
        assert held.untyped_storage().data_ptr() % 4096 == 0
        assert host._MALLOC_TRIM is not None          # glibc: the trace trims the heap after a drop
    host.release_free_memory()                         # a no-op where there is no malloc_trim
