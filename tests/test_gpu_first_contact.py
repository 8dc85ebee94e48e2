"""What the GPU path needs, checked on the CPU where it can be: graphs verified at capture (through
the emulated replay), a failed capture releasing what it captured, MoE models capping the capture
sizes, the engine's device made current for its launches, and device stage times from events."""
from __future__ import annotations

import dataclasses
import time
import warnings

import pytest
import torch

import toolkit.llm
import toolkit.runner.model_runner as model_runner
from toolkit import LLM, SamplingParams
from toolkit.layers.moe import DENSE_MAX_TOKENS
from toolkit.runner.cudagraph import CudaGraphManager, capture_sizes
from toolkit.runner.device import StageClock, on_device

F32 = dict(device="cpu", dtype="float32")
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (2, 5, 3)]
# The capture checks below are the runner's, whatever the layers: they run on the preset whose Triton
# forward is cheapest under the interpreter (a Mamba1 stack; tiny-bamba's Mamba2 + attention costs
# twice as much per forward). tests/test_cudagraph.py replays every layer family.
GRAPH_PRESET = "tiny-mamba"


class ClosureGraphs(CudaGraphManager):
    """CUDA-graph capture emulated on the CPU: the "graph" is the forward closure built at capture
    (it keeps the capture's metadata alive, as the real manager keeps `forwards`), "replay" calls
    it again. A replay then sees only what the step wrote into the persistent buffers."""

    def _record(self, forward):
        return forward, forward()

    def replay(self, size, tokens_per_row=None):
        return self.graphs[(size, tokens_per_row or self.tokens_per_row)]()


@pytest.fixture
def emulated_graphs(monkeypatch):
    monkeypatch.setattr(toolkit.llm, "resolve_cudagraph_mode", lambda *a: "full_decode")
    monkeypatch.setattr(model_runner, "CudaGraphManager", ClosureGraphs)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.slow          # Triton engines under the interpreter
def test_graphs_are_checked_at_capture_and_pass(emulated_graphs):
    with LLM(GRAPH_PRESET, **F32, backend="triton", **SMALL) as llm:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)         # a failed check would warn
            llm.warmup(progress=False)
        report = llm.cudagraph_report
        assert report.sizes == [1, 2, 4, 8] and report.failed == {} and report.check_seconds > 0
        manager = llm.model_runner.cudagraph_manager
        assert sorted(manager.forwards) == [(s, 1) for s in (1, 2, 4, 8)]     # capture-time inputs kept alive
        capture = llm.trace.by_stage("warmup/capture CUDA graphs")[0]
        assert capture.violations == [] and capture.timings["check"] > 0
        tokens(llm)
        assert any(r.graph == "graph" for r in llm.trace.user_steps())


@pytest.mark.slow          # Triton engines under the interpreter
def test_a_graph_reading_a_non_persistent_input_falls_back_to_eager(emulated_graphs, monkeypatch):
    """Planted: the captured forward reads a copy of the input ids taken at capture, not the
    persistent buffer the step rewrites. The check replays it on other token ids, sees the
    difference, drops every size to eager with one warning, and the outputs stay right."""
    original = model_runner.ModelRunner._prepare_dummy

    def stale_ids(self, num_reqs, num_tokens, for_capture=False, vary_tokens=False):
        batch, tables, md, forward = original(self, num_reqs, num_tokens, for_capture, vary_tokens)
        frozen = batch.input_ids.clone()
        return batch, tables, md, lambda: self.model(frozen, batch.positions, md.by_layer)
    monkeypatch.setattr(model_runner.ModelRunner, "_prepare_dummy", stale_ids)
    with LLM(GRAPH_PRESET, **F32, backend="triton", **SMALL) as llm:
        with pytest.warns(RuntimeWarning, match=r"CUDA graph check: 4 of 4 decode graph sizes .* size 8: row 0"):
            llm.warmup(progress=False)
        report = llm.cudagraph_report
        assert report.sizes == [] and sorted(report.failed) == [1, 2, 4, 8]
        assert "eager token" in report.failed[1] and "graph token" in report.failed[1]
        capture = llm.trace.by_stage("warmup/capture CUDA graphs")[0]
        assert [v.check for v in capture.violations] == ["graph_replays_as_eager"] * 4
        graphs_dropped = tokens(llm)
        steps = list(llm.trace.user_steps())
        assert all(r.graph != "graph" for r in steps) and any(r.graph == "padded eager" for r in steps)
    monkeypatch.undo()
    with LLM(GRAPH_PRESET, **F32, backend="triton", **SMALL, enforce_eager=True) as llm:
        assert tokens(llm) == graphs_dropped


