"""kernels/selective_scan.py: the Mamba1 Triton kernels (decode update and varlen scan) against their torch
references, under TRITON_INTERPRET=1 on the CPU (set in conftest) or compiled on CUDA (harness.KERNEL_DEVICE):
small shapes, fp32 / fp16 / bf16 inputs (the SSM state cache and the math stay fp32, so tolerances stay tight),
padded rows, varlen batches mixing sequences with and without initial state, the strided views the runner
passes. Internal checkpoints (prefix caching): the scan also saves the state after chosen tokens, as the
reference does; the reference's checkpoint equals the final state of a scan of the prefix."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import KERNEL_DEVICE as DEV  # the test device: CPU (interpreter) or CUDA (compiled)
from harness import checkpoint_prefixes

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.kernels import selective_scan as ss
from toolkit.kernels import selective_scan_ref
from toolkit.kernels.state_slots_ref import Checkpoints

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP32 = dict(atol=1e-5, rtol=1e-5)         # fp32 math on both sides, only the summation order differs
SCAN_BLOCK_D = 32                         # the scan launcher's channel block: Di = 40 leaves a masked tail


def _inputs(g: torch.Generator, rows: int, di: int, n: int, dtype: torch.dtype, with_d: bool,
            device: str = DEV, rank: int = 3):
    """x a column slice of an in_proj-like [rows, 2 Di] output; B, C column slices of one x_proj output
    [rows, R + 2N] (torch.split views, as the mixer passes them); dt fp32 softplus'ed; A negative."""
    xz = torch.randn(rows, 2 * di, generator=g).to(device, dtype)     # on the device before the views
    proj = torch.randn(rows, rank + 2 * n, generator=g).to(device, dtype)
    _, B, C = torch.split(proj, [rank, n, n], dim=-1)
    dt = F.softplus(torch.randn(rows, di, generator=g) - 1.0).to(device)
    A = (-(torch.rand(di, n, generator=g) * 2 + 0.05)).to(device)
    D = torch.randn(di, generator=g).to(device, dtype) if with_d else None
    x = xz[:, :di]
    return x, dt, A, B, C, D


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("di, n, with_d", [(40, 16, True), (24, 12, False)])   # N=12: masked state lanes
def test_selective_state_update_equals_reference(dtype, di, n, with_d):
    g = torch.Generator().manual_seed(10)
    slots, b = 7, 5
    state = torch.randn(slots, di, n, generator=g).to(DEV)            # the fp32 SSM state cache
    x, dt, A, B, C, D = _inputs(g, b, di, n, dtype, with_d)
    assert x.stride(0) == 2 * di and B.stride(0) == 3 + 2 * n          # the views the runner passes
    idx = torch.tensor([3, -1, 0, 6, -1], device=DEV)
    ours_state, ref_state = state.clone(), state.clone()
    y = ss.selective_state_update(ours_state, x, dt, A, B, C, D, idx)
    y_ref = selective_scan_ref.mamba1_update_at_slots(ref_state, x, dt, A, B, C, D, idx)
    assert y.dtype == torch.float32 and y.shape == (b, di)
    torch.testing.assert_close(y, y_ref, **FP32)
    torch.testing.assert_close(ours_state, ref_state, **FP32)
    untouched = [1, 2, 4, 5]
    assert torch.equal(ours_state[untouched], state[untouched])       # bit-identical
    assert (y[[1, 4]] == 0).all()                                     # padded rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("di, n, with_d", [(40, 16, True), (24, 12, False)])
def test_selective_scan_equals_reference(dtype, di, n, with_d):
    g = torch.Generator().manual_seed(11)
    slots = 9
    # lengths 1, block-1, block, block+1 in the token sense (the kernel has no chunks: these cover the
    # prefetch-ahead edge and short runs), an empty sequence, longer ones
    lens = [1, 7, 8, 9, 0, 20, 3]
    idx = torch.tensor([4, 0, -1, 6, 2, 8, 1], device=DEV)             # sequence 2 is padded
    has_init = torch.tensor([True, False, True, True, False, True, False], device=DEV)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(DEV)
    t = int(cu[-1])
    state = torch.randn(slots, di, n, generator=g).to(DEV)
    x, dt, A, B, C, D = _inputs(g, t, di, n, dtype, with_d)
    ours_state, ref_state = state.clone(), state.clone()
    y = ss.selective_scan(x, dt, A, B, C, D, cu, ours_state, idx, has_init)
    y_ref = selective_scan_ref.mamba1_scan_at_slots(x, dt, A, B, C, D, cu, ref_state, idx, has_init)
    assert y.dtype == torch.float32 and y.shape == (t, di)
    torch.testing.assert_close(y, y_ref, **FP32)
    torch.testing.assert_close(ours_state, ref_state, **FP32)
    untouched = [3, 5, 7]
    assert torch.equal(ours_state[untouched], state[untouched])
    assert (ours_state[2] == 0).all()          # an empty sequence without initial state leaves zeros
    assert not torch.equal(ours_state[6], state[6])                     # a real sequence wrote its slot


