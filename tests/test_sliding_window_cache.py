"""Sliding-window attention's KV cache (vLLM's `SlidingWindowSpec` / `SlidingWindowManager`): its
layers form a group of their own with a pool sized for windows; a block wholly before every query's
window goes back to that pool (the row holds the null id there, the ledger counts it) and stays
hittable when registered; a prefix hit needs only the window's blocks before its end. The engine's
outputs do not change, even with the released blocks poisoned."""
from __future__ import annotations

import math

import pytest
import torch

import toolkit.runner.kv_cache as kv_cache
from toolkit import LLM, SamplingParams
from toolkit.kv_cache_manager import CacheGroupKind, KVCacheManager, block_hashes, window_hit
from toolkit.kv_cache_spec import AttentionSpec, SlidingWindowSpec

BS, W = 4, 6
FULL, SLIDING = CacheGroupKind("attention", BS), CacheGroupKind("attention", BS, sliding_window=W, num_blocks=40)


def manager(caching: bool = False) -> KVCacheManager:
    return KVCacheManager([FULL, SLIDING], num_kv_blocks=40, num_state_pages=0, enable_prefix_caching=caching)


# ---- the hit rule -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cached, limit, need, hit", [
    ([1, 1, 1, 1, 1], 5, 2, 5),           # everything cached: the limit
    ([1, 1, 0, 1, 1, 0, 1], 7, 2, 5),     # the rightmost run of 2 ends at block 5
    ([0, 0, 1, 1, 1, 1], 4, 2, 4),        # the limit cuts the run
    ([1, 0, 1, 0, 1, 0], 6, 2, 1),        # no run of 2: the cached blocks from block 0 (1)
    ([0, 1, 0, 1, 0, 1], 6, 2, 0),        # ... none from block 0: no hit
    ([0, 0, 0, 1], 4, 1, 4),              # need 1: the last block alone
    ([0, 0, 0, 0], 3, 0, 3),              # W = 1 needs no cached key: any prefix
])
def test_window_hit_is_vllms_rightmost_run(cached, limit, need, hit):
    assert window_hit([bool(c) for c in cached], limit, need) == hit


# ---- the books ------------------------------------------------------------------------------------
def live(row: list[int]) -> list[int]:
    return [c for c, i in enumerate(row) if i]


def test_blocks_out_of_the_window_go_back_to_the_pool_and_the_full_group_keeps_all():
    kv = manager()
    assert kv.allocate("a", 0, 10) is not None          # a 10-token prefill chunk: blocks 0..2 both groups
    assert kv.block_ids("a")[0] == kv.block_ids("a")[1] != []  # two pools, the same ids handed out first
    n = 10
    while n < 30:                                        # decode: one token a step
        kv.trim_windows("a", n)                          # after the step (the scheduler calls it)
        full, window = kv.block_ids("a")
        first = max(n - W + 1, 0) // BS                  # the first block the query at n reads
        assert live(window) == list(range(first, math.ceil(n / BS)))
        assert live(full) == list(range(math.ceil(n / BS)))
        assert kv.window_pools[1].num_free == 39 - len(live(window))
        assert kv.released_columns("a", 1) == first
        assert kv.allocate("a", n, n + 1) is not None
        n += 1
    kv.free("a")
    assert kv.kv_pool.num_free == kv.window_pools[1].num_free == 39


def test_a_fork_child_holds_the_window_only_and_copies_nothing_out_of_it():
    kv = manager()
    kv.allocate("parent", 0, 13)
    kv.trim_windows("parent", 13)
    new = kv.allocate("child", 13, 14)                   # admitted with the parent's 13 tokens computed
    window = kv.block_ids("child")[1]
    assert new[1] == window and window[:2] == [0, 0] and live(window) == [2, 3]   # first = (13 - 5) // 4
    src = kv.ids_covering("parent", 13)[1]
    assert [s for s, d in zip(src, window) if d] == [kv.block_ids("parent")[1][2], kv.block_ids("parent")[1][3]]


def test_a_sliding_group_never_preempts_when_the_full_group_fits():
    """The window pool of RunnerConfig.num_window_blocks holds every running request's window and a
    step's new tokens: a long decode of 4 requests never runs it dry."""
    from toolkit.config import RunnerConfig
    cfg = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, block_size=BS, num_kv_blocks=None,
                       device=torch.device("cpu"), dtype=torch.float32, seed=0)
    blocks = cfg.num_window_blocks(W)
    assert blocks == 4 * (2 + 2) + 4 + 1 < cfg.num_full_kv_blocks
    kv = KVCacheManager([FULL, CacheGroupKind("attention", BS, W, blocks)], num_kv_blocks=cfg.num_full_kv_blocks,
                        num_state_pages=0)
    computed = dict.fromkeys("abcd", 0)
    for _ in range(60):
        budget = 16
        for rid in computed:
            n = min(budget, 7 if computed[rid] < 40 else 1)
            assert kv.allocate(rid, computed[rid], computed[rid] + n) is not None, (rid, computed)
            budget -= n
            computed[rid] += n
        for rid, n in computed.items():
            kv.trim_windows(rid, n)


