"""Rotary position embedding (RoPE) matching HF Llama / Bamba, driven by explicit positions.

HF layout ("rotate_half", non-interleaved): for the first `rotary_dim` channels of each head,
    x_rot' = x_rot * cos + rotate_half(x_rot) * sin,  rotate_half([a, b]) = [-b, a],
with cos/sin = cos/sin(positions * inv_freq) duplicated to `rotary_dim` channels and cast to the
input dtype before use (as HF does). Channels past `rotary_dim` pass through unchanged
(`partial_rotary_factor` < 1, e.g. Bamba uses 0.5). The rotation is an op (`self.ops.rotary`):
torch reference in toolkit/kernels/rotary_ref.py.

Frequencies are computed in fp32 on the CPU at construction and kept as a plain (non-buffer)
tensor, so `model.to(bfloat16)` cannot degrade them and meta-device construction works.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from toolkit.errors import UnsupportedArchitectureError
from toolkit.layers.ops import TORCH_OPS

# Rope types whose frequencies depend on the running sequence length (HF `dynamic_rope_update`).
_DYNAMIC_ROPE_TYPES = {"dynamic", "longrope"}


def default_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """inv_freq[i] = 1 / theta ** (2i / rotary_dim), i < rotary_dim // 2 (fp32, CPU)."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / rotary_dim
    return 1.0 / (theta**exps)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, n_q_heads, head_dim] and k [T, n_kv_heads, head_dim] at positions [T].

    Args:
        head_dim: per-head channel count.
        theta: rope base (`rope_parameters["rope_theta"]`).
        partial_rotary_factor: fraction of head_dim that rotates (rotary_dim = int(head_dim * f)).
        rope_parameters / config: only for non-default rope types ("linear", "llama3", "yarn",
            "proportional", ...): frequencies then come from transformers' `ROPE_INIT_FUNCTIONS[rope_type](config)`.
        layer_type: for a config whose rope_parameters are per layer type (LFM3: "sliding_attention",
            "full_attention"), the type this layer's come from (handed on to transformers' init function).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        partial_rotary_factor: float = 1.0,
        rope_parameters: dict[str, Any] | None = None,
        config: Any = None,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        rope_type = (rope_parameters or {}).get("rope_type", "default")
        self.rope_type = rope_type
        self.head_dim = head_dim
        # frequencies are real CPU data even when the model is built under `torch.device("meta")`
        with torch.device("cpu"):
            inv_freq, scaling = self._frequencies(head_dim, theta, partial_rotary_factor, rope_type, config,
                                                  layer_type)
        self.rotary_dim = 2 * inv_freq.shape[0]
        if self.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} exceeds head_dim {head_dim}")
        self.attention_scaling = float(scaling)
        self._inv_freq_cpu = inv_freq
        self._inv_freq_cache: dict[torch.device, torch.Tensor] = {}
        self.ops = TORCH_OPS                        # set_ops() swaps in the Triton kernel

    @staticmethod
    def _frequencies(
        head_dim: int, theta: float, partial_rotary_factor: float, rope_type: str, config: Any,
        layer_type: str | None = None,
    ) -> tuple[torch.Tensor, float]:
        if rope_type == "default":
            rotary_dim = int(head_dim * partial_rotary_factor)
            inv_freq = default_inv_freq(rotary_dim, theta)
            scaling = 1.0
        else:
            if rope_type in _DYNAMIC_ROPE_TYPES:
                raise UnsupportedArchitectureError(
                    f"rope_type '{rope_type}' (sequence-length dependent RoPE) is not supported; "
                    "supported: default, linear, llama3, yarn"
                )
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS or config is None:
                raise UnsupportedArchitectureError(f"unknown rope_type '{rope_type}'")
            kw = {"layer_type": layer_type} if layer_type is not None else {}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device=torch.device("cpu"), **kw)
            inv_freq = inv_freq.to(torch.float32)
        return inv_freq, scaling

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """fp32 [rotary_dim // 2] on `device` (cached per device)."""
        t = self._inv_freq_cache.get(device)
        if t is None:
            t = self._inv_freq_cpu.to(device)
            self._inv_freq_cache[device] = t
        return t

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int, q [T, Hq, D], k [T, Hkv, D] -> (q, k) rotated."""
        return self.ops.rotary(positions, q, k, self.inv_freq(positions.device), self.attention_scaling,
                               self.rotary_dim)

    def extra_repr(self) -> str:
        return f"type={self.rope_type}, head_dim={self.head_dim}, rotary_dim={self.rotary_dim}"
