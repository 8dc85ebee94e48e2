"""kernels/causal_conv1d.py: the causal conv1d kernels against their torch references, under TRITON_INTERPRET=1 on
the CPU (set in conftest before any kernel is defined) or compiled on CUDA (harness.KERNEL_DEVICE): small
shapes, fp32 / fp16 / bf16. The decode update: padded rows, x a view of a wider projection. The varlen prefill:
sequence lengths around the kernel's token block, with and without initial state, padded sequences, the views
the mixers pass (x a column slice of the projection, weight = conv1d.weight[:, 0, :]); real shapes on a GPU.
Internal checkpoints (prefix caching): the prefill also saves the state after chosen tokens, as the reference
does; the reference's checkpoint equals the final state of a prefill of the prefix."""
from __future__ import annotations

import pytest
import torch

from harness import KERNEL_DEVICE as DEV  # the test device: CPU (interpreter) or CUDA (compiled)
from harness import checkpoint_prefixes

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.kernels import causal_conv1d as conv
from toolkit.kernels import causal_conv1d_ref
from toolkit.kernels.state_slots_ref import Checkpoints

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# both sides compute in fp32 and round once to the output dtype: allow about one ulp of it
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_width, with_bias, activation", [(4, True, "silu"), (3, False, None), (2, True, "silu")])
def test_causal_conv1d_update_equals_reference(dtype, k_width, with_bias, activation):
    g = torch.Generator().manual_seed(1)
    slots_total, dim = 6, 40                         # dim not a power of two: masked lanes
    xz = torch.randn(5, 2 * dim, generator=g).to(DEV, dtype)
    x = xz[:, :dim]                                  # a view, as the mixers pass it
    state = torch.randn(slots_total, k_width - 1, dim, generator=g).to(DEV, dtype)
    weight = torch.randn(dim, k_width, generator=g).to(DEV, dtype)
    bias = torch.randn(dim, generator=g).to(DEV, dtype) if with_bias else None
    idx = torch.tensor([3, -1, 1, 5, -1], dtype=torch.int32, device=DEV)
    ours_state, ref_state = state.clone(), state.clone()
    ours = conv.causal_conv1d_update(x, ours_state, idx, weight, bias, activation)
    ref = causal_conv1d_ref.conv_update_at_slots(x, ref_state, idx, weight, bias, activation)
    torch.testing.assert_close(ours, ref, **TOL[dtype])
    assert torch.equal(ours_state, ref_state)                    # the shift is a copy: bit-exact
    assert torch.equal(ours_state[[0, 2, 4]], state[[0, 2, 4]])  # slots of padded rows untouched
    assert (ours[[1, 4]] == 0).all()


def test_causal_conv1d_update_launcher_names_what_is_wrong():
    x, state, w = torch.zeros(2, 8), torch.zeros(3, 3, 8), torch.zeros(8, 4)
    with pytest.raises(ValueError, match=r"weight must be \[Dc=8, K=4\]"):
        conv.causal_conv1d_update(x, state, torch.zeros(2, dtype=torch.long), torch.zeros(8, 3), None)
    with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[B=2\]"):
        conv.causal_conv1d_update(x, state, torch.zeros(3, dtype=torch.long), w, None)
    with pytest.raises(ValueError, match="activation='gelu'"):
        conv.causal_conv1d_update(x, state, torch.zeros(2, dtype=torch.long), w, None, "gelu")


def test_causal_conv1d_update_names_a_malformed_verify_argument():
    """Verify rows (query_start_loc, num_accepted_tokens, state_indices [R, 1 + k]): the launcher names
    the argument that is wrong, before any launch."""
    x, state, w = torch.zeros(5, 8), torch.zeros(6, 3, 8), torch.zeros(8, 4)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    qsl, accepted = torch.tensor([0, 2, 5], dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"query_start_loc must be int32/int64 \[R\+1=3\], got torch.int32 \(2,\)"):
        conv.causal_conv1d_update(x, state, idx, w, None, query_start_loc=qsl[:2], num_accepted_tokens=accepted)
    with pytest.raises(ValueError, match="query_start_loc was given without num_accepted_tokens"):
        conv.causal_conv1d_update(x, state, idx, w, None, query_start_loc=qsl)


def _case(g, dtype, dim, k_width, with_bias, lens, slots_total, state_dtype=None, device=DEV):
    """x: a column slice of a wider projection; weight: the [Dc, K] view of a [Dc, 1, K] conv weight."""
    t = sum(lens)
    proj = torch.randn(t, dim + 24, generator=g).to(dtype).to(device)
    x = proj[:, 8:8 + dim]
    state = torch.randn(slots_total, k_width - 1, dim, generator=g).to(state_dtype or dtype).to(device)
    weight = torch.randn(dim, 1, k_width, generator=g).to(dtype).to(device)[:, 0, :]
    bias = torch.randn(dim, generator=g).to(dtype).to(device) if with_bias else None
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    return x, state, weight, bias, cu


