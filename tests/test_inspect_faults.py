"""The fault catalogue: each planted fault is detected, with a message that says where; the same
workload without a fault raises nothing."""
from __future__ import annotations

import pytest

from toolkit import LLM, InvariantError, MetadataContractError, ModelStateError, SamplingParams, ToolkitError
from toolkit.inspect import faults

from harness import ScriptedProposer

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
FAULT_NAMES = [f.name for f in faults.catalogue()]
# presets on which a fault is a fault (routing an attention-free model wrongly needs one; a hit
# decided by attention alone needs attention layers)
# the state faults also on a Kimi Delta Attention layer (Kimi Linear: KDA on the Gated DeltaNet builder)
# and on MiniMax's lightning attention (the linear-attention builder)
STATE_FAULT_PRESETS = ["tiny-bamba", "tiny-mamba2", "tiny-kimi-linear", "tiny-minimax", "tiny-xlstm"]
PRESETS = {"attention_free_default_state": ["tiny-mamba2", "tiny-mamba"],
           "hit_counted_without_checkpoint": ["tiny-bamba", "tiny-lfm2"],
           **{name: STATE_FAULT_PRESETS for name in ("state_index_off_by_one", "initial_state_flag_on_fresh_request",
                                                      "slot_not_zeroed_on_reuse", "padded_row_on_real_slot")}}


def workload(preset: str) -> None:
    """Build, warm up, serve two overlapping requests (a decode next to a chunked prefill, slots
    reused after warmup), shut down."""
    llm = LLM(preset, device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=8,
              max_model_len=64)
    try:
        llm.warmup(progress=False)
        llm.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY)
        llm.step()
        llm.add_request({"prompt_token_ids": list(range(3, 15))}, GREEDY)
        while llm.has_unfinished_requests():
            llm.step()
    finally:
        llm.shutdown()


SHARED = list(range(3, 51))                      # 48 tokens: three blocks of 16


def prefix_workload(preset: str, **engine) -> None:
    """Prefix caching ("align", block 16, 40-token steps): A (48 shared + 32 own tokens) prefills in
    chunks [0, 32), [32, 64), [64, 80), leaving checkpoints at 32 and 64; then B (the same 48 + 32
    others) hits 32 tokens (A's checkpoint at 48 does not exist: attention alone would claim 48)."""
    llm = LLM(preset, device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=40, block_size=16,
              max_model_len=128, enable_prefix_caching=True, **engine)
    try:
        for own in (range(60, 92), range(100, 132)):
            llm.add_request({"prompt_token_ids": SHARED + list(own)}, GREEDY)
            while llm.has_unfinished_requests():
                llm.step()
        assert llm.stats()["prompt_tokens_skipped"] == 32
    finally:
        llm.shutdown()


def spec_workload(preset: str, **extra) -> None:
    """Speculative decoding (k = 3) on one request row: two requests one after the other, each
    verifying drafts (its plain run's own continuation) and ending with 3 tokens kept at its last
    step, so the second takes a row whose count is 3."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 32))]
    engine = dict(device="cpu", dtype="float32", max_num_seqs=1, max_num_batched_tokens=8, max_model_len=64)
    plain = LLM(preset, inspect="off", **engine)
    refs = [p + list(o.outputs[0].token_ids) for p, o in
            zip(prompts, plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY))]
    plain.shutdown()
    llm = LLM(preset, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **engine, **extra)
    llm.model_runner.proposer = ScriptedProposer(refs, 3, wrong_every=None)
    try:
        for p in prompts:
            llm.add_request({"prompt_token_ids": p}, GREEDY)
            while llm.has_unfinished_requests():
                llm.step()
    finally:
        llm.shutdown()


def spec_cached_workload(preset: str, **extra) -> None:
    """Speculative decoding with prefix caching (k = 3, block 4): A's verify rows (every draft
    accepted) cross block boundaries after their position 1, so its checkpoints come from boundary
    copies; B, A's first 25 tokens, hits the one at 24."""
    engine = dict(device="cpu", dtype="float32", max_num_seqs=1, max_num_batched_tokens=8, max_model_len=64)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a_prompt = list(range(20, 34))
    plain = LLM(preset, inspect="off", **engine)
    a_ref = a_prompt + list(plain.generate([{"prompt_token_ids": a_prompt}], greedy)[0].outputs[0].token_ids)
    b_ref = a_ref[:25] + list(plain.generate([{"prompt_token_ids": a_ref[:25]}], greedy)[0].outputs[0].token_ids)
    plain.shutdown()
    llm = LLM(preset, enable_prefix_caching=True, block_size=4, num_state_pages=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **engine, **extra)
    llm.model_runner.proposer = ScriptedProposer([a_ref, b_ref], 3, wrong_every=None)
    try:
        for p in (a_prompt, a_ref[:25]):
            llm.add_request({"prompt_token_ids": p}, greedy)
            while llm.has_unfinished_requests():
                llm.step()
        assert llm.stats()["prompt_tokens_skipped"] == 24
    finally:
        llm.shutdown()


def run_workload(fault: faults.Fault, preset: str) -> None:
    {"prefix caching": prefix_workload, "speculative decoding": spec_workload,
     "speculative decoding with prefix caching": spec_cached_workload}.get(fault.needs, workload)(preset)


