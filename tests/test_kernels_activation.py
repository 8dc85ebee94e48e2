"""SwiGLU's silu(gate) * up kernel against its torch reference under TRITON_INTERPRET=1: fp32 / fp16 /
bf16, widths past one block, the two halves of one projection as strided views, and bad input."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.kernels import activation as ka  # noqa: E402

# the project's per-dtype tolerances (one to two ulps of the output dtype: silu rounds once, the product again)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [40, ka._BLOCK + 3])
def test_silu_and_mul_equals_reference(dtype, dim):
    g = torch.Generator().manual_seed(0)
    proj = (3 * torch.randn(5, 2 * dim, generator=g)).to(dtype)
    gate, up = proj[:, :dim], proj[:, dim:]                      # halves of one projection
    ours, ref = ka.silu_and_mul(gate, up), ka.reference(gate, up)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, **TOL[dtype])


def test_silu_and_mul_leading_dims_and_empty():
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    torch.testing.assert_close(ka.silu_and_mul(gate, up), ka.reference(gate, up), atol=1e-6, rtol=1e-6)
    assert ka.silu_and_mul(torch.zeros(0, 8), torch.zeros(0, 8)).shape == (0, 8)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="share shape"):
        ka.silu_and_mul(torch.zeros(2, 8), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="gate must be contiguous"):
        ka.silu_and_mul(torch.zeros(8, 2).t(), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ka.silu_and_mul(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32))
