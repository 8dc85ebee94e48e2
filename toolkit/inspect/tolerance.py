"""Element-wise tolerance tests and the numbers they report, shared by `compare_with_hf` and
`diff_traces`: a value differs where |ours - ref| > atol + rtol * |ref|, NaN or Inf included."""
from __future__ import annotations

import math

import torch


def exceeds(ours: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """bool, same shape: |ours - ref| > atol + rtol * |ref|; NaN/inf anywhere counts as exceeding."""
    return ~((ours - ref).abs() <= atol + rtol * ref.abs())


def nan_max(a: float, b: float) -> float:
    """max(a, b), NaN if either is NaN (a NaN difference must not hide behind a finite one)."""
    if math.isnan(a) or math.isnan(b):
        return float("nan")
    return max(a, b)


def absmax(t: torch.Tensor) -> float:
    """max |t| (0 for an empty tensor, NaN if any element is NaN)."""
    if t.numel() == 0:
        return 0.0
    if torch.isnan(t).any():
        return float("nan")
    return float(t.abs().max())


def format_sci(x: float | None) -> str:
    """`1.23e-05` for a float, `str(x)` otherwise (None stays "None")."""
    return f"{x:.2e}" if isinstance(x, float) else str(x)