def test_selective_scan_without_flags_int64_and_contiguous_inputs():
    """has_initial_state None (every slotted sequence reads its slot), int64 indices and cu_seqlens,
    contiguous inputs; several channel blocks."""
    g = torch.Generator().manual_seed(12)
    di, n, slots = 2 * SCAN_BLOCK_D + 5, 16, 4
    lens = [5, 1, 11]
    cu = torch.tensor([0] + lens).cumsum(0).to(DEV)
    idx = torch.tensor([2, 0, 3], device=DEV)
    state = torch.randn(slots, di, n, generator=g).to(DEV)
    x, dt, A, B, C, D = (None if v is None else v.contiguous()
                         for v in _inputs(g, int(cu[-1]), di, n, torch.float32, True))
    ours_state, ref_state = state.clone(), state.clone()
    y = ss.selective_scan(x, dt, A, B, C, D, cu, ours_state, idx, None)
    y_ref = selective_scan_ref.mamba1_scan_at_slots(x, dt, A, B, C, D, cu, ref_state, idx, None)
    torch.testing.assert_close(y, y_ref, **FP32)
    torch.testing.assert_close(ours_state, ref_state, **FP32)
    assert torch.equal(ours_state[1], state[1])


def test_scan_equals_repeated_decode_updates():
    """Prefilling a sequence leaves the state that decoding it token by token leaves (both kernels)."""
    g = torch.Generator().manual_seed(13)
    di, n, t = 20, 16, 6
    x, dt, A, B, C, D = _inputs(g, t, di, n, torch.bfloat16, True)
    state = torch.randn(3, di, n, generator=g).to(DEV)
    by_scan, by_steps = state.clone(), state.clone()
    y_scan = ss.selective_scan(x, dt, A, B, C, D, torch.tensor([0, t], dtype=torch.int32, device=DEV), by_scan,
                               torch.tensor([1], dtype=torch.int32, device=DEV), torch.tensor([True], device=DEV))
    one = torch.tensor([1], dtype=torch.int32, device=DEV)
    y_steps = torch.cat([ss.selective_state_update(by_steps, x[i:i + 1], dt[i:i + 1], A, B[i:i + 1],
                                                   C[i:i + 1], D, one) for i in range(t)])
    torch.testing.assert_close(y_scan, y_steps, **FP32)
    torch.testing.assert_close(by_scan, by_steps, **FP32)


def test_launchers_name_what_is_wrong():
    state = torch.zeros(3, 8, 16)
    x, dt, A, BC = torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(8, 16), torch.zeros(2, 16)
    idx = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"A must be \[Di=8, N=16\], got \(8, 12\)"):
        ss.selective_state_update(state, x, dt, torch.zeros(8, 12), BC, BC, None, idx)
    with pytest.raises(ValueError, match=r"C must be \[Bt=2, N=16\], got \(3, 16\)"):
        ss.selective_state_update(state, x, dt, A, BC, torch.zeros(3, 16), None, idx)
    with pytest.raises(ValueError, match="ssm_state must be float32 .* got torch.bfloat16"):
        ss.selective_state_update(state.bfloat16(), x, dt, A, BC, BC, None, idx)
    with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[Bt=2\], got torch.float32"):
        ss.selective_state_update(state, x, dt, A, BC, BC, None, torch.zeros(2))
    with pytest.raises(ValueError, match="B must be contiguous in its last dimension"):
        ss.selective_state_update(state, x, dt, A, torch.zeros(16, 2).t(), BC, None, idx)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dt must be \[T=2, Di=8\], got \(2, 9\)"):
        ss.selective_scan(x, torch.zeros(2, 9), A, BC, BC, None, cu, state, one, one.bool())
    with pytest.raises(ValueError, match=r"has_initial_state must be bool/int32/int64 \[P=1\], got torch.float32"):
        ss.selective_scan(x, dt, A, BC, BC, None, cu, state, one, torch.zeros(1))
    with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[P=1\], got torch.int32 \(2,\)"):
        ss.selective_scan(x, dt, A, BC, BC, None, cu, state, idx.int(), one.bool())
    with pytest.raises(ValueError, match="x must be float32/float16/bfloat16, got torch.int64"):
        ss.selective_scan(x.long(), dt, A, BC, BC, None, cu, state, one, one.bool())


