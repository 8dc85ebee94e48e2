"""SwiGLU MLP (Llama / Bamba): down_proj(act(gate_proj(x)) * up_proj(x))."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from toolkit.errors import UnsupportedArchitectureError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "swish": F.silu}


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(gate) * up in the dtype promote(gate, up) (gate upcast first: SwiGLU's bf16 pair computes
    in bf16, Mamba1's bf16 gate on an fp32 y in fp32), then cast to out_dtype if given
    (`Ops.silu_and_mul`; the Triton kernel does it all in one launch)."""
    out = F.silu(gate.to(torch.promote_types(gate.dtype, up.dtype))) * up
    return out if out_dtype is None else out.to(out_dtype)


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Activation by HF `hidden_act` name (only the SiLU family is used by the supported models)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"hidden_act '{name}' is not supported; supported: {sorted(ACTIVATIONS)}"
        ) from None


class SwiGLUMLP(nn.Module):
    """x [T, hidden_size] -> [T, hidden_size]; HF names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, hidden_act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        get_activation(hidden_act)              # validate: only the SiLU family is supported
        from toolkit.layers.ops import TORCH_OPS    # ops imports this module's reference
        self.ops = TORCH_OPS                        # set_ops() swaps in the Triton kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_proj(x), self.up_proj(x)))
