"""kernels/activation.py: SwiGLU's silu(gate) * up kernel against its torch reference under TRITON_INTERPRET=1 on
the CPU or compiled on CUDA (harness.KERNEL_DEVICE): fp32 / fp16 / bf16, widths past one block, the two halves
of one projection as strided views, and bad input."""
from __future__ import annotations

import pytest
import torch

from harness import KERNEL_DEVICE as DEV  # the test device: CPU (interpreter) or CUDA (compiled)

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.kernels import activation as ka
from toolkit.kernels import activation_ref
from toolkit.kernels.launcher_checks import rows_per_program

# the project's per-dtype tolerances (one to two ulps of the output dtype: silu rounds once, the product again)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [40, ka._BLOCK + 3])
def test_silu_and_mul_equals_reference(dtype, dim):
    g = torch.Generator().manual_seed(0)
    proj = (3 * torch.randn(5, 2 * dim, generator=g)).to(DEV, dtype)
    gate, up = proj[:, :dim], proj[:, dim:]                      # halves of one projection
    ours, ref = ka.silu_and_mul(gate, up), activation_ref.silu_and_mul(gate, up)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, **TOL[dtype])


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float32])
def test_silu_and_mul_mamba1_gating_bf16_gate_on_fp32_y(out_dtype):
    """Mamba1: y fp32 * silu(z) with z bf16 computes in fp32 (no rounding of silu), then the cast."""
    g = torch.Generator().manual_seed(2)
    z = (3 * torch.randn(4, 40, generator=g)).to(DEV, torch.bfloat16)
    y = (3 * torch.randn(4, 40, generator=g)).to(DEV)
    ours, ref = ka.silu_and_mul(z, y, out_dtype), activation_ref.silu_and_mul(z, y, out_dtype)
    assert ours.dtype == ref.dtype == (out_dtype or torch.float32)
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    else:                                                      # one rounding, at the end
        assert ((ours.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-30).all()


def test_silu_and_mul_bf16_pair_to_fp32_rounds_like_torch():
    """Both bf16 with an fp32 output: the product is rounded to bf16 first, as torch's ops then .float()."""
    g = torch.Generator().manual_seed(3)
    gate = (3 * torch.randn(2, 64, generator=g)).to(DEV, torch.bfloat16)
    up = (3 * torch.randn(2, 64, generator=g)).to(DEV, torch.bfloat16)
    ours = ka.silu_and_mul(gate, up, torch.float32)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, ours.bfloat16().float())          # exactly representable in bf16
    torch.testing.assert_close(ours, activation_ref.silu_and_mul(gate, up, torch.float32), **TOL[torch.bfloat16])


def test_silu_and_mul_leading_dims_and_empty():
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(2, 3, 8, generator=g).to(DEV), torch.randn(2, 3, 8, generator=g).to(DEV)
    torch.testing.assert_close(ka.silu_and_mul(gate, up), activation_ref.silu_and_mul(gate, up), atol=1e-6, rtol=1e-6)
    assert ka.silu_and_mul(torch.zeros(0, 8, device=DEV), torch.zeros(0, 8, device=DEV)).shape == (0, 8)



def test_silu_and_mul_tiles_rows_across_programs():
    """Narrow rows go BLOCK_M to a program (launcher_checks.rows_per_program): more rows than two
    programs take, the last tile part masked."""
    g = torch.Generator().manual_seed(4)
    dim = 40                                                  # a 64-wide tile, 24 channels masked
    rows = 2 * rows_per_program(64) + 3
    proj = (3 * torch.randn(rows, 2 * dim, generator=g)).to(DEV)
    gate, up = proj[:, :dim], proj[:, dim:]
    torch.testing.assert_close(ka.silu_and_mul(gate, up), activation_ref.silu_and_mul(gate, up), **TOL[torch.float32])


def test_silu_and_mul_launcher_names_what_is_wrong():
    with pytest.raises(ValueError, match="share shape"):
        ka.silu_and_mul(torch.zeros(2, 8), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="gate must be contiguous"):
        ka.silu_and_mul(torch.zeros(8, 2).t(), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ka.silu_and_mul(torch.zeros(2, 8), torch.zeros(2, 8), torch.int32)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ka.silu_and_mul(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32))
