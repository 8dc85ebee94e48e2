"""RMS norms (plain, and gated/grouped in both orders), in torch: the references of `rms_norm.py`,
matching HF transformers bit for bit in fp32 (see toolkit/layers/norms.py for which HF module is which).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMS norm. x: [..., D], weight: [D] -> [..., D] (dtype: promote(weight, x.dtype))."""
    in_dtype = x.dtype
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(var + eps)
    return weight * xf.to(in_dtype)


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """Gated, grouped RMS norm (gate before norm).

    x, gate: [..., D]; weight: [D]; D must be a multiple of group_size.
    Returns weight * (normalize_per_group(x * silu(gate)) cast to x.dtype).
    """
    in_dtype = x.dtype
    xf = x.to(torch.float32)
    if gate is not None:
        xf = xf * F.silu(gate.to(torch.float32))
    *lead, d = xf.shape
    if d % group_size != 0:
        raise ValueError(f"rms_norm_gated: last dim {d} is not a multiple of group_size {group_size}")
    xg = xf.reshape(*lead, d // group_size, group_size)
    var = xg.pow(2).mean(-1, keepdim=True)
    xg = xg * torch.rsqrt(var + eps)
    return weight * xg.reshape(*lead, d).to(in_dtype)


def rms_norm_then_gate(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, group_size: int,
                       eps: float, cast_normed: bool = False) -> torch.Tensor:
    """Grouped RMS norm BEFORE gating: weight * normalize_per_group(x) (the normalised x rounded to
    x.dtype first if cast_normed), then * silu(gate); math in fp32; returns x.dtype."""
    in_dtype = x.dtype
    *lead, d = x.shape
    if d % group_size != 0:
        raise ValueError(f"rms_norm_then_gate: last dim {d} is not a multiple of group_size {group_size}")
    xg = x.to(torch.float32).reshape(*lead, d // group_size, group_size)
    normed = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).reshape(*lead, d)
    out = weight * (normed.to(in_dtype) if cast_normed else normed)
    if gate is not None:
        out = out * F.silu(gate.to(torch.float32))
    return out.to(in_dtype)


def rms_norm_gated_op(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, group_size: int,
                      eps: float, norm_before_gate: bool = False, cast_normed: bool = False,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The op both gated norms call (`Ops.rms_norm_gated`; the Triton kernel has this signature):
    `rms_norm_then_gate` if norm_before_gate else `rms_norm_gated`, cast to out_dtype if given."""
    out = (rms_norm_then_gate(x, gate, weight, group_size, eps, cast_normed) if norm_before_gate
           else rms_norm_gated(x, gate, weight, group_size, eps))
    return out if out_dtype is None else out.to(out_dtype)

