"""The prefix lookup recorded at admission (kv_cache_manager.PrefixLookup, `Request.prefix_lookup`,
`StepRecord.prefix_lookups`) and its HTML (inspect/prefix_views.py), on a real run of tiny-bamba
(attention + Mamba2, block size 16), plus the hit rules' lookups on small schedulers.

The run serves, one after the other (max_tokens=2 each):
- "a": 512 tokens (32 blocks), cold: a miss; its chunks [0, 496) [496, 512) leave checkpoints at 496
  and 512;
- "a2": the same prompt: a full hit at a block boundary, 496 tokens (31 blocks: the cap), block 31 past it;
- "b": shares a's first 480 tokens: attention blocks cached for them but no checkpoint (a's lie in
  its own tokens): a miss; b stops a chunk at the junction, 480;
- "c": shares the same 480 tokens: hits b's checkpoint at 480;
- "d": 10 tokens, shorter than a block.
"""
from __future__ import annotations

import re
from html import unescape

import pytest
from test_prefix_caching import request, run_to_end, scheduler

from toolkit import LLM, SamplingParams
from toolkit.inspect.prefix_views import prefix_cache_step_html, why_no_prefix_cache
from toolkit.kv_cache_manager import CacheGroupKind, block_hashes
from toolkit.request import Request

BS = 16
ENGINE = dict(device="cpu", dtype="float32", enable_prefix_caching=True, block_size=BS, max_num_seqs=2,
              max_num_batched_tokens=1024, max_model_len=1024)
SHARED = [(7 * i) % 300 + 10 for i in range(480)]
PROMPTS = {"a": SHARED + [5] * 32, "a2": SHARED + [5] * 32, "b": SHARED + [6] * 40, "c": SHARED + [9] * 40,
           "d": list(range(30, 40))}
CHIP = re.compile(r'class="pc-block pc-(\w+)( pc-checkpoint)?" title="block (\d+): tokens \[(\d+), (\d+)\)')


def serve(llm: LLM, rid: str) -> tuple[list, bool]:
    """Run one request to the end: its step records, and whether the admitting step's record holds
    the very lookup the scheduler left on the request."""
    llm.add_request({"prompt_token_ids": PROMPTS[rid]}, SamplingParams(max_tokens=2, temperature=0.0),
                    request_id=rid)
    records = [llm.step()]
    same = records[0].prefix_lookups[rid] is llm.scheduler.requests[rid].prefix_lookup
    while llm.has_unfinished_requests():
        records.append(llm.step())
    return records, same


@pytest.fixture(scope="module")
def run():
    llm = LLM("tiny-bamba", **ENGINE)
    served = {rid: serve(llm, rid) for rid in PROMPTS}
    yield {rid: recs for rid, (recs, _) in served.items()}, {rid: same for rid, (_, same) in served.items()}
    llm.shutdown()


def lookup_of(run, rid: str):
    return run[0][rid][0].prefix_lookups[rid]


def chips(html: str) -> list[tuple[int, str, bool]]:
    """(block, state, checkpoint mark) of every block chip, in order; checks each chip's token range."""
    out = []
    for state, ckpt, b, lo, hi in CHIP.findall(html):
        assert (int(lo), int(hi)) == (int(b) * BS, (int(b) + 1) * BS)
        out.append((int(b), state, bool(ckpt)))
    return out


# ---- the lookup --------------------------------------------------------------------------------------
def test_the_record_holds_the_lookup_the_scheduler_left_on_the_request(run):
    assert all(run[1].values()), run[1]
    records = run[0]
    for rid, recs in records.items():
        assert list(recs[0].prefix_lookups) == [rid]
        assert all(not r.prefix_lookups for r in recs[1:])          # only the admitting step
    assert lookup_of(run, "a").hashes == [h.hex()[:12] for h in block_hashes(PROMPTS["a"], BS, [])]


def test_a_cold_miss(run):
    lk = lookup_of(run, "a")
    assert (lk.num_tokens, lk.num_blocks, lk.cap_blocks) == (512, 32, 31)
    assert lk.attention_cached == [False] * 32 and lk.checkpoint_cached == [False] * 32
    assert (lk.attention_blocks, lk.hit_blocks, lk.known_blocks, lk.junction) == (0, 0, 0, 0)
    assert lk.reason == "no block of this prompt was computed before"
    assert [lk.block_state(b) for b in range(32)] == ["missing"] * 31 + ["capped"]
    assert run[0]["a"][0].prefix_hits == {}


