"""Inspecting a tensor-parallel engine (issue 27, point 4): rank 0's records hold full states gathered
from every rank (equal to one rank's), each rank's shard can be cut back out (and is what the rank
holds), every rank's metadata is compared each step, `memory_report()` has a row per rank, and the
two tensor-parallel faults are found: a rank whose block table drifts (by the runtime check) and a
Mamba2 group replicated instead of split (silent: by `diff_traces` against one rank).

The engine starts its worker (rank 1) in a spawned process; each engine here is TP=2 on gloo."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from toolkit import LLM, InvariantError, SamplingParams, TensorParallelError
from toolkit.errors import NotSupportedYetError
from toolkit.inspect import faults
from toolkit.inspect.capture import Captured
from toolkit.inspect.ranks import assemble
from toolkit.inspect.trace import Trace
from toolkit.inspect.trace_diff import diff_traces
from toolkit.layers.state_mixer import StateShard
from toolkit.widgets import StateView, panes

PROMPTS = [list(range(5, 26)), list(range(30, 39))]          # a 21-token prompt prefilled in 2 chunks
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)


def generate(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def stepped(preset: str, tp: int, **engine) -> tuple[LLM, list[list[int]]]:
    """An engine (left open) that ran PROMPTS to the end."""
    llm = LLM(preset, tensor_parallel_size=tp, **{**ENGINE, **engine})
    return llm, generate(llm)


class Ran:
    """What a finished engine leaves behind for the tests: its trace and its memory report."""
    def __init__(self, llm: LLM) -> None:
        self.trace, self.memory = llm.trace, llm.memory_report()
        self.model = llm.model_runner.model


# the tests of the pair in one xdist worker: the module fixture (four engines, two of them with ranks)
# is built once, not once per worker
SHARES_PAIR = pytest.mark.xdist_group("tp-inspect-pair")


@pytest.fixture(scope="module")
def mamba2_pair():
    """tiny-mamba2 (8 heads, 2 groups: split over the ranks) in full mode, TP=1 and TP=2 (shut down:
    one tensor-parallel engine at a time per process)."""
    runs = []
    for tp in (1, 2):
        llm, tokens = stepped("tiny-mamba2", tp, inspect="full")
        runs.append((Ran(llm), tokens))
        llm.shutdown()
    assert runs[0][1] == runs[1][1]
    assert not mp.active_children()
    return runs[0][0], runs[1][0]


# Mamba2 groups split; Bamba: Mamba2 with one group replicated on both ranks, and attention;
# Jamba: Mamba1 by channels; LFM2: short conv by channels; Qwen3-Next: GDN by key-head groups
@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-jamba", "tiny-lfm2", "tiny-qwen3-next"])
def test_gathered_states_equal_one_rank(preset):
    one, want = stepped(preset, 1, inspect="full")
    two, got = stepped(preset, 2, inspect="full")
    try:
        assert got == want
        diff = diff_traces(one.trace, two.trace)
        assert diff.identical, str(diff)
        assert diff.num_states_compared > 0
        assert all(not r.violations for r in two.trace)
        # the trace's budget counts a step's gathered (full) states, as with one rank
        assert two._recorder._slot_bytes == one._recorder._slot_bytes
    finally:
        one.shutdown()
        two.shutdown()


@SHARES_PAIR
def test_gathered_states_and_rank_shards(mamba2_pair):
    one, two = mamba2_pair
    diff = diff_traces(one.trace, two.trace)
    assert diff.identical and diff.num_states_compared >= 50, str(diff)
    rec = next(r for r in two.trace if r.states and r.step_index is not None)
    st = rec.states[0]
    rid = st.request_ids[0]
    full = st.of(rid)
    assert st.num_ranks == 2
    shards = [st.of(rid, "after", rank=r) for r in range(2)]
    layer = next(m for m in two.model.modules() if getattr(m, "layer_name", None) == st.layer_name)
    # each rank holds half the heads and, groups split, half the conv channels: [x_r | B_r | C_r]
    assert [tuple(s["ssm_state"].shape) for s in shards] == [(4, 16, 16)] * 2
    assert tuple(full["ssm_state"].shape) == (8, 16, 16)
    assert torch.equal(torch.cat([s["ssm_state"] for s in shards]), full["ssm_state"])
    assert tuple(shards[0]["conv_state"].shape) == layer.state_shapes()[0]       # rank 0's own cache shape
    conv = full["conv_state"]
    index = torch.cat([sh[0].index for sh in st.rank_shards])
    assert sorted(index.tolist()) == list(range(conv.shape[-1]))                 # every channel, once
    with pytest.raises(ValueError, match="ranks 0..1"):
        st.of(rid, "after", rank=2)


def test_each_rank_shard_is_what_the_rank_holds():
    """Mid-run, each rank's shard in the latest record is that rank's state cache at the request's
    slot: rank 0's read here, rank 1's asked of the worker."""
    llm = LLM("tiny-mamba2", tensor_parallel_size=2, inspect="full", **ENGINE)
    try:
        llm.add_request({"prompt_token_ids": PROMPTS[1]}, GREEDY)
        rec = llm.step()
        st = rec.states[0]
        slot = st.slots[0]
        cache = llm.model_runner.kv_caches[st.layer_name]
        for name, t in zip(st.state_names, cache):
            assert torch.equal(st.of(st.request_ids[0], "after", rank=0)[name], t[slot])
        held = llm._executor.ask("state_at", None, st.layer_name, slot)[1]
        assert [tuple(t.shape) for t in held] == [tuple(t.shape[1:]) for t in cache]
        for name, t in zip(st.state_names, held):
            assert torch.equal(st.of(st.request_ids[0], "after", rank=1)[name], t)
    finally:
        llm.shutdown()


@SHARES_PAIR
def test_state_view_shows_a_rank_or_the_gathered_state(mamba2_pair):
    _, two = mamba2_pair
    rec = next(r for r in two.trace if r.states and r.step_index is not None)
    st = rec.states[0]
    rid = st.request_ids[0]
    assert panes.state_ranks(rec) == 2
    assert "gathered from 2 tensor-parallel ranks" in panes.state_caption(rec, st.layer_name, rid)
    assert "rank 1's shard (conv_state [3, 96], ssm_state [4, 16, 16])" in \
        panes.state_caption(rec, st.layer_name, rid, rank=1)
    panels = panes.state_panels(rec, st.layer_name, rid, rank=1)
    assert [name for name, _ in panels] == ["conv_state", "ssm_state"] and all(png for _, png in panels)
    steps, norms = panes.state_norms(two.trace, st.layer_name, rid, rank=1)
    full_steps, full_norms = panes.state_norms(two.trace, st.layer_name, rid)
    assert steps == full_steps and all(a < b for a, b in zip(norms["ssm_state"], full_norms["ssm_state"]))


@SHARES_PAIR
def test_a_sharded_trace_saves_and_loads(mamba2_pair, tmp_path):
    _, two = mamba2_pair
    back = Trace.load(two.trace.save(tmp_path / "tp.trace"))
    rec = next(r for r in back if r.states)
    st = rec.states[0]
    assert st.num_ranks == 2 and st.of(st.request_ids[0], "after", rank=1)["ssm_state"].shape == (4, 16, 16)


@SHARES_PAIR
def test_memory_report_has_a_row_per_rank(mamba2_pair):
    one, two = mamba2_pair
    report = two.memory
    assert len(report.ranks) == 2
    whole = one.memory.marks["now"]
    for row in report.ranks:
        assert 0 < row["weights"] < 0.7 * whole["weights"]
        assert row["state_cache"] == whole["state_cache"] // 2         # half the heads and channels
    assert report.ranks[0]["trace_host"] > 0 and report.ranks[1]["trace_host"] == 0
    assert "per rank, now" in repr(report) and "per rank, now" in report._repr_html_()


def test_every_rank_metadata_compared_and_a_drifting_rank_found():
    """Clean: no violation on any step (the check ran: it compares every step's fingerprints). With
    rank 1 missing later block appends, the step that first reads them raises, naming rank 1, the
    attention group's block table and the entry."""
    llm, _ = stepped("tiny-llama", 2, block_size=8)
    assert all(not r.violations for r in llm.trace)
    llm.shutdown()
    with faults.inject("rank_block_table_differs"):
        llm = LLM("tiny-llama", tensor_parallel_size=2, block_size=8, **ENGINE)
        try:
            with pytest.raises(InvariantError) as err:
                generate(llm)
        finally:
            llm.shutdown()
    hits = [v for v in err.value.violations if v.check == "metadata_equal_on_every_rank"]
    assert hits, str(err.value)
    v = next(v for v in hits if v.field == "block_tables[0]")
    assert "step" in v.where and "rank 1" in v.where and "group 0" in v.where
    assert "vs" in v.message and "rank 1 vs rank 0" in v.message
    assert not mp.active_children()


@SHARES_PAIR
def test_a_mamba2_group_replicated_instead_of_split_is_found_by_diff(mamba2_pair):
    """Silent (no check sees it: every rank is self-consistent); diff_traces against one rank names
    the first request, position and layer state; rank 1's shard is the wrong one, rank 0's is not."""
    one, _ = mamba2_pair
    with faults.inject("mamba2_group_replicated_instead_of_split"):
        bad, _ = stepped("tiny-mamba2", 2, inspect="full")
    try:
        assert all(not r.violations for r in bad.trace)
        diff = diff_traces(one.trace, bad.trace)
        assert not diff.identical and diff.what.startswith("state ") and "mixer" in diff.what
        rec = next(r for r in bad.trace if r.states and r.step_index == diff.step_b)
        ref = next(r for r in one.trace if r.states and r.step_index == diff.step_a)
        layer = diff.what.split()[1].rsplit(".", 1)[0]
        st, want = rec.state(layer), ref.state(layer)
        rid = diff.request_id
        for rank, wrong in ((0, False), (1, True)):
            index = st.rank_shards[rank][1].index           # the rank's heads in the full ssm state
            got = st.of(rid, "after", rank)["ssm_state"]
            assert (not torch.allclose(got, want.of(rid)["ssm_state"][index], atol=1e-4)) == wrong
    finally:
        bad.shutdown()
    assert faults.active() == ()


def test_tensor_parallel_faults_are_catalogued():
    tp = {f.name for f in faults.catalogue() if f.needs == "tensor parallelism"}
    assert tp == {"rank_block_table_differs", "mamba2_group_replicated_instead_of_split"}


def test_full_mode_with_caching_or_speculation_is_refused():
    for extra in ({"enable_prefix_caching": True},
                  {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}):
        with pytest.raises(NotSupportedYetError, match="cold-replay checks"):
            LLM("tiny-bamba", tensor_parallel_size=2, inspect="full", device="cpu", **extra)
    assert not mp.active_children()


def test_a_second_engine_while_one_runs_is_refused():
    llm = LLM("tiny-llama", tensor_parallel_size=2, **ENGINE)
    try:
        with pytest.raises(TensorParallelError, match="still running: shut it down"):
            LLM("tiny-llama", tensor_parallel_size=2, **ENGINE)
        assert generate(llm)                  # the running engine is untouched
    finally:
        llm.shutdown()
    assert not mp.active_children()


@SHARES_PAIR
def test_state_tab_rank_selector(mamba2_pair):
    """The StateView shows a rank selector for a sharded trace (hidden for one rank); choosing a rank
    redraws its shard, "gathered" the full state."""
    one, two = mamba2_pair
    rec = next(r for r in two.trace if r.states and r.step_index is not None)
    view = StateView(two.trace, record=rec)
    assert view.rank.layout.display is None
    assert [label for label, _ in view.rank.options] == ["gathered", "rank 0", "rank 1"]
    assert "gathered from 2 tensor-parallel ranks" in view.note.value
    view.rank.value = 1
    assert "rank 1&#x27;s shard" in view.note.value or "rank 1's shard" in view.note.value
    assert len(view.images.children) == 2
    single = StateView(one.trace, record=next(r for r in one.trace if r.states))
    assert single.rank.layout.display == "none"


def test_workers_end_at_interpreter_exit(tmp_path):
    """A script that leaves its TP engine running exits promptly, and its worker with it."""
    script = tmp_path / "leave_running.py"
    script.write_text("from toolkit import LLM, SamplingParams\n"
                      "import torch.multiprocessing as mp\n"
                      "if __name__ == '__main__':\n"
                      "    llm = LLM('tiny-llama', tensor_parallel_size=2, device='cpu', dtype='float32')\n"
                      "    llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=2))\n"
                      "    print(mp.active_children()[0].pid, flush=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[-1])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _rank_with_its_own_budget(rank: int, world: int, store: str, out: str) -> None:
    """Under a launcher every rank builds its engine itself: here rank 1 with another token budget."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        llm = LLM("tiny-llama", tensor_parallel_size=world, device="cpu", dtype="float32", max_num_seqs=4,
                  max_num_batched_tokens=16 if rank == 0 else 8)
        try:
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
            result = "no error"
        except InvariantError as err:
            result = str(err)
        llm.shutdown()
        Path(out, f"rank{rank}.txt").write_text(result)
    finally:
        dist.destroy_process_group()


def test_ranks_whose_batches_differ_in_size_stop_before_the_forward(tmp_path):
    """Different sizes would make the forward's collectives mismatch (on gloo: a process aborts). With
    checks on, every rank sees the sizes differ and raises before the forward; both processes live."""
    mp.start_processes(_rank_with_its_own_budget, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    rank0, rank1 = ((tmp_path / f"rank{r}.txt").read_text() for r in range(2))
    assert "metadata_equal_on_every_rank" in rank0 and "rank 1" in rank0
    assert "8 vs 16 (rank 1 vs rank 0); stopped before the forward" in rank0     # 8 tokens scheduled, not 16
    assert "other sizes than rank 0's: stopped before the forward" in rank1


def test_assembly_keeps_the_lowest_rank_and_flags_replicas_that_differ():
    """`assemble` in one process: two ranks' conv shards [x_r | B] of a 6-channel state whose last 2
    channels (B) both hold; rank 1's copy of B is off: a violation, and the full state keeps rank 0's."""
    x = torch.arange(12.0).reshape(1, 2, 6)                              # [B=1, K-1=2, channels=6]
    index = [torch.tensor([0, 1, 4, 5]), torch.tensor([2, 3, 4, 5])]
    pieces = [x[..., i].clone() for i in index]
    shards = [{"m": (StateShard(1, i, 6),)} for i in index]
    parts = [Captured(["0"], {"m": [1]}, [("m", [p])]) for p in pieces]
    full, violations = assemble(parts, shards, "step 1")
    assert torch.equal(full.states[0][1][0], x) and not violations
    pieces[1][..., 3] += 1                                               # rank 1's replica of channel 5
    full, violations = assemble([Captured(["0"], {"m": [1]}, [("m", [p])]) for p in pieces], shards, "step 1")
    assert torch.equal(full.states[0][1][0], x)                          # rank 0's copy kept
    assert [(v.check, v.where) for v in violations] == [("replicated_state_equal_on_every_rank", "step 1, m, rank 1")]