def test_selective_state_update_names_a_malformed_verify_argument():
    """Verify rows (query_start_loc, num_accepted_tokens, state_indices [R, 1 + k]): the launcher names
    the argument that is wrong, before any launch."""
    state = torch.zeros(6, 8, 16)
    x, dt, A, BC = torch.zeros(5, 8), torch.zeros(5, 8), torch.zeros(8, 16), torch.zeros(5, 16)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"num_accepted_tokens must be int32/int64 \[R=2\], got torch.int32 \(3,\)"):
        ss.selective_state_update(state, x, dt, A, BC, BC, None, idx, query_start_loc=qsl,
                                  num_accepted_tokens=torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"num_accepted_tokens must be int32/int64 \[R=2\], got torch.float32"):
        ss.selective_state_update(state, x, dt, A, BC, BC, None, idx, query_start_loc=qsl,
                                  num_accepted_tokens=torch.ones(2))


# ---- internal checkpoints --------------------------------------------------------------------------
# lens [5, 1, 7, 0, 4]: sequence 0 (initial state, slot 4) saves after its first token and once with
# PAD_SLOT_ID; sequence 1 has one token (its last: no checkpoint); sequence 2 (no initial state) saves
# after its first token and after token 4; sequence 3 is empty; sequence 4 is padded.
CKPT_LENS = [5, 1, 7, 0, 4]
CKPT_IDX = [4, 0, 6, 2, -1]
CKPT_HAS_INIT = [True, False, False, True, True]
CKPT_TOKENS = [0, 3, 6, 10]
CKPT_SLOTS = [9, -1, 10, 1]
CKPT_UNTOUCHED = [3, 5, 7, 8]            # of 11 slots: no sequence and no checkpoint names these


def _checkpoints(tokens, slots):
    return Checkpoints(torch.tensor(tokens, dtype=torch.int64, device=DEV),
                       torch.tensor(slots, dtype=torch.int32, device=DEV))


def _ckpt_case(g, dtype, di, n, with_d):
    cu = torch.tensor([0] + CKPT_LENS).cumsum(0).to(torch.int32).to(DEV)
    state = torch.randn(11, di, n, generator=g).to(DEV)
    x, dt, A, B, C, D = _inputs(g, int(cu[-1]), di, n, dtype, with_d)
    idx = torch.tensor(CKPT_IDX, device=DEV)
    has_init = torch.tensor(CKPT_HAS_INIT, device=DEV)
    return x, dt, A, B, C, D, cu, state, idx, has_init


@pytest.mark.parametrize("dtype, di, n, with_d", [(torch.float32, 40, 16, True), (torch.float16, 40, 16, True),
                                                  (torch.bfloat16, 40, 16, True), (torch.float32, 24, 12, False)])
def test_selective_scan_checkpoints_equal_reference(dtype, di, n, with_d):
    g = torch.Generator().manual_seed(15)
    x, dt, A, B, C, D, cu, state, idx, has_init = _ckpt_case(g, dtype, di, n, with_d)
    ckpt = _checkpoints(CKPT_TOKENS, CKPT_SLOTS)
    ours_state, ref_state = state.clone(), state.clone()
    y = ss.selective_scan(x, dt, A, B, C, D, cu, ours_state, idx, has_init, checkpoints=ckpt)
    y_ref = selective_scan_ref.mamba1_scan_at_slots(x, dt, A, B, C, D, cu, ref_state, idx, has_init,
                                                    checkpoints=ckpt)
    torch.testing.assert_close(y, y_ref, **FP32)
    torch.testing.assert_close(ours_state, ref_state, **FP32)            # every slot
    assert torch.equal(ours_state[CKPT_UNTOUCHED], state[CKPT_UNTOUCHED])   # the -1 checkpoint wrote nothing
    for s in [9, 10, 1]:
        assert not torch.equal(ours_state[s], state[s])


def test_selective_scan_no_checkpoints_m0():
    """M = 0: the same outputs and states as without checkpoints, and as the reference."""
    g = torch.Generator().manual_seed(16)
    x, dt, A, B, C, D, cu, state, idx, has_init = _ckpt_case(g, torch.float32, 24, 12, True)
    empty = _checkpoints([], [])
    plain_state, ours_state, ref_state = state.clone(), state.clone(), state.clone()
    y_plain = ss.selective_scan(x, dt, A, B, C, D, cu, plain_state, idx, has_init)
    y = ss.selective_scan(x, dt, A, B, C, D, cu, ours_state, idx, has_init, checkpoints=empty)
    y_ref = selective_scan_ref.mamba1_scan_at_slots(x, dt, A, B, C, D, cu, ref_state, idx, has_init,
                                                    checkpoints=empty)
    assert torch.equal(y, y_plain) and torch.equal(ours_state, plain_state)
    torch.testing.assert_close(y, y_ref, **FP32)
    torch.testing.assert_close(ours_state, ref_state, **FP32)