def test_a_full_hit_at_a_block_boundary_stops_at_the_cap(run):
    lk = lookup_of(run, "a2")
    assert lk.attention_cached == [True] * 32
    assert [b for b, c in enumerate(lk.checkpoint_cached) if c] == [30, 31]    # a's chunk ends, 496 and 512
    assert (lk.cap_blocks, lk.attention_blocks, lk.hit_blocks, lk.hit_tokens) == (31, 31, 31, 496)
    assert [lk.block_state(b) for b in range(32)] == ["hit"] * 31 + ["capped"]
    assert lk.reason == ("hit 496 of 512 tokens: every full block before the last token is cached "
                         "(a hit covers at most N - 1 = 511 tokens)")
    assert run[0]["a2"][0].prefix_hits == {"a2": 496}


def test_the_junction_case_attention_cached_but_no_checkpoint(run):
    lk = lookup_of(run, "b")
    assert lk.attention_cached == [True] * 30 + [False] * 2
    assert lk.checkpoint_cached == [False] * 32
    assert (lk.cap_blocks, lk.attention_blocks, lk.hit_blocks, lk.known_blocks, lk.junction) == (32, 30, 0, 30, 480)
    assert [lk.block_state(b) for b in range(32)] == ["cached"] * 30 + ["missing"] * 2
    assert lk.reason == (
        "attention blocks cached for tokens [0, 480) but no recurrent checkpoint at a block end within "
        "them: the request(s) that computed this prefix saved their state only at their own chunk ends, "
        "which lie past the shared tokens (or those checkpoints were evicted); this request stops a chunk "
        "at the junction (token 480) so the next one can hit")
    first = run[0]["b"][0]
    assert [s.num_tokens for s in first.scheduled] == [480]          # the chunk stopped at the junction


def test_the_next_request_hits_the_checkpoint_the_junction_left(run):
    lk = lookup_of(run, "c")
    assert [b for b, c in enumerate(lk.checkpoint_cached) if c] == [29]
    assert (lk.attention_blocks, lk.hit_blocks, lk.hit_tokens, lk.junction) == (30, 30, 480, 0)
    assert lk.reason == "hit 480 of 520 tokens: the longest prefix with attention blocks and a checkpoint at its end"
    b_resumes = run[0]["b"][1].state_copies[0]                      # b's second chunk read its checkpoint
    (c_reads,) = run[0]["c"][0].state_copies
    assert (b_resumes.from_tokens, c_reads.from_tokens, c_reads.src_page) == (480, 480, b_resumes.src_page)


def test_a_prompt_shorter_than_a_block(run):
    lk = lookup_of(run, "d")
    assert (lk.num_blocks, lk.cap_blocks, lk.hit_blocks) == (0, 0, 0) and lk.hashes == []
    assert lk.reason == ("the prompt has no full block before its last token (a hit covers at most "
                         "N - 1 = 9 tokens; block size 16)")


# ---- the HTML ----------------------------------------------------------------------------------------
def test_the_step_html_colours_each_block_and_says_why(run):
    html = prefix_cache_step_html(run[0]["c"][0])
    assert chips(html) == [(b, "hit", b == 29) for b in range(30)] + [(30, "missing", False), (31, "missing", False)]
    text = unescape(html)
    assert "request 'c': 520 tokens, 32 full blocks of 16; hit 480 tokens (30 blocks, cap 32)" in text
    assert lookup_of(run, "c").reason in text
    copy = run[0]["c"][0].state_copies[0]
    assert f"page {copy.src_page} (the checkpoint after 480 tokens, its prefix hit) -> page {copy.dst_page}" in text


def test_the_step_html_marks_the_junction_the_cap_and_zeroed_states(run):
    html = prefix_cache_step_html(run[0]["b"][0])
    assert chips(html) == [(b, "cached", False) for b in range(30)] + [(30, "missing", False), (31, "missing", False)]
    chip_then_junction = r'title="block (\d+)[^"]*"[^>]*>[^<]*<br>[^<]*</span><span class="pc-junction"[^>]*>(\d+)<'
    marks = re.findall(chip_then_junction, html)
    assert marks == [("29", "480")]                                   # right after the block it ends
    text = unescape(html)
    assert lookup_of(run, "b").reason in text
    assert f"zeroed: from scratch -> page {run[0]['b'][0].state_copies[0].dst_page}" in text
    capped = chips(prefix_cache_step_html(run[0]["a2"][0]))
    assert capped[-1] == (31, "capped", True) and {s for _, s, _ in capped[:-1]} == {"hit"}


