"""Scheduler and pools, without a model: budgets, chunking, preemption, abort, leaks."""
import pytest

from toolkit.kv_cache_manager import BlockPool, CacheGroupKind
from toolkit.request import Request, RequestStatus
from toolkit.sampling import SamplingParams
from toolkit.scheduler import ModelRunnerOutput, Scheduler

ATTN = CacheGroupKind("attention", 4)
MAMBA = CacheGroupKind("mamba", 0)


def make_sched(groups=(ATTN, MAMBA), blocks=64, seqs=4, budget=16, max_len=64):
    return Scheduler(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                     groups=list(groups), num_kv_blocks=blocks)


def req(rid, n, max_tokens=4):
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, temperature=0),
                   eos_token_ids=frozenset())


def run_step(s, token=7):
    out = s.schedule()
    return out, s.update_from_output(out, ModelRunnerOutput.one_token_a_row(
        {r: token for r in out.num_scheduled_tokens}))


def test_block_pool_never_hands_out_null_and_tracks_owner():
    pool = BlockPool(4, "kv")
    ids = pool.allocate(3, "a")
    assert sorted(ids) == [1, 2, 3] and pool.num_free == 0
    with pytest.raises(RuntimeError, match=r"held by \['a'\]"):
        pool.free([1], "b")
    pool.free(ids, "a")
    assert pool.num_free == 3


def test_chunked_prefill_respects_budget_and_row_limit():
    s = make_sched(seqs=2, budget=10)
    for i, n in enumerate([25, 3, 4]):
        s.add_request(req(str(i), n))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"0": 10}           # long prompt takes the whole budget
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"0": 10}
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"0": 5, "1": 3}    # last chunk + next prompt
    assert len(s.running) == 2 and len(s.waiting) == 1     # max_num_seqs=2 keeps "2" waiting
    assert out.total_num_scheduled_tokens <= 10


def test_partial_prefill_sample_is_dropped():
    s = make_sched(budget=8)
    s.add_request(req("a", 12))
    _, (finished, kept) = run_step(s)
    assert kept == {} and s.requests["a"].output_token_ids == []
    _, (finished, kept) = run_step(s)
    assert kept == {"a": 7}


def test_new_request_gets_one_state_slot_and_blocks_for_its_chunk():
    s = make_sched(budget=16)
    s.add_request(req("a", 10))
    out = s.schedule()
    new = out.scheduled_new_reqs[0]
    assert len(new.block_ids[0]) == 3 and len(new.block_ids[1]) == 1
    assert 0 not in new.block_ids[0] + new.block_ids[1]


def test_preemption_frees_and_requeues_then_everything_finishes():
    # 5 usable blocks of 4 tokens: two requests of 8 prompt + 8 output cannot both fit
    s = make_sched(blocks=6, seqs=2, budget=32)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8))
    preempted, steps = [], 0
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        preempted += out.preempted_req_ids
        if out.preempted_req_ids:
            assert out.preempted_req_ids[0] in out.finished_req_ids   # runner drops its state
        steps += 1
        assert steps < 100
    assert preempted == ["b"]
    assert s.kv.kv_pool.num_free == 5 and s.kv.state_pool.num_free == 2
    assert s.kv.kv_pool.holders == {} and s.kv.state_pool.holders == {}


def test_resumed_request_reprefills_prompt_and_outputs():
    s = make_sched(blocks=6, seqs=2, budget=32)
    b = req("b", 8, max_tokens=8)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(b)
    outputs_at_preemption, resumed = None, None
    for _ in range(100):
        out, _ = run_step(s)
        if "b" in out.preempted_req_ids:
            outputs_at_preemption = list(b.output_token_ids)
        resumed = next((n for n in out.scheduled_new_reqs if n.req_id == "b" and n is not None
                        and outputs_at_preemption is not None), None)
        if resumed:
            break
    assert outputs_at_preemption, "b should have produced tokens before it was preempted"
    assert resumed.prefill_token_ids == b.prompt_token_ids + outputs_at_preemption
    assert resumed.num_computed_tokens == 0 and b.num_preemptions == 1


def test_abort_frees_everything_and_reports_to_runner():
    s = make_sched()
    s.add_request(req("a", 10))
    s.add_request(req("b", 10))
    run_step(s)
    s.abort_request("a")
    assert s.requests.get("a") is None
    out, _ = run_step(s)
    assert "a" in out.finished_req_ids and "a" not in out.num_scheduled_tokens
    s.abort_request("b")
    assert s.kv.kv_pool.num_free == 63 and s.kv.state_pool.num_free == 4
    assert not s.has_unfinished_requests()


def test_stop_conditions():
    s = make_sched()
    r = Request("a", [3, 4], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[9]),
                eos_token_ids=frozenset({2}))
    s.add_request(r)
    run_step(s, token=5)
    run_step(s, token=9)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5, 9]
    r2 = Request("b", [3], SamplingParams(max_tokens=10, temperature=0), eos_token_ids=frozenset({2}))
    s.add_request(r2)
    run_step(s, token=2)
    assert r2.finish_reason() == "stop"
    r3 = Request("c", [3], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), eos_token_ids=frozenset({2}))
    s.add_request(r3)
    for _ in range(10):
        run_step(s, token=2)
    assert r3.finish_reason() == "length" and len(r3.output_token_ids) == 10