def _run_both(x, state, idx, has_init, cu, weight, bias, activation):
    ours_state, ref_state = state.clone(), state.clone()
    ours = conv.causal_conv1d_prefill(x, ours_state, idx, has_init, cu, weight, bias, activation)
    ref = causal_conv1d_ref.conv_prefill_at_slots(x, ref_state, idx, has_init, cu, weight, bias, activation)
    return ours, ours_state, ref, ref_state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_width, with_bias, activation", [(4, True, "silu"), (3, False, None), (2, True, "swish")])
def test_causal_conv1d_prefill_equals_reference(dtype, k_width, with_bias, activation):
    g = torch.Generator().manual_seed(3)
    bt = conv._PREFILL_BLOCK_T
    # lengths 1, 2 (shorter than K-1 = 3 for K=4: the final state keeps part of the initial state),
    # block-1, block, block+1, longer than two blocks; one padded sequence (-1) in the middle
    lens = [1, bt - 1, bt, 2, bt + 1, 2 * bt + 6, 3]
    idx = torch.tensor([7, 2, 0, 5, -1, 3, 9], dtype=torch.int32, device=DEV)
    has_init = torch.tensor([True, False, True, True, True, True, False], device=DEV)
    x, state, weight, bias, cu = _case(g, dtype, 40, k_width, with_bias, lens, 11)   # Dc not a power of two
    ours, ours_state, ref, ref_state = _run_both(x, state, idx, has_init, cu, weight, bias, activation)
    torch.testing.assert_close(ours, ref, **TOL[dtype])
    assert torch.equal(ours_state, ref_state)                     # final states are copies: bit-exact
    untouched = [1, 4, 6, 8, 10]                                  # slots no sequence names
    assert torch.equal(ours_state[untouched], state[untouched])
    # the padded sequence's outputs come from a zero initial state, as the reference computes them
    pad = slice(sum(lens[:4]), sum(lens[:5]))
    assert ours[pad].abs().sum() > 0


@pytest.mark.parametrize("x_dtype, state_dtype",
                         [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_causal_conv1d_prefill_state_dtype_differs(x_dtype, state_dtype):
    """A cache dtype other than x's: states are cast once, exactly as the reference casts them;
    int64 indices and cu_seqlens, has_initial_state None (every real sequence reads its slot)."""
    g = torch.Generator().manual_seed(4)
    lens = [5, 1, 40]
    idx = torch.tensor([1, 3, 0], device=DEV)
    x, state, weight, bias, cu = _case(g, x_dtype, 24, 4, True, lens, 4, state_dtype)
    ours, ours_state, ref, ref_state = _run_both(x, state, idx, None, cu.long(), weight, bias, "silu")
    torch.testing.assert_close(ours, ref, **TOL[x_dtype])
    assert torch.equal(ours_state, ref_state)
    assert torch.equal(ours_state[2], state[2])


def test_causal_conv1d_prefill_all_padded_and_empty():
    """The profile run's shape: one sequence at slot -1 (zero state, no write); and P = 0."""
    g = torch.Generator().manual_seed(5)
    x, state, weight, bias, cu = _case(g, torch.float32, 16, 3, False, [37], 2)
    idx = torch.tensor([-1], dtype=torch.int32, device=DEV)
    ours, ours_state, ref, _ = _run_both(x, state, idx, torch.tensor([True], device=DEV), cu, weight, bias, None)
    torch.testing.assert_close(ours, ref, **TOL[torch.float32])
    assert torch.equal(ours_state, state)
    out = conv.causal_conv1d_prefill(x[:0], state, idx[:0], torch.zeros(0, dtype=torch.bool, device=DEV),
                                     cu[:1], weight, bias, None)
    assert out.shape == (0, 16)


def test_causal_conv1d_prefill_launcher_names_what_is_wrong():
    x, state, w = torch.zeros(5, 8), torch.zeros(3, 3, 8), torch.zeros(8, 4)
    idx, has = torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.bool)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"weight must be \[Dc=8, K=4\]"):
        conv.causal_conv1d_prefill(x, state, idx, has, cu, torch.zeros(8, 3), None)
    with pytest.raises(ValueError, match=r"cu_seqlens must be int32/int64 \[P\+1=3\], got torch.int32 \(2,\)"):
        conv.causal_conv1d_prefill(x, state, idx, has, cu[:2], w, None)
    with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[P\], got torch.float32"):
        conv.causal_conv1d_prefill(x, state, idx.float(), has, cu, w, None)
    with pytest.raises(ValueError, match=r"has_initial_state must be bool \[P=2\], got torch.int64"):
        conv.causal_conv1d_prefill(x, state, idx, has.long(), cu, w, None)
    with pytest.raises(ValueError, match=r"conv_state must be \[S, K-1, Dc=8\], got \(3, 3, 6\)"):
        conv.causal_conv1d_prefill(x, torch.zeros(3, 3, 6), idx, has, cu, w, None)
    with pytest.raises(ValueError, match="activation='gelu'"):
        conv.causal_conv1d_prefill(x, state, idx, has, cu, w, None, "gelu")
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        conv.causal_conv1d_prefill(torch.zeros(8, 5).t(), state, idx, has, cu, w, None)