def test_the_record_html_prefix_section_gives_the_reason(run):
    text = unescape(run[0]["b"][0]._repr_html_())
    assert "Prefix cache" in text and lookup_of(run, "b").reason in text
    text = unescape(run[0]["d"][0]._repr_html_())
    assert lookup_of(run, "d").reason in text


def test_steps_without_lookups_or_copies_and_engines_without_the_cache_say_so(run):
    later = [r for recs in run[0].values() for r in recs[1:] if not r.state_copies]
    assert later, "a decode inside a block copies no state"
    why = "no request was admitted in this step (the cache is looked up at admission) and no row entered a new block"
    assert why in unescape(prefix_cache_step_html(later[0]))
    assert why_no_prefix_cache(run[0]["c"][0]) is None
    with LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=2) as off:
        off.add_request({"prompt_token_ids": PROMPTS["d"]}, SamplingParams(max_tokens=1))
        rec = off.step()
    assert rec.prefix_lookups["0"].reason == "prefix caching is off" and not rec.state_copies
    assert unescape(prefix_cache_step_html(rec)).count("prefix caching is off: build the engine with "
                                                       "LLM(..., enable_prefix_caching=True)") == 1
    assert "Prefix cache" not in rec._repr_html_()


# ---- the lookup's rules on small schedulers (block size 4) ----------------------------------------------
ATTN, MAMBA = CacheGroupKind("attention", 4), CacheGroupKind("mamba", 4)


@pytest.mark.parametrize("groups", [[ATTN], [MAMBA], [ATTN, MAMBA]], ids=["attention", "mamba", "hybrid"])
def test_find_prefix_hit_is_the_lookups_hit(groups):
    s = scheduler(groups)
    s.add_request(request("first", range(10, 23)))                  # 13 tokens: checkpoints at 12 only
    run_to_end(s)
    for probe in (list(range(10, 23)), list(range(10, 20)) + [99, 98], list(range(10, 17)) + [1, 2, 3], [5, 6]):
        hashes = block_hashes(probe, 4, [])
        hit = s.kv.find_prefix_hit(hashes, len(probe))
        assert (hit.num_tokens if hit else 0) == s.kv.lookup(hashes, len(probe)).hit_tokens, probe


def test_reasons_of_attention_only_and_recurrent_only_models():
    prompt = list(range(10, 23))                                     # 13 tokens: blocks 0-2; checkpoint at 12
    diverging = prompt[:6] + [99] * 7                                # shares block 0 (and 2 tokens of block 1)
    for groups, want in (
            ([ATTN], "hit 4 of 13 tokens: the longest run of cached attention blocks (block 1 is not cached)"),
            ([MAMBA], "tokens [0, 4) were computed before but no recurrent checkpoint is cached at a block end "
                      "within them")):
        s = scheduler(groups)
        s.add_request(request("first", prompt))
        run_to_end(s)
        s.add_request(request("next", diverging))
        s.schedule()
        assert s.requests["next"].prefix_lookup.reason.startswith(want), s.requests["next"].prefix_lookup.reason
    s = scheduler([MAMBA])
    s.add_request(request("first", prompt))
    run_to_end(s)
    s.add_request(request("again", prompt + [7]))
    s.schedule()
    assert s.requests["again"].prefix_lookup.reason == ("hit 12 of 14 tokens: every full block before the last "
                                                        "token is cached (a hit covers at most N - 1 = 13 tokens)")


def test_a_request_with_prompt_logprobs_is_not_searched():
    s = scheduler([ATTN, MAMBA])
    s.add_request(request("first", range(10, 23)))
    run_to_end(s)
    req = Request("logprobs", list(range(10, 23)), SamplingParams(max_tokens=1, prompt_logprobs=1), frozenset())
    s.add_request(req)
    out = s.schedule()
    lk = out.scheduled_new_reqs[0].prefix_lookup
    assert lk is req.prefix_lookup and lk.hit_blocks == 0 and lk.hashes == []
    assert lk.reason.startswith("not searched: the request asks for prompt logprobs")


def test_lookups_survive_a_saved_trace(run, tmp_path):
    from toolkit.inspect import Trace
    records = [r for recs in run[0].values() for r in recs]
    Trace(None, records).save(tmp_path)
    loaded = Trace.load(tmp_path)
    for a, b in zip(records, loaded, strict=True):
        assert b.prefix_lookups.keys() == a.prefix_lookups.keys()
        for rid, lk in a.prefix_lookups.items():
            assert b.prefix_lookups[rid] == lk and b.prefix_lookups[rid].reason == lk.reason
        assert prefix_cache_step_html(b) == prefix_cache_step_html(a)