@pytest.mark.slow          # Triton engines under the interpreter
def test_a_capture_that_raises_releases_what_it_captured(emulated_graphs, monkeypatch):
    calls = []
    original = model_runner.ModelRunner._prepare_dummy

    def fails_on_the_third_size(self, num_reqs, num_tokens, for_capture=False, vary_tokens=False):
        if for_capture and not vary_tokens:
            calls.append(num_reqs)
            if len(set(calls)) == 3:
                raise RuntimeError("planted: capture failed")
        return original(self, num_reqs, num_tokens, for_capture, vary_tokens)
    monkeypatch.setattr(model_runner.ModelRunner, "_prepare_dummy", fails_on_the_third_size)
    with LLM(GRAPH_PRESET, **F32, backend="triton", **SMALL) as llm:
        with pytest.raises(RuntimeError, match="planted"):
            llm.warmup(progress=False)
        manager = llm.model_runner.cudagraph_manager
        assert not manager.captured and not manager.outputs and not manager.forwards
        monkeypatch.setattr(model_runner.ModelRunner, "_prepare_dummy", original)
        served = tokens(llm)                                      # it serves, eagerly
        assert all(r.graph != "graph" for r in llm.trace.user_steps())
    with LLM(GRAPH_PRESET, **F32, backend="triton", **SMALL, enforce_eager=True) as llm:
        assert tokens(llm) == served


def test_moe_models_cap_the_capture_sizes():
    assert capture_sizes(520, DENSE_MAX_TOKENS)[-1] == DENSE_MAX_TOKENS
    assert capture_sizes(520)[-1] == 520
    with LLM("tiny-jamba", **F32, max_num_seqs=520, max_num_batched_tokens=520, max_model_len=32,
             num_kv_blocks=64, cudagraph_mode="padded_eager") as llm:
        manager = llm.model_runner.cudagraph_manager
        assert llm.model.max_graph_tokens() == DENSE_MAX_TOKENS
        assert manager.sizes[-1] == DENSE_MAX_TOKENS
        assert manager.padded_size(513, 513, True) is None               # runs eagerly, not captured
    with LLM("tiny-mamba2", **F32, max_num_seqs=520, max_num_batched_tokens=520, max_model_len=32,
             cudagraph_mode="padded_eager") as llm:
        assert llm.model.max_graph_tokens() is None
        assert llm.model_runner.cudagraph_manager.sizes[-1] == 520


def test_runner_methods_run_on_the_engine_device(monkeypatch):
    entered = []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(torch.cuda, "device", Recorder)

    class Runner:
        def __init__(self, device):
            self.device = torch.device(device)

        @on_device
        def launch(self):
            return "ran"
    assert Runner("cuda:1").launch() == "ran" and entered == [torch.device("cuda:1")]
    assert Runner("cpu").launch() == "ran" and len(entered) == 1
    for name in ("execute_model", "sample_tokens", "profile_run", "dummy_run", "capture_cudagraphs"):
        assert getattr(model_runner.ModelRunner, name).__wrapped__, name


