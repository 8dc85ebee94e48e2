"""The Mamba2 kernels against their torch references, under TRITON_INTERPRET=1 on the CPU (set in conftest) or
compiled on CUDA (harness.KERNEL_DEVICE): kernels/selective_state_update.py (the decode update, with dt prepared
in the kernel or before it by `mamba2_dt`) and kernels/ssd_scan.py (the SSD chunked scan of the varlen prefill).
fp32 / fp16 / bf16 inputs, head_dim / widths not powers of two, padded rows, x / B / C / dt as views of one
projection; for the scan, chunk_size 8, sequence lengths around it, mixed initial states and a padded sequence;
real shapes on a GPU. Internal checkpoints (prefix caching): the scan also saves the state after chosen chunks,
as the reference does; the reference's checkpoint equals the final state of a scan of the prefix."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import KERNEL_DEVICE as DEV  # the test device: CPU (interpreter) or CUDA (compiled)
from harness import checkpoint_prefixes

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.attention.mamba2 import compute_chunk_metadata
from toolkit.kernels import selective_state_update as ssu
from toolkit.kernels import (
    selective_state_update_ref,
    ssd_scan_ref,
)
from toolkit.kernels import ssd_scan as ssd
from toolkit.kernels.launcher_checks import rows_per_program
from toolkit.kernels.ssd_scan_ref import ssm_scan_sequential_ref
from toolkit.kernels.state_slots_ref import Checkpoints, initial_states_at

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups, with_d", [(1, True), (2, False)])
def test_selective_state_update_equals_reference(dtype, groups, with_d):
    g = torch.Generator().manual_seed(2)
    slots, heads, head_dim, d_state, b = 5, 4, 12, 16, 4         # head_dim not a power of two
    state = torch.randn(slots, heads, head_dim, d_state, generator=g).to(DEV)   # the fp32 state cache
    xbc = torch.randn(b, heads * head_dim + 2 * groups * d_state, generator=g).to(DEV, dtype)
    x = xbc[:, :heads * head_dim].view(b, heads, head_dim)        # views into one projection
    B = xbc[:, heads * head_dim:heads * head_dim + groups * d_state].view(b, groups, d_state)
    C = xbc[:, heads * head_dim + groups * d_state:].view(b, groups, d_state)
    dt = torch.nn.functional.softplus(torch.randn(b, heads, generator=g)).to(DEV)
    A = (-torch.rand(heads, generator=g) - 0.5).to(DEV)
    D = torch.randn(heads, generator=g).to(DEV) if with_d else None
    idx = torch.tensor([2, -1, 4, 1], device=DEV)
    ours_state, ref_state = state.clone(), state.clone()
    y = ssu.selective_state_update(ours_state, x, dt, A, B, C, D, idx)
    y_ref = selective_state_update_ref.mamba2_update_at_slots(ref_state, x, dt, A, B, C, D, idx)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)      # fp32 math on both sides
    torch.testing.assert_close(ours_state, ref_state, atol=1e-6, rtol=1e-6)
    assert torch.equal(ours_state[[0, 3]], state[[0, 3]]) and (y[1] == 0).all()



def test_selective_state_update_tiles_heads_across_programs():
    """Heads go BLOCK_H to a program where a head's tile is small (launcher_checks.rows_per_program):
    6 heads in 3 groups, [32, 16] tiles, so 4 heads a program and the second program's last two
    masked; each head keeps its own state, dt, A, D and group's B and C."""
    g = torch.Generator().manual_seed(7)
    slots, heads, head_dim, d_state, groups, b = 4, 6, 32, 16, 3, 3
    assert rows_per_program(head_dim * d_state) == 4
    state = torch.randn(slots, heads, head_dim, d_state, generator=g).to(DEV)
    x = torch.randn(b, heads, head_dim, generator=g).to(DEV)
    B, C = torch.randn(b, groups, d_state, generator=g).to(DEV), torch.randn(b, groups, d_state, generator=g).to(DEV)
    dt_raw, dt_bias = torch.randn(b, heads, generator=g).to(DEV), torch.randn(heads, generator=g).to(DEV)
    A, D = (-torch.rand(heads, generator=g) - 0.5).to(DEV), torch.randn(heads, generator=g).to(DEV)
    idx = torch.tensor([3, -1, 0], device=DEV)
    ours_state, ref_state = state.clone(), state.clone()
    y = ssu.selective_state_update(ours_state, x, dt_raw, A, B, C, D, idx, dt_bias, (0.01, 2.0))
    y_ref = selective_state_update_ref.mamba2_update_at_slots(ref_state, x, dt_raw, A, B, C, D, idx, dt_bias,
                                                              (0.01, 2.0))
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, ref_state, atol=1e-6, rtol=1e-6)
    assert torch.equal(ours_state[[1, 2]], state[[1, 2]]) and (y[1] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dt_limit", [None, (0.0, float("inf")), (0.05, 0.8)])
def test_selective_state_update_prepares_raw_dt_like_mamba2_dt(dtype, dt_limit):
    """dt_bias given: dt is the raw in_proj column (a strided view), prepared in the kernel; equal to
    preparing it first with the torch reference of `mamba2_dt` and updating with that."""
    g = torch.Generator().manual_seed(5)
    slots, heads, head_dim, d_state, b = 6, 4, 8, 16, 5
    state = torch.randn(slots, heads, head_dim, d_state, generator=g).to(DEV)
    proj = (6 * torch.randn(b, heads * head_dim + 2 * d_state + heads, generator=g)).to(DEV, dtype)
    x = proj[:, :heads * head_dim].view(b, heads, head_dim)
    B = proj[:, heads * head_dim:heads * head_dim + d_state].view(b, 1, d_state)
    C = proj[:, heads * head_dim + d_state:heads * head_dim + 2 * d_state].view(b, 1, d_state)
    dt_raw = proj[:, -heads:]
    dt_bias = torch.randn(heads, generator=g).to(DEV, dtype)
    A, D = (-torch.rand(heads, generator=g) - 0.5).to(DEV), torch.randn(heads, generator=g).to(DEV)
    idx = torch.tensor([3, 0, -1, 5, 1], device=DEV)
    ours_state, ref_state = state.clone(), state.clone()
    y = ssu.selective_state_update(ours_state, x, dt_raw, A, B, C, D, idx, dt_bias, dt_limit)
    dt = selective_state_update_ref.mamba2_dt(dt_raw, dt_bias, dt_limit)
    y_ref = selective_state_update_ref.mamba2_update_at_slots(ref_state, x, dt, A, B, C, D, idx)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, ref_state, atol=1e-5, rtol=1e-5)
    y_ref_raw = selective_state_update_ref.mamba2_update_at_slots(    # the op's own form: raw dt and its bias
        state.clone(), x, dt_raw, A, B, C, D, idx, dt_bias, dt_limit)
    torch.testing.assert_close(y_ref_raw, y_ref, atol=0, rtol=0)



