"""Prefix caching (`LLM(enable_prefix_caching=True)`): the hit rules of kv_cache_manager.py, the
"align" chunking of scheduler.py, and outputs equal to a cold engine's on every preset.

Hit rules (vLLM 0.33.0: `KVCacheManager.get_computed_blocks`, `HybridKVCacheCoordinator`): a hit
is capped at N - 1 tokens; attention hits the longest run of cached full blocks; a Mamba group
needs a checkpoint (a state saved at exactly that block end), searched right to left within the
attention hit; the hit is the minimum over groups.
"""
from __future__ import annotations

import pytest
import torch

from toolkit import LLM, SamplingParams
from toolkit.kv_cache_manager import BlockPool, CacheGroupKind, KVCacheManager, RowTail, block_hashes
from toolkit.request import Request
from toolkit.scheduler import ModelRunnerOutput, Scheduler

from harness import F32, LOGIT_ATOL, TINY_PRESETS

BS = 4
ATTN, MAMBA = CacheGroupKind("attention", BS), CacheGroupKind("mamba", BS)


def scheduler(groups, num_kv_blocks=64, budget=64, seqs=4, pages=None) -> Scheduler:
    return Scheduler(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=128, groups=groups,
                     num_kv_blocks=num_kv_blocks, enable_prefix_caching=True, num_state_pages=pages)


def request(rid: str, tokens, max_tokens: int = 1) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset())


def run_to_end(s: Scheduler, token: int = 7) -> list[dict[str, int]]:
    """Steps until idle; the scheduled tokens of each step."""
    steps = []
    while s.has_unfinished_requests():
        out = s.schedule()
        steps.append(dict(out.num_scheduled_tokens))
        s.update_from_output(out, ModelRunnerOutput.one_token_a_row({r: token for r in out.num_scheduled_tokens}))
    return steps


def hit_of(s: Scheduler, rid: str, tokens) -> int:
    s.add_request(request(rid, tokens))
    req = s.requests[rid]
    s.schedule()
    return req.num_cached_tokens


def test_each_step_registers_only_the_blocks_it_completed(monkeypatch):
    """A long decode registers each full attention block once, when it completes (vLLM's
    cache_full_blocks): register calls grow with the blocks, not with steps x blocks, so the host
    work of a step does not grow with the context. The blocks are hit afterwards all the same."""
    calls = []
    original = BlockPool.register
    monkeypatch.setattr(BlockPool, "register", lambda self, i, h, index: (calls.append(index),
                                                                           original(self, i, h, index)))
    s = scheduler([ATTN])
    s.add_request(request("a", range(10, 19), max_tokens=40))          # 9 prompt tokens, 48 computed
    run_to_end(s)
    assert sorted(calls) == list(range(48 // BS))                    # blocks 0..11, once each
    assert hit_of(s, "b", list(range(10, 19)) + [7] * 39) == 44       # the full blocks within N - 1


# ---- the pool -------------------------------------------------------------------------------------
def test_pool_counts_holders_and_evicts_the_least_recently_freed_cached_id_last_of_all():
    pool = BlockPool(6, "kv")
    a = pool.allocate(3, "a")                       # 1, 2, 3
    for n, (i, h) in enumerate(zip(a, (b"x", b"y", b"z"))):
        pool.register(i, h, n)
    pool.touch([a[0]], "b")                          # b shares block 1 (a prefix hit)
    assert pool.holders[a[0]] == {"a", "b"}
    pool.free(a, "a")                                # 2, 3 free but cached; 1 still held by b
    assert pool.num_free == 4 and a[0] not in pool._free and pool.cached[b"y"] == a[1]
    assert pool.allocate(2, "c") == [4, 5]           # unregistered ids go first
    assert pool.allocate(1, "c") == [a[2]]           # then the cached ids, the prefix's tail first
    assert b"z" not in pool.cached and pool.num_evictions == 1 and pool.cached[b"y"] == a[1]
    with pytest.raises(RuntimeError, match=r"held by \['b'\]"):
        pool.free([a[0]], "a")


def test_hashes_chain_over_the_blocks_before():
    h1 = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS, [])
    h2 = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS, [])
    assert len(h1) == 2 and h1[0] != h2[0] and h1[1] != h2[1]      # same second block, other prefix
    known = h1[:1]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, known) is known and known == h1


