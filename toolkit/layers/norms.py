"""RMS norms matching HF transformers bit-for-bit in fp32 (and in dtype handling elsewhere).

- `RMSNorm`: LlamaRMSNorm / BambaRMSNorm / Mamba2RMSNorm. Normalises in fp32, casts the normalised
  value back to the input dtype, then multiplies by `weight` (so the result dtype follows torch type
  promotion of weight x input, exactly like HF).
- `RMSNormGated`: HF `MambaRMSNormGated` / `BambaRMSNormGated` (norm_before_gate=False): the gate is
  applied first (`x * silu(gate)`, in fp32), then the RMS statistic is taken per group of
  `group_size` channels (`group_size = intermediate_size // n_groups`), then `weight` is applied.
"""
from __future__ import annotations

import torch
from torch import nn
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


class RMSNorm(nn.Module):
    """RMSNorm with parameter `weight` [hidden_size]. forward(x [..., hidden_size]) -> same shape."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        from toolkit.layers.ops import TORCH_OPS    # ops imports this module's references
        self.ops = TORCH_OPS                        # set_ops() swaps in the Triton kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class RMSNormGated(nn.Module):
    """Mamba2/Bamba gated norm with parameter `weight` [hidden_size].

    forward(x [..., hidden_size], gate [..., hidden_size] | None) -> [..., hidden_size].
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        if hidden_size % group_size != 0:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of group_size {group_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps
        from toolkit.layers.ops import TORCH_OPS    # ops imports this module's references
        self.ops = TORCH_OPS                        # set_ops() swaps in the Triton kernel

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype: cast the result (one kernel on the Triton backend instead of two)."""
        return self.ops.rms_norm_gated(x, gate, self.weight, self.group_size, self.eps, False, False, out_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, group_size={self.group_size}, eps={self.eps}"


class RMSNormThenGate(RMSNormGated):
    """Normalises BEFORE gating (`RMSNormGated` gates first): weight * rmsnorm_per_group(x), then
    * silu(gate); math in fp32, result in x.dtype. mamba_ssm's `norm_before_gate=True` and HF
    Falcon-H1 (`mamba_norm_before_gate`); with `cast_normed` the normalised x is rounded to x.dtype
    before the weight, as HF Qwen3-Next's gated norm does (one group: group_size = hidden_size).
    A RMSNormGated subclass so `init_random_weights` treats its weight as a norm weight."""

    def __init__(self, hidden_size: int, group_size: int | None = None, eps: float = 1e-6,
                 cast_normed: bool = False) -> None:
        super().__init__(hidden_size, group_size=group_size or hidden_size, eps=eps)
        self.cast_normed = cast_normed

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.ops.rms_norm_gated(x, gate, self.weight, self.group_size, self.eps, True, self.cast_normed,
                                       out_dtype)