def test_selective_state_update_launcher_names_what_is_wrong():
    state = torch.zeros(3, 4, 8, 16)
    x, dt, A = torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(4)
    B = torch.zeros(2, 3, 16)
    with pytest.raises(ValueError, match="not a multiple of the 3 groups"):
        ssu.selective_state_update(state, x, dt, A, B, B, None, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"x must be \[B, H=4, P=8\]"):
        ssu.selective_state_update(state, torch.zeros(2, 8, 4), dt, A, B[:, :1], B[:, :1], None,
                                   torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"dt_bias must be \[H=4\]"):
        ssu.selective_state_update(state, x, dt, A, B[:, :1], B[:, :1], None, torch.zeros(2, dtype=torch.long),
                                   torch.zeros(3))



def test_selective_state_update_refuses_a_strided_dt():
    """The kernel reads dt[row, h] at row stride + h: a dt strided along H must be refused, not misread."""
    state = torch.zeros(3, 4, 8, 16)
    x, A, B = torch.zeros(2, 4, 8), torch.zeros(4), torch.zeros(2, 1, 16)
    with pytest.raises(ValueError, match="dt must be contiguous in its last dimension"):
        ssu.selective_state_update(state, x, torch.zeros(2, 8)[:, ::2], A, B, B, None,
                                   torch.zeros(2, dtype=torch.long))


