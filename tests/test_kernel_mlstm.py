"""kernels/mlstm.py: xLSTM's mLSTM kernels against their torch references (kernels/mlstm_ref.py, which
test_parity_xlstm.py checks against HF transformers' own mLSTM kernels), under TRITON_INTERPRET=1 on the
CPU (set in conftest) or compiled on CUDA (harness.KERNEL_DEVICE): the decode update (padded rows, int32
and int64 indices), the verify rows (ragged rows of 0 to k drafts, every accepted count, a padding row),
the sequential varlen prefill (1-token and longer sequences, mixed initial states, a padded sequence, the
profile run's layout, internal checkpoints), fp32 / fp16 / bf16 inputs (the three state caches and all
math fp32), q / k / v as views of one projection output and i / f as strided views; masked K / V tails
and several V blocks per head (a program walks them, n and m read once before anything is written: a
program per V block would read n and m another had already overwritten). The launchers name what is wrong.
"""
from __future__ import annotations

import pytest
import torch

from harness import KERNEL_DEVICE as DEV  # the test device: CPU (interpreter) or CUDA (compiled)

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.kernels import mlstm
from toolkit.kernels.mlstm_ref import mlstm_prefill_at_slots, mlstm_update_at_slots
from toolkit.kernels.state_slots_ref import Checkpoints

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp32 math on both sides from the same rounded inputs, h and the states fp32: tight for every input dtype
TOL = dict(atol=1e-5, rtol=1e-5)
# (H, K, V): BLOCK_V 32 -> 1 V block, masked K and V tails with 2 V blocks, 2 full V blocks
SHAPES = [(2, 16, 12), (1, 12, 40), (2, 8, 64)]


def _inputs(gen: torch.Generator, dtype, n: int, h: int, kd: int, vd: int, device=DEV):
    """q, k [n, H, K], v [n, H, V]: column slices of one projection output (model dtype); i, f [n, H]
    strided column views of a wider tensor (model dtype): i ~ 2 N(0, 1), f ~ 2 + 2 N(0, 1), a few
    forget gates far out on both sides (logsigmoid's tails)."""
    width = 1 + 2 * h * kd + h * vd + 2
    x = torch.randn(n, width, generator=gen).to(device=device, dtype=dtype)
    q = x[:, 1:1 + h * kd].reshape(n, h, kd)
    k = x[:, 1 + h * kd:1 + 2 * h * kd].reshape(n, h, kd)
    v = x[:, 1 + 2 * h * kd:1 + 2 * h * kd + h * vd].reshape(n, h, vd)
    gates = torch.randn(n, 3 * h, generator=gen) * 2
    gates[:, 2 * h:] += 2
    gates[::7, 2 * h] = -18.0
    gates[3::7, -1] = 25.0
    gates = gates.to(device=device, dtype=dtype)
    return q, k, v, gates[:, h:2 * h], gates[:, 2 * h:]


def _states(gen: torch.Generator, slots: int, h: int, kd: int, vd: int, device=DEV) -> tuple[torch.Tensor, ...]:
    """Random running states (m anywhere: a running state's stabiliser is any real)."""
    return ((torch.randn(slots, h, kd, vd, generator=gen) * 0.5).to(device),
            torch.randn(slots, h, kd, generator=gen).to(device), torch.randn(slots, h, generator=gen).to(device))


def _clone(states):
    return tuple(s.clone() for s in states)


def _assert_states(ours, ref, **tol):
    for a, b, name in zip(ours, ref, ("C", "n", "m")):
        torch.testing.assert_close(a, b, **(tol or TOL), msg=lambda m, name=name: f"{name}: {m}")


def _untouched(ours, before, slots):
    return all(torch.equal(a[slots], b[slots]) for a, b in zip(ours, before))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h, kd, vd", SHAPES)