def test_selective_scan_reference_checkpoint_is_the_prefix_final_state():
    """The reference's checkpoint after token t of a sequence is the final state the reference leaves
    after a scan of that sequence's prefix up to t, from the same initial state."""
    g = torch.Generator().manual_seed(17)
    x, dt, A, B, C, D, cu, state, idx, has_init = _ckpt_case(g, torch.bfloat16, 24, 12, True)
    ref_state = state.clone()
    selective_scan_ref.mamba1_scan_at_slots(x, dt, A, B, C, D, cu, ref_state, idx, has_init,
                                            checkpoints=_checkpoints(CKPT_TOKENS, CKPT_SLOTS))
    cases = checkpoint_prefixes(CKPT_TOKENS, CKPT_SLOTS, cu.tolist())
    assert len(cases) == 3
    for _tok, slot, s, rows in cases:
        prefix_state = state.clone()
        selective_scan_ref.mamba1_scan_at_slots(
            x[rows], dt[rows], A, B[rows], C[rows], D, torch.tensor([0, rows.stop - rows.start], device=DEV),
            prefix_state, idx[s:s + 1], has_init[s:s + 1])
        torch.testing.assert_close(ref_state[slot], prefix_state[CKPT_IDX[s]], **FP32)


def test_selective_scan_checkpoints_named_when_wrong():
    state = torch.zeros(3, 8, 16)
    x, dt, A, BC = torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(8, 16), torch.zeros(2, 16)
    cu, one = torch.tensor([0, 2], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    tok, slots = torch.tensor([0]), torch.tensor([1])
    with pytest.raises(ValueError, match=r"checkpoints.token_index must be int64 \[M\], got torch.int32"):
        ss.selective_scan(x, dt, A, BC, BC, None, cu, state, one, None, checkpoints=Checkpoints(tok.int(), slots))
    with pytest.raises(ValueError, match=r"checkpoints.slots must be int32/int64 \[M=1\], got torch.int64 \(2,\)"):
        ss.selective_scan(x, dt, A, BC, BC, None, cu, state, one, None,
                          checkpoints=Checkpoints(tok, torch.tensor([1, 2])))
    with pytest.raises(ValueError, match="checkpoints.token_index is on meta, x on "):
        ss.selective_scan(x, dt, A, BC, BC, None, cu, state, one, None,
                          checkpoints=Checkpoints(tok.to("meta"), slots))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: real shapes")
def test_mamba_130m_shapes_on_cuda():
    """mamba-130m (Di=1536, N=16), bf16 activations: 64 decode rows (some padded), then a prefill of
    4 sequences of 100..300 tokens (mixed initial states) on the same cache."""
    g = torch.Generator().manual_seed(14)
    dev, dtype, di, n, slots = "cuda", torch.bfloat16, 1536, 16, 80
    # GPU exp (ex2.approx) against torch's expf, compounded through up to 300 steps: a few e-6
    # relative per step, so 1e-4 rather than the CPU tests' 1e-5
    tol = dict(atol=1e-4, rtol=1e-4)
    state = torch.randn(slots, di, n, generator=g).to(dev)
    x, dt, A, B, C, D = _inputs(g, 64, di, n, dtype, True, dev, rank=48)
    idx = torch.randperm(slots, generator=g)[:64].to(dev)
    idx[[5, 40]] = -1
    ours_state, ref_state = state.clone(), state.clone()
    y = ss.selective_state_update(ours_state, x, dt, A, B, C, D, idx)
    y_ref = selective_scan_ref.mamba1_update_at_slots(ref_state, x, dt, A, B, C, D, idx)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(ours_state, ref_state, **tol)

    lens = [100, 173, 300, 257]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(dev)
    x, dt, A, B, C, D = _inputs(g, sum(lens), di, n, dtype, True, dev, rank=48)
    pidx = torch.tensor([7, 0, 79, 33], dtype=torch.int32, device=dev)
    has_init = torch.tensor([True, False, True, False], device=dev)
    y = ss.selective_scan(x, dt, A, B, C, D, cu, ours_state, pidx, has_init)
    y_ref = selective_scan_ref.mamba1_scan_at_slots(x, dt, A, B, C, D, cu, ref_state, pidx, has_init)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(ours_state, ref_state, **tol)
    torch.cuda.synchronize()
