"""SamplingParams' logits processors (repetition / presence / frequency penalties, min_p, logit_bias,
allowed_token_ids, bad_words) against transformers' processors on the same logits, and through the
engine: each token equals the processors applied to the step's raw logits with the request's
history, and the tokens do not change with batching, chunked prefill, preemption, prefix caching or
n-gram speculation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from toolkit import LLM, SamplingParams
from toolkit.errors import InvalidRequestError
from toolkit.runner.logits_processors import apply_min_p
from toolkit.runner.sampler import LogitsRows, Sampler
from toolkit.sampling import tokenize_bad_words

from harness import ScriptedProposer

CPU = torch.device("cpu")
V = 40


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    # positive and negative logits (the repetition penalty divides one, multiplies the other)
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _processed(params: SamplingParams, prompt: list[int], outputs: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The sampler's processing of one row whose request has these prompt and output tokens."""
    sampler = Sampler(2, CPU, vocab_size=V)
    sampler.add_request(1, params, 0, len(prompt), token_ids=prompt + outputs)
    position = len(prompt) + len(outputs)
    history = prompt + outputs
    rows = LogitsRows(np.array([1]), None, torch.tensor([position]), np.array([position]), np.array([True]),
                      last_outputs=lambda i, n: history[max(len(prompt), position - n):position])
    return sampler.process(logits, rows)


PROMPT, OUTPUTS = [3, 5, 5, 7, 9], [11, 5, 11, 11, 2, 30]


def test_repetition_penalty_equals_transformers():
    logits = _logits(1)
    for penalty in (1.3, 0.7):
        got = _processed(SamplingParams(repetition_penalty=penalty), PROMPT, OUTPUTS, logits)
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + OUTPUTS]), logits.clone())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert not torch.equal(got, logits)


def test_presence_and_frequency_penalties_count_the_output_only():
    logits = _logits(1, 1)
    got = _processed(SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25), PROMPT, OUTPUTS, logits)
    counts = torch.bincount(torch.tensor(OUTPUTS), minlength=V).float()
    want = logits - 0.5 * (counts > 0) + 0.25 * counts       # OpenAI's and vLLM's definition
    torch.testing.assert_close(got, want[None] if want.dim() == 1 else want, rtol=0, atol=1e-5)
    assert got[0, 3] == logits[0, 3]                          # a prompt-only token is untouched


def test_min_p_equals_transformers():
    scaled = _logits(3, 2) / 0.7
    for min_p in (0.05, 0.3):
        got = apply_min_p(scaled, torch.full((3,), min_p))
        want = MinPLogitsWarper(min_p)(torch.zeros(3, 1, dtype=torch.long), scaled.clone())
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got[torch.isfinite(got)], scaled[torch.isfinite(got)])


def test_logit_bias_allowed_ids_and_bad_words_equal_transformers():
    logits = _logits(1, 3)
    ids = torch.tensor([PROMPT + OUTPUTS])
    got = _processed(SamplingParams(logit_bias={4: 5.0, 11: -2.5}), PROMPT, OUTPUTS, logits)
    want = SequenceBiasLogitsProcessor({(4,): 5.0, (11,): -2.5})(ids, logits.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    allowed = [2, 8, 17]
    got = _processed(SamplingParams(allowed_token_ids=allowed), PROMPT, OUTPUTS, logits)
    want = PrefixConstrainedLogitsProcessor(lambda batch, seq: allowed, 1)(ids, logits.clone())
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[:, allowed], logits[:, allowed])

    # [30, 8]: its prefix ends the output, so 8 is banned; [2, 19]: 2 does not end it; [6]: always
    words = [[30, 8], [2, 19], [6]]
    params = SamplingParams(bad_words=["x"])
    object.__setattr__(params, "_bad_words_token_ids", words)
    got = _processed(params, PROMPT, OUTPUTS, logits)
    want = NoBadWordsLogitsProcessor(words, eos_token_id=None)(ids, logits.clone())
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(got[0, [8, 6]]).all()
    assert torch.isfinite(got[0, 19])


def test_bad_words_are_tokenized_as_vllm_does():
    vocab = {"bad": [50], " bad": [51], "two words": [60, 61], " two words": [62, 61], "x y": [70, 71],
             " x y": [72, 73, 74]}
    params = SamplingParams(bad_words=["bad", " two words", "x y"])
    tokenize_bad_words(params, lambda text: vocab[text])
    # a spaced variant is added when it starts with another token and has the same length
    assert params.bad_words_token_ids == [[50], [51], [60, 61], [62, 61], [70, 71]]


def test_a_verify_rows_positions_count_the_drafts_before_them():
    """Logits row j of a verify row sees the counts of the output plus drafts 0..j-1 (they precede
    its position), exactly as a one-token row whose output holds those drafts."""
    drafts = [11, 30, 11]
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    logits = _logits(len(drafts) + 1, 4)
    sampler = Sampler(1, CPU, vocab_size=V)
    sampler.add_request(0, params, 0, len(PROMPT), token_ids=PROMPT + OUTPUTS)
    start = len(PROMPT) + len(OUTPUTS)
    rows = LogitsRows(np.zeros(4, dtype=np.int64), torch.zeros(4, dtype=torch.long), torch.arange(4) + start,
                      np.arange(4) + start, np.ones(4, dtype=bool), drafts=torch.tensor(drafts + [-1]), max_drafts=3)
    got = sampler.process(logits, rows)
    for j in range(4):
        want = _processed(params, PROMPT, OUTPUTS + drafts[:j], logits[j:j + 1])
        torch.testing.assert_close(got[j:j + 1], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bad", [dict(repetition_penalty=0.0), dict(repetition_penalty=float("nan")),
                                 dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(min_p=1.5),
                                 dict(logit_bias={-1: 1.0}), dict(logit_bias={3: float("inf")}),
                                 dict(logit_bias=[1, 2]), dict(allowed_token_ids=[]), dict(allowed_token_ids=["a"]),
                                 dict(bad_words=[""]), dict(bad_words=[3]), dict(skip_special_tokens=1)])
