"""The "Engine correctness" review: one test per reviewed item, each named after it, plus the
sampling guarantee (a seeded request's tokens do not depend on scheduling) for every family."""
from __future__ import annotations

import json

import pytest
import torch

from toolkit import LLM, InvalidRequestError, SamplingParams
from toolkit.models import save_hf_folder
from toolkit.runner.model_runner import ModelRunner
from toolkit.runner.sampler import Sampler

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
FAMILIES = ["tiny-llama", "tiny-mamba", "tiny-falcon-mamba", "tiny-mamba2", "tiny-bamba",
            "tiny-jamba", "tiny-lfm2"]
# the snippet of item 2
PROMPT = {"prompt_token_ids": list(range(3, 40))}
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)


def small(preset: str, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                max_model_len=128) | kw
    return LLM(preset, **args)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def run_all(llm: LLM) -> dict:
    outs = {}
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step().outputs})
    return outs


# ---- item 1: one bad request poisons the engine --------------------------------------------------
def test_item1_bad_seed_or_temperature_is_refused_or_served():
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=2**64)
    with small("tiny-mamba2", seed=2**60) as llm:          # derived seeds do not overflow
        out = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=1.0))[0]
        assert len(out.outputs[0].token_ids) == 4
        tiny_t = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=1e-45, ignore_eos=True))
        greedy = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert tokens(tiny_t) == tokens(greedy)    # T floored at 1e-2: the argmax on these logits
    with pytest.raises(ValueError, match="seed"):
        small("tiny-mamba2", seed=-5)


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
def test_item1_a_step_that_raises_leaves_the_engine_serving(monkeypatch, preset, where, exc):
    """An exception in the forward or the sampler (or Ctrl-C) mid-run: the next steps serve every
    request and the outputs equal an uninterrupted run, with nothing leaked."""
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.8, top_k=20, ignore_eos=True)]
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (20, 5, 33)]
    with small(preset, max_num_batched_tokens=16) as ref:
        expected = tokens(ref.generate(prompts, params))
    with small(preset, max_num_batched_tokens=16) as llm:
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
        outs = run_all(llm)
        assert [outs[i].outputs[0].token_ids for i in ids] == expected
        after = llm.stats()
        for key in ("kv_blocks_free", "state_slots_free", "num_running", "num_waiting"):
            assert after[key] == total[key], key


def test_item1_aborting_the_request_that_fails_lets_the_others_finish(monkeypatch):
    with small("tiny-bamba") as llm:
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
        outs = run_all(llm)
        assert list(outs) == [good] and len(outs[good].outputs[0].token_ids) == 4
        assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


# ---- item 2: seeded sampling depends on scheduling ---------------------------------------------
@pytest.mark.parametrize("preset", FAMILIES)
def test_item2_seeded_sampling_does_not_depend_on_scheduling(preset):
    with small(preset, max_num_batched_tokens=512, max_num_seqs=16) as llm:
        expected = tokens(llm.generate([PROMPT], SEEDED))[0]
    for budget in (16, 5, 4):
        with small(preset, max_num_batched_tokens=budget) as llm:
            assert tokens(llm.generate([PROMPT], SEEDED))[0] == expected, f"budget {budget}"
    with small(preset, max_num_batched_tokens=16) as llm:      # warmed up, in a batch
        llm.warmup(progress=False)
        others = [SamplingParams(max_tokens=6, temperature=1.0), GREEDY,
                  SamplingParams(max_tokens=9, temperature=0.7, seed=1)]
        outs = llm.generate([{"prompt_token_ids": [7, 8]}, PROMPT, {"prompt_token_ids": [9] * 20},
                             {"prompt_token_ids": [4, 5, 6]}], [others[0], SEEDED, others[1], others[2]])
        assert outs[1].outputs[0].token_ids == expected
    with small(preset, max_num_batched_tokens=16) as llm:      # preempted mid-decode, resumed
        rid = llm.add_request(PROMPT, SEEDED)
        for _ in range(6):
            llm.step()
        req = llm.scheduler.requests[rid]
        assert 0 < len(req.output_token_ids) < 8
        llm.scheduler._preempt(req)
        assert run_all(llm)[rid].outputs[0].token_ids == expected


def test_item2_preemption_from_a_tight_kv_cache_keeps_seeded_tokens():
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + i))} for i in range(4)]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    with small("tiny-bamba") as roomy:
        expected = tokens(roomy.generate(prompts, params))
    with small("tiny-bamba", block_size=4, num_kv_blocks=20, max_num_batched_tokens=16) as tight:
        ids = [tight.add_request(p, sp) for p, sp in zip(prompts, params)]
        outs, preempted = {}, 0
        while tight.has_unfinished_requests():
            rec = tight.step()
            preempted += len(rec.preempted_request_ids)
            outs.update({o.request_id: o for o in rec.outputs})
        assert preempted > 0
        assert [outs[i].outputs[0].token_ids for i in ids] == expected


def test_item2_warmup_does_not_shift_unseeded_requests():
    unseeded = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    with small("tiny-mamba2") as cold:
        expected = tokens(cold.generate([PROMPT, PROMPT], unseeded))
    with small("tiny-mamba2") as warm:
        warm.warmup(progress=False)
        assert tokens(warm.generate([PROMPT, PROMPT], unseeded)) == expected
    assert expected[0] != expected[1]          # two arrivals, two derived seeds


# ---- items 3 to 10 -------------------------------------------------------------------------------
def _greedy_tokens(llm: LLM, n: int = 10) -> list[int]:
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return tokens(llm.generate({"prompt_token_ids": [5, 6, 7]}, sp))[0]


def _first_new(seq: list[int]) -> int:
    """Index of the first token (after the first) that did not occur before it."""
    return next(i for i in range(1, len(seq)) if seq[i] not in seq[:i])