# ---- the hit rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize("groups", [[ATTN], [MAMBA], [ATTN, MAMBA]], ids=["attention", "mamba", "hybrid"])
def test_a_resent_prompt_hits_its_last_full_block_before_the_final_token(groups):
    """vLLM #40696: P in {bs-1, bs, bs+1, 2bs+1} hits 0, 0, bs, 2bs (the last token is computed)."""
    for n, want in ((BS - 1, 0), (BS, 0), (BS + 1, BS), (2 * BS + 1, 2 * BS)):
        s = scheduler(groups)
        prompt = list(range(10, 10 + n))
        s.add_request(request("first", prompt))
        run_to_end(s)
        assert hit_of(s, "again", prompt) == want, (n, want)


def test_a_mamba_hit_needs_a_checkpoint_and_is_not_downward_closed():
    """vLLM #45238/#51250: the first request saved its state at 8 only (its last boundary before
    the final token). Requests sharing its first 8 tokens hit 8 everywhere; one sharing only its
    first 7 has block 0 cached for attention (a hit of 4) but no checkpoint at 4 (a hit of 0)."""
    prompt = list(range(10, 19))                                     # 9 tokens: checkpoint at 8
    for groups in ([ATTN], [ATTN, MAMBA], [MAMBA]):
        s = scheduler(groups)
        s.add_request(request("first", prompt))
        run_to_end(s)
        assert hit_of(s, "longer", prompt + [50, 51, 52]) == 8
        assert hit_of(s, "shorter", prompt[:8] + [99]) == 8
        assert hit_of(s, "diverging", prompt[:7] + [99, 98, 97]) == (4 if groups == [ATTN] else 0)


@pytest.mark.parametrize("groups", [[ATTN, MAMBA], [MAMBA]], ids=["hybrid", "mamba"])
def test_the_second_sibling_stops_at_the_shared_prefix_so_the_third_hits(groups):
    """vLLM #45238: A's last checkpoint (12) lies in its own tokens, so B, sharing A's first 8,
    cannot hit; B's prefill stops at the junction (8), saving a checkpoint there, and C hits 8."""
    shared = list(range(10, 18))
    s = scheduler(groups)
    s.add_request(request("A", shared + [50, 51, 52, 53, 54]))
    run_to_end(s)
    s.add_request(request("B", shared + [60, 61, 62, 63, 64]))
    steps = run_to_end(s)
    assert s.kv.stats.hits == 0 and [st["B"] for st in steps] == [8, 4, 1]    # [0,8) [8,12) [12,13)
    assert hit_of(s, "C", shared + [70, 71, 72, 73, 74]) == 8


def test_a_checkpoint_made_this_step_is_hit_only_from_the_next():
    """Hashes are registered after the step that filled them (vLLM registers attention blocks at
    allocation and defers a same-step Mamba hit, #29387): two requests admitted together both compute."""
    s = scheduler([ATTN, MAMBA])
    prompt = list(range(10, 19))
    s.add_request(request("first", prompt, max_tokens=4))
    s.add_request(request("sibling", prompt, max_tokens=4))
    out = s.schedule()                                               # both compute [0, 8)
    assert out.num_scheduled_tokens == {"first": 8, "sibling": 8}
    s.update_from_output(out, ModelRunnerOutput.one_token_a_row({"first": 7, "sibling": 7}))
    assert hit_of(s, "next", prompt) == 8
    assert s.requests["sibling"].num_cached_tokens == 0


def test_align_chunks_end_on_block_boundaries_and_at_the_last_one_before_the_end():
    """vLLM `_mamba_block_aligned_split`: P=23, bs=4. Budget 10: [0,8) [8,16) [16,20) [20,23);
    budget 64: [0,20) [20,23); attention-only engines chunk freely. (max_tokens=1: no decode.)"""
    for groups, budget, want in (([ATTN, MAMBA], 10, [8, 8, 4, 3]), ([MAMBA], 64, [20, 3]),
                                 ([ATTN], 10, [10, 10, 3])):
        s = scheduler(groups, budget=budget)
        s.add_request(request("r", range(10, 33)))
        assert [st["r"] for st in run_to_end(s)] == want


def test_a_block_larger_than_the_budget_still_progresses_and_meets_the_boundary():
    s = scheduler([MAMBA], budget=3, seqs=1)
    s.add_request(request("r", range(10, 20)))                       # 10 tokens, checkpoint at 8
    assert [st["r"] for st in run_to_end(s)] == [3, 1, 3, 1, 2]       # to 3, 4 | 7, 8 | 10


