"""kernels/gated_delta_rule.py: Gated DeltaNet (Qwen3-Next) gated delta rule kernels against their torch
references, under TRITON_INTERPRET=1 on the CPU (set in conftest) or compiled on CUDA (harness.KERNEL_DEVICE):
the decode update and the sequential varlen prefill, tiny shapes, fp32 / fp16 / bf16 inputs (the state cache and
all math fp32), padded rows, mixed initial states, q / k / v as views of one conv output and g / beta as strided
views, as the mixer passes them. Internal checkpoints (prefix caching): the prefill also saves the state after
chosen tokens (chunk ends or not), as the reference does; the reference's checkpoint equals the final state of a
prefill of the prefix."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import KERNEL_DEVICE as DEV  # the test device: CPU (interpreter) or CUDA (compiled)
from harness import checkpoint_prefixes

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.attention.gdn import compute_gdn_chunk_metadata
from toolkit.kernels import gated_delta_rule as gdr
from toolkit.kernels import gated_delta_rule_ref
from toolkit.kernels.gated_delta_rule_ref import gdn_recurrent_varlen
from toolkit.kernels.state_slots_ref import Checkpoints, initial_states_at
from toolkit.layers.gdn import gdn_gating

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp32 math on both sides from the same rounded inputs and y / state fp32: tight for every input dtype
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(g: torch.Generator, dtype, n, hk, hv, kd, vd, device=DEV):
    """q, k [n, Hk, K], v [n, Hv, V]: column slices of one conv output (model dtype); g fp32 and
    beta (model dtype) from `gdn_gating`, then as strided column views of wider tensors."""
    width = 3 + 2 * hk * kd + hv * vd + 5
    xc = torch.randn(n, width, generator=g).to(device=device, dtype=dtype)
    q = xc[:, 3:3 + hk * kd].reshape(n, hk, kd)
    k = xc[:, 3 + hk * kd:3 + 2 * hk * kd].reshape(n, hk, kd)
    v = xc[:, 3 + 2 * hk * kd:3 + 2 * hk * kd + hv * vd].reshape(n, hv, vd)
    ba = torch.randn(n, 2 * hv, generator=g).to(device=device, dtype=dtype)
    A_log = torch.log(torch.rand(hv, generator=g) * 0.3 + 0.02).to(device)     # mild decay: the state matters
    dt_bias = torch.randn(hv, generator=g).to(device)
    gate, beta = gdn_gating(ba[:, hv:], ba[:, :hv], A_log, dt_bias)
    g_wide = torch.zeros(n, hv + 3, device=device)
    g_wide[:, 1:hv + 1] = gate
    b_wide = torch.zeros(n, 2 * hv, device=device, dtype=dtype)
    b_wide[:, hv:] = beta
    return q, k, v, g_wide[:, 1:hv + 1], b_wide[:, hv:]


SHAPES = [(2, 4, 16, 12), (1, 1, 12, 40), (2, 2, 8, 8)]     # (Hk, Hv, K, V): GVA, masked K / V tails, 2 V blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk, hv, kd, vd", SHAPES)
def test_gdn_update_equals_reference(dtype, hk, hv, kd, vd):
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = _inputs(gen, dtype, 5, hk, hv, kd, vd)
    assert not q.is_contiguous() and not g.is_contiguous() and not beta.is_contiguous()
    q[2].mul_(1e-3)
    k[3].mul_(1e-3)                      # near-zero rows: the l2norm's eps matters
    state = (torch.randn(7, hv, vd, kd, generator=gen) * 0.5).to(DEV)
    idx = torch.tensor([3, -1, 0, 6, -1], dtype=torch.int32, device=DEV)
    ours_state, ref_state = state.clone(), state.clone()
    y = gdr.gdn_update(ours_state, q, k, v, g, beta, idx)
    y_ref = gated_delta_rule_ref.gdn_update_at_slots(ref_state, q, k, v, g, beta, idx)
    assert y.dtype == torch.float32 and y.shape == (5, hv, vd)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(ours_state, ref_state, **TOL)
    assert (y[[1, 4]] == 0).all()
    assert torch.equal(ours_state[[1, 2, 4, 5]], state[[1, 2, 4, 5]])    # padded rows and unused slots
    assert not torch.equal(ours_state[[0, 3, 6]], state[[0, 3, 6]])


def test_gdn_update_without_l2norm_and_int64_indices():
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = _inputs(gen, torch.float32, 3, 2, 4, 16, 8)
    state = (torch.randn(4, 4, 8, 16, generator=gen) * 0.5).to(DEV)
    idx = torch.tensor([2, 0, -1], device=DEV)
    ours_state, ref_state = state.clone(), state.clone()
    y = gdr.gdn_update(ours_state, q * 0.2, k * 0.2, v, g, beta, idx, use_qk_l2norm=False)
    y_ref = gated_delta_rule_ref.gdn_update_at_slots(ref_state, q * 0.2, k * 0.2, v, g, beta, idx, use_qk_l2norm=False)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(ours_state, ref_state, **TOL)
    assert torch.equal(ours_state[[1, 3]], state[[1, 3]])


# lengths 1, 2, chunk-1, chunk, chunk+1 and longer (chunk_size 16), initial states mixed in; the last
# sequence is padded (slot -1, says it has a state: reads nothing, writes nothing, y from zeros)
LENS = [1, 15, 2, 16, 40, 17, 5]
HAS_INIT = [True, False, False, True, True, False, True]
SLOTS = [4, 0, 7, 2, 8, 5, -1]
UNTOUCHED = [1, 3, 6]
CHUNK = 16


def _prefill_case(dtype, hk, hv, kd, vd, lens, has_init, slots, num_slots, seed, device=DEV, chunk=CHUNK):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = _inputs(gen, dtype, sum(lens), hk, hv, kd, vd, device)
    cu, sidx, last = (torch.from_numpy(a).to(device) for a in compute_gdn_chunk_metadata(np.array(lens), chunk))
    state = (torch.randn(num_slots, hv, vd, kd, generator=gen) * 0.5).to(device)
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    flags = torch.tensor(has_init, device=device)
    return [q, k, v, g, beta, cu, sidx, last, chunk], state, idx, flags


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk, hv, kd, vd", SHAPES[:2])
def test_gdn_prefill_equals_reference(dtype, hk, hv, kd, vd):
    args, state, idx, flags = _prefill_case(dtype, hk, hv, kd, vd, LENS, HAS_INIT, SLOTS, 9, seed=2)
    ours_state, ref_state = state.clone(), state.clone()
    y = gdr.gdn_prefill(*args, ours_state, idx, flags)
    y_ref = gated_delta_rule_ref.gdn_prefill_at_slots(*args, ref_state, idx, flags)    # chunked (UT transform)
    assert y.dtype == torch.float32 and y.shape == y_ref.shape
    # fp32 on both sides; they differ in the order of operations only (per token vs per chunk)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(ours_state, ref_state, **TOL)
    assert torch.equal(ours_state[UNTOUCHED], state[UNTOUCHED])     # no other slot written (pad included)
    assert not torch.equal(ours_state[SLOTS[:-1]], state[SLOTS[:-1]])


def test_gdn_prefill_equals_sequential_recurrence():
    """Against the plain per-token recurrence (the same order of operations: tight), GVA, int64
    indices, and without the l2 norm."""
    for use_l2 in (True, False):
        args, state, idx, flags = _prefill_case(torch.float32, 2, 4, 16, 12, LENS[:-1], HAS_INIT[:-1],
                                                SLOTS[:-1], 9, seed=3)
        q, k, v, g, beta = args[:5]
        if not use_l2:
            q, k = q * 0.2, k * 0.2
            args[:2] = q, k
        init = initial_states_at(state, idx, flags)
        cu_seqlens = torch.tensor(np.cumsum([0] + LENS[:-1]), device=DEV)
        y_seq, finals = gdn_recurrent_varlen(q, k, v, g, beta, cu_seqlens, init, use_qk_l2norm=use_l2)
        ours_state = state.clone()
        args[5:8] = [a.long() for a in args[5:8]]
        y = gdr.gdn_prefill(*args, ours_state, idx.long(), flags, use_qk_l2norm=use_l2)
        torch.testing.assert_close(y, y_seq, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours_state[idx.long()], finals, atol=1e-6, rtol=1e-6)


def test_gdn_prefill_profile_run_layout():
    """One padded sequence over the whole batch from a zero state (the profile run's call): y only."""
    args, state, idx, flags = _prefill_case(torch.float32, 2, 4, 16, 12, [19], [True], [-1], 2, seed=4)
    ours_state, ref_state = state.clone(), state.clone()
    y = gdr.gdn_prefill(*args, ours_state, idx, flags)
    y_ref = gated_delta_rule_ref.gdn_prefill_at_slots(*args, ref_state, idx, flags)
    torch.testing.assert_close(y, y_ref, **TOL)
    assert torch.equal(ours_state, state) and torch.equal(ref_state, state)


def test_gdn_launchers_name_what_is_wrong():
    state = torch.zeros(3, 4, 8, 16)
    q, v = torch.zeros(2, 2, 16), torch.zeros(2, 4, 8)
    g = torch.zeros(2, 4)
    idx = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k must be \[B=2, Hk=2, K=16\] like q, got \(2, 2, 8\)"):
        gdr.gdn_update(state, q, torch.zeros(2, 2, 8), v, g, g, idx)
    with pytest.raises(ValueError, match=r"ssm_state must be \[S, Hv=4, V=8, K=16\], got \(3, 4, 16, 8\)"):
        gdr.gdn_update(torch.zeros(3, 4, 16, 8), q, q, v, g, g, idx)
    with pytest.raises(ValueError, match="ssm_state must be float32 .* got torch.float16"):
        gdr.gdn_update(state.half(), q, q, v, g, g, idx)
    with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[B=2\], got torch.float32"):
        gdr.gdn_update(state, q, q, v, g, g, torch.zeros(2))
    with pytest.raises(ValueError, match=r"Hv=3 value heads are not a multiple of q/k's Hk=2"):
        gdr.gdn_update(torch.zeros(3, 3, 8, 16), q, q, torch.zeros(2, 3, 8), torch.zeros(2, 3), torch.zeros(2, 3), idx)
    cu, sidx, last = torch.tensor([0, 2]), torch.tensor([0]), torch.tensor([0])
    with pytest.raises(ValueError, match=r"has_initial_state must be bool/int32/int64 \[R=1\], got torch.float32"):
        gdr.gdn_prefill(q, q, v, g, g, cu, sidx, last, 16, state, idx[:1], torch.zeros(1))
    with pytest.raises(ValueError, match=r"g must be \[T=2, Hv=4\], got \(2, 3\)"):
        gdr.gdn_prefill(q, q, v, torch.zeros(2, 3), g, cu, sidx, last, 16, state, idx[:1],
                        torch.ones(1, dtype=torch.bool))


def test_gdn_update_names_a_malformed_verify_argument():
    """Verify rows (query_start_loc, num_accepted_tokens, state_indices [R, 1 + k]): the launcher names
    the argument that is wrong, before any launch."""
    state = torch.zeros(6, 4, 8, 16)
    q, v, g = torch.zeros(5, 2, 16), torch.zeros(5, 4, 8), torch.zeros(5, 4)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    qsl, accepted = torch.tensor([0, 2, 5], dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"query_start_loc must be int32/int64 \[R\+1=3\], got torch.float32"):
        gdr.gdn_update(state, q, q, v, g, g, idx, query_start_loc=qsl.float(), num_accepted_tokens=accepted)
    with pytest.raises(ValueError, match="num_accepted_tokens was given without query_start_loc"):
        gdr.gdn_update(state, q, q, v, g, g, idx, num_accepted_tokens=accepted)


# ---- internal checkpoints --------------------------------------------------------------------------
# lens [5, 20, 1, 18, 7] (chunk 16, row-relative chunks): sequence 0 (initial state, slot 4) saves after
# its first token (token 0) and once with PAD_SLOT_ID (token 3); sequence 1 (no initial state) saves after
# its first token (5) and after its token 17 (22, inside its second chunk); sequence 2 has one token (its
# last: no checkpoint); sequence 3 (initial state) saves after its token 15 (41, a chunk end); sequence 4
# is padded.
CKPT_LENS = [5, 20, 1, 18, 7]
CKPT_HAS_INIT = [True, False, False, True, True]
CKPT_IDX = [4, 0, 7, 2, -1]
CKPT_TOKENS = [0, 3, 5, 22, 41]
CKPT_SLOTS = [9, -1, 10, 11, 1]
CKPT_UNTOUCHED = [3, 5, 6, 8, 12, 13]        # of 14 slots: no sequence and no checkpoint names these


def _checkpoints(tokens, slots):
    return Checkpoints(torch.tensor(tokens, dtype=torch.int64, device=DEV),
                       torch.tensor(slots, dtype=torch.int32, device=DEV))


def _ckpt_case(dtype, hk, hv, kd, vd, seed):
    return _prefill_case(dtype, hk, hv, kd, vd, CKPT_LENS, CKPT_HAS_INIT, CKPT_IDX, 14, seed)


@pytest.mark.parametrize("dtype, hk, hv, kd, vd", [(torch.float32, *SHAPES[0]), (torch.float16, *SHAPES[0]),
                                                   (torch.bfloat16, *SHAPES[1]), (torch.float32, *SHAPES[2])])
def test_gdn_prefill_checkpoints_equal_reference(dtype, hk, hv, kd, vd):
    args, state, idx, flags = _ckpt_case(dtype, hk, hv, kd, vd, seed=7)
    ckpt = _checkpoints(CKPT_TOKENS, CKPT_SLOTS)
    ours_state, ref_state, plain_state = state.clone(), state.clone(), state.clone()
    y = gdr.gdn_prefill(*args, ours_state, idx, flags, checkpoints=ckpt)
    y_ref = gated_delta_rule_ref.gdn_prefill_at_slots(*args, ref_state, idx, flags, checkpoints=ckpt)
    y_plain = gated_delta_rule_ref.gdn_prefill_at_slots(*args, plain_state, idx, flags)
    # the reference's y and final states are those it computes without checkpoints
    assert torch.equal(y_ref, y_plain)
    assert torch.equal(ref_state[CKPT_IDX[:-1]], plain_state[CKPT_IDX[:-1]])
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(ours_state, ref_state, **TOL)                 # every slot
    assert torch.equal(ours_state[CKPT_UNTOUCHED], state[CKPT_UNTOUCHED])   # the -1 checkpoint wrote nothing
    assert torch.equal(ref_state[CKPT_UNTOUCHED], state[CKPT_UNTOUCHED])
    for s in [9, 10, 11, 1]:
        assert not torch.equal(ours_state[s], state[s])


def test_gdn_prefill_no_checkpoints_m0():
    """M = 0: the same outputs and states as without checkpoints, and as the reference."""
    args, state, idx, flags = _ckpt_case(torch.float32, *SHAPES[0], seed=8)
    empty = _checkpoints([], [])
    plain_state, ours_state, ref_state = state.clone(), state.clone(), state.clone()
    y_plain = gdr.gdn_prefill(*args, plain_state, idx, flags)
    y = gdr.gdn_prefill(*args, ours_state, idx, flags, checkpoints=empty)
    y_ref = gated_delta_rule_ref.gdn_prefill_at_slots(*args, ref_state, idx, flags, checkpoints=empty)
    assert torch.equal(y, y_plain) and torch.equal(ours_state, plain_state)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(ours_state, ref_state, **TOL)


def test_gdn_prefill_reference_checkpoint_is_the_prefix_final_state():
    """The reference's checkpoint after token t of a sequence (the plain recurrence) is the final state
    the reference (chunked) leaves after a prefill of that sequence's prefix up to t, from the same
    initial state."""
    args, state, idx, flags = _ckpt_case(torch.bfloat16, *SHAPES[0], seed=9)
    q, k, v, g, beta = args[:5]
    ref_state = state.clone()
    gated_delta_rule_ref.gdn_prefill_at_slots(*args, ref_state, idx, flags,
                                              checkpoints=_checkpoints(CKPT_TOKENS, CKPT_SLOTS))
    cases = checkpoint_prefixes(CKPT_TOKENS, CKPT_SLOTS, np.cumsum([0] + CKPT_LENS).tolist())
    assert len(cases) == 4
    for _tok, slot, s, rows in cases:
        chunks = [torch.from_numpy(a).to(DEV)
                  for a in compute_gdn_chunk_metadata(np.array([rows.stop - rows.start]), CHUNK)]
        prefix_state = state.clone()
        gated_delta_rule_ref.gdn_prefill_at_slots(q[rows], k[rows], v[rows], g[rows], beta[rows], *chunks, CHUNK,
                                                  prefix_state, idx[s:s + 1], flags[s:s + 1])
        torch.testing.assert_close(ref_state[slot], prefix_state[CKPT_IDX[s]], **TOL)


def test_gdn_prefill_checkpoints_named_when_wrong():
    args, state, idx, flags = _prefill_case(torch.float32, 2, 4, 16, 12, [3, 5], [False, True], [0, 1], 2, seed=10)
    tok, slots = torch.tensor([0], device=DEV), torch.tensor([1], device=DEV)
    with pytest.raises(ValueError, match=r"checkpoints.token_index must be int64 \[M\], got torch.int32"):
        gdr.gdn_prefill(*args, state, idx, flags, checkpoints=Checkpoints(tok.int(), slots))
    with pytest.raises(ValueError, match=r"checkpoints.slots must be int32/int64 \[M=1\], got torch.int64 \(2,\)"):
        gdr.gdn_prefill(*args, state, idx, flags, checkpoints=Checkpoints(tok, torch.tensor([1, 2], device=DEV)))
    with pytest.raises(ValueError, match=r"checkpoints.slots must be int32/int64 \[M=1\], got torch.float32"):
        gdr.gdn_prefill(*args, state, idx, flags, checkpoints=Checkpoints(tok, slots.float()))
    with pytest.raises(ValueError, match="checkpoints.token_index is on meta, x on "):
        gdr.gdn_prefill(*args, state, idx, flags, checkpoints=Checkpoints(tok.to("meta"), slots))
    with pytest.raises(ValueError, match="checkpoints must be a state_slots_ref.Checkpoints"):
        gdr.gdn_prefill(*args, state, idx, flags, checkpoints=(tok, slots))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: real shapes")
def test_gdn_real_shape_cuda():
    """Qwen3-Next-80B's GDN shapes (Hk 16, Hv 32, K = V = 128, chunk 64), compiled kernels, bf16 inputs."""
    hk, hv, kd, vd = 16, 32, 128, 128
    lens, has_init, slots = [1, 63, 64, 65, 300], [True, False, True, True, False], [12, 3, -1, 7, 30]
    args, state, idx, flags = _prefill_case(torch.bfloat16, hk, hv, kd, vd, lens, has_init, slots, 40,
                                            seed=5, device="cuda", chunk=64)
    ours_state, ref_state = state.clone(), state.clone()
    y = gdr.gdn_prefill(*args, ours_state, idx, flags)
    y_ref = gated_delta_rule_ref.gdn_prefill_at_slots(*args, ref_state, idx, flags)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_state, ref_state, atol=1e-4, rtol=1e-4)
    gen = torch.Generator().manual_seed(6)
    q, k, v, g, beta = _inputs(gen, torch.bfloat16, 9, hk, hv, kd, vd, "cuda")
    dec = torch.tensor([0, 5, -1, 39, 12, 2, -1, 20, 33], device="cuda")
    y = gdr.gdn_update(ours_state, q, k, v, g, beta, dec)
    y_ref = gated_delta_rule_ref.gdn_update_at_slots(ref_state, q, k, v, g, beta, dec)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_state, ref_state, atol=1e-4, rtol=1e-4)
