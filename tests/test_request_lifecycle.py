"""What happens to a request, from `add_request` to its output: seeds and temperatures outside the
sampler's range are refused or served, a step that raises (an error or Ctrl-C, in the forward or
the sampler) leaves the engine serving every request with unchanged outputs, every EOS id stops a
request, automatic ids skip ids chosen by hand, requests finished inside `generate` come out of the
next `step`, sampling params are copied per request, KV admission counts only the tokens that enter
the cache, a stop token's text is left out, step records count rows as the layers ran them, and
seed=-1 means no seed."""
from __future__ import annotations

import json

import pytest

from toolkit import LLM, InvalidRequestError, SamplingParams
from toolkit.models import save_hf_folder
from toolkit.runner.model_runner import ModelRunner
from toolkit.runner.sampler import Sampler

from harness import run_to_completion, small_llm, token_ids

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(3, 40))}


def test_extreme_seeds_and_temperatures_are_refused_or_served():
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=2**64)
    with small_llm("tiny-mamba2", seed=2**60) as llm:          # derived seeds do not overflow
        out = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=1.0))[0]
        assert len(out.outputs[0].token_ids) == 4
        tiny_t = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=1e-45, ignore_eos=True))
        greedy = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert token_ids(tiny_t) == token_ids(greedy)    # T floored at 1e-2: the argmax on these logits
    with pytest.raises(ValueError, match="seed"):
        small_llm("tiny-mamba2", seed=-5)


def _fail_once(monkeypatch, target, name: str, exc: BaseException, at_call: int) -> None:
    original = getattr(target, name)
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise exc
        return original(*args, **kwargs)
    monkeypatch.setattr(target, name, failing)


@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-mamba2"])
@pytest.mark.parametrize("where", ["forward", "sampler"])
@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()])
def test_a_step_that_raises_leaves_the_engine_serving(monkeypatch, preset, where, exc):
    """An exception in the forward or the sampler (or Ctrl-C) mid-run: the next steps serve every
    request and the outputs equal an uninterrupted run, with nothing leaked."""
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.8, top_k=20, ignore_eos=True)]
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (20, 5, 33)]
    with small_llm(preset, max_num_batched_tokens=16) as ref:
        expected = token_ids(ref.generate(prompts, params))
    with small_llm(preset, max_num_batched_tokens=16) as llm:
        total = llm.stats()
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        llm.step()
        if where == "forward":
            _fail_once(monkeypatch, type(llm.model), "forward", exc, at_call=2)
        else:
            _fail_once(monkeypatch, Sampler, "__call__", exc, at_call=2)
        llm.step()
        with pytest.raises(type(exc)):
            llm.step()
        outs = run_to_completion(llm)
        assert [outs[i].outputs[0].token_ids for i in ids] == expected
        after = llm.stats()
        for key in ("kv_blocks_free", "state_pages_free", "num_running", "num_waiting"):
            assert after[key] == total[key], key


def test_aborting_the_request_that_fails_lets_the_others_finish(monkeypatch):
    with small_llm("tiny-bamba") as llm:
        good = llm.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY)
        bad = llm.add_request({"prompt_token_ids": [8, 9]}, GREEDY)
        original = ModelRunner.execute_model

        def fails_with_bad(self, sched_out):
            if bad in sched_out.num_scheduled_tokens:
                raise RuntimeError("this request breaks the forward")
            return original(self, sched_out)
        monkeypatch.setattr(ModelRunner, "execute_model", fails_with_bad)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="breaks"):
                llm.step()
        llm.abort_request(bad)
        outs = run_to_completion(llm)
        assert list(outs) == [good] and len(outs[good].outputs[0].token_ids) == 4
        assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def _greedy_token_ids(llm: LLM, n: int = 10) -> list[int]:
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return token_ids(llm.generate({"prompt_token_ids": [5, 6, 7]}, sp))[0]


def _first_new(seq: list[int]) -> int:
    """Index of the first token (after the first) that did not occur before it."""
    return next(i for i in range(1, len(seq)) if seq[i] not in seq[:i])


def test_every_eos_id_stops_generation(tmp_path):
    with small_llm("tiny-llama") as llm:
        seq = _greedy_token_ids(llm)
        k = _first_new(seq)
        llm.model.config.eos_token_id = [317, seq[k]]          # Llama-3 style list
        save_hf_folder(llm, tmp_path / "list")
        llm.model.config.eos_token_id = 317
        save_hf_folder(llm, tmp_path / "genconfig")
    (tmp_path / "genconfig" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [318, seq[k]]}))
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    for folder in ("list", "genconfig"):
        with small_llm(str(tmp_path / folder)) as llm:
            assert seq[k] in llm.eos_token_ids
            out = llm.generate({"prompt_token_ids": [5, 6, 7]}, sp)[0].outputs[0]
            assert out.token_ids == seq[:k + 1] and out.finish_reason == "stop", folder