def test_mamba_rows_hold_the_running_page_and_release_the_one_copied_from():
    s = scheduler([MAMBA], budget=4, seqs=1)
    s.add_request(request("r", range(10, 20), max_tokens=3))
    rows = []
    while s.has_unfinished_requests():
        out = s.schedule()
        rows.append(list(s.kv.block_ids("r")[0]))
        s.update_from_output(out, ModelRunnerOutput.one_token_a_row({"r": 7}))
    # chunks [0,4) [4,8) [8,10), decodes at 10, 11: columns 0, 1, 2; a page left behind is released
    # one step later, and stays cached: the checkpoints at 4, 8 and 12
    assert [len(r) for r in rows] == [1, 2, 3, 3, 3]
    assert all(sum(1 for i in r if i) <= 2 and r[-1] for r in rows)
    assert len(s.kv.state_pool.cached) == 3 and not s.kv.state_pool.holders


def test_an_aligned_row_goes_to_the_runner_as_the_columns_a_step_changed():
    """Decoding a long row, each step sends the runner the row from its first changed column on
    (kv_cache_manager.RowTail), never the whole row: at most the previous running column and the new
    one, however long the row; applied to a copy of the row, the tails rebuild the ledger's row."""
    s = scheduler([MAMBA], budget=64, seqs=1)
    s.add_request(request("r", range(10, 74), max_tokens=40))     # 64 prompt tokens: 16 columns of 4
    runner_row: list[int] = []
    widths = []
    while s.has_unfinished_requests():
        out = s.schedule()
        if out.scheduled_new_reqs:
            runner_row = list(out.scheduled_new_reqs[0].block_ids[0])
        for tails in out.scheduled_cached_reqs.new_block_ids:
            tail = tails[0]
            assert isinstance(tail, RowTail)
            runner_row = runner_row[:tail.start] + tail.ids
            widths.append(len(tail.ids))
        ledger = s.kv.block_ids("r")[0] if "r" in s.kv.holdings() else None
        if ledger is not None:
            behind = s.kv.released_columns("r")          # released checkpoint columns: never read again
            assert runner_row[behind:] == ledger[behind:] and len(runner_row) == len(ledger)
        s.update_from_output(out, ModelRunnerOutput.one_token_a_row({"r": 7}))
    # a page when the row crosses into a new block (every 4 tokens), nothing in between
    assert len(widths) >= 39 and max(widths) <= 2 and sum(widths) <= len(widths) // 4 + 2


def test_stats_count_queries_hits_and_skipped_tokens():
    s = scheduler([ATTN])
    prompt = list(range(10, 23))
    s.add_request(request("a", prompt))
    run_to_end(s)
    s.add_request(request("b", prompt))
    run_to_end(s)
    st = s.kv.stats
    assert (st.queries, st.hits, st.prompt_tokens, st.hit_tokens) == (2, 1, 26, 12)


# ---- engines: outputs with the cache equal outputs without it ------------------------------------
SHARED = list(range(20, 33))         # 13 tokens: with block_size 4 the replay boundary is 12
ENGINE = dict(F32, block_size=BS, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64,
              trace_capacity=None)


