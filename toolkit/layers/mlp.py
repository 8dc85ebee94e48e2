"""SwiGLU MLP (Llama / Bamba): down_proj(act(gate_proj(x)) * up_proj(x))."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.errors import UnsupportedArchitectureError
from toolkit.layers.ops import TORCH_OPS
from toolkit.layers.parallel import ShardedGatedMLP

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "swish": F.silu}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Activation by HF `hidden_act` name (only the SiLU family is used by the supported models)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"hidden_act '{name}' is not supported; supported: {sorted(ACTIVATIONS)}"
        ) from None


class SwiGLUMLP(ShardedGatedMLP, nn.Module):
    """x [T, hidden_size] -> [T, hidden_size]; HF names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, hidden_act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        get_activation(hidden_act)              # validate: only the SiLU family is supported
        self.ops = TORCH_OPS                        # set_ops() swaps in the Triton kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_proj(x), self.up_proj(x))))
