"""Rotary position embedding for q and k in one launch (the torch reference takes about 20 kernels):
the Triton kernel, its launcher and the torch reference it must equal, roundings included.

positions [T] int; q [T, Hq, D], k [T, Hkv, D] (unit stride along D, any token / head strides, e.g. the
views of a qkv projection); inv_freq fp32 [R/2]; R = rotary_dim <= D, even. HF's "rotate_half" layout:
    f = position * inv_freq (fp32);  c, s = cos(f) * scaling, sin(f) * scaling, rounded to q.dtype
    x'[j]       = x[j] * c[j] - x[j + R/2] * s[j]          j < R/2
    x'[j + R/2] = x[j + R/2] * c[j] + x[j] * s[j]
    x'[j]       = x[j]                                    j >= R (partial rotary: passed through)
Every product and the sum are rounded to x.dtype, as the torch ops in that dtype do. Returns new
contiguous tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher_checks import rows_per_program, tile_warps


@triton.jit(do_not_specialize=["num_tokens"])      # one compile for every row count
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, inv_ptr, num_tokens, q_heads, k_heads, head_dim,
                   stride_qt, stride_qh, stride_kt, stride_kh, scaling,
                   HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (block of BLOCK_M tokens, head of q then of k)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    t_ok = t < num_tokens
    dt = q_ptr.dtype.element_ty
    if h < q_heads:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = qo_ptr + (t * q_heads + h) * head_dim
    else:
        src = k_ptr + t * stride_kt + (h - q_heads) * stride_kh
        dst = ko_ptr + (t * k_heads + h - q_heads) * head_dim
    src, dst = src[:, None], dst[:, None]                         # [BLOCK_M, 1] row starts
    d = tl.arange(0, BLOCK_D)[None, :]                            # pass-through channels
    tl.store(dst + d, tl.load(src + d, mask=t_ok[:, None] & (d < head_dim)),
             mask=t_ok[:, None] & (d >= 2 * HALF) & (d < head_dim))
    j = tl.arange(0, BLOCK_HALF)
    m = t_ok[:, None] & (j < HALF)[None, :]
    j = j[None, :]
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.float32)
    f = pos[:, None] * tl.load(inv_ptr + j, mask=j < HALF, other=0.0)
    c = (tl.cos(f) * scaling).to(dt).to(tl.float32)
    s = (tl.sin(f) * scaling).to(dt).to(tl.float32)
    x1 = tl.load(src + j, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j, mask=m, other=0.0).to(tl.float32)
    o1 = ((x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    tl.store(dst + j, o1, mask=m)
    tl.store(dst + HALF + j, o2, mask=m)


def _check(name: str, x: torch.Tensor, positions: torch.Tensor, rotary_dim: int) -> None:
    if x.dim() != 3 or x.shape[0] != positions.shape[0]:
        raise ValueError(f"{name} must be [T={positions.shape[0]}, heads, head_dim], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim, strides {x.stride()}")
    if x.device != positions.device or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} must be float32/float16/bfloat16 on {positions.device}, got {x.dtype} on {x.device}")
    if rotary_dim > x.shape[2]:
        raise ValueError(f"rotary_dim {rotary_dim} exceeds {name}'s head_dim {x.shape[2]}")


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                 scaling: float, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: checks shapes, dtypes and strides; returns (q, k) rotated, new tensors."""
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64) or positions.stride(0) != 1:
        raise ValueError(f"positions must be a contiguous int32/int64 [T], got {positions.dtype} "
                         f"{tuple(positions.shape)} strides {positions.stride()}")
    if (not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2
            or tuple(inv_freq.shape) != (rotary_dim // 2,) or inv_freq.dtype != torch.float32):
        raise ValueError(f"inv_freq must be float32 [rotary_dim / 2] for an even rotary_dim >= 2, got "
                         f"rotary_dim {rotary_dim!r} and {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if inv_freq.device != positions.device or inv_freq.stride(0) != 1:
        raise ValueError(f"inv_freq must be contiguous on {positions.device}, got strides {inv_freq.stride()} "
                         f"on {inv_freq.device}")
    _check("q", q, positions, rotary_dim)
    _check("k", k, positions, rotary_dim)
    if k.dtype != q.dtype or k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k must share a dtype and head_dim, got {q.dtype} {tuple(q.shape)} and "
                         f"{k.dtype} {tuple(k.shape)}")
    t, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t and q_heads + k_heads:
        half = rotary_dim // 2
        block_d = triton.next_power_of_2(head_dim)
        block_m = rows_per_program(block_d)
        _rotary_kernel[(triton.cdiv(t, block_m), q_heads + k_heads)](
            q, k, q_out, k_out, positions, inv_freq, t, q_heads, k_heads, head_dim,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), float(scaling),
            HALF=half, BLOCK_M=block_m, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=block_d,
            num_warps=tile_warps(block_m * block_d))
    return q_out, k_out