# ---- internal checkpoints --------------------------------------------------------------------------
# lens [6, 3, 1, 9]: sequence 0 (initial state, slot 2) saves after its first token (a window reaching
# into the initial state, which the kernel overwrites with the final state) and after token 3;
# sequence 1 (no initial state) after its first token and once with PAD_SLOT_ID; sequence 2 is padded;
# sequence 3 (initial state) after tokens 1 and 5.
CKPT_LENS = [6, 3, 1, 9]
CKPT_IDX = [2, 5, -1, 0]
CKPT_HAS_INIT = [True, False, True, True]
CKPT_TOKENS = [0, 3, 6, 7, 11, 15]
CKPT_SLOTS = [7, 8, 9, -1, 3, 10]
CKPT_UNTOUCHED = [1, 4, 6, 11]           # of 12 slots: no sequence and no checkpoint names these


def _checkpoints(tokens, slots, device=DEV):
    return Checkpoints(torch.tensor(tokens, dtype=torch.int64, device=device),
                       torch.tensor(slots, dtype=torch.int32, device=device))


def _ckpt_case(g, dtype, k_width, state_dtype=None):
    x, state, weight, bias, cu = _case(g, dtype, 20, k_width, True, CKPT_LENS, 12, state_dtype)
    idx = torch.tensor(CKPT_IDX, dtype=torch.int32, device=DEV)
    has_init = torch.tensor(CKPT_HAS_INIT, device=DEV)
    return x, state, weight, bias, cu, idx, has_init


@pytest.mark.parametrize("dtype, state_dtype, k_width",
                         [(torch.float32, None, 4), (torch.float16, None, 4), (torch.bfloat16, None, 4),
                          (torch.bfloat16, torch.float32, 4), (torch.float32, None, 2)])
def test_causal_conv1d_prefill_checkpoints_equal_reference(dtype, state_dtype, k_width):
    g = torch.Generator().manual_seed(7)
    x, state, weight, bias, cu, idx, has_init = _ckpt_case(g, dtype, k_width, state_dtype)
    ckpt = _checkpoints(CKPT_TOKENS, CKPT_SLOTS)
    ours_state, ref_state = state.clone(), state.clone()
    ours = conv.causal_conv1d_prefill(x, ours_state, idx, has_init, cu, weight, bias, "silu", checkpoints=ckpt)
    ref = causal_conv1d_ref.conv_prefill_at_slots(x, ref_state, idx, has_init, cu, weight, bias, "silu",
                                                  checkpoints=ckpt)
    torch.testing.assert_close(ours, ref, **TOL[dtype])
    assert torch.equal(ours_state, ref_state)               # every slot: states are copies, bit-exact
    assert torch.equal(ours_state[CKPT_UNTOUCHED], state[CKPT_UNTOUCHED])   # the -1 checkpoint wrote nothing
    for s in [7, 8, 9, 3, 10]:
        assert not torch.equal(ours_state[s], state[s])
    # the first-token checkpoint of sequence 0: K-2 rows of its initial state, then x[0]
    win = ours_state[7]
    assert torch.equal(win[:k_width - 2], state[2, 1:])
    assert torch.equal(win[-1], x[0].to(win.dtype))


def test_causal_conv1d_prefill_no_checkpoints_m0():
    """M = 0: the same outputs and states as without checkpoints, and as the reference."""
    g = torch.Generator().manual_seed(8)
    x, state, weight, bias, cu, idx, has_init = _ckpt_case(g, torch.float32, 4)
    empty = _checkpoints([], [])
    plain_state, ours_state, ref_state = state.clone(), state.clone(), state.clone()
    plain = conv.causal_conv1d_prefill(x, plain_state, idx, has_init, cu, weight, bias, "silu")
    ours = conv.causal_conv1d_prefill(x, ours_state, idx, has_init, cu, weight, bias, "silu", checkpoints=empty)
    ref = causal_conv1d_ref.conv_prefill_at_slots(x, ref_state, idx, has_init, cu, weight, bias, "silu",
                                                  checkpoints=empty)
    assert torch.equal(ours, plain) and torch.equal(ours_state, plain_state)
    torch.testing.assert_close(ours, ref, **TOL[torch.float32])
    assert torch.equal(ours_state, ref_state)


