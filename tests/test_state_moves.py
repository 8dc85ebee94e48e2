"""Prefix caching's Mamba rows ("align"): the scheduler's KV manager alone books where a row's state
is and plans its moves (SchedulerOutput.state_moves); the runner carries them out and reports, after
a verify step, where the state went (ModelRunnerOutput.state_offsets)."""
from __future__ import annotations

import pytest

from toolkit import LLM, SamplingParams
from toolkit.kv_cache_manager import CacheGroupKind, KVCacheManager, StateMoves

BS = 4


def manager(k: int = 2) -> KVCacheManager:
    return KVCacheManager([CacheGroupKind("mamba", BS)], num_kv_blocks=0, num_state_pages=32,
                          enable_prefix_caching=True, state_columns=1 + k)


def moves_of(kv: KVCacheManager, *req_ids: str) -> list[tuple[str, int, int, int]]:
    m = kv.take_state_moves(req_ids)
    return list(zip(m.req_ids, m.from_tokens, m.src, m.dst))


def test_a_row_moves_when_its_running_column_does_and_from_the_offset_it_was_told():
    kv = manager()
    kv.allocate("a", 0, 3)                      # a fresh prefill: its column 0 page is zeroed
    row = kv.block_ids("a")[0]
    assert moves_of(kv, "a") == [("a", 0, 0, row[0])]
    kv.allocate("a", 3, 4)                      # still in block 0: no move
    assert moves_of(kv, "a") == []
    kv.allocate("a", 4, 7, num_drafts=2)        # a verify row of 2 drafts: running column 1
    row = kv.block_ids("a")[0]
    assert moves_of(kv, "a") == [("a", 4, row[0], row[1])]
    kv.set_state_offsets(["a"], {"a": 1})       # it kept 2 tokens: the state is in column 1 + 1
    kv.allocate("a", 6, 9, num_drafts=2)        # running column 2: copied from column 2 (already there)
    row = kv.block_ids("a")[0]
    assert moves_of(kv, "a") == [("a", 6, row[2], row[2])]
    kv.set_state_offsets(["a"], {})             # kept 1: column 2 + 0
    kv.allocate("a", 7, 13, num_drafts=2)       # running column 3, from column 2
    row = kv.block_ids("a")[0]
    assert moves_of(kv, "a") == [("a", 7, row[2], row[3])]


def test_only_the_steps_scheduled_requests_move_and_a_freed_one_forgets_its_books():
    kv = manager()
    kv.allocate("a", 0, 4)
    kv.allocate("b", 0, 4)
    kv.free("b")                                 # e.g. preempted later in the same schedule()
    assert [m[0] for m in moves_of(kv, "a", "b")] == ["a"]
    assert kv.take_state_moves(["a"]) == StateMoves()       # taken once


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_the_engine_runs_the_schedulers_plan_and_keeps_no_column_books(method):
    """tiny-mamba2 with prefix caching and speculation: every step's recorded state copies are the
    SchedulerOutput's moves, and the model state holds no running columns of its own."""
    spec = ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
            if method == "ngram" else {"method": "draft_model", "model": "tiny-mamba2", "num_speculative_tokens": 2})
    llm = LLM("tiny-mamba2", device="cpu", dtype="float32", block_size=4, max_num_seqs=2,
              max_num_batched_tokens=64, enable_prefix_caching=True, speculative_config=spec)
    planned = []
    schedule = llm.scheduler.schedule

    def keep(*a, **kw):
        out = schedule(*a, **kw)
        planned.append(out.state_moves)
        return out
    llm.scheduler.schedule = keep
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5]
    for i in range(2):
        llm.add_request({"prompt_token_ids": prompt[i:]}, SamplingParams(max_tokens=12, ignore_eos=True))
    recorded = []
    while llm.has_unfinished_requests():
        recorded.append(llm.step().state_copies)
    assert len(planned) == len(recorded)
    moved = 0
    for plan, copies in zip(planned, recorded):
        assert [(c.request_id, c.from_tokens, c.src_page, c.dst_page) for c in copies] == \
            list(zip(plan.req_ids, plan.from_tokens, plan.src, plan.dst))
        moved += len(copies)
    assert moved > 4                             # rows crossed several blocks
    assert not hasattr(llm.model_runner.model_state, "state_column")
    llm.shutdown()
