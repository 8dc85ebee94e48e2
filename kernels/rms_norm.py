"""RMS norms in one launch each (the torch references take 6 to 11 kernels): the plain norm of every
block and the grouped, gated norm of the Mamba2 / GDN mixers. Triton kernels, launchers and the torch
references (rms_norm_ref.py) they must equal, including where the references round.

rms_norm(x [..., D], weight [D], eps) -> [..., D], dtype promote(weight, x):
    weight * (x / sqrt(mean(x^2) + eps) computed in fp32, rounded to x.dtype)        (HF LlamaRMSNorm)

rms_norm_gated(x [..., D], gate [..., D] | None, weight [D], group_size, eps, norm_before_gate,
               cast_normed, out_dtype) -> [..., D] in out_dtype; the statistic is per group of
group_size channels; math in fp32.
    norm_before_gate=False (RMSNormGated):  r = weight * round_x(norm(x * silu(gate)))
                                            (rounded to promote(weight, x)), then out_dtype
    norm_before_gate=True (RMSNormThenGate): n = norm(x), rounded to x.dtype if cast_normed;
                                             r = round(weight * n) * silu(gate), then x.dtype
x and gate need unit stride in D (any row stride); leading dimensions must flatten to rows as a view.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher_checks import rows_per_program, rows_view, tile_warps

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["n_rows"])      # one compile for every row count
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, dim, stride_x, stride_o, eps,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program: BLOCK_M rows (launcher_checks.rows_per_program), each normalised on its own."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mask = (row < n_rows)[:, None] & (d < dim)[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + d[None, :], mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)[:, None]
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)           # the reference rounds here
    w = tl.load(w_ptr + d, mask=d < dim, other=0.0).to(tl.float32)
    tl.store(out_ptr + row[:, None] * stride_o + d[None, :], (w[None, :] * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=["n_rows"])      # one compile for every row count
def _rms_norm_gated_kernel(x_ptr, z_ptr, w_ptr, out_ptr, n_rows, group_size, stride_x, stride_z, stride_o, eps,
                           HAS_GATE: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, CAST_NORMED: tl.constexpr,
                           ROUND_PROD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """Program (block of BLOCK_M rows, group). ROUND_PROD: the reference's weight product is in x's
    (16-bit) dtype, so it is rounded there; otherwise that product is fp32."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_G)
    d = tl.program_id(1) * group_size + j
    mask = (row < n_rows)[:, None] & (j < group_size)[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + d[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=j < group_size, other=0.0).to(tl.float32)[None, :]
    if HAS_GATE:
        z = tl.load(z_ptr + row[:, None] * stride_z + d[None, :], mask=mask, other=0.0).to(tl.float32)
        silu_z = z * tl.sigmoid(z)
    if NORM_BEFORE_GATE:
        normed = x * tl.rsqrt(tl.sum(x * x, axis=1) / group_size + eps)[:, None]
        if CAST_NORMED:
            normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        r = w * normed
        if ROUND_PROD:
            r = r.to(x_ptr.dtype.element_ty).to(tl.float32)
        if HAS_GATE:
            r = r * silu_z
    else:
        if HAS_GATE:
            x = x * silu_z
        normed = x * tl.rsqrt(tl.sum(x * x, axis=1) / group_size + eps)[:, None]
        r = w * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        if ROUND_PROD:
            r = r.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row[:, None] * stride_o + d[None, :], r.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(name: str, t: torch.Tensor, dim: int) -> torch.Tensor:
    """t [..., dim] -> a [rows, dim] view with unit stride along dim."""
    if t.shape[-1] != dim:
        raise ValueError(f"{name} must be [..., D={dim}] (D: the weight's length), got {tuple(t.shape)}")
    return rows_view(name, t)


def _check_weight(weight: torch.Tensor, dim: int, x: torch.Tensor) -> None:
    if tuple(weight.shape) != (dim,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [D={dim}], got {tuple(weight.shape)} strides {weight.stride()}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Launcher of the plain norm: checks shapes, dtypes and strides; returns a new tensor."""
    dim = weight.shape[-1]
    _check_weight(weight, dim, x)
    rows = _rows("x", x, dim)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        block_m = rows_per_program(block)
        _rms_norm_kernel[(triton.cdiv(rows.shape[0], block_m),)](
            rows, weight, out, rows.shape[0], dim, rows.stride(0), dim, float(eps),
            BLOCK_M=block_m, BLOCK_D=block, num_warps=tile_warps(block_m * block))
    return out


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, group_size: int, eps: float,
                   norm_before_gate: bool = False, cast_normed: bool = False,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Launcher of the grouped, gated norm (see the module docstring); returns a new tensor in
    out_dtype (default: what the reference returns)."""
    dim = weight.shape[-1]
    _check_weight(weight, dim, x)
    if not isinstance(group_size, int) or group_size < 1 or dim % group_size:
        raise ValueError(f"group_size must be a positive int dividing D={dim}, got {group_size!r}")
    rows = _rows("x", x, dim)
    if gate is not None:
        if gate.shape != x.shape:
            raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
        if gate.device != x.device or gate.dtype not in _FLOATS:
            raise ValueError(f"gate must be a float32/float16/bfloat16 tensor on {x.device}, got {gate.dtype} "
                             f"on {gate.device}")
        gate_rows = _rows("gate", gate, dim)
    # the dtype of the reference's weight product: fp32, or x's when weight and x share a 16-bit dtype
    prod = torch.promote_types(weight.dtype, x.dtype if (cast_normed or not norm_before_gate) else torch.float32)
    default = x.dtype if norm_before_gate else prod
    out = torch.empty(x.shape, dtype=out_dtype or default, device=x.device)
    if out.dtype not in _FLOATS:
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out.dtype}")
    if rows.shape[0]:
        block = triton.next_power_of_2(group_size)
        block_m = rows_per_program(block)
        z = gate_rows if gate is not None else rows
        _rms_norm_gated_kernel[(triton.cdiv(rows.shape[0], block_m), dim // group_size)](
            rows, z, weight, out, rows.shape[0], group_size, rows.stride(0), z.stride(0), dim, float(eps),
            HAS_GATE=gate is not None, NORM_BEFORE_GATE=norm_before_gate, CAST_NORMED=cast_normed,
            ROUND_PROD=prod != torch.float32, BLOCK_M=block_m, BLOCK_G=block, num_warps=tile_warps(block_m * block))
    return out