def cases():
    for name in FAULT_NAMES:
        if faults.get(name).needs == "tensor parallelism":      # tests/test_tensor_parallel_inspect.py
            continue
        for preset in PRESETS.get(name, ["tiny-bamba", "tiny-mamba2"]):
            yield pytest.param(name, preset, id=f"{name}-{preset}")


@pytest.mark.parametrize("name, preset", list(cases()))
def test_each_fault_is_detected_and_located(name, preset):
    fault = faults.get(name)
    with faults.inject(name):
        with pytest.raises(ToolkitError) as err:
            run_workload(fault, preset)
    e = err.value
    if fault.detected_by == "MetadataContractError":
        assert isinstance(e, MetadataContractError)
        assert e.builder in str(e) and e.field in str(e) and "MambaHybridModelState" in e.producer
    elif fault.detected_by == "ModelStateError":
        assert isinstance(e, ModelStateError) and "MambaHybridModelState" in str(e)
    else:
        assert isinstance(e, InvariantError), repr(e)
        hits = [v for v in e.violations if v.check == fault.detected_by]
        assert hits, f"{name}: expected a {fault.detected_by} violation, got {e}"
        v = hits[0]
        assert v.field and v.message
        if name != "graph_manager_kept_on_shutdown":
            assert ("step" in v.where or "warmup" in v.where) and ("request" in v.where or "group" in v.where)
    # the fault is gone after the block
    run_workload(fault, preset)


def test_every_fault_has_a_detection_and_a_description():
    assert len(FAULT_NAMES) == len(set(FAULT_NAMES)) >= 8
    for f in faults.catalogue():
        assert f.breaks and f.mirrors and f.detection and f.detected_by
    with pytest.raises(KeyError, match="catalogue has"):
        with faults.inject("no_such_fault"):
            pass


@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-mamba2", "tiny-jamba", "tiny-lfm2", "tiny-mamba"])
def test_workload_without_faults_raises_nothing(preset):
    workload(preset)


@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-mamba2", "tiny-lfm2", "tiny-mamba", "tiny-qwen3-next",
                                    "tiny-kimi-linear"])
def test_prefix_workload_without_faults_raises_nothing_in_full_mode(preset):
    """Every prefix-caching check on, the cold-state oracle included, on each recurrent family."""
    prefix_workload(preset, inspect="full")


@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-mamba", "tiny-lfm2", "tiny-qwen3-next", "tiny-kimi-linear"])
def test_spec_workload_without_faults_raises_nothing_in_full_mode(preset):
    """Every speculative-decoding check on, the cold-state oracle of each verify row's start included."""
    spec_workload(preset, inspect="full")


def test_cold_oracle_catches_a_verify_step_on_the_wrong_column():
    with faults.inject("verify_starts_from_last_column"):
        with pytest.raises(InvariantError) as err:
            spec_workload("tiny-mamba2", inspect="full")
    cold = [v for v in err.value.violations if v.check == "spec_start_state_equals_plain"]
    # the planted count points at the last of the 1 + 3 columns: the cold replay sees the wrong state
    assert cold and "request '0'" in cold[0].where and "num_accepted_tokens=4" in cold[0].message


def test_violations_are_in_the_trace_and_the_step_completes():
    with faults.inject("slot_not_zeroed_on_reuse"):
        llm = LLM("tiny-mamba2", device="cpu", dtype="float32", max_num_seqs=1,
                  max_num_batched_tokens=8)
        llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)
        llm.add_request({"prompt_token_ids": [8, 9]}, GREEDY)
        with pytest.raises(InvariantError, match="fresh_slot_is_zero") as err:
            llm.step()
    rec = llm.trace[-1]
    assert rec.violations == err.value.violations and rec.scheduled[0].num_tokens == 2
    assert "layer backbone.layers.0.mixer" in str(err.value) and "slot 1" in str(err.value)
    while llm.has_unfinished_requests():          # the engine goes on
        llm.step()
    llm.shutdown()


def test_checks_off_lets_a_fault_through_silently():
    with faults.inject("initial_state_flag_on_fresh_request"):
        with LLM("tiny-mamba2", device="cpu", dtype="float32", checks=False) as llm:
            llm.warmup(progress=False)
            llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)
            assert all(not r.violations for r in llm.trace)


def test_a_warmup_stage_that_raises_is_in_the_trace():
    from toolkit import MetadataContractError
    with faults.inject("missing_seq_lens_cpu_upper_bound"):
        llm = LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=8)
        with pytest.raises(MetadataContractError):
            llm.warmup(progress=False)
    last = llm.trace[-1]
    assert last.stage == "warmup/dummy batch 1 reqs x 1 tokens"
    assert last.violations[0].field == "seq_lens_cpu_upper_bound"
    assert last.violations[0].check == "MetadataContractError" and "Builder" in last.violations[0].where
    llm.warmup(progress=False)                      # fault gone: the same engine warms up
    llm.shutdown()


@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-mamba", "tiny-lfm2", "tiny-qwen3-next", "tiny-kimi-linear"])
def test_spec_cached_workload_without_faults_raises_nothing_in_full_mode(preset):
    """Speculation with prefix caching, every check on: the boundary copies' sources, and the state B
    starts from after its hit on a boundary copy's checkpoint (the cold-state oracle)."""
    spec_cached_workload(preset, inspect="full")