def test_mlstm_update_equals_reference(dtype, h, kd, vd):
    gen = torch.Generator().manual_seed(0)
    q, k, v, i, f = _inputs(gen, dtype, 5, h, kd, vd)
    assert not q.is_contiguous() and not i.is_contiguous() and not f.is_contiguous()
    states = _states(gen, 7, h, kd, vd)
    idx = torch.tensor([3, -1, 0, 6, -1], dtype=torch.int32, device=DEV)
    ours, ref = _clone(states), _clone(states)
    y = mlstm.mlstm_update(*ours, q, k, v, i, f, idx)
    y_ref = mlstm_update_at_slots(*ref, q, k, v, i, f, idx)
    assert y.dtype == torch.float32 and y.shape == (5, h, vd)
    torch.testing.assert_close(y, y_ref, **TOL)
    _assert_states(ours, ref)
    assert (y[[1, 4]] == 0).all()
    assert _untouched(ours, states, [1, 2, 4, 5])                    # padded rows and unused slots
    assert not torch.equal(ours[0][[0, 3, 6]], states[0][[0, 3, 6]])


def test_mlstm_update_int64_indices_contiguous_gates_and_eps():
    """int64 indices, contiguous i / f as the layer passes them, another eps, states with a small m
    (exp(-m) the denominator's floor) and a near-zero q (|q . n| under that floor)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, i, f = _inputs(gen, torch.float32, 3, 2, 16, 8)
    q[1].mul_(1e-4)
    i, f = i.contiguous(), f.contiguous()
    states = _states(gen, 4, 2, 16, 8)
    states[2].mul_(8)
    idx = torch.tensor([2, 0, -1], device=DEV)
    ours, ref = _clone(states), _clone(states)
    y = mlstm.mlstm_update(*ours, q, k, v, i, f, idx, 1e-3)
    y_ref = mlstm_update_at_slots(*ref, q, k, v, i, f, idx, 1e-3)
    torch.testing.assert_close(y, y_ref, **TOL)
    _assert_states(ours, ref)
    assert _untouched(ours, states, [1, 3])


@pytest.mark.parametrize("accepted", [1, 2, 3, 4])
def test_mlstm_verify_rows_equal_reference(accepted):
    """Verify rows (speculative decoding), state columns [R, 1 + k = 4]: rows of 4, 1, 2 and 3 tokens
    (3, 0, 1 and 2 drafts), each starting from column num_accepted - 1 (every count row 0 can have), a
    padding row (column 0 = -1) holding a token, and a real row with a -1 column (nothing written there)."""
    gen = torch.Generator().manual_seed(3)
    h, kd, vd = 2, 12, 40
    q, k, v, i, f = _inputs(gen, torch.float32, 11, h, kd, vd)
    states = _states(gen, 20, h, kd, vd)
    cols = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [-1, -1, -1, -1], [9, -1, 10, 11], [12, 13, 14, 15]],
                        dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 4, 5, 6, 8, 11], dtype=torch.int32, device=DEV)
    acc = torch.tensor([accepted, 1, 1, min(accepted, 2), min(accepted, 3)], dtype=torch.int32, device=DEV)
    ours, ref = _clone(states), _clone(states)
    kw = dict(query_start_loc=qsl, num_accepted_tokens=acc)
    y = mlstm.mlstm_update(*ours, q, k, v, i, f, cols, **kw)
    y_ref = mlstm_update_at_slots(*ref, q, k, v, i, f, cols, **kw)
    assert y.shape == (11, h, vd)
    torch.testing.assert_close(y, y_ref, **TOL)
    _assert_states(ours, ref)
    assert (y[5] == 0).all()                                          # the padding row's token
    assert _untouched(ours, states, [0, 6, 7, 8, 10, 11, 15, 16, 17, 18, 19])     # read at most, never written


def test_mlstm_verify_rows_bf16_inputs_and_no_rows():
    gen = torch.Generator().manual_seed(4)
    q, k, v, i, f = _inputs(gen, torch.bfloat16, 5, 2, 8, 64)
    states = _states(gen, 8, 2, 8, 64)
    cols = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int64, device=DEV)
    kw = dict(query_start_loc=torch.tensor([0, 3, 5], device=DEV), num_accepted_tokens=torch.tensor([2, 1], device=DEV))
    ours, ref = _clone(states), _clone(states)
    y = mlstm.mlstm_update(*ours, q, k, v, i, f, cols, **kw)
    torch.testing.assert_close(y, mlstm_update_at_slots(*ref, q, k, v, i, f, cols, **kw), **TOL)
    _assert_states(ours, ref)
    none = dict(query_start_loc=torch.zeros(1, dtype=torch.int32, device=DEV),
                num_accepted_tokens=torch.zeros(0, dtype=torch.int32, device=DEV))
    y = mlstm.mlstm_update(*ours, q, k, v, i, f, cols[:0], **none)
    assert y.shape == (5, 2, 64) and (y == 0).all()


# lengths 1, 2 and longer, initial states mixed in; the last sequence is padded (slot -1, says it has a
# state: reads nothing, writes nothing, h from zeros)
LENS = [1, 15, 2, 16, 40, 1, 5]
HAS_INIT = [True, False, False, True, True, False, True]
SLOTS = [4, 0, 7, 2, 8, 5, -1]
UNTOUCHED = [1, 3, 6]


def _prefill_case(dtype, h, kd, vd, lens, has_init, slots, num_slots, seed, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, i, f = _inputs(gen, dtype, sum(lens), h, kd, vd, device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    states = _states(gen, num_slots, h, kd, vd, device)
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    flags = torch.tensor(has_init, device=device)
    return [q, k, v, i, f, cu], states, idx, flags


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h, kd, vd", SHAPES[:2])
def test_mlstm_prefill_equals_reference(dtype, h, kd, vd):
    args, states, idx, flags = _prefill_case(dtype, h, kd, vd, LENS, HAS_INIT, SLOTS, 9, seed=2)
    ours, ref = _clone(states), _clone(states)
    y = mlstm.mlstm_prefill(*args, *ours, idx, flags)
    y_ref = mlstm_prefill_at_slots(*args, *ref, idx, flags)
    assert y.dtype == torch.float32 and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, **TOL)
    _assert_states(ours, ref)
    assert _untouched(ours, states, UNTOUCHED)                        # no other slot written (pad included)
    assert not torch.equal(ours[0][SLOTS[:-1]], states[0][SLOTS[:-1]])


def test_mlstm_prefill_int64_layout_and_a_fresh_sequence_overwrites_its_slot():
    """int64 cu_seqlens / indices and int has_initial_state; a sequence without an initial state
    starts from zeros whatever its slot holds, and leaves its own final state there."""
    args, states, idx, flags = _prefill_case(torch.float32, 2, 8, 64, [3, 6, 1], [False, True, False], [2, 0, 1], 4,
                                             seed=3)
    args[5] = args[5].long()
    ours, ref = _clone(states), _clone(states)
    y = mlstm.mlstm_prefill(*args, *ours, idx.long(), flags.int(), 1e-3)
    y_ref = mlstm_prefill_at_slots(*args, *ref, idx, flags, 1e-3)
    torch.testing.assert_close(y, y_ref, **TOL)
    _assert_states(ours, ref)
    fresh = mlstm_prefill_at_slots(*[a[:3] for a in args[:5]], args[5][:2], *_clone(states), idx[:1],
                                   torch.tensor([False], device=DEV), 1e-3)
    torch.testing.assert_close(y[:3], fresh, **TOL)


def test_mlstm_prefill_profile_run_layout():
    """One padded sequence over the whole batch from a zero state (the profile run's call): h only."""
    args, states, idx, flags = _prefill_case(torch.float32, 2, 16, 12, [19], [True], [-1], 2, seed=4)
    ours, ref = _clone(states), _clone(states)
    y = mlstm.mlstm_prefill(*args, *ours, idx, flags)
    y_ref = mlstm_prefill_at_slots(*args, *ref, idx, flags)
    torch.testing.assert_close(y, y_ref, **TOL)
    assert _untouched(ours, states, [0, 1]) and _untouched(ref, states, [0, 1])


# ---- internal checkpoints --------------------------------------------------------------------------
# lens [5, 20, 1, 18, 7]: sequence 0 (initial state, slot 4) saves after its first token (token 0) and
# once with PAD_SLOT_ID (token 3); sequence 1 (no initial state) after its first token (5) and its 18th
# (22); sequence 2 has one token (its last: no checkpoint); sequence 3 (initial state) after its 16th
# (41); sequence 4 is padded (slot -1) and still saves after its 2nd token (45) to slot 12.
CKPT_LENS = [5, 20, 1, 18, 7]
CKPT_HAS_INIT = [True, False, False, True, True]
CKPT_IDX = [4, 0, 7, 2, -1]
CKPT_TOKENS = [0, 3, 5, 22, 41, 45]
CKPT_SLOTS = [9, -1, 10, 11, 1, 12]
CKPT_UNTOUCHED = [3, 5, 6, 8, 13]            # of 14 slots: no sequence and no checkpoint names these


def _checkpoints(tokens, slots):
    return Checkpoints(torch.tensor(tokens, dtype=torch.int64, device=DEV),
                       torch.tensor(slots, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("dtype, h, kd, vd", [(torch.float32, *SHAPES[0]), (torch.bfloat16, *SHAPES[1])])
def test_mlstm_prefill_checkpoints_equal_reference(dtype, h, kd, vd):
    args, states, idx, flags = _prefill_case(dtype, h, kd, vd, CKPT_LENS, CKPT_HAS_INIT, CKPT_IDX, 14, seed=7)
    ckpt = _checkpoints(CKPT_TOKENS, CKPT_SLOTS)
    ours, ref, plain = _clone(states), _clone(states), _clone(states)
    y = mlstm.mlstm_prefill(*args, *ours, idx, flags, checkpoints=ckpt)
    y_ref = mlstm_prefill_at_slots(*args, *ref, idx, flags, checkpoints=ckpt)
    y_plain = mlstm.mlstm_prefill(*args, *plain, idx, flags)
    assert torch.equal(y, y_plain)                                    # saving changes nothing else
    assert all(torch.equal(a[CKPT_IDX[:-1]], b[CKPT_IDX[:-1]]) for a, b in zip(ours, plain))
    torch.testing.assert_close(y, y_ref, **TOL)
    _assert_states(ours, ref)                                         # every slot
    assert _untouched(ours, states, CKPT_UNTOUCHED)                   # the -1 checkpoint wrote nothing
    for s in [9, 10, 11, 1, 12]:
        assert all(not torch.equal(a[s], b[s]) for a, b in zip(ours, states))


def test_mlstm_prefill_no_checkpoints_m0():
    """M = 0: the same outputs and states as without checkpoints."""
    args, states, idx, flags = _prefill_case(torch.float32, *SHAPES[0], CKPT_LENS, CKPT_HAS_INIT, CKPT_IDX, 14,
                                             seed=8)
    plain, ours = _clone(states), _clone(states)
    y_plain = mlstm.mlstm_prefill(*args, *plain, idx, flags)
    y = mlstm.mlstm_prefill(*args, *ours, idx, flags, checkpoints=_checkpoints([], []))
    assert torch.equal(y, y_plain) and all(torch.equal(a, b) for a, b in zip(ours, plain))


def test_mlstm_launchers_name_what_is_wrong():
    c, n, m = torch.zeros(3, 2, 16, 8), torch.zeros(3, 2, 16), torch.zeros(3, 2)
    q, v, g = torch.zeros(2, 2, 16), torch.zeros(2, 2, 8), torch.zeros(2, 2)
    idx = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k must be \[B=2, H=2, K=16\] like q, got \(2, 2, 8\)"):
        mlstm.mlstm_update(c, n, m, q, torch.zeros(2, 2, 8), v, g, g, idx)
    with pytest.raises(ValueError, match=r"c_state must be \[S, H=2, K=16, V=8\] \(S as c_state's\), "
                                         r"got \(3, 2, 8, 16\)"):
        mlstm.mlstm_update(torch.zeros(3, 2, 8, 16), n, m, q, q, v, g, g, idx)
    with pytest.raises(ValueError, match=r"m_state must be \[S, H=2\] \(S as c_state's\), got \(3, 2, 1\)"):
        mlstm.mlstm_update(c, n, torch.zeros(3, 2, 1), q, q, v, g, g, idx)
    with pytest.raises(ValueError, match="n_state must be float32 .* got torch.bfloat16"):
        mlstm.mlstm_update(c, n.bfloat16(), m, q, q, v, g, g, idx)
    with pytest.raises(ValueError, match=r"f must be \[B=2, H=2\] \(a gate pre-activation per head\), got \(2, 3\)"):
        mlstm.mlstm_update(c, n, m, q, q, v, g, torch.zeros(2, 3), idx)
    with pytest.raises(ValueError, match=r"q must be contiguous in its last dimension"):
        mlstm.mlstm_update(c, n, m, torch.zeros(2, 16, 2).transpose(1, 2), q, v, g, g, idx)
    with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[B=2\], got torch.float32"):
        mlstm.mlstm_update(c, n, m, q, q, v, g, g, torch.zeros(2))
    with pytest.raises(ValueError, match="num_accepted_tokens was given without query_start_loc"):
        mlstm.mlstm_update(c, n, m, q, q, v, g, g, idx.view(1, 2), num_accepted_tokens=idx[:1])
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens must be int32/int64 \[P\+1=2\], got torch.int32 \(3,\)"):
        mlstm.mlstm_prefill(q, q, v, g, g, torch.tensor([0, 1, 2], dtype=torch.int32), c, n, m, idx[:1],
                            torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"has_initial_state must be bool/int32/int64 \[P=1\], got torch.float32"):
        mlstm.mlstm_prefill(q, q, v, g, g, cu, c, n, m, idx[:1], torch.zeros(1))
    with pytest.raises(ValueError, match=r"i must be \[T=2, H=2\]"):
        mlstm.mlstm_prefill(q, q, v, torch.zeros(2), g, cu, c, n, m, idx[:1], torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"checkpoints.token_index must be int64 \[M\], got torch.int32"):
        mlstm.mlstm_prefill(q, q, v, g, g, cu, c, n, m, idx[:1], torch.ones(1, dtype=torch.bool),
                            checkpoints=Checkpoints(torch.tensor([0], dtype=torch.int32), torch.tensor([1])))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: real shapes")
def test_mlstm_real_shape_cuda():
    """xLSTM-7b's mLSTM head shapes (K = 256, V = 512; 4 of its 8 heads), compiled kernels, bf16 inputs:
    a prefill with checkpoints, then decode rows and verify rows."""
    h, kd, vd = 4, 256, 512
    lens, has_init, slots = [1, 63, 64, 300], [True, False, True, False], [12, 3, -1, 7]
    args, states, idx, flags = _prefill_case(torch.bfloat16, h, kd, vd, lens, has_init, slots, 40, seed=5,
                                             device="cuda")
    ckpt = Checkpoints(torch.tensor([5, 100, 200], device="cuda"), torch.tensor([30, 31, 32], device="cuda"))
    ours, ref = _clone(states), _clone(states)
    y = mlstm.mlstm_prefill(*args, *ours, idx, flags, checkpoints=ckpt)
    y_ref = mlstm_prefill_at_slots(*args, *ref, idx, flags, checkpoints=ckpt)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    _assert_states(ours, ref, atol=1e-4, rtol=1e-4)
    gen = torch.Generator().manual_seed(6)
    q, k, v, i, f = _inputs(gen, torch.bfloat16, 9, h, kd, vd, "cuda")
    dec = torch.tensor([0, 5, -1, 39, 12, 2, -1, 20, 33], device="cuda")
    y = mlstm.mlstm_update(*ours, q, k, v, i, f, dec)
    y_ref = mlstm_update_at_slots(*ref, q, k, v, i, f, dec)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    _assert_states(ours, ref, atol=1e-4, rtol=1e-4)
    cols = torch.tensor([[1, 2, 3, 4], [5, 6, 8, 9]], device="cuda")
    kw = dict(query_start_loc=torch.tensor([0, 4, 6], device="cuda"),
              num_accepted_tokens=torch.tensor([2, 1], device="cuda"))
    y = mlstm.mlstm_update(*ours, q[:6], k[:6], v[:6], i[:6], f[:6], cols, **kw)
    y_ref = mlstm_update_at_slots(*ref, q[:6], k[:6], v[:6], i[:6], f[:6], cols, **kw)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    _assert_states(ours, ref, atol=1e-4, rtol=1e-4)
