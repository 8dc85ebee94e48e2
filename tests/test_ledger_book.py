"""The step-by-step ledger audit (inspect/ledger_book.py, what the Recorder runs after each step)
against the whole one (`checks.check_ledger`): on random traffic (preemption, aborts, forks, prefix
caching "align" and "all", sliding windows, speculative decoding) both find nothing at every step; a
bookkeeping fault planted in a pool, the KV manager or the runner's block tables is named by both, the
same violations at the same step; and the step audit looks at what a step changed, not at what the
requests hold."""
from __future__ import annotations

import random

import pytest

from toolkit import LLM, SamplingParams
from toolkit.errors import InvariantError
from toolkit.inspect.checks import check_ledger
from toolkit.inspect.ledger_book import LedgerBook
from toolkit.kv_cache_manager import BlockPool, KVCacheManager
from toolkit.runner.block_table import BlockTables

pytestmark = pytest.mark.xdist_group("ledger_book")

F32 = dict(device="cpu", dtype="float32")
TIGHT = dict(F32, max_num_seqs=4, max_num_batched_tokens=24, block_size=4, num_kv_blocks=24, max_model_len=96)


def key(violations) -> set[tuple[str, str, str]]:
    return {(v.check, v.where, v.message) for v in violations}


@pytest.fixture
def side_by_side(monkeypatch):
    """Each step audit of the Recorder, with the whole audit of the same moment: [(step's, whole's)]."""
    pairs = []
    audit = LedgerBook.audit

    def both(self, where):
        found = audit(self, where)
        pairs.append((found, check_ledger(self.scheduler, self.runner, where)))
        return found
    monkeypatch.setattr(LedgerBook, "audit", both)
    return pairs


def traffic(llm: LLM, seed: int, steps: int = 40, n: int = 1) -> None:
    """Random adds (a burst first: preemption), aborts and steps."""
    rng = random.Random(seed)
    for step in range(steps):
        if step < 3 or (rng.random() < 0.5 and len(llm.scheduler.requests) < 8):
            prompt = [rng.randrange(3, llm.vocab_size) for _ in range(rng.randint(1, 30))]
            if rng.random() < 0.3:
                prompt = [7, 8, 9, 10, 11, 12, 13, 14] + prompt        # a shared prefix: prefix hits
            llm.add_request({"prompt_token_ids": prompt},
                            SamplingParams(max_tokens=rng.randint(1, 10), temperature=0.8, seed=step,
                                           ignore_eos=True, n=n if rng.random() < 0.3 else 1))
        if rng.random() < 0.1 and llm.scheduler.requests:
            llm.abort_request(rng.choice(sorted(llm.scheduler.requests)))
        llm.step()