def test_item3_every_eos_id_stops_generation(tmp_path):
    with small("tiny-llama") as llm:
        seq = _greedy_tokens(llm)
        k = _first_new(seq)
        llm.model.config.eos_token_id = [317, seq[k]]          # Llama-3 style list
        save_hf_folder(llm, tmp_path / "list")
        llm.model.config.eos_token_id = 317
        save_hf_folder(llm, tmp_path / "genconfig")
    (tmp_path / "genconfig" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [318, seq[k]]}))
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    for folder in ("list", "genconfig"):
        with small(str(tmp_path / folder)) as llm:
            assert seq[k] in llm.eos_token_ids
            out = llm.generate({"prompt_token_ids": [5, 6, 7]}, sp)[0].outputs[0]
            assert out.token_ids == seq[:k + 1] and out.finish_reason == "stop", folder


def test_item4_auto_request_ids_skip_ids_chosen_by_hand():
    with small("tiny-mamba2") as llm:
        hand = [llm.add_request({"prompt_token_ids": [5]}, GREEDY, request_id=r) for r in ("0", "1")]
        outs = llm.generate([{"prompt_token_ids": [6]}, {"prompt_token_ids": [7]}], GREEDY)
        assert len({o.request_id for o in outs} | set(hand)) == 4
        delivered = run_all(llm)
        assert sorted(delivered) == hand
        assert llm.stats()["num_waiting"] == llm.stats()["num_running"] == 0
        with pytest.raises(InvalidRequestError, match="already in use"):
            llm.add_request({"prompt_token_ids": [5]}, GREEDY, request_id="x")
            llm.add_request({"prompt_token_ids": [5]}, GREEDY, request_id="x")


def test_item5_stepping_loop_delivers_requests_finished_inside_generate():
    with small("tiny-mamba2") as llm:
        rid = llm.add_request({"prompt_token_ids": [5, 6]}, GREEDY)
        llm.generate({"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_tokens=8, temperature=0.0))
        delivered = []
        while llm.has_unfinished_requests():                   # the README's loop
            delivered += [o.request_id for o in llm.step().outputs]
        assert delivered == [rid]


def test_item6_sampling_params_are_copied_per_request():
    with small("tiny-mamba2") as llm:
        sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        rid = llm.add_request({"prompt_token_ids": [5, 6]}, sp)
        sp.max_tokens, sp.temperature = 50, -1.0                # changed (and broken) after submission
        assert len(run_all(llm)[rid].outputs[0].token_ids) == 3
        sp.temperature = 0.0
        outs = llm.generate([{"prompt_token_ids": [5]}] * 2, sp)  # one object, two requests
        assert [len(t) for t in tokens(outs)] == [50, 50]


def test_item7_kv_admission_counts_only_tokens_that_enter_the_cache():
    # 5 prompt + 4 output tokens: 8 go through the model (the last sample never does) = 2 blocks
    with small("tiny-llama", block_size=4, num_kv_blocks=3) as llm:
        out = llm.generate({"prompt_token_ids": [3, 4, 5, 6, 7]}, GREEDY)[0]
        assert len(out.outputs[0].token_ids) == 4
        with pytest.raises(InvalidRequestError, match="KV blocks"):
            llm.add_request({"prompt_token_ids": [3, 4, 5, 6, 7]}, SamplingParams(max_tokens=5))
    with small("tiny-bamba", block_size=2, num_kv_blocks=3) as llm:   # the smallest valid cache
        llm.warmup(progress=False)


def test_item8_stop_token_text_is_left_out_of_text():
    with small("tiny-llama") as llm:
        seq = _greedy_tokens(llm)
        k = _first_new(seq)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[seq[k]]))
        comp = out[0].outputs[0]
        assert comp.token_ids == seq[:k + 1] and comp.finish_reason == "stop"
        assert comp.text == llm.tokenizer.decode(seq[:k])
        kept = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(
            max_tokens=10, temperature=0.0, stop_token_ids=[seq[k]], include_stop_str_in_output=True))
        assert kept[0].outputs[0].text == llm.tokenizer.decode(seq[:k + 1])


def test_item9_step_record_counts_rows_as_the_layers_ran_them():
    # budget 1: a 3-token prompt goes in 1-token chunks; chunks 2 and 3 run as decodes
    with small("tiny-mamba2", max_num_seqs=1, max_num_batched_tokens=1) as llm:
        llm.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY)
        recs = []
        while llm.has_unfinished_requests():
            recs.append(llm.step())
        assert recs[1].scheduled[0].is_prefill and recs[1].scheduled[0].runs_as_decode
        for rec in recs:
            md = rec.metadata("mamba").metadata
            assert (rec.num_prefills, rec.num_decodes) == (md.num_prefills, md.num_decodes)
        assert [r.num_decodes for r in recs] == [0] + [1] * (len(recs) - 1)


def test_item10_seed_minus_one_means_no_seed():
    assert SamplingParams(seed=-1).seed is None
    sp = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    with small("tiny-mamba2") as a:
        unseeded = tokens(a.generate(PROMPT, sp))
    with small("tiny-mamba2") as b:
        minus_one = tokens(b.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=-1,
                                                             ignore_eos=True)))
    assert minus_one == unseeded


def test_noise_is_the_same_on_cuda_when_present():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CPU/CUDA comparison runs on a GPU machine")
    from toolkit.kernels.gumbel_ref import gumbel_noise
    seeds = torch.randint(0, 2**32, (8, 2))
    pos = torch.randint(0, 10_000, (8,))
    assert torch.equal(gumbel_noise(seeds, pos, 1000), gumbel_noise(seeds.cuda(), pos.cuda(), 1000).cpu())
