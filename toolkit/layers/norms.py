"""RMS norms matching HF transformers bit-for-bit in fp32 (and in dtype handling elsewhere).

- `RMSNorm`: LlamaRMSNorm / BambaRMSNorm / Mamba2RMSNorm. Normalises in fp32, casts the normalised
  value back to the input dtype, then multiplies by `weight` (so the result dtype follows torch type
  promotion of weight x input, exactly like HF).
- `RMSNormGated`: HF `MambaRMSNormGated` / `BambaRMSNormGated` (norm_before_gate=False): the gate is
  applied first (`x * silu(gate)`, in fp32), then the RMS statistic is taken per group of
  `group_size` channels (`group_size = intermediate_size // n_groups`), then `weight` is applied.
The math is the op set's (`self.ops`): torch references in toolkit/kernels/rms_norm_ref.py.
"""
from __future__ import annotations

import torch
from torch import nn

from toolkit.layers.ops import TORCH_OPS


class RMSNorm(nn.Module):
    """RMSNorm with parameter `weight` [hidden_size]. forward(x [..., hidden_size]) -> same shape."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
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

