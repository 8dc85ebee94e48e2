"""compare_with_hf (our layers vs HF transformers, first divergence) and diff_traces (where two
traces of the same workload part). CPU, tiny presets."""
from __future__ import annotations

import pytest
import torch

from toolkit import LLM, SamplingParams
from toolkit.inspect.compare_hf import DivergenceReport, compare_with_hf
from toolkit.inspect.trace import Trace
from toolkit.inspect.trace_diff import TraceDiff, diff_traces
from toolkit.models import save_hf_folder

# two prompts of different lengths; with a budget of 8 tokens the long one is prefilled in chunks
# and shares steps with the short one's prefill and decodes
PROMPTS = [list(range(3, 16)), list(range(40, 46))]
MAX_TOKENS = 8


def make_llm(preset: str, budget: int = 8, **kw) -> LLM:
    return LLM(preset, device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=budget,
               seed=0, **kw)


def mixer_of(llm: LLM, layer: int) -> torch.nn.Module:
    block = llm.model.body.layers[layer]
    return getattr(block, "mamba", None) or block.mixer


def hook_counts(llm: LLM) -> list[int]:
    body = llm.model.body
    mods = list(body.layers) + [getattr(body, body.final_norm_name)]
    return [len(m._forward_hooks) for m in mods]


# ---- compare_with_hf ----------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny-falcon-h1", "tiny-granite-hybrid", "tiny-zamba2", "tiny-nemotron-h",
                                    "tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-olmo-hybrid",
                                    "tiny-kimi-linear", "tiny-lfm2-moe", "tiny-minimax", "tiny-lfm3",
                                    "tiny-xlstm"])
def test_model_zoo_ii_and_iii_have_no_divergence(preset):
    """Falcon-H1 and Granite scale the embeddings before the first block: HF's entry 0 is that
    scaled input, which must not be mistaken for a layer output."""
    rep = compare_with_hf(make_llm(preset), PROMPTS[:1])
    assert not rep.diverged, str(rep)
    assert all(v <= 1e-4 for v in rep.per_layer_max_diff.values()), rep.per_layer_max_diff


@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-mamba2"])
def test_correct_model_has_no_divergence(preset):
    llm = make_llm(preset)
    hooks_before = hook_counts(llm)
    rep = compare_with_hf(llm, PROMPTS)
    assert isinstance(rep, DivergenceReport)
    assert not rep.diverged, str(rep)
    assert rep.num_tokens_compared > 0 and rep.num_steps > 0 and rep.num_layers == 4
    # every token our run consumed (the last sampled one is never fed back)
    assert {rid: len(t) for rid, t in rep.tokens.items()} == {
        "0": len(PROMPTS[0]) + MAX_TOKENS - 1, "1": len(PROMPTS[1]) + MAX_TOKENS - 1}
    assert rep.num_tokens_compared == sum(len(t) for t in rep.tokens.values())
    # all four blocks, the final norm and the logits were compared
    assert len(rep.per_layer_max_diff) == 6 and "logits" in rep.per_layer_max_diff
    assert all(v <= 1e-4 for v in rep.per_layer_max_diff.values()), rep.per_layer_max_diff
    assert str(rep).startswith("no divergence over")
    assert "<script" not in rep._repr_html_() and "<table" in rep._repr_html_()
    assert hook_counts(llm) == hooks_before          # our hooks are gone
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("preset,layer", [("tiny-bamba", 2), ("tiny-bamba", 0),
                                          ("tiny-mamba2", 2), ("tiny-mamba2", 0)])
def test_perturbed_layer_is_named(preset, layer):
    llm = make_llm(preset)
    with torch.no_grad():
        mixer_of(llm, layer).in_proj.weight.add_(1e-2)
    rep = compare_with_hf(llm, PROMPTS)
    assert rep.diverged
    assert rep.layer == layer and rep.layer_name.endswith(f"layers.{layer}"), str(rep)
    assert rep.step_index == 0 and rep.request_id in ("0", "1") and rep.position is not None
    atol, rtol = rep.tolerance
    assert rep.max_abs_diff > atol + rtol * rep.max_abs_ref
    # the layers before the perturbed one stay within tolerance over the whole run
    for i in range(layer):
        assert rep.per_layer_max_diff[rep.layer_name.replace(f"layers.{layer}", f"layers.{i}")] <= 1e-4
    assert str(rep).startswith(f"first divergence at step 0, request {rep.request_id!r}, layer {layer} (")


