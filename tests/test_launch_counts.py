"""Kernels per decode step (toolkit/inspect/launches.py). A CUDA-graph decode step at batch 1 costs
about its kernel count times a few microseconds, so the Triton backend's fusions are pinned here:
a Mamba2 layer's decode is 7 launches (norm, residual add, in_proj, conv, state update with dt
prepared inside, gated norm, out_proj) where the torch references take about 75; RoPE is one launch for q and k."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit import LLM
from toolkit.inspect.launches import LaunchCounter, count_decode_step


def _decode_step_launches(preset: str, backend: str) -> tuple[LaunchCounter, LaunchCounter, int]:
    """(forward, whole runner step) counters of a decode step at batch 1, and the layers."""
    llm = LLM(preset, inspect="off", backend=backend, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=32)
    forward, step = count_decode_step(llm)
    layers = len(llm.model.body.layers)
    llm.shutdown()
    return forward, step, layers


def _decode_forward_launches(preset: str, backend: str) -> tuple[LaunchCounter, int]:
    forward, _, layers = _decode_step_launches(preset, backend)
    return forward, layers


def test_mamba2_decode_layer_is_seven_launches_on_the_triton_backend():
    counter, layers = _decode_forward_launches("tiny-mamba2", "triton")
    per_layer = {"linear": 2, "add": 1}                     # in/out projections, residual add
    per_layer_triton = {"_rms_norm_kernel": 1, "_conv_update_kernel": 1, "_ssu_kernel": 1,
                        "_rms_norm_gated_kernel": 1}
    assert dict(counter.torch_ops) == {**{k: v * layers for k, v in per_layer.items()}, "embedding": 1}
    assert dict(counter.triton) == {k: v * layers + (k == "_rms_norm_kernel") for k, v in per_layer_triton.items()}
    assert counter.total == 7 * layers + 2                   # + embedding and the final norm


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


def test_the_rest_of_a_decode_step_launches_little():
    """Outside the forward (eager even with CUDA graphs): the step's host data in two staged copies
    (int32 and int64: positions, query_start_loc, seq_lens, idx_mapping, logits_indices, the block
    table and the slot mapping, runner/staging.py), the input ids gathered on the device from the
    last sampled tokens, the LM head, argmax, the sampled ids' copy to the host and remembering
    them. It was 28 before the slot mapping moved to the host and the padding fills into the
    copies, 13 before the staging."""
    forward, step, _ = _decode_step_launches("tiny-mamba2", "triton")
    rest = step.total - forward.total
    assert rest <= 8, step.table()
    assert not {"repeat_interleave", "remainder", "floor_divide", "fill_", "zero_"} & set(step.torch_ops)
