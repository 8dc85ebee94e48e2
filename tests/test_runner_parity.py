"""The runner reproduces HF transformers: greedy tokens and logits, single and batched requests
with chunked prefill and queueing, for every preset and for HF-initialised random models."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness import F32, PRESETS, assert_matches_hf, load_hf, run_by_hand
from toolkit import LLM, SamplingParams
from toolkit.models import PRESETS as PRESET_CONFIGS
from toolkit.models import DEMO_MODELS, model_folder, save_hf_folder

MAX_TOKENS = 6
BATCH_PROMPT_LENS = [1, 60, 17, 33, 5]     # 5 requests, 1..60 tokens


def prompts_of(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=PRESETS + [f"hf-random-{p}" for p in PRESETS] + list(DEMO_MODELS))
def model_pair(request, tmp_path_factory):
    """(LLM model argument, HF folder with the same weights)."""
    name = request.param
    if name in DEMO_MODELS:                  # the trained demo models: their shipped folder
        return name, model_folder(name)
    folder = tmp_path_factory.mktemp(name)
    if name.startswith("hf-random-"):
        cfg = PRESET_CONFIGS[name.removeprefix("hf-random-")]()
        torch.manual_seed(1234)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        return str(folder), folder
    with LLM(name, **F32) as llm:
        save_hf_folder(llm, folder)
    return name, folder


@pytest.fixture(scope="module")
def hf_model(model_pair):
    return load_hf(model_pair[1])


def test_single_request_matches_hf(model_pair, hf_model):
    with LLM(model_pair[0], **F32) as llm:
        prompt = prompts_of([23], llm.vocab_size)[0]
        res = run_by_hand(llm, [prompt], MAX_TOKENS)
        rid = next(iter(res.tokens))
        assert_matches_hf(hf_model, prompt, res.tokens[rid], res.logits[rid], MAX_TOKENS)


def test_batch_with_chunked_prefill_and_queueing_matches_hf(model_pair, hf_model):
    with LLM(model_pair[0], **F32, max_num_seqs=3,
             max_num_batched_tokens=24) as llm:
        prompts = prompts_of(BATCH_PROMPT_LENS, llm.vocab_size, seed=1)
        res = run_by_hand(llm, prompts, MAX_TOKENS)
        chunked = any(s.is_prefill and s.num_computed_before > 0       # a prompt's 2nd+ chunk
                      for r in res.records for s in r.scheduled)
        mixed = any(r.num_prefills and r.num_decodes for r in res.records)
        queued = any(len(r.scheduled) < len(prompts) for r in res.records[:2])
        assert chunked and mixed and queued, "the batch must exercise chunking, mixing and queueing"
        for rid, prompt in zip(res.tokens, prompts):
            assert_matches_hf(hf_model, prompt, res.tokens[rid], res.logits[rid], MAX_TOKENS)
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["state_slots_free"] == stats["state_slots_total"]


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
