"""Rotary position embedding ("rotate_half", non-interleaved, HF's roundings), in torch: the
reference of `rotary.py` (see toolkit/layers/rotary.py for the layout)."""
from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., 2m] -> [..., 2m]: [a, b] -> [-b, a]."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], inv_freq fp32 [R/2] -> (cos, sin) each [T, R] in `dtype` (HF: fp32, scaled, cast)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim], cos/sin [T, R] -> x with its first R channels rotated (same dtype)."""
    rd = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    if rd == x.shape[-1]:
        return x * c + rotate_half(x) * s
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat((x_rot * c + rotate_half(x_rot) * s, x_pass), dim=-1)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                 scaling: float, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The op (`Ops.rotary`; the Triton kernel has this signature): positions [T] int, q [T, Hq, D],
    k [T, Hkv, D], inv_freq fp32 [rotary_dim / 2] -> (q, k) rotated, new tensors."""
    if 2 * inv_freq.shape[0] != rotary_dim:
        raise ValueError(f"inv_freq has {inv_freq.shape[0]} frequencies, rotary_dim {rotary_dim} "
                         f"needs {rotary_dim // 2}")
    cos, sin = cos_sin(positions, inv_freq, scaling, q.dtype)
    return rotate(q, cos, sin), rotate(k, cos, sin)