def test_reference_folder_follows_the_weights(tmp_path):
    """reference=<folder> (here: the perturbed weights themselves) is what we compare with."""
    llm = make_llm("tiny-bamba")
    with torch.no_grad():
        mixer_of(llm, 2).in_proj.weight.add_(1e-2)
    save_hf_folder(llm, tmp_path)
    rep = compare_with_hf(llm, PROMPTS, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                          reference=tmp_path)
    assert not rep.diverged, str(rep)


def test_hooks_removed_on_error(monkeypatch):
    llm = make_llm("tiny-mamba2")
    before = hook_counts(llm)
    real_step = llm.step

    def failing_step():
        real_step()                     # the hooks fire, then the step "fails"
        raise RuntimeError("planted")
    monkeypatch.setattr(llm, "step", failing_step)
    with pytest.raises(RuntimeError, match="planted"):
        compare_with_hf(llm, PROMPTS)
    assert hook_counts(llm) == before
    with pytest.raises(ValueError):     # 1 sampling params for 2 prompts
        compare_with_hf(make_llm("tiny-mamba2"), PROMPTS, [SamplingParams()])


# ---- diff_traces --------------------------------------------------------------------------------

DIFF_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 101, 250, 103, 104, 105, 106]]
ONLY_IN_1 = 250          # a token of request "1"'s prompt only


def run_trace(budget: int, perturb=None, prompts=DIFF_PROMPTS, **kw) -> Trace:
    """The same seeded workload (random sampling, fixed seed) stepped by hand."""
    llm = make_llm("tiny-bamba", budget, **kw)
    if perturb is not None:
        perturb(llm)
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    for p in prompts:
        llm.add_request({"prompt_token_ids": p}, sp)
    trace = Trace(None)
    while llm.has_unfinished_requests():
        trace.append(llm.step())
    return trace


@pytest.fixture(scope="module")
def unchunked() -> Trace:
    return run_trace(64)


def test_chunked_and_unchunked_traces_agree(unchunked):
    chunked = run_trace(5)
    assert len(chunked) > len(unchunked)             # the steps do not align one to one
    d = diff_traces(unchunked, chunked)
    assert isinstance(d, TraceDiff)
    assert d.identical, str(d)
    assert d.num_requests_compared == 2 and d.num_tokens_compared == 12 and d.num_logits_compared >= 12
    assert str(d).startswith("traces agree")
    assert "<script" not in d._repr_html_()


def test_planted_fault_is_found_for_the_right_request(unchunked):
    def perturb(llm):      # only request "1"'s prompt holds this token (untied embeddings)
        with torch.no_grad():
            llm.model.get_input_embeddings().weight[ONLY_IN_1] += 0.5
    d = diff_traces(unchunked, run_trace(5, perturb))
    assert not d.identical
    assert d.request_id == "1" and d.what in {"logits", "token"}, str(d)
    assert d.position == len(DIFF_PROMPTS[1])        # the first sampled position
    assert d.step_a == 0 and d.step_b is not None and d.step_b > 0
    assert d.per_request["1"].position == d.position
    assert "request '1'" in str(d) and "<table" in d._repr_html_()


def test_missing_request(unchunked):
    d = diff_traces(unchunked, run_trace(64, prompts=DIFF_PROMPTS[:1]))
    assert not d.identical and d.request_id == "1" and d.what == "missing request"
    assert "0" not in d.per_request


def test_states_compared_with_full_inspect():
    a = run_trace(64, inspect="full")
    assert any(r.states for r in a), "inspect='full' recorded no states"
    b = run_trace(5, inspect="full")
    same = diff_traces(a, b)
    assert same.identical and same.num_states_compared > 0, str(same)

    def perturb(llm):      # layer 2's conv bias: its conv state (conv input) stays, its SSM state moves
        with torch.no_grad():
            mixer_of(llm, 2).conv1d.bias.add_(1e-2)
    d = diff_traces(a, run_trace(5, perturb, inspect="full"))
    assert not d.identical and d.what.startswith("state ") and "layers.2" in d.what, str(d)