def test_bad_values_are_refused(bad):
    with pytest.raises(InvalidRequestError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_ids_outside_the_vocabulary_are_refused_and_nothing_is_queued():
    llm = LLM("tiny-mamba2", inspect="off")
    for bad in (dict(logit_bias={llm.vocab_size: 1.0}), dict(allowed_token_ids=[1, llm.vocab_size + 3])):
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            llm.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(**bad))
    assert not llm.has_unfinished_requests()


# ---- through the engine ------------------------------------------------------------------------
PRESET = "tiny-bamba"        # attention (KV blocks, prefix caching) and Mamba2 state
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.8, presence_penalty=0.6, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=1.5, logit_bias={7: 4.0}, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, seed=5, repetition_penalty=1.4, min_p=0.2, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, bad_words=["ab", "c"], ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, seed=9, allowed_token_ids=list(range(40, 80)),
                   frequency_penalty=0.5, ignore_eos=True),
]
SHARED = [5 + (i * 7) % 50 for i in range(21)]        # a prefix the prompts share (prefix caching hits it)
PROMPTS = [SHARED + [3 + i, 60 + i, 60 + i] + [ord("a") + 3] * i for i in range(len(PARAMS))]


def _tokens(llm: LLM, outs: list | None = None) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS) if outs is None else outs
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference():
    """Every request in one batch, recorded: (tokens, the engine's trace)."""
    llm = LLM(PRESET, max_num_seqs=8, max_num_batched_tokens=256, inspect="metadata")
    tokens = _tokens(llm)
    yield tokens, llm
    llm.shutdown()


def test_each_token_is_the_processors_on_the_steps_raw_logits(reference):
    tokens, llm = reference
    done = {}
    for rec in llm.trace:
        for rid in rec.kept_token_ids:
            i = int(rid)
            for row in rec.kept_logits(rid):
                done.setdefault(i, []).append(row)
    for i, params in enumerate(PARAMS):
        if not params.greedy:
            continue
        ids = PROMPTS[i]
        for step, row in enumerate(done[i]):
            history = torch.tensor([ids + tokens[i][:step]])
            want = row[None].clone()
            if params.repetition_penalty != 1.0:
                want = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(history, want)
            counts = torch.bincount(torch.tensor(tokens[i][:step], dtype=torch.long), minlength=want.shape[-1])
            want = want - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
            if params.logit_bias:
                want = SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias.items()})(history, want)
            if params.bad_words:
                words = llm._make_request({"prompt_token_ids": [1]}, params, "probe").sampling_params
                want = NoBadWordsLogitsProcessor(words.bad_words_token_ids, None)(
                    torch.tensor([tokens[i][:step]]) if step else torch.zeros(1, 0, dtype=torch.long), want)
            assert tokens[i][step] == int(want.argmax()), f"request {i}, token {step}"
    assert tokens[0] != tokens[3] and len(set(tokens[0])) > 3      # the penalties spread the choices
    assert all(40 <= t < 80 for t in tokens[4])                    # allowed ids only


@pytest.mark.parametrize("variant", ["alone", "chunked-preempted", "prefix-caching", "ngram"])
def test_tokens_do_not_depend_on_scheduling(reference, variant):
    tokens, _ = reference
    if variant == "alone":
        llm = LLM(PRESET, max_num_seqs=1, inspect="off")
        got = [list(llm.generate({"prompt_token_ids": p}, sp)[0].outputs[0].token_ids)
               for p, sp in zip(PROMPTS, PARAMS)]
    else:
        kw = {"chunked-preempted": dict(max_num_seqs=4, max_num_batched_tokens=8, block_size=4, num_kv_blocks=24),
              "prefix-caching": dict(enable_prefix_caching=True, block_size=4),
              "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 1})}[variant]
        llm = LLM(PRESET, inspect="metadata" if variant == "chunked-preempted" else "off", **kw)
        if variant == "ngram":      # penalties make a text repeat little: drafts from the reference, some wrong
            llm.model_runner.proposer = ScriptedProposer([p + t for p, t in zip(PROMPTS, tokens)], 3, wrong_every=2)
        if variant == "prefix-caching":
            _tokens(llm)                     # the second run hits the blocks the first registered
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
        got = _tokens(llm, outs)
        if variant == "chunked-preempted":
            assert any(rec.preempted_request_ids for rec in llm.trace)
        if variant == "prefix-caching":
            assert all(o.num_cached_tokens >= 20 for o in outs)
        if variant == "ngram":
            stats = llm.spec_stats
            assert 0 < stats.num_accepted_drafts < stats.num_draft_tokens, stats
    llm.shutdown()
    assert got == tokens