def test_stage_clock_reads_device_times_from_events():
    class FakeEvent:
        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):            # milliseconds, as torch.cuda.Event's
            return (end.t - self.t) * 1e3 + 2.0   # the device ran 2 ms longer than the host saw

    clock = StageClock(use_events=True, event_factory=FakeEvent)
    clock.start()
    clock.mark("prepare_inputs")
    clock.skip()
    clock.mark("forward")
    clock.mark("wait", event=False)
    device = clock.device_times()
    assert set(clock.host) == {"prepare_inputs", "forward", "wait"}
    assert set(device) == {"prepare_inputs", "forward"}
    assert all(abs(device[k] - clock.host[k] - 0.002) < 1e-3 for k in device)
    cpu = StageClock(use_events=False)
    cpu.start()
    cpu.mark("forward")
    assert cpu.device_times() == {} and "forward" in cpu.host


def test_steps_record_host_stages_and_no_device_times_on_a_cpu():
    with LLM("tiny-bamba", **F32) as llm:
        llm.generate(PROMPTS, GREEDY)
        rec = llm.trace[-1]
        stages = {"schedule", "prepare_inputs", "build_metadata", "forward", "sample", "wait", "update"}
        assert stages <= set(rec.timings)
        assert rec.device_timings == {}


# ---- host-to-device copies of a decode step ----------------------------------------------------------
def decode_step_transfers(preset: str, backend: str, cudagraph_mode: str, params=GREEDY) -> dict[str, int]:
    from toolkit.host import TRANSFERS
    with LLM(preset, **F32, backend=backend, cudagraph_mode=cudagraph_mode, inspect="off", **SMALL) as llm:
        for prompt in PROMPTS:
            llm.add_request(prompt, params)
        llm.step()                      # the prefills
        llm.step()
        TRANSFERS.clear()
        llm.step()                      # a decode step
        return dict(TRANSFERS)


# decode steps in every sampling mode: greedy; seeded temperature with top-k and top-p (the rows'
# parameters are gathered on the device from the table copied when they were added, by the staged
# idx_mapping); logprobs of the sampled tokens
SAMPLING_MODES = {
    "greedy": GREEDY,
    "seeded-top-k-top-p": SamplingParams(max_tokens=5, temperature=0.8, top_k=5, top_p=0.9, seed=3,
                                         ignore_eos=True),
    "logprobs": SamplingParams(max_tokens=5, temperature=0.7, seed=4, logprobs=3, ignore_eos=True),
}


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-bamba", "tiny-mamba", "tiny-mamba2", "tiny-lfm2",
                                    "tiny-qwen3-next", "tiny-jamba", "tiny-zamba2", "tiny-falcon-h1",
                                    "tiny-nemotron-h", "tiny-granite-hybrid"])
def test_a_decode_step_copies_its_host_data_in_one_transfer(preset):
    """The staged inputs (runner/staging.py) go in one copy (one arena for every dtype); the only other transfer is
    the torch reference attention's batch of single-token rows, which the Triton kernel never
    asks for (checked below on the Triton backend). Sampled and logprob steps copy nothing more."""
    for mode in ("none", "padded_eager"):
        for name, params in SAMPLING_MODES.items() if preset == "tiny-bamba" else [("greedy", GREEDY)]:
            transfers = decode_step_transfers(preset, "torch", mode, params)
            assert transfers.pop("copy_pinned") == 1, (mode, name, transfers)
            assert transfers in ({}, {"to_device": 1}), (mode, name, transfers)


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# tiny-mamba2 drafting for tiny-bamba, k = 3
DRAFT_MODEL = {"method": "draft_model", "model": "tiny-mamba2", "num_speculative_tokens": 3}


def verify_step_transfers(mode: str, params: SamplingParams, spec: dict = NGRAM) -> tuple[dict[str, int], int]:
    """The transfers of the first decode step that verifies drafts (tiny-bamba, torch), and the
    drafts it verified (0: no step did). A draft model's step must also have run all k of its
    forwards (the target's verify forward and the draft's catch-up and k - 1 guesses)."""
    from toolkit.host import TRANSFERS
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8, 9]]
    with LLM("tiny-bamba", **F32, cudagraph_mode=mode, inspect="off", speculative_config=spec, **SMALL) as llm:
        draft = llm.model_runner.draft
        for prompt in prompts:
            llm.add_request({"prompt_token_ids": prompt}, dataclasses.replace(params, max_tokens=24))
        while llm.has_unfinished_requests():
            TRANSFERS.clear()
            forwards = draft.stats.forwards if draft else 0
            llm.step()
            batch = llm.model_runner.execute_state.input_batch
            all_forwards = draft is None or draft.stats.forwards - forwards == spec["num_speculative_tokens"]
            if not batch.has_prefill and batch.num_drafts_np.sum() > 0 and all_forwards:
                return dict(TRANSFERS), int(batch.num_drafts_np.sum())
    return {}, 0