ENGINES = {
    "bamba": ("tiny-bamba", {}),
    "bamba, caching align": ("tiny-bamba", dict(enable_prefix_caching=True, mamba_cache_mode="align")),
    "lfm2, caching all": ("tiny-lfm2", dict(enable_prefix_caching=True, mamba_cache_mode="all", num_state_pages=16)),
    "lfm3, sliding windows": ("tiny-lfm3", {}),
    "bamba, blocks of 16": ("tiny-bamba", dict(block_size=16)),       # rows that rarely grow
    "bamba, n-gram, caching align": ("tiny-bamba", dict(enable_prefix_caching=True, mamba_cache_mode="align",
                                                        speculative_config={"method": "ngram",
                                                                            "num_speculative_tokens": 2})),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_both_audits_find_nothing_on_random_traffic(engine, side_by_side):
    preset, extra = ENGINES[engine]
    with LLM(preset, **{**TIGHT, **extra}) as llm:
        traffic(llm, seed=len(engine), n=2)
    assert len(side_by_side) >= 40
    assert all(step == [] and whole == [] for step, whole in side_by_side)


# ---- planted faults: (engine, patch) -------------------------------------------------------------
def after(calls: list[int], n: int) -> bool:
    """True once, at the n-th call (calls: a one-item counter)."""
    calls[0] += 1
    return calls[0] == n


def free_keeps_a_holder(mp):                 # the pool forgets to let go of one id: ref counts differ
    free, calls = BlockPool.free, [0]

    def patched(self, ids, holder):
        if self.name == "kv blocks" and len(ids) > 1 and after(calls, 2):
            ids = list(ids)[1:]
        return free(self, ids, holder)
    mp.setattr(BlockPool, "free", patched)


def allocate_hands_out_a_held_id(mp):        # two requests hold one block: no_shared_ids, ref counts
    allocate, calls = BlockPool.allocate, [0]

    def patched(self, n, holder):
        ids = allocate(self, n, holder)
        held = [i for i, h in self.holders.items() if holder not in h]
        if self.name == "kv blocks" and ids and held and after(calls, 3):
            self.holders.pop(ids[0])
            self._free[ids[0]] = None
            ids[0] = held[0]
            self.holders[held[0]].add(holder)
        return ids
    mp.setattr(BlockPool, "allocate", patched)


def touch_leaves_it_free(mp):                # a prefix hit's block stays in the free queue
    touch, calls = BlockPool.touch, [0]

    def patched(self, ids, holder):
        touch(self, ids, holder)
        if self.name == "kv blocks" and ids and after(calls, 1):
            self._free[ids[0]] = None
    mp.setattr(BlockPool, "touch", patched)


def row_gains_the_null_id(mp):               # the KV manager writes 0 into a full-attention row
    allocate, calls = KVCacheManager.allocate, [0]

    def patched(self, req_id, *args, **kwargs):
        out = allocate(self, req_id, *args, **kwargs)
        if out is not None and req_id in self._ids and self._ids[req_id][0] and after(calls, 8):
            self._ids[req_id][0].append(0)
        return out
    mp.setattr(KVCacheManager, "allocate", patched)


def runner_writes_a_wrong_id(mp):            # the runner's block table takes another id than sent
    append, calls = BlockTables.append_block_ids, [0]

    def patched(self, req_idx, block_ids, overwrite):
        append(self, req_idx, block_ids, overwrite)
        if block_ids[0] and isinstance(block_ids[0], list) and after(calls, 5):
            self.tables[0][req_idx, int(self.num_blocks[0][req_idx]) - 1] += 1
    mp.setattr(BlockTables, "append_block_ids", patched)


def pool_frees_a_page_its_row_keeps(mp):    # the KV manager frees a block but leaves it in the row
    allocate, calls = KVCacheManager.allocate, [0]

    def patched(self, req_id, *args, **kwargs):
        out = allocate(self, req_id, *args, **kwargs)
        row = self._ids.get(req_id, [[]])[0]
        if out is not None and len(row) > 1 and after(calls, 8):
            self.kv_pool.free([row[0]], req_id)
        return out
    mp.setattr(KVCacheManager, "allocate", patched)


def runner_drops_a_delta(mp):                # the runner misses the ids a step added to a row
    append, calls = BlockTables.append_block_ids, [0]

    def patched(self, req_idx, block_ids, overwrite):
        if not overwrite and block_ids[0] and after(calls, 3):
            return
        append(self, req_idx, block_ids, overwrite)
    mp.setattr(BlockTables, "append_block_ids", patched)


def runner_applies_a_delta_twice(mp):        # ... and writes them into another request's row as well
    append, calls = BlockTables.append_block_ids, [0]

    def patched(self, req_idx, block_ids, overwrite):
        append(self, req_idx, block_ids, overwrite)
        others = [i for i in range(len(self.num_blocks[0])) if i != req_idx and self.num_blocks[0][i]]
        if not overwrite and block_ids[0] and others and after(calls, 3):
            append(self, others[0], block_ids, overwrite)
    mp.setattr(BlockTables, "append_block_ids", patched)


def update_frees_a_block_its_row_keeps(llm):   # after the step, a block is freed and left in its row
    update, calls, kv = llm.scheduler.update_from_output, [0], llm.scheduler.kv

    def patched(*args, **kwargs):
        out = update(*args, **kwargs)
        held = [(rid, ids[0][0]) for rid, ids in kv.block_ids_by_request() if ids[0]]
        if held and after(calls, 6):
            kv.kv_pool.free([held[0][1]], held[0][0])
        return out
    llm.scheduler.update_from_output = patched


def runner_swaps_two_rows(llm):              # the runner's request rows trade places (a wrong slot)
    update, calls, states = llm.scheduler.update_from_output, [0], llm.model_runner.req_states

    def patched(*args, **kwargs):
        out = update(*args, **kwargs)
        running = [r.request_id for r in llm.scheduler.running if r.request_id in states.req_id_to_index]
        if len(running) > 1 and after(calls, 4):
            a, b = running[:2]
            index = states.req_id_to_index
            index[a], index[b] = index[b], index[a]
        return out
    llm.scheduler.update_from_output = patched


FAULTS = {
    "free keeps a holder": ("bamba", free_keeps_a_holder, {"ref_counts_match_rows"}),
    "allocate hands out a held id": ("bamba", allocate_hands_out_a_held_id, {"no_shared_ids"}),
    "touch leaves it free": ("bamba, caching align", touch_leaves_it_free, {"held_ids_not_free"}),
    "row gains the null id": ("bamba", row_gains_the_null_id, {"null_id_not_live"}),
    "runner writes a wrong id": ("bamba", runner_writes_a_wrong_id, {"block_table_matches_ledger"}),
    # the pool moves, the rows do not (only BlockPool.changed shows it)
    "pool frees a page its row keeps": ("bamba", pool_frees_a_page_its_row_keeps, {"ref_counts_match_rows"}),
    # the ledger row moves, the runner's does not; the runner writes a row whose ledger row stays
    "runner drops a delta": ("bamba", runner_drops_a_delta, {"block_table_matches_ledger"}),
    "runner applies a delta twice": ("bamba", runner_applies_a_delta_twice, {"block_table_matches_ledger"}),
    # planted on the engine (patch(llm)): the pool moves after the step and no row does; only the
    # runner's row index moves
    "update frees a block its row keeps": ("bamba", update_frees_a_block_its_row_keeps,
                                           {"ref_counts_match_rows", "held_ids_not_free"}),
    "runner swaps two rows": ("bamba, blocks of 16", runner_swaps_two_rows, {"block_table_matches_ledger"}),
}
ON_ENGINE = {update_frees_a_block_its_row_keeps, runner_swaps_two_rows}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_planted_fault_is_named_by_both_audits_at_the_same_step(fault, side_by_side, monkeypatch):
    """... and at the step after it, where most are still there: the step audit looks again at what
    it found wrong, as the whole audit looks at everything again. (Each fault fires once.)"""
    engine, plant, wanted = FAULTS[fault]
    preset, extra = ENGINES[engine]
    with LLM(preset, **{**TIGHT, **extra}) as llm:
        plant(llm if plant in ON_ENGINE else monkeypatch)
        with pytest.raises(InvariantError):
            traffic(llm, seed=3, steps=60)
        *clean, (step, whole) = side_by_side
        assert all(s == [] and w == [] for s, w in clean)     # neither saw anything before this step
        assert key(step) == key(whole)
        assert wanted <= {v.check for v in step}
        try:
            llm.step()
        except InvariantError:
            pass
        step, whole = side_by_side[-1]
        assert len(side_by_side) == len(clean) + 2 and key(step) == key(whole)
        assert bool(whole) == (fault not in MENDED_BY_THE_NEXT_STEP)


MENDED_BY_THE_NEXT_STEP = {"runner writes a wrong id"}       # (its request finishes at the next step)


# ---- cost ----------------------------------------------------------------------------------------
def audited_per_decode_step(prompt_len: int) -> tuple[int, int]:
    """(most ids, most runner rows) the step audit looked at in the decode steps of 4 requests (the
    last step left out: the finished requests' ids are audited as they are freed)."""
    counts = []
    audit = LedgerBook.audit

    def counting(self, where):
        found = audit(self, where)
        counts.append(self.audited)
        return found
    LedgerBook.audit = counting
    try:
        with LLM("tiny-bamba", **F32, max_num_seqs=4, block_size=4, max_model_len=1024,
                 max_num_batched_tokens=4 * 400) as llm:          # one prefill step: the rows decode together
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            for r in range(4):
                llm.add_request({"prompt_token_ids": [3 + (r * 7 + i) % 50 for i in range(prompt_len)]}, params)
            while llm.scheduler.requests:
                llm.step()
    finally:
        LedgerBook.audit = audit
    decode = counts[-9:-1]                      # every row decodes
    return max(c[0] for c in decode), max(c[1] for c in decode)


def test_the_step_audit_looks_at_what_changed_not_at_what_is_held():
    """4 rows of 40 and of 400 prompt tokens (10 and 100 blocks each): a decode step audits the same
    handful of ids and rows (a block every 4 tokens per row), not the 40 or 400 blocks they hold."""
    short, long = audited_per_decode_step(40), audited_per_decode_step(400)
    assert long == short, (short, long)
    assert 0 < long[0] <= 4 and 0 < long[1] <= 4, long


# ---- check_metadata's whole-batch compare (the book's arrays) against its row-by-row one ------------
@pytest.fixture
def metadata_side_by_side(monkeypatch):
    """Each check_metadata of the Recorder (with the book's arrays, used for any number of ids), with
    the same check row by row (no book): [(with, without)]."""
    from toolkit.inspect import checks
    monkeypatch.setattr(checks, "WHOLE_TABLE_FROM", 0)
    pairs = []
    check = checks.check_metadata

    def both(*args, book=None, **kwargs):
        found = check(*args, book=book, **kwargs)
        pairs.append((found, check(*args, **kwargs)))
        return found
    monkeypatch.setattr(checks, "check_metadata", both)
    return pairs


def staged_table_off_by_one(mp):             # the batch's block table differs from the runner's rows
    gather, calls = BlockTables.gather_block_tables, [0]

    def patched(self, *args, **kwargs):
        out = gather(self, *args, **kwargs)
        if out[0].shape[0] > 1 and out[0][1, 0] and after(calls, 4):
            out[0][1, 0] += 1
        return out
    mp.setattr(BlockTables, "gather_block_tables", patched)


def window_released_early(mp):               # a block the window still reads leaves the row (and the
    # manager counts it released, so that the ledger audit passes: check_metadata names it)
    trim, calls = KVCacheManager.trim_windows, [0]

    def patched(self, req_id, num_computed):
        trim(self, req_id, num_computed)
        for g in self.window_pools:
            row = self._ids.get(req_id, [[]] * (g + 1))[g]
            live = [c for c, i in enumerate(row) if i]
            if len(live) > 1 and after(calls, 6):
                self.pool(g).free([row[live[0]]], req_id)
                row[live[0]] = 0
                self._window_released_upto[req_id, g] = live[0] + 1
    mp.setattr(KVCacheManager, "trim_windows", patched)


METADATA_FAULTS = {
    "staged table off by one": ("bamba", staged_table_off_by_one, {"block_table_matches_ledger"}),
    "window released early": ("lfm3, sliding windows", window_released_early, {"window_blocks_held"}),
}


@pytest.mark.parametrize("engine", ["bamba", "lfm3, sliding windows", "bamba, caching align"])
def test_the_whole_batch_compare_finds_nothing_where_the_row_compare_finds_nothing(engine, metadata_side_by_side):
    preset, extra = ENGINES[engine]
    with LLM(preset, **{**TIGHT, **extra}) as llm:
        traffic(llm, seed=5, n=2)
    assert len(metadata_side_by_side) >= 30
    assert all(w == [] and wo == [] for w, wo in metadata_side_by_side)


@pytest.mark.parametrize("fault", list(METADATA_FAULTS))
def test_a_wrong_batch_table_is_named_as_the_row_compare_names_it(fault, metadata_side_by_side, monkeypatch):
    engine, plant, wanted = METADATA_FAULTS[fault]
    preset, extra = ENGINES[engine]
    with LLM(preset, **{**TIGHT, **extra}) as llm:
        plant(monkeypatch)
        with pytest.raises(InvariantError):
            traffic(llm, seed=3, steps=60)
    *clean, (found, row_by_row) = metadata_side_by_side
    assert all(w == [] and wo == [] for w, wo in clean)
    assert key(found) == key(row_by_row) and wanted <= {v.check for v in found}


def test_a_pool_that_moves_alone_is_audited():
    """A step where no row changed and the runner wrote nothing, but a pool's method moved an id:
    the audit does not take the quick way out (the whole audit's violations, no fewer)."""
    from types import SimpleNamespace

    from toolkit.kv_cache_manager import CacheGroupKind
    kv = KVCacheManager([CacheGroupKind("attention", 4)], num_kv_blocks=40, num_state_pages=0)
    for rid in ("a", "b", "c"):
        kv.allocate(rid, 0, 10)
    sched = SimpleNamespace(kv=kv, running=[])
    book = LedgerBook(sched)
    book.refresh()
    assert book.audit("here") == [] and book.audited[0] == 9
    book.refresh()
    assert book.audit("here") == [] and book.audited == (0, 0)       # nothing moved
    kv.kv_pool.free([kv.block_ids("a")[0][0]], "a")                   # the pool moves; a's row does not
    book.refresh()
    found = book.audit("here")
    assert {v.check for v in found} == {"ref_counts_match_rows", "held_ids_not_free"}
    assert key(found) == key(check_ledger(sched, None, "here"))
