"""Triton kernels against their torch references, under TRITON_INTERPRET=1 on the CPU (set in
conftest before any kernel is defined): small shapes, fp32 / fp16 / bf16, padded rows, the
non-contiguous views the runner passes."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.kernels import causal_conv1d as conv  # noqa: E402
from toolkit.kernels import kv_cache  # noqa: E402
from toolkit.kernels import causal_conv1d_ref, kv_cache_ref, selective_state_update_ref  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_write_equals_reference(dtype):
    g = torch.Generator().manual_seed(0)
    blocks, bs, heads, d = 6, 4, 2, 16
    qkv = torch.randn(9, 3, heads, d, generator=g).to(dtype)       # k, v are views of a fused tensor
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([5, -1, 0 + 4, 17, -1, 22, 8, 9, 23])       # two padded tokens
    ours = torch.zeros(blocks, 2, bs, heads, d, dtype=dtype)
    ref = ours.clone()
    kv_cache.write_kv_cache(ours, k, v, slots)
    kv_cache_ref.write_kv_cache(ref, k, v, slots)
    assert torch.equal(ours, ref)
    assert ours.abs().sum() > 0


def test_kv_cache_launcher_names_what_is_wrong():
    cache = torch.zeros(4, 2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"k must be \[N=3, Hkv=2, D=8\]"):
        kv_cache.write_kv_cache(cache, torch.zeros(3, 2, 4), torch.zeros(3, 2, 8), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_mapping must be int32/int64"):
        kv_cache.write_kv_cache(cache, torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), torch.zeros(3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_width, with_bias, activation", [(4, True, "silu"), (3, False, None), (2, True, "silu")])
def test_causal_conv1d_update_equals_reference(dtype, k_width, with_bias, activation):
    g = torch.Generator().manual_seed(1)
    slots_total, dim = 6, 40                         # dim not a power of two: masked lanes
    xz = torch.randn(5, 2 * dim, generator=g).to(dtype)
    x = xz[:, :dim]                                  # a view, as the mixers pass it
    state = torch.randn(slots_total, k_width - 1, dim, generator=g).to(dtype)
    weight = torch.randn(dim, k_width, generator=g).to(dtype)
    bias = torch.randn(dim, generator=g).to(dtype) if with_bias else None
    idx = torch.tensor([3, -1, 1, 5, -1], dtype=torch.int32)
    ours_state, ref_state = state.clone(), state.clone()
    ours = conv.causal_conv1d_update(x, ours_state, idx, weight, bias, activation)
    ref = causal_conv1d_ref.conv_update_at_slots(x, ref_state, idx, weight, bias, activation)
    # both sides compute in fp32 and round once to the output dtype: allow about one ulp of it
    tol = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
           torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}[dtype]
    torch.testing.assert_close(ours, ref, **tol)
    assert torch.equal(ours_state, ref_state)                    # the shift is a copy: bit-exact
    assert torch.equal(ours_state[[0, 2, 4]], state[[0, 2, 4]])  # slots of padded rows untouched
    assert (ours[[1, 4]] == 0).all()


def test_causal_conv1d_launcher_names_what_is_wrong():
    x, state, w = torch.zeros(2, 8), torch.zeros(3, 3, 8), torch.zeros(8, 4)
    with pytest.raises(ValueError, match=r"weight must be \[Dc=8, K=4\]"):
        conv.causal_conv1d_update(x, state, torch.zeros(2, dtype=torch.long), torch.zeros(8, 3), None)
    with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[B=2\]"):
        conv.causal_conv1d_update(x, state, torch.zeros(3, dtype=torch.long), w, None)
    with pytest.raises(ValueError, match="activation='gelu'"):
        conv.causal_conv1d_update(x, state, torch.zeros(2, dtype=torch.long), w, None, "gelu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups, with_d", [(1, True), (2, False)])
def test_selective_state_update_equals_reference(dtype, groups, with_d):
    from toolkit.kernels import selective_state_update as ssu
    g = torch.Generator().manual_seed(2)
    slots, heads, head_dim, d_state, b = 5, 4, 12, 16, 4         # head_dim not a power of two
    state = torch.randn(slots, heads, head_dim, d_state, generator=g)   # the fp32 state cache
    xbc = torch.randn(b, heads * head_dim + 2 * groups * d_state, generator=g).to(dtype)
    x = xbc[:, :heads * head_dim].view(b, heads, head_dim)        # views into one projection
    B = xbc[:, heads * head_dim:heads * head_dim + groups * d_state].view(b, groups, d_state)
    C = xbc[:, heads * head_dim + groups * d_state:].view(b, groups, d_state)
    dt = torch.nn.functional.softplus(torch.randn(b, heads, generator=g))
    A = -torch.rand(heads, generator=g) - 0.5
    D = torch.randn(heads, generator=g) if with_d else None
    idx = torch.tensor([2, -1, 4, 1])
    ours_state, ref_state = state.clone(), state.clone()
    y = ssu.selective_state_update(ours_state, x, dt, A, B, C, D, idx)
    y_ref = selective_state_update_ref.mamba2_update_at_slots(ref_state, x, dt, A, B, C, D, idx)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)      # fp32 math on both sides
    torch.testing.assert_close(ours_state, ref_state, atol=1e-6, rtol=1e-6)
    assert torch.equal(ours_state[[0, 3]], state[[0, 3]]) and (y[1] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dt_limit", [None, (0.0, float("inf")), (0.05, 0.8)])
def test_selective_state_update_prepares_raw_dt_like_mamba2_dt(dtype, dt_limit):
    """dt_bias given: dt is the raw in_proj column (a strided view), prepared in the kernel; equal to
    preparing it first with the torch reference of `mamba2_dt` and updating with that."""
    from toolkit.kernels import selective_state_update as ssu
    g = torch.Generator().manual_seed(5)
    slots, heads, head_dim, d_state, b = 6, 4, 8, 16, 5
    state = torch.randn(slots, heads, head_dim, d_state, generator=g)
    proj = (6 * torch.randn(b, heads * head_dim + 2 * d_state + heads, generator=g)).to(dtype)
    x = proj[:, :heads * head_dim].view(b, heads, head_dim)
    B = proj[:, heads * head_dim:heads * head_dim + d_state].view(b, 1, d_state)
    C = proj[:, heads * head_dim + d_state:heads * head_dim + 2 * d_state].view(b, 1, d_state)
    dt_raw = proj[:, -heads:]
    dt_bias = torch.randn(heads, generator=g).to(dtype)
    A, D = -torch.rand(heads, generator=g) - 0.5, torch.randn(heads, generator=g)
    idx = torch.tensor([3, 0, -1, 5, 1])
    ours_state, ref_state = state.clone(), state.clone()
    y = ssu.selective_state_update(ours_state, x, dt_raw, A, B, C, D, idx, dt_bias, dt_limit)
    y_ref = selective_state_update_ref.mamba2_update_at_slots(ref_state, x, selective_state_update_ref.mamba2_dt(dt_raw, dt_bias, dt_limit), A, B, C, D, idx)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, ref_state, atol=1e-5, rtol=1e-5)
    y_ref_raw = selective_state_update_ref.mamba2_update_at_slots(state.clone(), x, dt_raw, A, B, C, D, idx, dt_bias, dt_limit)  # the op's own form
    torch.testing.assert_close(y_ref_raw, y_ref, atol=0, rtol=0)


def test_selective_state_update_launcher_names_what_is_wrong():
    from toolkit.kernels import selective_state_update as ssu
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
    from toolkit.kernels import selective_state_update as ssu
    state = torch.zeros(3, 4, 8, 16)
    x, A, B = torch.zeros(2, 4, 8), torch.zeros(4), torch.zeros(2, 1, 16)
    with pytest.raises(ValueError, match="dt must be contiguous in its last dimension"):
        ssu.selective_state_update(state, x, torch.zeros(2, 8)[:, ::2], A, B, B, None,
                                   torch.zeros(2, dtype=torch.long))
