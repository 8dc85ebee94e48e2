"""kernels/rms_norm.py: the one-launch RMS norms against their torch references, under TRITON_INTERPRET=1 on the
CPU or compiled on CUDA (harness.KERNEL_DEVICE): fp32 / fp16 / bf16, widths that are not powers of two, the
views the layers pass (a column slice of a projection, per-head rows), both gated-norm orders, and bad input."""
from __future__ import annotations

import pytest
import torch

from harness import KERNEL_DEVICE as DEV  # the test device: CPU (interpreter) or CUDA (compiled)

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.kernels import rms_norm as kn
from toolkit.kernels import rms_norm_ref
from toolkit.kernels.launcher_checks import rows_per_program

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# both sides compute in fp32 and round at the same places: allow about one ulp of the output dtype
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _weight(g, dim, dtype):
    return (1 + 0.3 * torch.randn(dim, generator=g)).to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
def test_rms_norm_equals_reference(dtype, weight_dtype):
    g = torch.Generator().manual_seed(0)
    wide = (3 * torch.randn(7, 72, generator=g)).to(DEV, dtype)
    x = wide[:, 5:45]                                         # D = 40, row stride 72
    w = _weight(g, 40, dtype if weight_dtype == "same" else weight_dtype)
    ours, ref = kn.rms_norm(x, w, 1e-6), rms_norm_ref.rms_norm(x, w, 1e-6)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, **TOL[ref.dtype if ref.dtype != torch.float32 else dtype])


def test_rms_norm_per_head_rows_and_empty_batch():
    """q/k norms pass [T, heads, head_dim]; a profile run may pass no rows."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 24, generator=g).to(DEV)
    w = _weight(g, 24, torch.float32)
    torch.testing.assert_close(kn.rms_norm(x, w, 1e-5), rms_norm_ref.rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    assert kn.rms_norm(torch.zeros(0, 24, device=DEV), w, 1e-5).shape == (0, 24)



@pytest.mark.parametrize("gated", [False, True])
def test_rms_norms_tile_rows_across_programs(gated):
    """Narrow rows go BLOCK_M to a program (launcher_checks.rows_per_program): more rows than two
    programs take, the last tile part masked, equal the reference row by row (a row-index or mask
    slip in the tiling moves or drops rows)."""
    g = torch.Generator().manual_seed(4)
    dim = 16
    rows = 2 * rows_per_program(dim) + 5
    x = (2 * torch.randn(rows, dim + 4, generator=g)).to(DEV)[:, 2:2 + dim]      # a row stride past D
    w = _weight(g, dim, torch.float32)
    if gated:
        gate = torch.randn(rows, dim, generator=g).to(DEV)
        args = (x, gate, w, dim // 2, 1e-5, False, False)
        ours, ref = kn.rms_norm_gated(*args), rms_norm_ref.rms_norm_gated_op(*args)
    else:
        ours, ref = kn.rms_norm(x, w, 1e-5), rms_norm_ref.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_before_gate, cast_normed", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("with_gate", [True, False])
def test_rms_norm_gated_equals_reference(dtype, norm_before_gate, cast_normed, with_gate):
    g = torch.Generator().manual_seed(2)
    d, groups = 48, 3                                       # group_size 16; D not a power of two
    proj = torch.randn(6, 2 * d + 8, generator=g).to(DEV, dtype)
    gate = proj[:, 8:8 + d] if with_gate else None        # a column slice, as Mamba2 passes its gate
    x = (2 * torch.randn(6, d, generator=g)).to(DEV, dtype)
    w = _weight(g, d, dtype)
    args = (x, gate, w, d // groups, 1e-5, norm_before_gate, cast_normed)
    ours, ref = kn.rms_norm_gated(*args), rms_norm_ref.rms_norm_gated_op(*args)
    assert ours.dtype == ref.dtype
    torch.testing.assert_close(ours, ref, **TOL[dtype])


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_rms_norm_gated_mamba2_case_fp32_y_model_dtype_gate_and_out(norm_before_gate):
    """Mamba2 / Falcon-H1: y fp32, gate and weight bf16, output cast to bf16 in the same launch."""
    g = torch.Generator().manual_seed(3)
    y = torch.randn(4, 64, generator=g).to(DEV)
    gate = torch.randn(4, 64, generator=g).to(DEV, torch.bfloat16)
    w = _weight(g, 64, torch.bfloat16)
    args = (y, gate, w, 32, 1e-6, norm_before_gate, False, torch.bfloat16)
    ours, ref = kn.rms_norm_gated(*args), rms_norm_ref.rms_norm_gated_op(*args)
    assert ours.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(ours, ref, **TOL[torch.bfloat16])
    # the only rounding is the final one: at most one bf16 ulp apart
    assert ((ours.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-30).all()


def test_rms_norm_launcher_names_what_is_wrong():
    x, w = torch.randn(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match="x must be"):
        kn.rms_norm(torch.randn(3, 6), w, 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last"):
        kn.rms_norm(torch.randn(8, 3).t(), w, 1e-6)
    with pytest.raises(ValueError, match="group_size"):
        kn.rms_norm_gated(x, None, w, 3, 1e-6)
    with pytest.raises(ValueError, match="gate must have"):
        kn.rms_norm_gated(x, torch.randn(3, 4), w, 4, 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        kn.rms_norm(x, torch.ones(16)[::2], 1e-6)              # a strided weight
