"""Mamba1's selective scan over per-request state, in torch: the reference of `selective_scan.py`.

Notation: T tokens, Di = d_inner, N = d_state, S sequences.
    h_t = exp(dt_t * A) * h_{t-1} + (dt_t * B_t) * x_t        A = -exp(A_log)  [Di, N]
    y_t = h_t . C_t + D * x_t
All math in fp32.
"""
from __future__ import annotations

import torch

from .state_slots_ref import Checkpoints, initial_states_at, step_rows_at_columns, write_states_at


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token selective-SSM update for a batch of rows.

    state [Bt, Di, N]; x [Bt, Di]; dt [Bt, Di] (softplus'ed, > 0); A [Di, N] (negative);
    B, C [Bt, N]; D [Di] | None.
        new = exp(dt * A) * state + (dt * B) * x ;  y = new . C + D * x
    Returns (y [Bt, Di] fp32, new_state [Bt, Di, N] fp32).
    """
    f32 = torch.float32
    xf, dtf = x.to(f32), dt.to(f32)
    dA = torch.exp(dtf[:, :, None] * A.to(f32)[None])                        # [Bt, Di, N]
    dBx = (dtf[:, :, None] * B.to(f32)[:, None, :]) * xf[:, :, None]         # [Bt, Di, N]
    new = state.to(f32) * dA + dBx
    y = torch.matmul(new, C.to(f32)[:, :, None])[..., 0]                    # [Bt, Di]
    if D is not None:
        y = y + xf * D.to(f32)[None]
    return y, new


def selective_scan_varlen(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    save_slots: torch.Tensor | None = None,
    cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan of S concatenated sequences, each continuing from an initial state.

    u [T, Di]; delta [T, Di] (softplus'ed); A [Di, N]; B, C [T, N]; D [Di] | None;
    cu_seqlens int [S+1] (cu[0] == 0, cu[-1] == T); initial_states [S, Di, N] | None (zeros).
    The recurrence of `selective_state_update`, token by token; the S sequences advance together
    (padded to the longest; padding steps have decay 1 and no input, so they leave the state as is).
    Returns (y [T, Di] fp32, final_states [S, Di, N] fp32); a zero-length sequence's final state is
    its initial state. With `save_slots` (int [T], -1 = none) the state after token t is also
    written to cache[save_slots[t]] (internal checkpoints).
    """
    f32 = torch.float32
    dev = u.device
    t, di = u.shape
    n = A.shape[-1]
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    s = cu.numel() - 1
    state = (
        initial_states.to(f32).clone() if initial_states is not None
        else torch.zeros(s, di, n, device=dev, dtype=f32)
    )
    y = torch.zeros(t, di, device=dev, dtype=f32)
    if t == 0 or s == 0:
        return y, state
    lens = cu[1:] - cu[:-1]
    max_len = int(lens.max())
    uf, dtf, Af, Bf, Cf = u.to(f32), delta.to(f32), A.to(f32), B.to(f32), C.to(f32)
    # padded layout [S, L]: token index of step l of sequence i (0 past its end, masked out)
    ar = torch.arange(max_len, device=dev)
    valid = ar[None, :] < lens[:, None]                                      # [S, L]
    tok = torch.where(valid, cu[:-1, None] + ar[None, :], torch.zeros((), dtype=torch.int64, device=dev))
    one = torch.ones((), device=dev, dtype=f32)
    zero = torch.zeros((), device=dev, dtype=f32)
    for step in range(max_len):
        v = valid[:, step]
        ti = tok[:, step]
        d = dtf[ti]                                                          # [S, Di]
        dA = torch.exp(d[:, :, None] * Af[None])                             # [S, Di, N]
        dBu = (d[:, :, None] * Bf[ti][:, None, :]) * uf[ti][:, :, None]      # [S, Di, N]
        vm = v[:, None, None]
        state = torch.where(vm, dA, one) * state + torch.where(vm, dBu, zero)
        ys = torch.matmul(state, Cf[ti][:, :, None])[..., 0]                 # [S, Di]
        y[ti[v]] = ys[v]
        if save_slots is not None:
            write_states_at(cache, torch.where(v, save_slots[ti], -1), state)
    if D is not None:
        y = y + uf * D.to(f32)[None]
    return y, state


def mamba1_update_at_slots(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
                           state_indices: torch.Tensor, *, query_start_loc: torch.Tensor | None = None,
                           num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """`selective_state_update` in place at state indices: ssm_state [S, Di, N] (row i reads and
    writes slot state_indices[i]; -1: padded row, y = 0, nothing touched). Returns y fp32 [B, Di].
    Verify rows (query_start_loc [R+1], num_accepted_tokens [R], state_indices [R, 1 + k], x, dt, B,
    C [T, ...]): state_slots_ref.step_rows_at_columns; y fp32 [T, Di]."""
    if query_start_loc is not None:
        def step(state, x_, dt_, B_, C_):
            return selective_state_update(state, x_, dt_, A, B_, C_, D)
        return step_rows_at_columns(ssm_state, state_indices, query_start_loc, num_accepted_tokens, step,
                                    (x, dt, B, C), x.shape[0])
    y, new = selective_state_update(initial_states_at(ssm_state, state_indices, None), x, dt, A, B, C, D)
    write_states_at(ssm_state, state_indices, new)
    return torch.where((state_indices >= 0).view(-1, 1), y, torch.zeros((), dtype=y.dtype, device=y.device))


def mamba1_scan_at_slots(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                         D: torch.Tensor | None, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
                         state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                         checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """`selective_scan_varlen` in place at state indices: sequence i starts from
    ssm_state[state_indices[i]] if has_initial_state[i] else zeros; its final state is written
    back there; with `checkpoints`, the state after each of their tokens goes to their slots.
    Returns y fp32 [T, Di]."""
    init = initial_states_at(ssm_state, state_indices, has_initial_state)
    save = None
    if checkpoints is not None:
        save = torch.full((x.shape[0],), -1, dtype=torch.int64, device=x.device)
        save[checkpoints.token_index] = checkpoints.slots.to(torch.int64)
    y, final = selective_scan_varlen(x, dt, A, B, C, D, cu_seqlens, init, save, ssm_state)
    write_states_at(ssm_state, state_indices, final)
    return y
