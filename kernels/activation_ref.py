"""silu(gate) * up, in torch: the reference of `activation.py`."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(gate) * up in the dtype promote(gate, up) (gate upcast first: SwiGLU's bf16 pair computes
    in bf16, Mamba1's bf16 gate on an fp32 y in fp32), then cast to out_dtype if given
    (`Ops.silu_and_mul`; the Triton kernel does it all in one launch)."""
    out = F.silu(gate.to(torch.promote_types(gate.dtype, up.dtype))) * up
    return out if out_dtype is None else out.to(out_dtype)