@pytest.mark.parametrize("mode", ["none", "padded_eager"])
def test_a_verify_step_copies_its_host_data_in_one_transfer(mode):
    """Speculative decoding's verify steps: the drafts and each token's request row are staged with
    the rest; the input ids, the sampler's rows and positions and the kept counts (the last sampled
    tokens, the recurrent state's accepted column) are made on the device. In every sampling mode.
    (With prefix caching, a step whose rows enter a new block also sends the state pages to copy.)"""
    for name, params in SAMPLING_MODES.items():
        transfers, drafts = verify_step_transfers(mode, params)
        assert drafts > 0, (mode, name, "the step verified no drafts: the test checks nothing")
        assert transfers.pop("copy_pinned") == 1, (mode, name, transfers)
        assert transfers in ({}, {"to_device": 1}), (mode, name, transfers)     # the torch attention's


@pytest.mark.parametrize("mode", ["none", "padded_eager"])
def test_a_draft_model_step_copies_its_host_data_in_two_transfers(mode):
    """A step with the draft model inside: the target's verify step stages its data in one copy
    (as above), and the draft's k forwards (its catch-up and its k - 1 guesses: every forward's
    batch, block tables, slot mappings, token ids and state pages to copy, each in a bank of one
    staging) in one more, one flush per step, however large k is. (MRV2's draft builds its inputs
    from the target's on the device instead: its step makes the target's copy only.)"""
    for name, params in SAMPLING_MODES.items():
        transfers, drafts = verify_step_transfers(mode, params, DRAFT_MODEL)
        assert drafts > 0, (mode, name, "the step verified no drafts: the test checks nothing")
        assert transfers.pop("copy_pinned") == 2, (mode, name, transfers)
        assert transfers in ({}, {"to_device": 1}), (mode, name, transfers)     # the torch attention's


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_a_step_entering_a_new_block_with_prefix_caching_copies_in_one_transfer(spec):
    """Prefix caching ("align"): a decode step whose rows enter a new block's state column copies
    their states to the new pages before the forward; the page indices (and the rows whose accepted
    count goes back to 1) are staged with the step's inputs (`ModelState.stage_state`), so the step
    still makes one copy. With speculation: a verify step that enters a new block."""
    from toolkit.host import TRANSFERS
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8, 9]]
    seen = 0
    with LLM("tiny-bamba", **F32, inspect="off", enable_prefix_caching=True, block_size=4,
             speculative_config=spec, **SMALL) as llm:
        for prompt in prompts:
            llm.add_request({"prompt_token_ids": prompt}, dataclasses.replace(GREEDY, max_tokens=16))
        while llm.has_unfinished_requests():
            TRANSFERS.clear()
            llm.step()
            state = llm.model_runner.execute_state
            batch = state.input_batch
            if batch.has_prefill or state.state_copies is None or (spec and not batch.num_drafts_np.sum()):
                continue
            seen += 1
            transfers = dict(TRANSFERS)
            assert transfers.pop("copy_pinned") == 1, transfers
            assert transfers in ({}, {"to_device": 1}), transfers     # the torch attention's
    assert seen, "no decode step entered a new block: the test checks nothing"


@pytest.mark.slow          # Triton engines under the interpreter
def test_a_decode_step_on_the_triton_backend_makes_one_transfer():
    assert decode_step_transfers("tiny-bamba", "triton", "padded_eager") == {"copy_pinned": 1}
