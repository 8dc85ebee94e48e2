"""A seeded request's tokens, end to end: each one is the rule toolkit/sampling.py documents,

    token = argmax_v(logits[v] / T + gumbel(seed, position, v)),  position = the index it takes,

applied to HF transformers' logits of the same weights. test_sampling checks the Sampler alone and
test_schedule_independence that schedules agree with each other; this file pins the engine to the
rule itself, so a sampler keyed on the wrong position (or the wrong seed) fails here even when it
is wrong the same way in every schedule."""
from __future__ import annotations

import pytest
import torch

from toolkit import LLM, SamplingParams
from toolkit.kernels.gumbel_ref import gumbel_noise, split_seed

from harness import F32, hf_logits, load_hf, prompts_of, save_model_pair

PROMPT_LENS = [5, 11]
MAX_TOKENS = 6
TEMPERATURE = 0.9
SEED = 2**40 + 12345          # both 32-bit words nonzero


def expected_tokens(hf, prompt: list[int], ours: list[int], seed: int) -> list[int]:
    """The documented rule applied step by step to HF's logits, teacher-forced on `ours`
    (the i-th output token takes position len(prompt) + i)."""
    low, high = split_seed(seed)
    seeds = torch.tensor([[low, high]], dtype=torch.int64)
    logits = hf_logits(hf, prompt + ours[:-1])[len(prompt) - 1:]          # [MAX_TOKENS, V]
    want = []
    for i, row in enumerate(logits):
        noise = gumbel_noise(seeds, torch.tensor([len(prompt) + i]), row.shape[-1])[0]
        want.append(int((row / TEMPERATURE + noise).argmax()))
    return want


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mamba2"])
def test_seeded_tokens_are_the_documented_draw_at_each_position(preset, tmp_path_factory):
    model, folder = save_model_pair(preset, tmp_path_factory)
    hf = load_hf(folder)
    with LLM(model, **F32, max_num_seqs=4) as llm:
        vocab = llm.vocab_size
        prompts = prompts_of(PROMPT_LENS, vocab, seed=3)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=SEED, ignore_eos=True, n=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        for i, child in enumerate(out.outputs):           # child i samples with seed + i
            got = list(child.token_ids)
            assert got == expected_tokens(hf, prompt, got, SEED + i), (preset, len(prompt), i)
        # the two children differ, so the test would see a seed offset that is not applied
        assert out.outputs[0].token_ids != out.outputs[1].token_ids
