"""Kernels per decode step (toolkit/inspect/launches.py). A CUDA-graph decode step at batch 1 costs
about its kernel count times a few microseconds, so the Triton backend's fusions are pinned here:
a Mamba2 layer's decode is 8 launches (norm, residual add, in_proj, dt, conv, state update, gated
norm, out_proj) where the torch references take about 75; RoPE is one launch for q and k."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit import LLM, SamplingParams  # noqa: E402
from toolkit.inspect.launches import LaunchCounter  # noqa: E402


def _decode_forward_launches(preset: str, backend: str) -> tuple[LaunchCounter, int]:
    llm = LLM(preset, inspect="off", backend=backend, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=32)
    model = llm.model
    counters: list[LaunchCounter] = []
    forward = model.forward

    def counted(*args, **kwargs):
        counters.append(LaunchCounter())
        with counters[-1]:
            return forward(*args, **kwargs)

    model.forward = counted
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    layers = len(model.body.layers)
    llm.shutdown()
    return counters[-1], layers


def test_mamba2_decode_layer_is_eight_launches_on_the_triton_backend():
    counter, layers = _decode_forward_launches("tiny-mamba2", "triton")
    per_layer = {"linear": 2, "add": 1}                     # in/out projections, residual add
    per_layer_triton = {"_rms_norm_kernel": 1, "_dt_kernel": 1, "_conv_update_kernel": 1, "_ssu_kernel": 1,
                        "_rms_norm_gated_kernel": 1}
    assert dict(counter.torch_ops) == {**{k: v * layers for k, v in per_layer.items()}, "embedding": 1}
    assert dict(counter.triton) == {k: v * layers + (k == "_rms_norm_kernel") for k, v in per_layer_triton.items()}
    assert counter.total == 8 * layers + 2                   # + embedding and the final norm


def test_rope_and_norms_are_one_launch_each_in_attention_layers():
    counter, layers = _decode_forward_launches("tiny-llama", "triton")
    assert counter.triton["_rotary_kernel"] == layers            # q and k together
    assert counter.triton["_rms_norm_kernel"] == 2 * layers + 1
    assert not {"cos", "sin", "cat", "neg", "pow", "rsqrt"} & set(counter.torch_ops)


def test_the_torch_backend_counts_the_same_way():
    """The counter is not blind: the reference path of the same step launches far more."""
    counter, layers = _decode_forward_launches("tiny-mamba2", "torch")
    assert counter.total > 40 * layers and not counter.triton


def test_counter_counts_kernels_not_views_or_allocations():
    x = torch.randn(4, 6)
    with LaunchCounter() as c:
        y = x.view(2, 12).t()[0]            # views
        torch.empty(3)
        z = (y + 1) * 2                    # two kernels
        z.sum()                            # one more
    assert dict(c.torch_ops) == {"add": 1, "mul": 1, "sum": 1}