def test_selective_state_update_names_a_malformed_verify_argument():
    """Verify rows (query_start_loc, num_accepted_tokens, state_indices [R, 1 + k]): the launcher names
    the argument that is wrong, before any launch."""
    state = torch.zeros(6, 4, 8, 16)
    x, dt, A, B = torch.zeros(5, 4, 8), torch.zeros(5, 4), torch.zeros(4), torch.zeros(5, 1, 16)
    qsl, accepted = torch.tensor([0, 2, 5], dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[R, J=1\+k\] with query_start_loc"):
        ssu.selective_state_update(state, x, dt, A, B, B, None, torch.zeros(2, dtype=torch.int32),
                                   query_start_loc=qsl, num_accepted_tokens=accepted)
    with pytest.raises(ValueError, match=r"query_start_loc must be int32/int64 \[R\+1=3\], got torch.int32 \(4,\)"):
        ssu.selective_state_update(state, x, dt, A, B, B, None, torch.zeros(2, 4, dtype=torch.int32),
                                   query_start_loc=torch.zeros(4, dtype=torch.int32), num_accepted_tokens=accepted)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [None, (0.0, float("inf")), (1e-3, 0.5)])
def test_mamba2_dt_equals_reference(dtype, limit):
    g = torch.Generator().manual_seed(4)
    heads = 6
    proj = torch.empty(40, heads + 10)
    proj[:, :] = torch.linspace(-40, 40, 40 * (heads + 10)).reshape(40, heads + 10)   # small, and past threshold 20
    dt_raw = proj.to(DEV, dtype)[:, 10:]                      # the dt columns of in_proj's output
    bias = torch.randn(heads, generator=g).to(DEV, dtype)
    ours, ref = ssu.mamba2_dt(dt_raw, bias, limit), selective_state_update_ref.mamba2_dt(dt_raw, bias, limit)
    assert ours.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=0, rtol=2e-6)  # relative: softplus(-40) is 4e-18



def test_mamba2_dt_tiles_tokens_across_programs():
    """Tokens go BLOCK_M to a program (launcher_checks.rows_per_program): more tokens than two
    programs take, the last tile part masked."""
    g = torch.Generator().manual_seed(6)
    heads = 3
    t = 2 * rows_per_program(4) + 7
    dt_raw = (8 * torch.randn(t, heads + 2, generator=g)).to(DEV)[:, 1:1 + heads]
    bias = torch.randn(heads, generator=g).to(DEV)
    torch.testing.assert_close(ssu.mamba2_dt(dt_raw, bias, (1e-3, 0.5)),
                               selective_state_update_ref.mamba2_dt(dt_raw, bias, (1e-3, 0.5)), atol=0, rtol=2e-6)



def test_mamba2_dt_launcher_names_what_is_wrong():
    with pytest.raises(ValueError, match="dt_bias must be"):
        ssu.mamba2_dt(torch.randn(3, 4), torch.ones(5))
    with pytest.raises(ValueError, match="dt_raw must be"):
        ssu.mamba2_dt(torch.randn(4, 3).t(), torch.ones(4))


