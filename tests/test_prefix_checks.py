"""The prefix-caching runtime checks on correct runs, and the cold-state oracle of inspect="full"
(`checkpoint_equals_cold_state`, inspect/cold_state.py). The faults they catch are planted in
tests/test_inspect_faults.py."""
from __future__ import annotations

import pytest
import torch
from test_inspect_faults import GREEDY, SHARED

from toolkit import LLM, InvariantError
from toolkit.inspect import faults
from toolkit.inspect.cold_state import ColdReplay

ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=40, block_size=16,
              max_model_len=128)
PROMPTS = [SHARED + list(range(60, 92)), SHARED + list(range(100, 132))]


def serve_one_by_one(llm: LLM) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        (res,) = llm.generate({"prompt_token_ids": prompt}, GREEDY)
        out.append(res.outputs[0].token_ids)
    return out


def test_cold_replay_equals_an_engine_that_prefilled_those_tokens():
    """The oracle itself: the state after a cold prefill of 32 tokens equals, exactly, the state an
    engine (no prefix caching) holds after prefilling the same 32 tokens in one chunk."""
    llm = LLM("tiny-bamba", inspect="full", **ENGINE | dict(max_num_batched_tokens=32))
    llm.add_request({"prompt_token_ids": SHARED[:32]}, GREEDY)
    rec = llm.step()                                # the whole prompt in one chunk
    assert rec.scheduled[0].num_tokens == 32
    cold = ColdReplay(llm.model_runner).states(SHARED[:32])
    assert rec.states, "full mode records the states"
    for layer in rec.states:
        for name, ours in layer.of(rec.request_ids[0], "after").items():
            ref = cold[layer.layer_name][layer.state_names.index(name)]
            torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    # the engine's layers are bound to its own caches again: it goes on serving
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.model.model.layers[0].mamba.conv_state is llm.model_runner.kv_caches["model.layers.0.mamba"][0]


@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-mamba2"])
def test_the_oracle_runs_on_each_hit_and_outputs_equal_a_cold_engine(preset):
    warm = LLM(preset, inspect="full", enable_prefix_caching=True, **ENGINE)
    got = serve_one_by_one(warm)
    hits = [r for r in warm.trace if r.prefix_hits]
    assert [r.prefix_hits for r in hits] == [{"1": 32}]         # B hits A's checkpoint at 32
    assert list(warm._recorder.cold._cache) == [tuple(SHARED[:32])]
    assert not [v for r in warm.trace for v in r.violations]
    assert got == serve_one_by_one(LLM(preset, inspect="off", **ENGINE))


def test_a_wrong_starting_state_is_caught_by_the_oracle_too():
    """A hit decided by attention alone starts B from the checkpoint at 32 as if it were 48: the
    cold prefill of 48 tokens disagrees, in every recurrent layer and state tensor."""
    with faults.inject("hit_counted_without_checkpoint"):
        llm = LLM("tiny-bamba", inspect="full", enable_prefix_caching=True, **ENGINE)
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY)
        with pytest.raises(InvariantError) as err:
            llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY)
    cold = [v for v in err.value.violations if v.check == "checkpoint_equals_cold_state"]
    assert {(v.where.split(", layer ")[1], v.field.split(" at ")[0]) for v in cold} == {
        (layer, state) for layer in ("model.layers.0.mamba", "model.layers.2.mamba")
        for state in ("conv_state", "ssm_state")}
    assert all("after a hit of 48 tokens" in v.message for v in cold)
