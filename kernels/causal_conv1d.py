"""Causal conv1d decode update, in place at state indices (Mamba1 / Mamba2 / short-conv decode):
the Triton kernel, its launcher and the torch reference it must equal.

x [B, Dc] (one new token per row); conv_state [S, K-1, Dc] (vLLM "SD" layout, oldest first);
state_indices int [B] (a row's slot; PAD_SLOT_ID = -1: a padded row, nothing read or written);
weight [Dc, K]; bias [Dc] or None. For each real row:
    out = act(bias + sum_k weight[:, k] * window[k]),  window = [conv_state[slot]; x]  (K inputs)
    conv_state[slot] = window[1:]
Math in fp32; out in x.dtype; the state keeps its dtype. Padded rows get out = 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from toolkit.layers.causal_conv1d import PAD_SLOT_ID  # noqa: F401
from toolkit.layers.causal_conv1d import conv_update_at_slots as reference  # noqa: F401  (torch reference)


@triton.jit
def _conv_update_kernel(x_ptr, state_ptr, idx_ptr, w_ptr, b_ptr, out_ptr, dim,
                        stride_xb, stride_ss, stride_sk, stride_wd, stride_ob,
                        KM1: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """Program (row, block of channels): K-tap dot product, then shift the window into the state."""
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < dim
    slot = tl.load(idx_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(out_ptr + row * stride_ob + d, tl.zeros([BLOCK_D], dtype=tl.float32).to(out_ptr.dtype.element_ty),
                 mask=mask)
        return
    x = tl.load(x_ptr + row * stride_xb + d, mask=mask, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + d * stride_wd + KM1, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=mask, other=0.0).to(tl.float32)
    state = state_ptr + slot * stride_ss + d
    prev = tl.load(state, mask=mask, other=0.0)            # window[0], dropped after use
    acc += prev.to(tl.float32) * tl.load(w_ptr + d * stride_wd, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(1, KM1):
        cur = tl.load(state + k * stride_sk, mask=mask, other=0.0)
        acc += cur.to(tl.float32) * tl.load(w_ptr + d * stride_wd + k, mask=mask, other=0.0).to(tl.float32)
        tl.store(state + (k - 1) * stride_sk, cur, mask=mask)   # shift left by one
    tl.store(state + (KM1 - 1) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=mask)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + row * stride_ob + d, acc.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None = "silu") -> torch.Tensor:
    """Launcher: checks shapes, dtypes and strides; updates `conv_state` in place; returns out."""
    if x.dim() != 2:
        raise ValueError(f"x must be [B, Dc], got {tuple(x.shape)}")
    b, dim = x.shape
    if conv_state.dim() != 3 or conv_state.shape[2] != dim:
        raise ValueError(f"conv_state must be [S, K-1, Dc={dim}], got {tuple(conv_state.shape)}")
    km1 = conv_state.shape[1]
    if tuple(weight.shape) != (dim, km1 + 1):
        raise ValueError(f"weight must be [Dc={dim}, K={km1 + 1}] (K-1 from conv_state), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must be [Dc={dim}], got {tuple(bias.shape)}")
    if tuple(state_indices.shape) != (b,) or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices must be int32/int64 [B={b}], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation={activation!r}: the kernel has None and 'silu'")
    for name, t in (("x", x), ("conv_state", conv_state), ("weight", weight)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, strides {t.stride()}")
    if km1 < 1:
        raise ValueError("a conv kernel of width 1 has no state")
    out = torch.empty_like(x)
    if b == 0:
        return out
    block = min(triton.next_power_of_2(dim), 256)
    _conv_update_kernel[(b, triton.cdiv(dim, block))](
        x, conv_state, state_indices, weight, bias if bias is not None else x, out, dim,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), out.stride(0),
        KM1=km1, HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_D=block)
    return out
