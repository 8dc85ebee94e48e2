"""SwiGLU MLP (Llama / Bamba): down_proj(act(gate_proj(x)) * up_proj(x))."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.distributed import SINGLE, TPGroup
from toolkit.errors import UnsupportedArchitectureError
from toolkit.layers.ops import TORCH_OPS
from toolkit.layers.parallel import check_divides, shard_gated_mlp

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "swish": F.silu}


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
        self.ops = TORCH_OPS                        # set_ops() swaps in the Triton kernel

    tp: TPGroup = SINGLE             # tensor parallelism: set by shard_

    def check_shardable(self, tp_size: int) -> None:
        check_divides("intermediate_size", self.down_proj.in_features, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        shard_gated_mlp(self.gate_proj, self.up_proj, self.down_proj, tp)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_proj(x), self.up_proj(x))))