@pytest.mark.parametrize("k_width", [4, 2])
def test_causal_conv1d_reference_checkpoint_is_the_prefix_final_state(k_width):
    """The reference's checkpoint after token t of a sequence is the final state the reference leaves
    after a prefill of that sequence's prefix up to t, from the same initial state."""
    g = torch.Generator().manual_seed(9)
    x, state, weight, bias, cu, idx, has_init = _ckpt_case(g, torch.bfloat16, k_width)
    ref_state = state.clone()
    causal_conv1d_ref.conv_prefill_at_slots(x, ref_state, idx, has_init, cu, weight, bias, "silu",
                                            checkpoints=_checkpoints(CKPT_TOKENS, CKPT_SLOTS))
    cases = checkpoint_prefixes(CKPT_TOKENS, CKPT_SLOTS, cu.tolist())
    assert len(cases) == 5
    for tok, slot, s, rows in cases:
        prefix_state = state.clone()
        causal_conv1d_ref.conv_prefill_at_slots(
            x[rows], prefix_state, idx[s:s + 1], has_init[s:s + 1],
            torch.tensor([0, rows.stop - rows.start], dtype=torch.int32, device=DEV), weight, bias, "silu")
        assert torch.equal(ref_state[slot], prefix_state[CKPT_IDX[s]]), (tok, slot)


def test_causal_conv1d_prefill_checkpoints_named_when_wrong():
    x, state, w = torch.zeros(5, 8), torch.zeros(3, 3, 8), torch.zeros(8, 4)
    idx, has = torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.bool)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    tok, slots = torch.tensor([0, 2]), torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"checkpoints.token_index must be int64 \[M\], got torch.int32"):
        conv.causal_conv1d_prefill(x, state, idx, has, cu, w, None, checkpoints=Checkpoints(tok.int(), slots))
    with pytest.raises(ValueError, match=r"checkpoints.token_index must be int64 \[M\], got torch.int64 \(1, 2\)"):
        conv.causal_conv1d_prefill(x, state, idx, has, cu, w, None, checkpoints=Checkpoints(tok[None], slots))
    with pytest.raises(ValueError, match=r"checkpoints.slots must be int32/int64 \[M=2\], got torch.int32 \(1,\)"):
        conv.causal_conv1d_prefill(x, state, idx, has, cu, w, None, checkpoints=Checkpoints(tok, slots[:1]))
    with pytest.raises(ValueError, match=r"checkpoints.slots must be int32/int64 \[M=2\], got torch.float32"):
        conv.causal_conv1d_prefill(x, state, idx, has, cu, w, None, checkpoints=Checkpoints(tok, slots.float()))
    with pytest.raises(ValueError, match="checkpoints.slots is on meta, x on "):
        conv.causal_conv1d_prefill(x, state, idx, has, cu, w, None, checkpoints=Checkpoints(tok, slots.to("meta")))
    with pytest.raises(ValueError, match="checkpoints must be a state_slots_ref.Checkpoints"):
        conv.causal_conv1d_prefill(x, state, idx, has, cu, w, None, checkpoints=(tok, slots))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: real shapes")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim, k_width, with_bias, activation",
                         [(1536 + 2 * 128, 4, True, "silu"),      # mamba2-130m xBC conv
                          (1024, 3, False, None)])                # lfm2-350m short conv
def test_causal_conv1d_prefill_real_shapes(dtype, dim, k_width, with_bias, activation):
    g = torch.Generator().manual_seed(6)
    lens = [64, 300, 129, 1, 2, 97, 211]
    idx = torch.tensor([12, 3, -1, 7, 0, 30, 5], dtype=torch.int32, device="cuda")
    has_init = torch.tensor([True, True, True, True, False, False, True], device="cuda")
    x, state, weight, bias, cu = _case(g, dtype, dim, k_width, with_bias, lens, 32, device="cuda")
    ours, ours_state, ref, ref_state = _run_both(x, state, idx, has_init, cu, weight, bias, activation)
    torch.testing.assert_close(ours, ref, **TOL[dtype])
    assert torch.equal(ours_state, ref_state)
    untouched = [s for s in range(32) if s not in (12, 3, 7, 0, 30, 5)]
    assert torch.equal(ours_state[untouched], state[untouched])
