"""Random add / abort / step sequences on a real engine with a tight KV cache (so preemption
happens), checking the bookkeeping after every step and the outputs at the end."""
from __future__ import annotations

import random

import pytest

from toolkit import LLM, SamplingParams


def check_invariants(llm: LLM, rec) -> None:
    sched, runner = llm.scheduler, llm.model_runner
    assert rec.num_tokens <= llm.cfg.max_num_batched_tokens
    assert len(rec.scheduled) <= llm.cfg.max_num_seqs and len(sched.running) <= llm.cfg.max_num_seqs
    for pool in (sched.kv.kv_pool, sched.kv.state_pool):
        assert 0 not in pool.holders, f"{pool.name}: the null id was handed out"
        assert pool.num_free + len(pool.holders) == pool.num_total, f"{pool.name}: ids leaked"
        assert set().union(*pool.holders.values()) <= {r.request_id for r in sched.running}, \
            f"{pool.name}: ids held by requests that are not running"
    for req in sched.running:                    # the runner's block-table rows mirror the pools
        idx = runner.req_states.req_id_to_index[req.request_id]
        for g, ids in enumerate(sched.kv.block_ids(req.request_id)):
            held = runner.block_tables.tables[g][idx, :runner.block_tables.num_blocks[g][idx]]
            assert held.tolist() == ids, f"{req.request_id}: group {g} table {held.tolist()} != {ids}"
        if any(g.kind == "mamba" for g in sched.kv.groups):
            assert len(sched.kv.block_ids(req.request_id)[-1]) == 1, "one state page per request"
    mamba = [g for g in rec.attn_metadata if g.kind == "mamba"]
    if mamba:                                    # decode rows lead the batch (then padded rows)
        md = mamba[0].metadata
        runs_as_decode = [s.num_tokens == 1 and s.num_computed_before > 0 for s in rec.scheduled]
        padded = (rec.padded_size or len(rec.scheduled)) - len(rec.scheduled)
        assert runs_as_decode == [True] * (md.num_decodes - padded) + [False] * md.num_prefills
        if padded:
            assert md.state_indices_tensor_d[-padded:].tolist() == [0] * padded, "padded rows on slot 0"


@pytest.mark.parametrize("preset, seed", [("tiny-bamba", 0), ("tiny-jamba", 1), ("tiny-lfm2", 2),
                                          ("tiny-mamba2", 3), ("tiny-nemotron-h", 4), ("tiny-bamba", 7)])
def test_random_engine_traffic_keeps_books_and_outputs(preset, seed):
    """Seed 7 runs decode batches padded to CUDA-graph sizes (padded_eager, 5 rows: sizes 1, 2, 4, 5)."""
    rng = random.Random(seed)
    padded = seed == 7
    with LLM(preset, device="cpu", dtype="float32", max_num_seqs=5 if padded else 3, max_num_batched_tokens=20,
             block_size=4, num_kv_blocks=16, max_model_len=96,
             cudagraph_mode="padded_eager" if padded else "none") as llm:
        prompts, params, outputs, aborted, preempted, padded_steps = {}, {}, {}, set(), 0, 0
        for step in range(60):
            if step < 3 or (rng.random() < 0.5 and len(prompts) < 14):   # a burst first: preemption
                prompt = [rng.randrange(3, llm.vocab_size) for _ in range(rng.randint(1, 40))]
                p = SamplingParams(max_tokens=rng.randint(1, 10), temperature=0.0, ignore_eos=True)
                rid = llm.add_request({"prompt_token_ids": prompt}, p)
                prompts[rid], params[rid] = prompt, p
            if rng.random() < 0.12 and llm.scheduler.requests:
                victim = rng.choice(sorted(llm.scheduler.requests))
                llm.abort_request(victim)
                aborted.add(victim)
            rec = llm.step()
            check_invariants(llm, rec)
            outputs.update({o.request_id: o for o in rec.outputs})
            preempted += len(rec.preempted_request_ids)
            padded_steps += rec.padded_size is not None and rec.padded_size > len(rec.scheduled)
        while llm.has_unfinished_requests():
            rec = llm.step()
            check_invariants(llm, rec)
            outputs.update({o.request_id: o for o in rec.outputs})
            preempted += len(rec.preempted_request_ids)
            padded_steps += rec.padded_size is not None and rec.padded_size > len(rec.scheduled)
        assert aborted, "the traffic should include aborts"
        if padded:
            assert padded_steps, "the traffic should pad decode batches"
        if llm.stats()["kv_blocks_total"]:
            assert preempted, "15 usable blocks of 4 tokens should run out under this traffic"
        llm.step()                               # the runner drops the last finished rows
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["state_pages_free"] == stats["state_pages_total"]
        assert stats["runner_rows_in_use"] == 0
        assert set(outputs) == set(prompts) - aborted
        for rid, out in outputs.items():          # each survivor equals its run alone
            alone = llm.generate({"prompt_token_ids": prompts[rid]}, params[rid])[0]
            assert out.outputs[0].token_ids == alone.outputs[0].token_ids, rid
