"""kernels/rotary.py: the one-launch RoPE kernel against its torch reference under TRITON_INTERPRET=1 on the CPU or
compiled on CUDA (harness.KERNEL_DEVICE): fp32 / fp16 / bf16, full and partial rotary, GQA (different head
counts for q and k), strided views of a fused qkv projection, large positions, attention scaling (yarn), and bad
input."""
from __future__ import annotations

import pytest
import torch

from harness import KERNEL_DEVICE as DEV  # the test device: CPU (interpreter) or CUDA (compiled)

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.kernels import rotary as kr
from toolkit.kernels import rotary_ref
from toolkit.kernels.launcher_checks import rows_per_program
from toolkit.layers.rotary import default_inv_freq

# the kernel rounds where the reference's dtype ops do; cos/sin may differ by an fp32 ulp before rounding
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 16), (24, 12), (20, 8)])
def test_rotary_equals_reference(dtype, head_dim, rotary_dim):
    g = torch.Generator().manual_seed(0)
    t, hq, hkv = 7, 4, 2
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim + 8, generator=g).to(DEV, dtype)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)                       # row stride > hq * head_dim
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(t, hkv, head_dim)
    positions = torch.tensor([0, 1, 2, 17, 300, 4095, 65000], device=DEV)
    inv = default_inv_freq(rotary_dim, 10000.0).to(DEV)
    for scaling in (1.0, 1.2):
        ours = kr.apply_rotary(positions, q, k, inv, scaling, rotary_dim)
        ref = rotary_ref.apply_rotary(positions, q, k, inv, scaling, rotary_dim)
        for o, r in zip(ours, ref):
            assert o.dtype == r.dtype and o.shape == r.shape
            torch.testing.assert_close(o, r, **TOL[dtype])
            torch.testing.assert_close(o[..., rotary_dim:], r[..., rotary_dim:], atol=0, rtol=0)  # passed through


def test_rotary_position_zero_is_the_identity_and_empty_batch():
    q, k = torch.randn(1, 2, 8).to(DEV), torch.randn(1, 1, 8).to(DEV)
    inv = default_inv_freq(8, 10000.0).to(DEV)
    oq, ok = kr.apply_rotary(torch.zeros(1, dtype=torch.int64, device=DEV), q, k, inv, 1.0, 8)
    assert torch.equal(oq, q) and torch.equal(ok, k)
    eq, ek = kr.apply_rotary(torch.zeros(0, dtype=torch.int64, device=DEV), q[:0], k[:0], inv, 1.0, 8)
    assert eq.shape == (0, 2, 8) and ek.shape == (0, 1, 8)



def test_rotary_tiles_tokens_across_programs():
    """Tokens go BLOCK_M to a program (launcher_checks.rows_per_program): more tokens than two
    programs take, the last tile part masked, each rotated at its own position."""
    g = torch.Generator().manual_seed(3)
    head_dim, rotary_dim = 16, 12
    t = 2 * rows_per_program(head_dim) + 3
    q, k = torch.randn(t, 3, head_dim, generator=g).to(DEV), torch.randn(t, 1, head_dim, generator=g).to(DEV)
    positions = torch.randperm(4 * t, generator=g)[:t].to(DEV)
    inv = default_inv_freq(rotary_dim, 10000.0).to(DEV)
    for o, r in zip(kr.apply_rotary(positions, q, k, inv, 1.0, rotary_dim),
                    rotary_ref.apply_rotary(positions, q, k, inv, 1.0, rotary_dim)):
        torch.testing.assert_close(o, r, **TOL[torch.float32])


def test_rotary_launcher_names_what_is_wrong():
    q, k, pos = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.arange(3)
    inv = default_inv_freq(8, 10000.0)
    with pytest.raises(ValueError, match="positions must be"):
        kr.apply_rotary(pos.float(), q, k, inv, 1.0, 8)
    with pytest.raises(ValueError, match="inv_freq must be"):
        kr.apply_rotary(pos, q, k, inv, 1.0, 6)
    with pytest.raises(ValueError, match="k must be"):
        kr.apply_rotary(pos, q, torch.randn(2, 1, 8), inv, 1.0, 8)
    with pytest.raises(ValueError, match="rotary_dim 16 exceeds"):
        kr.apply_rotary(pos, q, k, default_inv_freq(16, 10000.0), 1.0, 16)
    with pytest.raises(ValueError, match="share a dtype and head_dim"):
        kr.apply_rotary(pos, q, k.half(), inv, 1.0, 8)
