"""SwiGLU's activation in one launch: silu(gate) * up (torch: two kernels). The Triton kernel, its
launcher and the torch reference it must equal, roundings included.

gate, up [..., D] (same shape and dtype; unit stride along D, any row stride, e.g. the two halves of
a fused projection) -> silu(gate) * up, a new tensor of their dtype; silu(gate) is rounded to the
dtype before the product, as torch's two ops do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from toolkit.layers.mlp import silu_and_mul as reference  # noqa: F401  (torch reference)

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, dim, stride_g, stride_u, BLOCK: tl.constexpr):
    """Program (row, block of channels)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = d < dim
    g = tl.load(gate_ptr + row * stride_g + d, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + d, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * dim + d, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, strides {t.stride()}")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} {tuple(t.shape)} with strides {t.stride()}: its leading dimensions do not "
                         "flatten to rows without a copy") from None


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Launcher: checks shapes, dtypes and strides; returns silu(gate) * up."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate and up must share shape, dtype and device, got {gate.dtype} {tuple(gate.shape)} "
                         f"on {gate.device} and {up.dtype} {tuple(up.shape)} on {up.device}")
    if gate.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"gate and up must be float32, float16 or bfloat16, got {gate.dtype}")
    g, u = _rows("gate", gate), _rows("up", up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows, dim = g.shape
    if rows and dim:
        _silu_and_mul_kernel[(rows, triton.cdiv(dim, _BLOCK))](g, u, out, dim, g.stride(0), u.stride(0), BLOCK=_BLOCK)
    return out
