"""The runner reproduces HF transformers: greedy tokens and logits, single and batched requests
with chunked prefill and queueing, for every preset and for HF-initialised random models."""
from __future__ import annotations

import pytest

from harness import (BATCH_LIMITS, F32, MAX_TOKENS, PRESETS, check_chunked_mixed_queued_batch_matches_hf,
                     check_single_request_matches_hf, load_hf, prompts_of, run_by_hand, save_model_pair)
from toolkit import LLM, SamplingParams
from toolkit.models import DEMO_MODELS


@pytest.fixture(scope="module", params=PRESETS + [f"hf-random-{p}" for p in PRESETS] + list(DEMO_MODELS))
def model_pair(request, tmp_path_factory):
    """(LLM model argument, HF folder with the same weights)."""
    return save_model_pair(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def hf_model(model_pair):
    return load_hf(model_pair[1])


def test_single_request_matches_hf(model_pair, hf_model):
    with LLM(model_pair[0], **F32) as llm:
        check_single_request_matches_hf(llm, hf_model)


def test_batch_with_chunked_prefill_and_queueing_matches_hf(model_pair, hf_model):
    with LLM(model_pair[0], **F32, **BATCH_LIMITS) as llm:
        check_chunked_mixed_queued_batch_matches_hf(llm, hf_model)


@pytest.mark.parametrize("preset", PRESETS)
def test_batched_equals_alone_and_generate_equals_stepping(preset):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(preset, **F32, max_num_seqs=4, max_num_batched_tokens=20) as llm:
        prompts = prompts_of([9, 31, 2, 14, 26], llm.vocab_size, seed=2)
        batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        alone = [llm.generate({"prompt_token_ids": p}, params)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in alone]
        stepped = run_by_hand(llm, prompts, MAX_TOKENS)
        assert list(stepped.tokens.values()) == [o.outputs[0].token_ids for o in batched]


@pytest.mark.parametrize("preset", PRESETS)
def test_preemption_by_recompute_keeps_outputs(preset):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = prompts_of([20, 20, 20], 320, seed=3)
    with LLM(preset, **F32, max_num_seqs=3) as roomy:
        expected = [o.outputs[0].token_ids for o in
                    roomy.generate([{"prompt_token_ids": p} for p in prompts], params)]
    with LLM(preset, **F32, max_num_seqs=3, block_size=4,
             num_kv_blocks=17) as tight:
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
