"""kernels/kda.py: Kimi Delta Attention (the gated delta rule with a log decay per key channel).

Truth is external: the torch references (kernels/kda_ref.py: the per-token recurrence and the chunked
form) equal HF transformers' `recurrent_kimi_delta_attention` and `chunk_kimi_delta_attention`
(Kimi Linear) on ragged sequences with initial states. The Triton kernels, under TRITON_INTERPRET=1
on the CPU (conftest) or compiled on CUDA, equal those references: the decode update (padded rows,
verify rows at every accepted count) and the varlen prefill (mixed initial states, a padded sequence,
internal checkpoints), fp32 / bf16 inputs, g and beta as strided views as a mixer passes them; the
launchers name a malformed g. A per-head decay written out per channel gives Gated DeltaNet's result.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import KERNEL_DEVICE as DEV

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)

from toolkit.attention.gdn import compute_gdn_chunk_metadata
from toolkit.kernels import gated_delta_rule_ref, kda, kda_ref
from toolkit.kernels.state_slots_ref import Checkpoints, initial_states_at

TOL = dict(atol=1e-5, rtol=1e-5)
LENS = [1, 15, 2, 16, 40, 17, 5]                 # around the chunk of 16; the last sequence padded
HAS_INIT = [True, False, False, True, True, False, True]
SLOTS = [4, 0, 7, 2, 8, 5, -1]
UNTOUCHED = [1, 3, 6]
CHUNK = 16


def _inputs(gen: torch.Generator, dtype, n: int, h: int, kd: int, vd: int, device=DEV):
    """q, k [n, H, K], v [n, H, V] as column slices of one conv output (model dtype); g fp32 [n, H, K]
    (mild per-channel decays, a row view of a wider tensor with a contiguous last dim) and beta (model
    dtype, a strided view)."""
    width = 2 + 2 * h * kd + h * vd + 3
    xc = torch.randn(n, width, generator=gen).to(device=device, dtype=dtype)
    q = xc[:, 2:2 + h * kd].reshape(n, h, kd)
    k = xc[:, 2 + h * kd:2 + 2 * h * kd].reshape(n, h, kd)
    v = xc[:, 2 + 2 * h * kd:2 + 2 * h * kd + h * vd].reshape(n, h, vd)
    g_wide = torch.zeros(n, h + 1, kd, device=device)
    g_wide[:, 1:] = -torch.rand(n, h, kd, generator=gen).to(device) * 0.4
    b_wide = torch.zeros(n, 2 * h, device=device, dtype=dtype)
    b_wide[:, h:] = torch.rand(n, h, generator=gen).to(device=device, dtype=dtype)
    return q, k, v, g_wide[:, 1:], b_wide[:, h:]


def _layout(lens: list[int], chunk: int = CHUNK, device=DEV):
    return [torch.from_numpy(a).to(device) for a in compute_gdn_chunk_metadata(np.array(lens), chunk)]


def test_references_equal_transformers_kimi_delta_attention():
    """Per sequence, from its initial state: our recurrence and chunked form against HF's (HF's state is
    [H, K, V], ours [H, V, K]); chunk sizes 4 and 16 inside the sequences."""
    gen = torch.Generator().manual_seed(0)
    h, kd, vd, lens = 2, 8, 12, [5, 13, 1, 20]
    q, k, v, g, beta = _inputs(gen, torch.float32, sum(lens), h, kd, vd, "cpu")
    init = torch.randn(len(lens), h, vd, kd, generator=gen) * 0.3
    cu = torch.tensor(np.cumsum([0] + lens))
    y_rec, f_rec = kda_ref.kda_recurrent_varlen(q, k, v, g, beta, cu, init)
    for chunk in (4, 16):
        y_chunk, f_chunk = kda_ref.kda_chunk_varlen(q, k, v, g, beta, *_layout(lens, chunk, "cpu"), chunk, init)
        torch.testing.assert_close(y_chunk, y_rec, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(f_chunk, f_rec, atol=1e-6, rtol=1e-6)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        args = [x[a:b][None].contiguous() for x in (q, k, v, g, beta)]
        start = init[i:i + 1].transpose(-1, -2).contiguous()
        y_hf, f_hf = recurrent_kimi_delta_attention(*args, initial_state=start.clone(), output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(y_rec[a:b], y_hf[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(f_rec[i], f_hf[0].transpose(-1, -2), atol=1e-6, rtol=1e-6)
        y_hf, f_hf = chunk_kimi_delta_attention(*args, chunk_size=8, initial_state=start.clone(),
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(y_rec[a:b], y_hf[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(f_rec[i], f_hf[0].transpose(-1, -2), atol=1e-6, rtol=1e-6)


def test_a_decay_equal_across_channels_is_gated_deltanet():
    """g [T, H, K] with every channel equal to a per-head g gives the gated delta rule's result."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = _inputs(gen, torch.float32, 9, 2, 8, 4, "cpu")
    per_head = g[..., 0]
    cu = torch.tensor([0, 4, 9])
    y_kda, f_kda = kda_ref.kda_recurrent_varlen(q, k, v, per_head[..., None].expand_as(g).contiguous(), beta, cu)
    y_gdn, f_gdn = gated_delta_rule_ref.gdn_recurrent_varlen(q, k, v, per_head, beta, cu)
    torch.testing.assert_close(y_kda, y_gdn, atol=0, rtol=0)
    torch.testing.assert_close(f_kda, f_gdn, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h, kd, vd", [(2, 16, 12), (1, 12, 40)])      # masked K / V tails, 2 V blocks
def test_kda_update_equals_reference(dtype, h, kd, vd):
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta = _inputs(gen, dtype, 5, h, kd, vd)
    assert not g.is_contiguous() and g.stride(-1) == 1 and not beta.is_contiguous()
    state = (torch.randn(7, h, vd, kd, generator=gen) * 0.5).to(DEV)
    idx = torch.tensor([3, -1, 0, 6, -1], dtype=torch.int32, device=DEV)
    ours, ref = state.clone(), state.clone()
    y = kda.kda_update(ours, q, k, v, g, beta, idx)
    y_ref = kda_ref.kda_update_at_slots(ref, q, k, v, g, beta, idx)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(ours, ref, **TOL)
    assert (y[[1, 4]] == 0).all() and torch.equal(ours[[1, 2, 4, 5]], state[[1, 2, 4, 5]])


@pytest.mark.parametrize("accepted", [1, 2, 3])
def test_kda_verify_rows_equal_reference(accepted):
    """Verify rows (speculative decoding): 3 rows of 3, 1 and 2 tokens, state columns [R, 3], each row
    starting from column num_accepted - 1; a padding row (column 0 = -1) computes nothing."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = _inputs(gen, torch.float32, 6, 2, 8, 12)
    state = (torch.randn(12, 2, 12, 8, generator=gen) * 0.5).to(DEV)
    cols = torch.tensor([[1, 2, 3], [4, 5, 6], [-1, -1, -1], [7, 8, 9]], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 3, 4, 4, 6], dtype=torch.int32, device=DEV)
    acc = torch.tensor([accepted, 1, 1, min(accepted, 2)], dtype=torch.int32, device=DEV)
    ours, ref = state.clone(), state.clone()
    kw = dict(query_start_loc=qsl, num_accepted_tokens=acc)
    y = kda.kda_update(ours, q, k, v, g, beta, cols, **kw)
    y_ref = kda_ref.kda_update_at_slots(ref, q, k, v, g, beta, cols, **kw)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(ours, ref, **TOL)


def _prefill_case(dtype, h, kd, vd, lens, has_init, slots, num_slots, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = _inputs(gen, dtype, sum(lens), h, kd, vd)
    state = (torch.randn(num_slots, h, vd, kd, generator=gen) * 0.5).to(DEV)
    return ([q, k, v, g, beta, *_layout(lens), CHUNK], state, torch.tensor(slots, dtype=torch.int32, device=DEV),
            torch.tensor(has_init, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_prefill_equals_reference(dtype):
    args, state, idx, flags = _prefill_case(dtype, 2, 16, 12, LENS, HAS_INIT, SLOTS, 9, seed=4)
    ours, ref = state.clone(), state.clone()
    y = kda.kda_prefill(*args, ours, idx, flags)
    y_ref = kda_ref.kda_prefill_at_slots(*args, ref, idx, flags)              # chunked
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(ours, ref, **TOL)
    assert torch.equal(ours[UNTOUCHED], state[UNTOUCHED])
    q, k, v, g, beta = args[:5]                                              # and the plain recurrence
    y_seq, finals = kda_ref.kda_recurrent_varlen(q, k, v, g, beta, torch.tensor(np.cumsum([0] + LENS[:-1]),
                                                                                 device=DEV),
                                                 initial_states_at(state, idx[:-1], flags[:-1]))
    n = sum(LENS[:-1])
    torch.testing.assert_close(y[:n], y_seq[:n], **TOL)
    torch.testing.assert_close(ours[idx[:-1].long()], finals, **TOL)


def test_kda_prefill_checkpoints_equal_reference():
    """Internal checkpoints (prefix caching "all"): the state after chosen tokens, chunk ends or not,
    a -1 slot writing nothing."""
    lens, has_init, slots = [5, 20, 1, 18, 7], [True, False, False, True, True], [4, 0, 7, 2, -1]
    args, state, idx, flags = _prefill_case(torch.float32, 2, 8, 12, lens, has_init, slots, 14, seed=5)
    ckpt = Checkpoints(torch.tensor([0, 3, 5, 22, 41], device=DEV),
                       torch.tensor([9, -1, 10, 11, 1], dtype=torch.int32, device=DEV))
    ours, ref = state.clone(), state.clone()
    y = kda.kda_prefill(*args, ours, idx, flags, checkpoints=ckpt)
    y_ref = kda_ref.kda_prefill_at_slots(*args, ref, idx, flags, checkpoints=ckpt)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(ours, ref, **TOL)
    untouched = [3, 5, 6, 8, 12, 13]
    assert torch.equal(ours[untouched], state[untouched])
    assert all(not torch.equal(ours[s], state[s]) for s in [9, 10, 11, 1])


def test_kda_launchers_name_what_is_wrong():
    state = torch.zeros(3, 2, 8, 16)
    q, v = torch.zeros(2, 2, 16), torch.zeros(2, 2, 8)
    beta = torch.zeros(2, 2)
    idx = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"g must be \[B=2, H=2, K=16\] \(one log decay per key channel\)"):
        kda.kda_update(state, q, q, v, torch.zeros(2, 2), beta, idx)
    with pytest.raises(ValueError, match=r"contiguous in its last dimension, got \(2, 2, 16\) strides \(1, 2, 4\)"):
        kda.kda_update(state, q, q, v, torch.zeros(16, 2, 2).permute(2, 1, 0), beta, idx)
    with pytest.raises(ValueError, match=r"as many key heads as value heads: q/k have H=2, v has 4"):
        kda.kda_update(torch.zeros(3, 4, 8, 16), q, q, torch.zeros(2, 4, 8), torch.zeros(2, 4, 16), beta, idx)
    with pytest.raises(ValueError, match=r"g must be \[\.\.\., H, K\] like q"):
        kda_ref.kda_update_at_slots(state, q, q, v, torch.zeros(2, 2), beta, idx)