def evict(pool, h) -> None:
    """The cached block under hash h is evicted (its id handed out again, as the pool's LRU does)."""
    pool.hash_of.pop(pool.cached.pop(h))


def test_a_released_registered_block_stays_hittable_and_a_hit_needs_only_the_window():
    kv = manager(caching=True)
    tokens = list(range(100, 124))                       # 6 full blocks
    hashes = block_hashes(tokens, BS, [])
    kv.allocate("a", 0, 24)
    kv.cache_computed("a", hashes, 24)
    kv.trim_windows("a", 24)                             # blocks 0..3 released, registered: still cached
    assert live(kv.block_ids("a")[1]) == [4, 5]
    kv.free("a")
    longer = block_hashes(tokens + [1, 2, 3, 4], BS, [])            # the same 6 blocks and one more
    look = kv.lookup(longer, 28)
    assert look.hit_blocks == 6 and look.window_cached == [True] * 6 + [False]
    hit = kv.prefix_hit(look, longer)
    need = -(-(W - 1) // BS)                             # 2: the window's blocks before the hit's end
    window = kv.window_pools[1]
    assert hit.ids[1] == [0] * (6 - need) + [window.cached[h] for h in hashes[6 - need:]]
    assert hit.ids[0] == [kv.kv_pool.cached[h] for h in hashes]
    for h in hashes[:3]:                                 # blocks before the window evicted: the hit stands
        evict(window, h)
    assert kv.lookup(longer, 28).hit_blocks == 6
    evict(window, hashes[4])                             # one inside it: no run of 2 is left, and block 0
    assert kv.lookup(longer, 28).hit_blocks == 0         # is gone: no hit (vLLM's rule)
    assert kv.lookup(longer, 28).window_cached == [False, False, False, True, False, True, False]


# ---- the engine -----------------------------------------------------------------------------------
ENGINE = dict(device="cpu", dtype="float32", block_size=BS, max_num_seqs=3, max_num_batched_tokens=16,
              max_model_len=96)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 200, (n,), generator=g).tolist()} for n in (37, 9, 22)]


def run(llm: LLM, poison: bool = False) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of `prompts()` stepped one by one; per step, the most blocks a running request
    holds in the sliding-window group. poison: after every step, every free block of that group is
    filled with NaN in its layers (a released block read by anyone would turn logits to NaN)."""
    kv = llm.scheduler.kv
    (g,) = kv.window_pools
    layers = llm.model_runner.kv_cache_groups[g].layer_names
    for i, p in enumerate(prompts()):
        llm.add_request(p, GREEDY, request_id=str(i))
    most, outs = [], []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step().outputs if o.finished]
        most.append(max((len(live(held[g])) for _, held in kv.block_ids_by_request()), default=0))
        if poison:
            free = torch.tensor([i for i in range(1, kv.window_pools[g].num_ids) if kv.window_pools[g].is_free(i)])
            for name in layers:
                llm.model_runner.kv_caches[name][free] = float("nan")
    outs.sort(key=lambda o: int(o.request_id))
    return [list(o.outputs[0].token_ids) for o in outs], most


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "prefix-caching"])
def test_lfm3_releases_out_of_window_blocks_and_its_tokens_do_not_change(caching, monkeypatch):
    with LLM("tiny-lfm3", **ENGINE, enable_prefix_caching=caching) as llm:
        groups = llm.model_runner.kv_cache_groups
        full, window = [g for g in groups if g.kind == "attention"]
        assert isinstance(window.spec, SlidingWindowSpec) and window.sliding_window == 4
        assert type(full.spec) is AttentionSpec and window.num_blocks < full.num_blocks
        assert llm.stats()["window_kv_blocks_total"] == window.num_blocks - 1
        released, most = run(llm, poison=True)
        report = llm.memory_report()
        if caching:       # the window pool's registered blocks are listed with the others, by kind
            kinds = {e.kind for e in llm.prefix_cache.entries}
            assert kinds == {"kv block", "kv block (window 4)", "state page"}, kinds
            assert llm.stats()["cached_kv_blocks"] == sum(e.kind.startswith("kv block") for e in
                                                          llm.prefix_cache.entries)
    # between steps a request holds its window's blocks: cdiv(W - 1, bs) + 1 = 2
    assert max(most) <= 2 + math.ceil(16 / BS) and most[-1] <= 2
    monkeypatch.setattr(kv_cache, "make_kv_cache_groups",
                        lambda specs, cfg, release_windows=True: ORIGINAL(specs, cfg, release_windows=False))
    import toolkit.runner.model_runner as model_runner
    monkeypatch.setattr(model_runner, "make_kv_cache_groups", kv_cache.make_kv_cache_groups)
    with LLM("tiny-lfm3", **ENGINE, enable_prefix_caching=caching) as llm:
        assert [g.kind for g in llm.model_runner.kv_cache_groups].count("attention") == 1
        kept = llm.generate(prompts(), GREEDY)
    assert released == [list(o.outputs[0].token_ids) for o in kept]
    assert report is not None


ORIGINAL = kv_cache.make_kv_cache_groups
