"""Cache mode "all" (`LLM(enable_prefix_caching=True, mamba_cache_mode="all")`): prefill chunks also
save the recurrent state at every block boundary inside them (internal checkpoints), so a request
sharing only part of an earlier prompt hits at the last boundary of the shared part, where "align"
(vLLM's MRV2 mode) has no checkpoint (vLLM #45238). Outputs stay a cold engine's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from toolkit import LLM, SamplingParams
from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.mamba2 import Mamba2MetadataBuilder
from toolkit.attention.short_conv import ShortConvMetadataBuilder
from toolkit.kv_cache_spec import PAD_SLOT_ID

from harness import F32, LOGIT_ATOL, TINY_PRESETS

BS = 16
ENGINE = dict(F32, block_size=BS, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=160,
              trace_capacity=None)
SHARED = list(range(20, 68))                     # 48 tokens: three blocks


def serve(llm: LLM, prompts, params, ids) -> dict[str, tuple[list[int], int]]:
    """Run the prompts one after another; (tokens, cached prompt tokens) by request id."""
    out = {}
    for p, sp, rid in zip(prompts, params, ids, strict=True):
        res = _run(llm, p, sp, rid)
        out[rid] = (list(res.outputs[0].token_ids), res.num_cached_tokens)
    return out


def _run(llm: LLM, prompt, params, rid):
    llm.add_request({"prompt_token_ids": prompt}, params, request_id=rid)
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step().outputs})
    return done[rid]


def workload(llm: LLM) -> dict[str, tuple[list[int], int]]:
    """a: 48 shared + 20 own tokens, one 64-token chunk (boundaries 16, 32, 48 inside it) then 4;
    b: the 48 shared + 20 others; c: a again; d, e: seeded samples after the shared 48 + 1."""
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=5, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]
    a = SHARED + list(range(100, 120))
    prompts = [a, SHARED + list(range(200, 220)), a, SHARED + [90], SHARED + [91]]
    return serve(llm, prompts, [greedy] * 3 + seeded, list("abcde"))


def logits_of(llm: LLM, rid: str) -> list[torch.Tensor]:
    return [rec.logits_of(rid) for rec in llm.trace if rid in rec.kept_token_ids]


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_internal_checkpoints_hit_where_align_cannot_and_outputs_equal_a_cold_engine(preset):
    cold = LLM(preset, **ENGINE)
    warm = LLM(preset, enable_prefix_caching=True, mamba_cache_mode="all", **ENGINE)
    want, got = workload(cold), workload(warm)
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in want.items()}
    for rid in got:
        for x, y in zip(logits_of(warm, rid), logits_of(cold, rid), strict=True):
            assert torch.allclose(x, y, atol=LOGIT_ATOL, rtol=0), (rid, float((x - y).abs().max()))
    # b hits the checkpoint a's first chunk saved at 48 from inside; c the one at a's chunk end (64)
    assert {r: n for r, (_, n) in got.items()} == {"a": 0, "b": 48, "c": 64, "d": 48, "e": 48}


def test_align_mode_misses_where_all_mode_hits():
    """The same two prompts on a hybrid: "align" saves a's state only at its chunk end (64, in its
    own tokens), so b finds attention blocks for 48 tokens but no checkpoint (#45238)."""
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [SHARED + list(range(100, 120)), SHARED + list(range(200, 220))]
    hits = {}
    for mode in ("align", "all"):
        llm = LLM("tiny-bamba", enable_prefix_caching=True, mamba_cache_mode=mode, **ENGINE)
        hits[mode] = [n for _, n in serve(llm, prompts, [greedy] * 2, ["a", "b"]).values()]
        lookup = next(r for r in llm.trace if "b" in r.prefix_lookups).prefix_lookups["b"]
        assert ("stops a chunk at the junction (token 48)" in lookup.reason) == (mode == "align"), lookup.reason
        pages = [e for e in llm.prefix_cache.entries if e.kind == "state page"]
        assert {e.block for e in pages} >= ({0, 1, 2, 3} if mode == "all" else {3}), (mode, pages)
    assert hits == {"align": [0, 0], "all": [0, 48]}


def test_a_hit_on_an_internal_checkpoint_starts_from_the_cold_state():
    """inspect="full": b's starting state (a's internal checkpoint at 48) equals a cold prefill of
    the 48 tokens, within the fp32 tolerance (the oracle ran, and found nothing)."""
    llm = LLM("tiny-mamba", enable_prefix_caching=True, mamba_cache_mode="all", inspect="full", **ENGINE)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    got = serve(llm, [SHARED + list(range(100, 120)), SHARED + list(range(200, 220))], [greedy] * 2, ["a", "b"])
    assert got["b"][1] == 48
    assert list(llm._recorder.cold._cache) == [tuple(SHARED)]
    assert not [v for r in llm.trace for v in r.violations]


def test_a_small_pool_saves_what_it_can_and_outputs_still_equal():
    """Two state pages per row (the minimum): a chunk's boundaries get pages only while the pool
    has free ones, the rest save nothing; hits and outputs stay right."""
    tight = dict(ENGINE, num_state_pages=6)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [SHARED + [70 + i] * (i + 5) for i in range(4)]
    ids = ["p", "q", "r", "s"]
    cold = serve(LLM("tiny-lfm2", **tight), prompts, [params] * 4, ids)
    warm_llm = LLM("tiny-lfm2", enable_prefix_caching=True, mamba_cache_mode="all", **tight)
    warm = serve(warm_llm, prompts, [params] * 4, ids)
    assert {r: t for r, (t, _) in warm.items()} == {r: t for r, (t, _) in cold.items()}
    assert warm["q"][1] == 48 and warm_llm.stats()["prefix_cache_evictions"] > 0


def test_checkpoint_pages_do_not_preempt_what_align_would_not():
    """Pages a prefill chunk's internal checkpoints took are released once registered (cached,
    hittable, evictable), not held until their request's next allocation: a tight pool preempts no
    request that "align" keeps running (it preempted one when they were held), outputs equal align's,
    and a released checkpoint is still hit."""
    tight = dict(F32, block_size=4, max_num_seqs=4, max_num_batched_tokens=24, num_state_pages=8,
                 enable_prefix_caching=True, trace_capacity=None)
    prompts = [[(i * 13 + n) % 200 + 3 for i in range(n)] for n in (7, 25, 21, 28, 15)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("align", "all"):
        llm = LLM("tiny-lfm2", mamba_cache_mode=mode, **tight)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        preempted = sum(len(r.preempted_request_ids) for r in llm.trace)
        # alone, a 25-token prompt saves its checkpoints; run again, it hits the last one (6 blocks)
        again = [llm.generate({"prompt_token_ids": prompts[1]}, params)[0] for _ in range(2)]
        runs[mode] = ([list(o.outputs[0].token_ids) for o in outs], preempted, again[1].num_cached_tokens)
    assert runs["align"][1] == 0 and runs["all"][1] == 0, runs
    assert runs["all"][0] == runs["align"][0]
    assert runs["all"][2] == 24, runs


def _common(query_lens, computed, table) -> CommonAttentionMetadata:
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq = (np.array(computed) + np.array(query_lens)).astype(np.int32)
    t = torch.from_numpy
    return CommonAttentionMetadata(
        query_start_loc=t(qsl), query_start_loc_cpu=t(qsl), seq_lens=t(seq), num_reqs=len(seq),
        num_actual_tokens=int(qsl[-1]), max_query_len=int(max(query_lens)), max_seq_len=int(seq.max()),
        block_table_tensor=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), seq_lens_cpu_upper_bound=t(seq),
        is_prefilling=torch.tensor([q > 1 for q in query_lens]))


def test_builder_lists_every_boundary_inside_each_prefill_chunk():
    """Block size 4. Rows: a decode (none), [2, 11) (boundaries 4 and 8), [0, 4) (4 is its end: none),
    [8, 13) (12, whose column has no page: PAD)."""
    table = [[9, 0, 0, 0], [1, 2, 3, 0], [4, 0, 0, 0], [0, 5, 0, 6]]
    md = ShortConvMetadataBuilder(mamba_block_size=4, prefill_checkpoints=True).build(
        _common([1, 9, 4, 5], [6, 2, 0, 8], table), producer="test")
    assert md.num_decodes == 1
    # prefill tokens: row 1 is 0..8 (token 1 ends at position 4, token 5 at 8), row 3 starts at 13
    assert md.checkpoint_token_index_p.tolist() == [1, 5, 16]
    assert md.checkpoint_slots_p.tolist() == [1, 2, PAD_SLOT_ID]
    plain = ShortConvMetadataBuilder(mamba_block_size=4).build(_common([1, 9, 4, 5], [6, 2, 0, 8], table),
                                                               producer="test")
    assert plain.checkpoint_token_index_p is None and plain.checkpoint_slots_p is None


def test_bad_modes_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="mamba_cache_mode='all' with enable_prefix_caching=False"):
        LLM("tiny-bamba", mamba_cache_mode="all", **F32)
    with pytest.raises(ValueError, match="mamba_cache_mode='every': use None, 'align' or 'all'"):
        LLM("tiny-bamba", enable_prefix_caching=True, mamba_cache_mode="every", **F32)
    with pytest.raises(ValueError, match="chunk_size 16 does not divide the block size 8"):
        Mamba2MetadataBuilder(16, mamba_block_size=8, prefill_checkpoints=True)
    with pytest.raises(ValueError, match=r"Mamba2Mixer\).*every 16 tokens, which does not divide block_size=8"):
        LLM("tiny-mamba2", enable_prefix_caching=True, mamba_cache_mode="all", **dict(ENGINE, block_size=8))