def _case(dtype, heads, head_dim, d_state, groups, lens, computed, slots, num_slots, with_d, chunk_size,
          seed=0, device=DEV):
    """Inputs as the Mamba2 mixer passes them: x, B, C column slices of one wider projection (model
    dtype), dt a non-contiguous fp32 view, the chunk layout from compute_chunk_metadata."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    hp, gn = heads * head_dim, groups * d_state
    proj = (torch.randn(t, 3 + hp + 2 * gn + 5, generator=g) * 0.5).to(device, dtype)   # views of it, on the device
    x = proj[:, 3:3 + hp].reshape(t, heads, head_dim)
    B = proj[:, 3 + hp:3 + hp + gn].reshape(t, groups, d_state)
    C = proj[:, 3 + hp + gn:3 + hp + 2 * gn].reshape(t, groups, d_state)
    dt = torch.nn.functional.softplus(torch.randn(t, heads + 2, generator=g) - 1.0).to(device)[:, 1:heads + 1]
    A = -(torch.rand(heads, generator=g) * 0.8 + 0.2)
    D = torch.randn(heads, generator=g) if with_d else None
    state = torch.randn(num_slots, heads, head_dim, d_state, generator=g)
    cu, sidx, last = (torch.from_numpy(a) for a in
                      compute_chunk_metadata(np.array(lens), np.array(computed), chunk_size))
    idx = torch.tensor(slots, dtype=torch.int32)
    has_init = torch.tensor([c > 0 for c in computed])
    args = [x, dt, A, B, C, D, cu, sidx, last, chunk_size]
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    return args, state.to(device), idx.to(device), has_init.to(device)


# lengths 1, chunk-1, chunk, chunk+1 and longer; rows with a saved state start mid-chunk (the first
# chunk tops up to a chunk boundary); the last row is padded (slot -1, says it has a state: read nothing)
LENS = [9, 1, 20, 7, 8, 3]
COMPUTED = [0, 5, 3, 0, 16, 2]
SLOTS = [4, 0, 6, 2, 7, -1]
UNTOUCHED = [1, 3, 5]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, head_dim, d_state, groups, with_d",
                         [(4, 8, 16, 1, True), (4, 12, 8, 2, False), (2, 16, 16, 2, True),
                          (6, 32, 16, 3, True)])      # state passing: 4 heads a program, the second's last 2 masked
def test_ssd_scan_equals_reference(dtype, heads, head_dim, d_state, groups, with_d):
    args, state, idx, has_init = _case(dtype, heads, head_dim, d_state, groups, LENS, COMPUTED, SLOTS, 8,
                                       with_d, chunk_size=8)
    ours_state, ref_state = state.clone(), state.clone()
    y = ssd.ssd_scan(*args, ours_state, idx, has_init)
    y_ref = ssd_scan_ref.ssd_scan_at_slots(*args, ref_state, idx, has_init)
    assert y.dtype == torch.float32 and y.shape == y_ref.shape
    # fp32 math on both sides from the same (rounded) inputs; they differ in summation order only
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, ref_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours_state[UNTOUCHED], state[UNTOUCHED])   # no other slot written (pad included)
    assert not torch.equal(ours_state[SLOTS[:-1]], state[SLOTS[:-1]])


def test_ssd_scan_equals_sequential_recurrence():
    """The chunked kernel against the plain per-token recurrence (not the chunked reference)."""
    args, state, idx, has_init = _case(torch.float32, 3, 8, 16, 1, LENS[:-1], COMPUTED[:-1], SLOTS[:-1], 8,
                                       True, chunk_size=8, seed=3)
    x, dt, A, B, C, D = args[:6]
    init = initial_states_at(state, idx, has_init)
    cu_seqlens = torch.tensor(np.cumsum([0] + LENS[:-1]), device=DEV)
    y_seq, finals = ssm_scan_sequential_ref(x, dt, A, B, C, D, cu_seqlens, init)
    ours_state = state.clone()
    y = ssd.ssd_scan(*args, ours_state, idx, has_init)
    torch.testing.assert_close(y, y_seq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state[idx.long()], finals, atol=1e-5, rtol=1e-5)


def test_ssd_scan_launcher_names_what_is_wrong():
    args, state, idx, has_init = _case(torch.float32, 2, 8, 8, 1, [3, 5], [0, 0], [0, 1], 2, True, 8)
    x, dt = args[0], args[1]
    with pytest.raises(ValueError, match=r"dt must be float \[T=8, H=2\]"):
        ssd.ssd_scan(x, dt[:, :1], *args[2:], state, idx, has_init)
    with pytest.raises(ValueError, match=r"ssm_state must be \[S, H=2, P=8, N\]"):
        ssd.ssd_scan(*args, state[:, :1], idx, has_init)
    with pytest.raises(ValueError, match="ssm_state must be float32"):
        ssd.ssd_scan(*args, state.half(), idx, has_init)
    with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[R=2\]"):
        ssd.ssd_scan(*args, state, idx.float(), has_init)
    with pytest.raises(ValueError, match=r"seq_idx must be int32/int64 \[NC=2\]"):
        ssd.ssd_scan(*args[:7], args[7][:1], *args[8:], state, idx, has_init)


# ---- internal checkpoints --------------------------------------------------------------------------
# chunk_size 8; chunk ends (compute_chunk_metadata): sequence 0 (9 tokens from 0, no initial state)
# [0, 8) [8, 9); sequence 1 (20 tokens, 3 computed) [9, 14) [14, 22) [22, 29); sequence 2 (4 tokens,
# 7 computed: its first chunk is its first token) [29, 30) [30, 33); sequence 3 (6, no initial
# state) [33, 39); sequence 4 padded. Checkpoints at chunk ends that are not a sequence's last token:
# 7 (sequence 0), 13 with PAD_SLOT_ID, 21 (sequence 1), 29 (sequence 2's first token).
CKPT_LENS = [9, 20, 4, 6, 3]
CKPT_COMPUTED = [0, 3, 7, 0, 2]
CKPT_IDX = [4, 0, 6, 2, -1]
CKPT_TOKENS = [7, 13, 21, 29]
CKPT_SLOTS = [8, -1, 9, 10]
CKPT_UNTOUCHED = [1, 3, 5, 7, 11]        # of 12 slots: no sequence and no checkpoint names these


def _checkpoints(tokens, slots):
    return Checkpoints(torch.tensor(tokens, dtype=torch.int64, device=DEV),
                       torch.tensor(slots, dtype=torch.int32, device=DEV))


def _ckpt_case(dtype, heads, head_dim, d_state, groups, with_d, seed):
    case = _case(dtype, heads, head_dim, d_state, groups, CKPT_LENS, CKPT_COMPUTED, CKPT_IDX, 12, with_d,
                 chunk_size=8, seed=seed)
    ends = case[0][6][1:] - 1                                  # the last token of each chunk
    assert set(CKPT_TOKENS) <= set(ends.tolist())
    return case


@pytest.mark.parametrize("dtype, heads, head_dim, d_state, groups, with_d",
                         [(torch.float32, 4, 8, 16, 1, True), (torch.float16, 4, 8, 16, 1, True),
                          (torch.bfloat16, 4, 8, 16, 1, True), (torch.float32, 4, 12, 8, 2, False)])
def test_ssd_scan_checkpoints_equal_reference(dtype, heads, head_dim, d_state, groups, with_d):
    args, state, idx, has_init = _ckpt_case(dtype, heads, head_dim, d_state, groups, with_d, seed=6)
    ckpt = _checkpoints(CKPT_TOKENS, CKPT_SLOTS)
    ours_state, ref_state = state.clone(), state.clone()
    y = ssd.ssd_scan(*args, ours_state, idx, has_init, checkpoints=ckpt)
    y_ref = ssd_scan_ref.ssd_scan_at_slots(*args, ref_state, idx, has_init, checkpoints=ckpt)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, ref_state, atol=1e-5, rtol=1e-5)        # every slot
    assert torch.equal(ours_state[CKPT_UNTOUCHED], state[CKPT_UNTOUCHED])   # the -1 checkpoint wrote nothing
    for s in [8, 9, 10]:
        assert not torch.equal(ours_state[s], state[s])


def test_ssd_scan_no_checkpoints_m0():
    """M = 0: the same outputs and states as without checkpoints, and as the reference."""
    args, state, idx, has_init = _ckpt_case(torch.float32, 2, 8, 16, 1, True, seed=7)
    empty = _checkpoints([], [])
    plain_state, ours_state, ref_state = state.clone(), state.clone(), state.clone()
    y_plain = ssd.ssd_scan(*args, plain_state, idx, has_init)
    y = ssd.ssd_scan(*args, ours_state, idx, has_init, checkpoints=empty)
    y_ref = ssd_scan_ref.ssd_scan_at_slots(*args, ref_state, idx, has_init, checkpoints=empty)
    assert torch.equal(y, y_plain) and torch.equal(ours_state, plain_state)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, ref_state, atol=1e-5, rtol=1e-5)


def test_ssd_scan_reference_checkpoint_is_the_prefix_final_state():
    """The reference's checkpoint after the chunk ending at token t is the final state the reference
    leaves after a scan of that sequence's prefix up to t (chunked the same way: it ends at a chunk
    end), from the same initial state."""
    args, state, idx, has_init = _ckpt_case(torch.bfloat16, 4, 8, 16, 1, True, seed=8)
    x, dt, A, B, C, D = args[:6]
    ref_state = state.clone()
    ssd_scan_ref.ssd_scan_at_slots(*args, ref_state, idx, has_init, checkpoints=_checkpoints(CKPT_TOKENS, CKPT_SLOTS))
    cases = checkpoint_prefixes(CKPT_TOKENS, CKPT_SLOTS, np.cumsum([0] + CKPT_LENS).tolist())
    assert len(cases) == 3
    for _tok, slot, s, rows in cases:
        chunks = [torch.from_numpy(a).to(DEV) for a in
                  compute_chunk_metadata(np.array([rows.stop - rows.start]), np.array([CKPT_COMPUTED[s]]), 8)]
        prefix_state = state.clone()
        ssd_scan_ref.ssd_scan_at_slots(x[rows], dt[rows], A, B[rows], C[rows], D, *chunks, 8, prefix_state,
                                       idx[s:s + 1], has_init[s:s + 1])
        torch.testing.assert_close(ref_state[slot], prefix_state[CKPT_IDX[s]], atol=1e-5, rtol=1e-5)


def test_ssd_scan_checkpoints_named_when_wrong():
    args, state, idx, has_init = _case(torch.float32, 2, 8, 8, 1, [3, 5], [0, 0], [0, 1], 2, True, 8)
    tok, slots = torch.tensor([0], device=state.device), torch.tensor([1], device=state.device)
    with pytest.raises(ValueError, match=r"checkpoints.token_index must be int64 \[M\], got torch.float32"):
        ssd.ssd_scan(*args, state, idx, has_init, checkpoints=Checkpoints(tok.float(), slots))
    with pytest.raises(ValueError, match=r"checkpoints.slots must be int32/int64 \[M=1\], got torch.int64 \(0,\)"):
        ssd.ssd_scan(*args, state, idx, has_init, checkpoints=Checkpoints(tok, slots[:0]))
    with pytest.raises(ValueError, match="checkpoints.slots is on meta, x on "):
        ssd.ssd_scan(*args, state, idx, has_init, checkpoints=Checkpoints(tok, slots.to("meta")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: real shapes")
def test_ssd_scan_real_shape_cuda():
    """mamba2-130m: H=24, P=64, N=128, G=1, chunk_size 256; lengths around the chunk size."""
    lens, computed, slots = [1, 255, 256, 257, 600], [0, 100, 0, 256, 37], [3, 0, 9, 5, 1]
    args, state, idx, has_init = _case(torch.bfloat16, 24, 64, 128, 1, lens, computed, slots, 10, True,
                                       chunk_size=256, device="cuda")
    ours_state, ref_state = state.clone(), state.clone()
    y = ssd.ssd_scan(*args, ours_state, idx, has_init)
    y_ref = ssd_scan_ref.ssd_scan_at_slots(*args, ref_state, idx, has_init)
    # chunks of 256 and N=128: longer sums than the tiny tests, and 3xTF32 tensor-core dots (about fp32
    # accuracy); the interpreter run of this case gave max errors ~2e-6 (y) and ~5e-6 (state) of the scale
    scale = y_ref.abs().max().item()
    torch.testing.assert_close(y, y_ref, atol=5e-5 * scale, rtol=1e-4)
    torch.testing.assert_close(ours_state, ref_state, atol=5e-5 * ref_state.abs().max().item(), rtol=1e-4)
    untouched = [2, 4, 6, 7, 8]
    assert torch.equal(ours_state[untouched], state[untouched])