def serve(llm: LLM, prompts: list[list[int]], params, ids: list[str]) -> list:
    """Run the prompts (with these request ids) to the end; their RequestOutputs in that order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for p, sp, rid in zip(prompts, params, ids, strict=True):
        llm.add_request({"prompt_token_ids": p}, sp, request_id=rid)
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step().outputs})
    return [done[rid] for rid in ids]


def workload(llm: LLM) -> dict[str, tuple[list[int], int]]:
    """(tokens, cached prompt tokens) by request id: a prompt cached, then sent again whole, cut to
    its first 12 tokens (a whole block recomputed), extended, next to an unrelated one; then seeded
    sampling over the shared prefix."""
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    out = serve(llm, [SHARED], greedy, ["a"])
    out += serve(llm, [SHARED, SHARED[:12], SHARED + [40, 41, 42], [7, 8, 9, 10, 11, 12]], greedy,
                 ["b", "c", "d", "e"])
    seeded = [SamplingParams(max_tokens=5, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]
    out += serve(llm, [SHARED + [50 + i] for i in range(2)], seeded, ["f", "g"])
    return {o.request_id: (list(o.outputs[0].token_ids), o.num_cached_tokens) for o in out}


def sampled_logits(llm: LLM, rid: str) -> list[torch.Tensor]:
    return [rec.logits_of(rid) for rec in llm.trace if rid in rec.kept_token_ids]


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_outputs_with_the_prefix_cache_equal_a_cold_engine(preset):
    cold, warm = LLM(preset, **ENGINE), LLM(preset, enable_prefix_caching=True, **ENGINE)
    want, got = workload(cold), workload(warm)
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in want.items()}
    for rid in got:
        for a, b in zip(sampled_logits(warm, rid), sampled_logits(cold, rid), strict=True):
            assert torch.allclose(a, b, atol=LOGIT_ATOL, rtol=0), (rid, float((a - b).abs().max()))
    recurrent = any(g.kind == "mamba" for g in warm.model_runner.kv_cache_groups)
    hits = {r: n for r, (_, n) in got.items()}
    # c (12 tokens) may hit 8: attention has block 2, a Mamba group has no checkpoint at 8
    assert hits == {"a": 0, "b": 12, "c": 0 if recurrent else 8, "d": 12, "e": 0, "f": 12, "g": 12}
    assert all(n == 0 for _, n in want.values())
    st = warm.stats()
    assert st["prompt_tokens_skipped"] == sum(hits.values()) and st["prefix_cache_hits"] == 5 - recurrent


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mamba2", "tiny-bamba", "tiny-lfm2"])
def test_a_small_cache_preempts_and_evicts_and_outputs_still_equal(preset):
    """Three rows, KV blocks for fewer than three full requests and no spare state page: requests
    preempt each other (where there is attention) and resume with hits, and cached blocks and
    checkpoints are evicted; the outputs stay a cold engine's."""
    tight = dict(ENGINE, num_kv_blocks=17, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [SHARED + [60 + i] * (i + 1) for i in range(4)]
    ids = ["p", "q", "r", "s"]
    cold = serve(LLM(preset, **tight), prompts, params, ids)
    warm_llm = LLM(preset, enable_prefix_caching=True, num_state_pages=6, **tight)
    warm = serve(warm_llm, prompts, params, ids)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    preempted = sum(len(r.preempted_request_ids) for r in warm_llm.trace)
    st = warm_llm.stats()
    attention = any(g.kind == "attention" for g in warm_llm.model_runner.kv_cache_groups)
    assert preempted >= attention and st["prefix_cache_hits"] >= 2 and st["prefix_cache_evictions"] > 0, \
        (preempted, st)


def test_n_samples_hit_the_parents_prefix_instead_of_copying_it():
    llm = LLM("tiny-bamba", enable_prefix_caching=True, **ENGINE)
    cold = LLM("tiny-bamba", **ENGINE)
    params = SamplingParams(n=3, max_tokens=4, temperature=0.9, seed=5, ignore_eos=True)
    got = llm.generate({"prompt_token_ids": SHARED}, params)[0]
    want = cold.generate({"prompt_token_ids": SHARED}, params)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert got.num_cached_tokens == 12


def test_bad_values_are_refused_with_their_name():
    with pytest.raises(ValueError, match="enable_prefix_caching='yes'"):
        LLM("tiny-mamba2", enable_prefix_caching="yes", **F32)
    with pytest.raises(ValueError, match="num_state_pages=3: must be an int >= 8"):
        LLM("tiny-mamba2", enable_prefix_caching=True, max_num_seqs=4, num_state_pages=3, **F32)
    pool = KVCacheManager([ATTN], 4, 0, enable_prefix_caching=True)
    assert pool.find_prefix_hit([], 1) is None


def test_the_cache_report_lists_blocks_checkpoints_holders_and_eviction_order():
    llm = LLM("tiny-bamba", enable_prefix_caching=True, **ENGINE)
    assert "prefix caching is off" in repr(LLM("tiny-bamba", **ENGINE).prefix_cache)
    assert "Nothing cached yet" in llm.prefix_cache._repr_html_()
    serve(llm, [SHARED], SamplingParams(max_tokens=2, temperature=0.0), ["a"])
    llm.add_request({"prompt_token_ids": SHARED + [40, 41, 42]}, SamplingParams(max_tokens=3), request_id="b")
    llm.step()                                      # b hit 12 and holds blocks 0-2 and the checkpoint at 12
    report = llm.prefix_cache
    kv = [e for e in report.entries if e.kind == "kv block"]
    pages = [e for e in report.entries if e.kind == "state page"]
    assert [e.block for e in kv] == [0, 1, 2, 3] and kv[0].tokens == (0, 4)   # 0-2 a's, 3 b's own
    assert [e.holders for e in kv] == [["b"]] * 4 and all(e.evict_rank is None for e in kv)
    # a's state after 12: b copied it into its running page, then let it go (cached, first to evict)
    assert pages[0].block == 2 and pages[0].holders == [] and pages[0].evict_rank == 1
    html = report._repr_html_()
    assert "Prefix cache" in html and "[8, 12)" in html and "1 of 2 requests hit" in html
    assert "KV blocks" in repr(report) and "12 prompt tokens skipped" in repr(report)
    while llm.has_unfinished_requests():
        llm.step()
    kv = [e for e in llm.prefix_cache.entries if e.kind == "kv block"]
    assert [e.evict_rank for e in kv] == [4, 3, 2, 1] and not any(e.holders for e in kv)  # the tail first


def test_records_show_the_hits_and_where_each_state_came_from():
    llm = LLM("tiny-bamba", enable_prefix_caching=True, **ENGINE)
    serve(llm, [SHARED], SamplingParams(max_tokens=1, temperature=0.0), ["a"])
    steps_a = list(llm.trace)
    assert steps_a[0].state_copies[0].src_page == 0 and steps_a[0].state_copies[0].from_tokens == 0   # zeroed
    assert [c.from_tokens for r in steps_a for c in r.state_copies] == [0, 12]   # [0,12), then [12,13)
    llm.add_request({"prompt_token_ids": SHARED + [40]}, SamplingParams(max_tokens=1), request_id="b")
    rec = llm.step()
    checkpoint = next(e for e in llm.prefix_cache.entries if e.kind == "state page" and e.block == 2)
    assert rec.prefix_hits == {"b": 12}
    (copy,) = rec.state_copies
    assert (copy.request_id, copy.from_tokens, copy.src_page) == ("b", 12, checkpoint.id)
    assert copy.dst_page not in (0, copy.src_page)
    html = rec._repr_html_()
    assert "Prefix cache" in html
    assert f"page {checkpoint.id} (the checkpoint after 12 tokens, its prefix hit) -&gt; page {copy.dst_page}" in html
    assert rec.prefix_lookups["b"].reason in html      # "hit 12 of 14 tokens: every full block before ..."
    assert rec.prefix_lookups["b"].hit_tokens == 12


def test_a_step_writing_a_cached_page_is_caught():
    """A planted bookkeeping bug: the page a request is about to write is also registered as a
    checkpoint (as if a stale hash had survived a reuse); the check names the request and page."""
    from toolkit.errors import InvariantError
    llm = LLM("tiny-bamba", enable_prefix_caching=True, **ENGINE)
    llm.add_request({"prompt_token_ids": SHARED}, SamplingParams(max_tokens=4), request_id="a")
    llm.step()                                                     # [0, 12): its running page is column 2
    page = llm.scheduler.kv.block_ids("a")[1][-1]
    llm.step()                                                     # [12, 13): a new page, column 3
    running = llm.scheduler.kv.block_ids("a")[1][-1]
    assert running != page
    llm.scheduler.kv.state_pool.register(running, b"stale", 5)
    with pytest.raises(InvariantError, match=rf"cached_ids_not_written.*request 'a'.*writes id {running}"):
        llm.step()


def test_hashes_extended_from_a_requests_tail_equal_hashing_it_whole():
    """The scheduler hashes a filled block from the request's tail (`token_slice`, `offset`), never
    joining its whole prompt and output: the same chain as hashing every token."""
    req = Request("r", list(range(3, 40)), SamplingParams(), frozenset())
    req.output_token_ids = list(range(100, 130))
    whole = block_hashes(req.all_token_ids, 4, [])
    known = block_hashes(req.prompt_token_ids[:13], 4, [])            # 3 blocks hashed before
    start = len(known) * 4
    assert block_hashes(req.token_slice(start, req.num_tokens), 4, known, offset=start) == whole
    assert all(req.token_slice(a, b) == req.all_token_ids[a:b] for a in range(0, 67, 5) for b in range(a, 68, 7))
