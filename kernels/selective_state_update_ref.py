"""Mamba2's one-token SSM update over per-request state, in torch: the reference of
`selective_state_update.py` (and `mamba2_dt`, the dt preparation it can do in the same launch).

Notation: H heads, P head_dim, N d_state, G n_groups (head h reads group h // (H // G)).
All SSM math is fp32.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .state_slots_ref import initial_states_at, step_rows_at_columns, write_states_at


def mamba2_dt(
    dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_limit: Sequence[float] | None = None
) -> torch.Tensor:
    """dt_raw [T, H], dt_bias [H] -> fp32 [T, H] = clamp(softplus(dt_raw + dt_bias), *dt_limit)."""
    dt = F.softplus(dt_raw.to(torch.float32) + dt_bias.to(torch.float32))
    if dt_limit is not None:
        lo, hi = float(dt_limit[0]), float(dt_limit[1])
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(min=lo, max=hi)
    return dt


def heads_from_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H // G)."""
    g = t.shape[-2]
    if num_heads % g != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of n_groups {g}")
    return t.repeat_interleave(num_heads // g, dim=-2)


def ssm_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token SSM update.

    state [B, H, P, N]; x [B, H, P]; dt [B, H] (already softplus'ed, > 0); A [H] (negative);
    B, C [B, G, N]; D [H] | None.
        new = state * exp(dt * A) + (dt * x) outer B ;  y = new . C + D * x
    Returns (y [B, H, P] fp32, new_state [B, H, P, N] fp32).
    """
    h = x.shape[1]
    xf, dtf = x.to(torch.float32), dt.to(torch.float32)
    Bh = heads_from_groups(B.to(torch.float32), h)
    Ch = heads_from_groups(C.to(torch.float32), h)
    dA = torch.exp(dtf * A.to(torch.float32)[None, :])                       # [B, H]
    new = state.to(torch.float32) * dA[:, :, None, None] + (dtf[:, :, None] * xf)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        y = y + D.to(torch.float32)[None, :, None] * xf
    return y, new


def mamba2_update_at_slots(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
                           state_indices: torch.Tensor, dt_bias: torch.Tensor | None = None,
                           dt_limit: Sequence[float] | None = None, *,
                           query_start_loc: torch.Tensor | None = None,
                           num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """`ssm_step` in place at state indices: ssm_state [S, H, P, N] (row i reads and writes slot
    state_indices[i]; -1: padded row, y = 0, nothing touched). Returns y fp32 [B, H, P].
    With dt_bias, dt is raw: `mamba2_dt(dt, dt_bias, dt_limit)` is applied first (the kernel
    does it in the same launch, as mamba_ssm's `dt_softplus`).
    Verify rows (speculative decoding): with query_start_loc [R+1] and num_accepted_tokens [R],
    state_indices is [R, 1 + k] and x, dt, B, C hold the rows' tokens ([T, ...]): see
    state_slots_ref.step_rows_at_columns. Returns y fp32 [T, H, P]."""
    if dt_bias is not None:
        dt = mamba2_dt(dt, dt_bias, dt_limit)
    if query_start_loc is not None:
        def step(state, x_, dt_, B_, C_):
            return ssm_step(state, x_, dt_, A, B_, C_, D)
        return step_rows_at_columns(ssm_state, state_indices, query_start_loc, num_accepted_tokens, step,
                                    (x, dt, B, C), x.shape[0])
    y, new = ssm_step(initial_states_at(ssm_state, state_indices, None), x, dt, A, B, C, D)
    write_states_at(ssm_state, state_indices, new)
    return torch.where((state_indices >= 0).view(-1, 1, 1), y, torch.zeros((), dtype=y.dtype, device=y.device))
