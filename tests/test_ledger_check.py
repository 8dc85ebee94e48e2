"""`check_ledger` tests each group's books whole (set and array operations) and walks them id by id
only when that test fails: every corruption the walk names must fail the whole test too."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from toolkit.inspect import checks
from toolkit.inspect.checks import _group_books_agree, check_held_not_free, check_ledger, ledger_of
from toolkit.kv_cache_manager import CacheGroupKind, KVCacheManager


def books(caching: bool) -> SimpleNamespace:
    kv = KVCacheManager([CacheGroupKind("attention", 4)], num_kv_blocks=40, num_state_pages=0,
                        enable_prefix_caching=caching)
    for rid in ("a", "b", "c"):
        kv.allocate(rid, 0, 10)                 # 3 blocks each
    return SimpleNamespace(kv=kv, running=[])


def swap_holders(s):            # the pool names b as the holder of a's first block and a of b's: counts agree
    pool, (a0, b0) = s.kv.kv_pool, (s.kv.block_ids("a")[0][0], s.kv.block_ids("b")[0][0])
    pool.holders[a0], pool.holders[b0] = {"b"}, {"a"}


CORRUPTIONS = {
    "null_id_not_live": (False, lambda s: s.kv.block_ids("a")[0].append(0)),
    "no_shared_ids": (False, lambda s: s.kv.block_ids("a")[0].append(s.kv.block_ids("b")[0][0])),
    "held_ids_not_free": (True, lambda s: s.kv.kv_pool._free.__setitem__(s.kv.block_ids("c")[0][1], None)),
    "ref_counts_match_rows": (True, swap_holders),
}


@pytest.mark.parametrize("walk_below", [0, 2048], ids=["arrays-then-walk", "walk"])
@pytest.mark.parametrize("check", list(CORRUPTIONS))
def test_each_corruption_is_named(check, walk_below, monkeypatch):
    monkeypatch.setattr(checks, "WALK_BELOW", walk_below)       # these books hold 9 ids
    caching, corrupt = CORRUPTIONS[check]
    s = books(caching)
    assert check_ledger(s, None, "here") == [] and _group_books_agree(s.kv, 0, s.kv.holdings())
    corrupt(s)
    assert not _group_books_agree(s.kv, 0, s.kv.holdings())        # the whole test fails: the walk runs
    assert check in {v.check for v in check_ledger(s, None, "here")}


def test_a_holder_missing_from_the_pool_and_an_extra_one_are_named():
    s = books(True)
    pool, a0 = s.kv.kv_pool, s.kv.block_ids("a")[0][0]
    pool.holders[a0] = set()                        # a holds it, the pool counts nobody
    assert [v.check for v in check_ledger(s, None, "here")] == ["ref_counts_match_rows"]
    pool.holders[a0] = {"a", "ghost"}               # the pool counts a request that holds nothing
    assert "ghost" in check_ledger(s, None, "here")[0].message


def test_the_check_at_scheduling_names_a_held_page_in_the_free_queue_as_the_ledger_check_does():
    s = books(True)
    assert check_held_not_free(s, "here") == []
    CORRUPTIONS["held_ids_not_free"][1](s)
    want = [v for v in check_ledger(s, None, "here") if v.check == "held_ids_not_free"]
    assert check_held_not_free(s, "here") == want and len(want) == 1


def test_a_records_ledger_shares_the_rows_that_did_not_change():
    s = books(False)
    first = ledger_of(s)
    s.kv.allocate("b", 10, 14)                      # b grows by a block; a and c do not
    second = ledger_of(s, first)
    assert second.holdings["a"][0] is first.holdings["a"][0] and second.holdings["c"][0] is first.holdings["c"][0]
    assert second.holdings["b"][0] is not first.holdings["b"][0] and len(second.holdings["b"][0]) == 4
    assert second.holdings == {rid: [list(ids) for ids in held] for rid, held in s.kv.holdings().items()}
    assert second.holdings["b"][0] is not s.kv.block_ids("b")[0]        # a copy, not the manager's own row


def test_logits_check_names_each_row_with_a_non_finite_value():
    """`check_logits`: every row holding a NaN or an inf is named with its request (a verify row's
    several logits rows map back to it through cu_num_logits); finite logits pass, also where their
    sum overflows (the one-pass test falls back to the per-row one)."""
    import numpy as np
    import torch

    logits = torch.zeros(5, 7)
    assert checks.check_logits(logits, ["a", "b"], "step 0", np.array([0, 2, 5])) == []
    assert checks.check_logits(torch.full((3, 7), 3e38), ["a", "b", "c"], "step 0") == []    # sum is inf
    logits[1, 3] = float("nan")
    logits[4, 0] = float("-inf")
    logits[4, 1] = float("inf")
    found = checks.check_logits(logits, ["a", "b"], "step 0", lambda: np.array([0, 2, 5]))
    assert [(v.check, v.where) for v in found] == [("logits_finite", "step 0, request 'a'"),
                                                   ("logits_finite", "step 0, request 'b'")]
    assert [v.message for v in found] == ["1 non-finite values", "2 non-finite values"]
    one_row_each = checks.check_logits(logits[[1, 4]], ["x", "y"], "step 1")
    assert [v.where for v in one_row_each] == ["step 1, request 'x'", "step 1, request 'y'"]


def test_a_runner_block_table_row_that_differs_from_the_ledger_is_named():
    """check_ledger with the runner: each running request's block-table row against its ledger ids,
    per group (an attention and a Mamba group here); a changed id is named with the request and group."""
    from toolkit import LLM, SamplingParams
    llm = LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=2, checks=False)
    for prompt in ([5, 6, 7, 8, 9], [10, 11, 12]):
        llm.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, ignore_eos=True))
    llm.step()
    llm.step()
    sched, runner = llm.scheduler, llm.model_runner
    assert check_ledger(sched, runner, "here") == []
    idx = runner.req_states.req_id_to_index["1"]
    for g in range(len(sched.kv.groups)):
        table = runner.block_tables.tables[g]
        table[idx, 0] += 1
        (v,) = check_ledger(sched, runner, "here")
        assert (v.check, v.where) == ("block_table_matches_ledger", f"here, request '1', group {g}"), v
        table[idx, 0] -= 1
    assert check_ledger(sched, runner, "here") == []
