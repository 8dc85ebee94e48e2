"""A request's output does not depend on how the engine schedules it: greedy requests batched equal
them run alone, `generate` equals stepping by hand, preemption by recompute keeps outputs. On every
preset of ENGINE_PRESETS."""
from __future__ import annotations

import pytest

from harness import ENGINE_PRESETS, F32, MAX_TOKENS, prompts_of, run_by_hand, token_ids
from toolkit import LLM, SamplingParams


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
