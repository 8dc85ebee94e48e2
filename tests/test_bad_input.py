"""The bad-input catalogue (README, "Bad input"): each case raises a specific exception type whose
message says what to change, while a request running beside it completes with the tokens it
would have had, and nothing leaks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from toolkit import (
    LLM,
    CheckpointError,
    EngineClosedError,
    InvalidRequestError,
    SamplingParams,
    UnknownModelError,
    UnsupportedArchitectureError,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
GOOD_PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
ARGS = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)


@pytest.fixture(scope="module")
def expected_tokens():
    with LLM("tiny-bamba", **ARGS) as llm:
        return llm.generate(GOOD_PROMPT, GREEDY)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def folder(hf_folders) -> Path:
    """tiny-llama as an HF folder (conftest's, shared: the cases change copies of it)."""
    return hf_folders("tiny-llama")[1]


def broken_copy(folder: Path, tmp: Path, how: str) -> Path:
    out = tmp / how
    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    weights = out / "model.safetensors"
    if how == "nan":
        tensors = load_file(str(weights))
        tensors["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
        save_file(tensors, str(weights))
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "config_sizes":
        cfg = json.loads((out / "config.json").read_text())
        cfg["intermediate_size"] = 96
        (out / "config.json").write_text(json.dumps(cfg))
    elif how == "pickle_only":
        weights.unlink()
        (out / "pytorch_model.bin").write_bytes(b"not really a pickle")
    return out


# (name, action(llm, folder, tmp), exception type, message pattern)
CASES = [
    ("generate(None)", lambda llm, f, t: llm.generate(None), InvalidRequestError, "prompts: a prompt"),
    ("generate([])", lambda llm, f, t: llm.generate([]), InvalidRequestError, "nothing to generate"),
    ("empty token list", lambda llm, f, t: llm.add_request({"prompt_token_ids": []}), InvalidRequestError, "empty"),
    ("token id past the vocabulary", lambda llm, f, t: llm.add_request({"prompt_token_ids": [5, 320]}),
     InvalidRequestError, r"out of range \[0, 320\)"),
    ("negative token id", lambda llm, f, t: llm.add_request({"prompt_token_ids": [-1]}), InvalidRequestError,
     "out of range"),
    ("prompt of the wrong type", lambda llm, f, t: llm.add_request(42), InvalidRequestError, "a prompt is"),
    ("prompt too long", lambda llm, f, t: llm.add_request({"prompt_token_ids": [5] * 64}), InvalidRequestError,
     "max_model_len=64"),
    ("stop id outside the vocabulary", lambda llm, f, t: llm.add_request(
        GOOD_PROMPT, SamplingParams(stop_token_ids=[100_000])), InvalidRequestError, "outside the vocabulary"),
    ("params of the wrong type", lambda llm, f, t: llm.add_request(GOOD_PROMPT, {"max_tokens": 3}),
     InvalidRequestError, "must be a SamplingParams"),
    ("max_tokens=0", lambda llm, f, t: SamplingParams(max_tokens=0), InvalidRequestError, "max_tokens"),
    ("temperature=NaN", lambda llm, f, t: SamplingParams(temperature=float("nan")), InvalidRequestError,
     "temperature"),
    ("top_p=0", lambda llm, f, t: SamplingParams(top_p=0.0), InvalidRequestError, "top_p"),
    ("seed=2**64", lambda llm, f, t: SamplingParams(seed=2**64), InvalidRequestError, "seed"),
    ("logprobs=-1", lambda llm, f, t: SamplingParams(logprobs=-1), InvalidRequestError, "logprobs=-1"),
    ("prompt_logprobs=1.5", lambda llm, f, t: SamplingParams(prompt_logprobs=1.5), InvalidRequestError,
     "prompt_logprobs=1.5"),
    ("logprobs past the vocabulary", lambda llm, f, t: llm.add_request(GOOD_PROMPT, SamplingParams(logprobs=321)),
     InvalidRequestError, r"logprobs=321: more than the vocabulary \(320 tokens\)"),
    ("n=0", lambda llm, f, t: SamplingParams(n=0), InvalidRequestError, "n=0"),
    ("min_tokens > max_tokens", lambda llm, f, t: SamplingParams(max_tokens=3, min_tokens=4), InvalidRequestError,
     r"min_tokens=4: must be an int in \[0, max_tokens=3\]"),
    ("empty stop string", lambda llm, f, t: SamplingParams(stop=["\n", ""]), InvalidRequestError, "stop="),
    ("n > 1 whose sample ids are taken", lambda llm, f, t: (
        llm.add_request({"prompt_token_ids": [9]}, GREEDY, request_id="1_x"),
        llm.add_request(GOOD_PROMPT, SamplingParams(n=2), request_id="x")), InvalidRequestError,
     "'1_x', already used"),
    ("params for the wrong number of prompts", lambda llm, f, t: llm.generate(
        ["a", "b"], [GREEDY]), InvalidRequestError, "1 sampling params for 2 prompts"),
    ("request id in use", lambda llm, f, t: llm.add_request(GOOD_PROMPT, GREEDY, request_id="good"),
     InvalidRequestError, "already in use"),
    ("request id reused after it finished", lambda llm, f, t: (
        llm.add_request({"prompt_token_ids": [9]}, SamplingParams(max_tokens=1), request_id="short"),
        [llm.step() for _ in range(2)], llm.add_request(GOOD_PROMPT, GREEDY, request_id="short")),
     InvalidRequestError, "was used by a request that finished"),
    ("request larger than the KV cache", lambda llm, f, t: LLM("tiny-llama", **ARGS | dict(
        block_size=4, num_kv_blocks=4)).add_request({"prompt_token_ids": [5] * 20}), InvalidRequestError,
     "KV blocks"),
    ("unknown model name", lambda llm, f, t: LLM("tiny-nothing"), UnknownModelError, "neither a preset"),
    ("folder without config.json", lambda llm, f, t: LLM(str(t)), CheckpointError, "no config.json"),
    ("unsupported architecture", lambda llm, f, t: (
        (t / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}'), LLM(str(t))),
     UnsupportedArchitectureError, "GPT2LMHeadModel"),
    ("NaN weights", lambda llm, f, t: LLM(str(broken_copy(f, t, "nan")), device="cpu"), CheckpointError,
     r"NaN or Inf weights in model.layers.1.mlp.up_proj.weight"),
    ("truncated safetensors", lambda llm, f, t: LLM(str(broken_copy(f, t, "truncated")), device="cpu"),
     CheckpointError, "unreadable safetensors"),
    ("config sizes disagree with the weights", lambda llm, f, t: LLM(str(broken_copy(f, t, "config_sizes")),
                                                                    device="cpu"),
     CheckpointError, "misshapen tensors: .*mlp"),
    ("pickle-only checkpoint", lambda llm, f, t: LLM(str(broken_copy(f, t, "pickle_only")), device="cpu"),
     CheckpointError, "safetensors only"),
    ("bad device", lambda llm, f, t: LLM("tiny-llama", device="tpu"), ValueError, "device='tpu'"),
    ("bad dtype", lambda llm, f, t: LLM("tiny-llama", dtype="int8"), ValueError, "dtype='int8'"),
    ("max_model_len past the model's", lambda llm, f, t: LLM("tiny-llama", max_model_len=10**6), ValueError,
     "max_position_embeddings"),
    ("num_kv_blocks=1", lambda llm, f, t: LLM("tiny-llama", num_kv_blocks=1), ValueError, "null block"),
    ("token budget below max_num_seqs", lambda llm, f, t: LLM("tiny-llama", max_num_seqs=8,
                                                             max_num_batched_tokens=4),
     ValueError, "max_num_batched_tokens=4 must be >= max_num_seqs=8"),
    ("unknown inspect mode", lambda llm, f, t: LLM("tiny-llama", inspect="all"), ValueError, "inspect='all'"),
    ("unknown backend", lambda llm, f, t: LLM("tiny-llama", backend="cuda"), ValueError, "backend='cuda'"),
    ("warmup with requests running", lambda llm, f, t: llm.warmup(progress=False), RuntimeError, "idle engine"),
]


@pytest.mark.parametrize("name, action, exc, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_the_engine_keeps_serving(name, action, exc, match, expected_tokens,
                                                           folder, tmp_path):
    with LLM("tiny-bamba", **ARGS) as llm:
        total = llm.stats()
        llm.add_request(GOOD_PROMPT, GREEDY, request_id="good")
        llm.step()
        with pytest.raises(exc, match=match):
            action(llm, folder, tmp_path)
        outs = {}
        while llm.has_unfinished_requests():
            outs.update({o.request_id: o for o in llm.step().outputs})
        assert outs["good"].outputs[0].token_ids == expected_tokens
        after = llm.stats()
        for key in ("kv_blocks_free", "state_pages_free", "num_running", "num_waiting", "runner_rows_in_use"):
            assert after[key] == total[key], key


def test_max_model_len_reached_mid_generation_finishes_with_length():
    with LLM("tiny-mamba2", **ARGS | dict(max_model_len=12)) as llm:
        out = llm.generate({"prompt_token_ids": [5] * 8}, SamplingParams(max_tokens=50, temperature=0.0,
                                                                          ignore_eos=True))[0]
        assert out.outputs[0].finish_reason == "length"
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 12


def test_abort_returns_whether_it_aborted_and_unknown_ids_change_nothing():
    with LLM("tiny-bamba", **ARGS) as llm:
        rid = llm.add_request(GOOD_PROMPT, GREEDY)
        llm.step()
        before = llm.stats()
        assert llm.abort_request("no-such-id") is False and llm.stats() == before
        assert llm.abort_request(rid) is True
        assert llm.abort_request(rid) is False                       # already gone
        stats = llm.stats()
        assert stats["num_running"] == 0 and stats["runner_rows_in_use"] == 0
        assert stats["state_pages_free"] == stats["state_pages_total"]


def test_calls_after_shutdown_raise_engine_closed():
    llm = LLM("tiny-llama", device="cpu")
    llm.shutdown()
    for call in (lambda: llm.generate("hi"), lambda: llm.add_request("hi"), lambda: llm.step(),
                 lambda: llm.abort_request("0"), lambda: llm.warmup(progress=False)):
        with pytest.raises(EngineClosedError, match="shut down"):
            call()
    assert llm.memory_report().marks["shutdown"]["weights"] == 0


def test_warmup_twice_works():
    """warmup's own request ids do not count as used ids."""
    with LLM("tiny-mamba2", **ARGS) as llm:
        llm.warmup(progress=False)
        llm.warmup(progress=False)
        assert llm.stats()["state_pages_free"] == llm.stats()["state_pages_total"]


def test_interrupted_generate_keeps_its_request_ids_used(monkeypatch):
    """An interrupted generate() aborts its requests like abort_request does, so their ids stay
    used (the trace refers to them)."""
    from toolkit.runner.model_runner import ModelRunner
    original, calls = ModelRunner.sample_tokens, {"n": 0}

    def interrupted(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return original(self)
    with LLM("tiny-mamba2", **ARGS) as llm:
        monkeypatch.setattr(ModelRunner, "sample_tokens", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(GOOD_PROMPT, GREEDY)
        monkeypatch.undo()
        with pytest.raises(InvalidRequestError, match="was used by a request that finished"):
            llm.add_request(GOOD_PROMPT, GREEDY, request_id="0")
        stats = llm.stats()
        assert stats["num_waiting"] == stats["num_running"] == stats["runner_rows_in_use"] == 0
