"""A request's output does not depend on how the engine schedules it: greedy requests batched equal
them run alone, `generate` equals stepping by hand, preemption by recompute keeps outputs; a seeded
request's tokens do not depend on the token budget (chunking), its batch, warmup or preemption, and
warmup does not shift the seeds unseeded requests derive. On every preset of ENGINE_PRESETS."""
from __future__ import annotations

import pytest

from toolkit import LLM, SamplingParams

from harness import ENGINE_PRESETS, F32, MAX_TOKENS, prompts_of, run_by_hand, run_to_completion, small_llm, token_ids

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(3, 40))}
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)


@pytest.mark.parametrize("preset", ENGINE_PRESETS)
def test_batched_equals_alone_and_generate_equals_stepping(preset):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(preset, **F32, max_num_seqs=4, max_num_batched_tokens=20) as llm:
        prompts = prompts_of([9, 31, 2, 14, 26], llm.vocab_size, seed=2)
        batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        alone = [llm.generate({"prompt_token_ids": p}, params)[0] for p in prompts]
        assert token_ids(batched) == token_ids(alone)
        stepped = run_by_hand(llm, prompts, MAX_TOKENS)
        assert list(stepped.tokens.values()) == token_ids(batched)


@pytest.mark.parametrize("preset", ENGINE_PRESETS)
def test_preemption_by_recompute_keeps_outputs(preset):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = prompts_of([20, 20, 20], 320, seed=3)
    with LLM(preset, **F32, max_num_seqs=3) as roomy:
        expected = token_ids(roomy.generate([{"prompt_token_ids": p} for p in prompts], params))
    with LLM(preset, **F32, max_num_seqs=3, block_size=4, num_kv_blocks=17) as tight:
        ids = [tight.add_request({"prompt_token_ids": p}, params) for p in prompts]
        outs, preempted = {}, []
        while tight.has_unfinished_requests():
            rec = tight.step()
            preempted += rec.preempted_request_ids
            outs.update({o.request_id: o.outputs[0].token_ids for o in rec.outputs})
        if tight.stats()["kv_blocks_total"]:     # attention-free models have no KV blocks to run out of
            assert preempted, "16 blocks of 4 tokens cannot hold 3 x 32 tokens"
        assert [outs[i] for i in ids] == expected
        stats = tight.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("preset", ENGINE_PRESETS)
def test_seeded_tokens_ignore_chunk_budget_batch_warmup_and_preemption(preset):
    with small_llm(preset, max_num_batched_tokens=512, max_num_seqs=16) as llm:
        expected = token_ids(llm.generate([PROMPT], SEEDED))[0]
    for budget in (16, 5, 4):
        with small_llm(preset, max_num_batched_tokens=budget) as llm:
            assert token_ids(llm.generate([PROMPT], SEEDED))[0] == expected, f"budget {budget}"
    with small_llm(preset, max_num_batched_tokens=16) as llm:      # warmed up, in a batch
        llm.warmup(progress=False)
        others = [SamplingParams(max_tokens=6, temperature=1.0), GREEDY,
                  SamplingParams(max_tokens=9, temperature=0.7, seed=1)]
        outs = llm.generate([{"prompt_token_ids": [7, 8]}, PROMPT, {"prompt_token_ids": [9] * 20},
                             {"prompt_token_ids": [4, 5, 6]}], [others[0], SEEDED, others[1], others[2]])
        assert outs[1].outputs[0].token_ids == expected
    with small_llm(preset, max_num_batched_tokens=16) as llm:      # preempted mid-decode, resumed
        rid = llm.add_request(PROMPT, SEEDED)
        for _ in range(6):
            llm.step()
        req = llm.scheduler.requests[rid]
        assert 0 < len(req.output_token_ids) < 8
        llm.scheduler._preempt(req)
        assert run_to_completion(llm)[rid].outputs[0].token_ids == expected


def test_preemption_from_a_tight_kv_cache_keeps_seeded_tokens():
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + i))} for i in range(4)]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    with small_llm("tiny-bamba") as roomy:
        expected = token_ids(roomy.generate(prompts, params))
    with small_llm("tiny-bamba", block_size=4, num_kv_blocks=20, max_num_batched_tokens=16) as tight:
        ids = [tight.add_request(p, sp) for p, sp in zip(prompts, params)]
        outs, preempted = {}, 0
        while tight.has_unfinished_requests():
            rec = tight.step()
            preempted += len(rec.preempted_request_ids)
            outs.update({o.request_id: o for o in rec.outputs})
        assert preempted > 0
        assert [outs[i].outputs[0].token_ids for i in ids] == expected


def test_warmup_does_not_shift_unseeded_requests():
    unseeded = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    with small_llm("tiny-mamba2") as cold:
        expected = token_ids(cold.generate([PROMPT, PROMPT], unseeded))
    with small_llm("tiny-mamba2") as warm:
        warm.warmup(progress=False)
        assert token_ids(warm.generate([PROMPT, PROMPT], unseeded)) == expected
    assert expected[0] != expected[1]          # two arrivals, two derived seeds