def test_auto_request_ids_skip_ids_chosen_by_hand():
    with small_llm("tiny-mamba2") as llm:
        hand = [llm.add_request({"prompt_token_ids": [5]}, GREEDY, request_id=r) for r in ("0", "1")]
        outs = llm.generate([{"prompt_token_ids": [6]}, {"prompt_token_ids": [7]}], GREEDY)
        assert len({o.request_id for o in outs} | set(hand)) == 4
        delivered = run_to_completion(llm)
        assert sorted(delivered) == hand
        assert llm.stats()["num_waiting"] == llm.stats()["num_running"] == 0
        with pytest.raises(InvalidRequestError, match="already in use"):
            llm.add_request({"prompt_token_ids": [5]}, GREEDY, request_id="x")
            llm.add_request({"prompt_token_ids": [5]}, GREEDY, request_id="x")


def test_stepping_loop_delivers_requests_finished_inside_generate():
    with small_llm("tiny-mamba2") as llm:
        rid = llm.add_request({"prompt_token_ids": [5, 6]}, GREEDY)
        llm.generate({"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_tokens=8, temperature=0.0))
        delivered = []
        while llm.has_unfinished_requests():                   # the README's loop
            delivered += [o.request_id for o in llm.step().outputs]
        assert delivered == [rid]


def test_sampling_params_are_copied_per_request():
    with small_llm("tiny-mamba2") as llm:
        sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        rid = llm.add_request({"prompt_token_ids": [5, 6]}, sp)
        sp.max_tokens, sp.temperature = 50, -1.0                # changed (and broken) after submission
        assert len(run_to_completion(llm)[rid].outputs[0].token_ids) == 3
        sp.temperature = 0.0
        outs = llm.generate([{"prompt_token_ids": [5]}] * 2, sp)  # one object, two requests
        assert [len(t) for t in token_ids(outs)] == [50, 50]


def test_kv_admission_counts_only_tokens_that_enter_the_cache():
    # 5 prompt + 4 output tokens: 8 go through the model (the last sample never does) = 2 blocks
    with small_llm("tiny-llama", block_size=4, num_kv_blocks=3) as llm:
        out = llm.generate({"prompt_token_ids": [3, 4, 5, 6, 7]}, GREEDY)[0]
        assert len(out.outputs[0].token_ids) == 4
        with pytest.raises(InvalidRequestError, match="KV blocks"):
            llm.add_request({"prompt_token_ids": [3, 4, 5, 6, 7]}, SamplingParams(max_tokens=5))
    with small_llm("tiny-bamba", block_size=2, num_kv_blocks=3) as llm:   # the smallest valid cache
        llm.warmup(progress=False)


def test_stop_token_text_is_left_out_of_text():
    with small_llm("tiny-llama") as llm:
        seq = _greedy_token_ids(llm)
        k = _first_new(seq)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[seq[k]]))
        comp = out[0].outputs[0]
        assert comp.token_ids == seq[:k + 1] and comp.finish_reason == "stop"
        assert comp.text == llm.tokenizer.decode(seq[:k])
        kept = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(
            max_tokens=10, temperature=0.0, stop_token_ids=[seq[k]], include_stop_str_in_output=True))
        assert kept[0].outputs[0].text == llm.tokenizer.decode(seq[:k + 1])


def test_step_record_counts_rows_as_the_layers_ran_them():
    # budget 1: a 3-token prompt goes in 1-token chunks; chunks 2 and 3 run as decodes
    with small_llm("tiny-mamba2", max_num_seqs=1, max_num_batched_tokens=1) as llm:
        llm.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY)
        recs = []
        while llm.has_unfinished_requests():
            recs.append(llm.step())
        assert recs[1].scheduled[0].is_prefill and recs[1].scheduled[0].runs_as_decode
        for rec in recs:
            md = rec.metadata("mamba").metadata
            assert (rec.num_prefills, rec.num_decodes) == (md.num_prefills, md.num_decodes)
        assert [r.num_decodes for r in recs] == [0] + [1] * (len(recs) - 1)


def test_seed_minus_one_means_no_seed():
    assert SamplingParams(seed=-1).seed is None
    sp = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    with small_llm("tiny-mamba2") as a:
        unseeded = token_ids(a.generate(PROMPT, sp))
    with small_llm("tiny-mamba2") as b:
        minus_one = token_ids(b.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=-1,
                                                                ignore_eos=True)))
    assert minus_one == unseeded
