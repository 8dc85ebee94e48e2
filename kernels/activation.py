"""SwiGLU's activation in one launch: silu(gate) * up (torch: two kernels). The Triton kernel, its
launcher and the torch reference it must equal, roundings included.

gate, up [..., D] (same shape; unit stride along D, any row stride, e.g. the two halves of a fused
projection) -> silu(gate) * up in P = promote(gate.dtype, up.dtype), cast to out_dtype if given, a new
tensor. silu(gate) is rounded to P before the product, as torch's two ops do: SwiGLU (both bf16)
rounds there, Mamba1's gating (a bf16 gate on an fp32 y) does not.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher_checks import rows_per_program, rows_view, tile_warps

_BLOCK = 1024          # the widest channel block of a program


@triton.jit(do_not_specialize=["n_rows"])      # one compile for every row count
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, n_rows, dim, stride_g, stride_u, ROUND_ACT: tl.constexpr,
                         ROUND_PROD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Program (block of BLOCK_M rows, block of channels). ROUND_ACT: P is 16-bit (= gate's dtype),
    round silu there; ROUND_PROD: also round the product to P before the cast to the output dtype."""
    row = (tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    d = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (row < n_rows) & (d < dim)
    g = tl.load(gate_ptr + row * stride_g + d, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + d, mask=mask, other=0.0).to(tl.float32)
    act = g * tl.sigmoid(g)
    if ROUND_ACT:
        act = act.to(gate_ptr.dtype.element_ty).to(tl.float32)
    prod = act * u
    if ROUND_PROD:
        prod = prod.to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * dim + d, prod.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Launcher: checks shapes, dtypes and strides; returns silu(gate) * up (see the module docstring)."""
    floats = (torch.float32, torch.float16, torch.bfloat16)
    if gate.shape != up.shape or gate.device != up.device:
        raise ValueError(f"gate and up must share shape and device, got {tuple(gate.shape)} on {gate.device} "
                         f"and {tuple(up.shape)} on {up.device}")
    if gate.dtype not in floats or up.dtype not in floats or (out_dtype is not None and out_dtype not in floats):
        raise ValueError(f"gate, up and out_dtype must be float32, float16 or bfloat16, got {gate.dtype}, "
                         f"{up.dtype} and {out_dtype}")
    promoted = torch.promote_types(gate.dtype, up.dtype)       # fp32, or the dtype gate and up share
    g, u = rows_view("gate", gate), rows_view("up", up)
    out = torch.empty(gate.shape, dtype=out_dtype or promoted, device=gate.device)
    rows, dim = g.shape
    if rows and dim:
        rounds = promoted != torch.float32
        block = min(_BLOCK, triton.next_power_of_2(dim))
        block_m = rows_per_program(block)
        _silu_and_mul_kernel[(triton.cdiv(rows, block_m), triton.cdiv(dim, block))](
            g, u, out, rows, dim, g.stride(0), u.stride(0), ROUND_ACT=rounds,
            ROUND_PROD=rounds and out.dtype != promoted, BLOCK_M=block_m, BLOCK=block,
            num_warps=tile_warps(block_m * block))
    return out
