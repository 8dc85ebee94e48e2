"""The mLSTM recurrence (xLSTM's matrix LSTM) over per-request state, in torch: the reference of
`mlstm.py` (its Triton kernels, the Triton op set's; these are the torch op set's, toolkit/layers/ops.py).

Notation: T tokens, H heads, K = qk head dim, V = v head dim, S state slots, P sequences. Per token,
per head, with i, f the (soft-capped) input / forget gate pre-activations and q, k [K], v [V]:
    m' = max(logsigmoid(f) + m, i)                           the stabiliser (a log scale)
    C' = exp(logsigmoid(f) + m - m') C + exp(i - m') k v^T    C [K, V]
    n' = exp(logsigmoid(f) + m - m') n + exp(i - m') k        n [K]
    h  = (q' C') / (max(|q' . n'|, exp(-m')) + eps),  q' = q * K ** -0.5
(HF transformers' `mlstm_recurrent_step_native`, eps = config.eps). HF's chunkwise prefill
(`mlstm_chunkwise_native_autograd`) is the same recurrence regrouped: its chunk-end stabiliser
max(G + m, max_j(b_last - b_j + i_j)) is the unrolled max above, so states and outputs agree up to
rounding. A fresh state is HF's initial one: C, n and m all zero.

State per slot, all fp32 (HF's `inference_state_dtype`), three tensors in this order:
    C_state [H, K, V]   HF's layout (k v^T): the state equals HF's xLSTMCache C with no transpose
    n_state [H, K]
    m_state [H]         HF keeps [H, 1]; its trailing 1 only broadcasts in HF's batched math, and a
                        state tensor per slot needs no such axis (the ops broadcast explicitly)
All math is fp32; outputs h are fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .state_slots_ref import Checkpoints, initial_states_at, step_rows_at_columns, write_states_at

MLSTM_EPS = 1e-6        # HF xLSTMConfig.eps's default

MLSTMState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def mlstm_step(state: MLSTMState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor,
               f: torch.Tensor, eps: float = MLSTM_EPS) -> tuple[torch.Tensor, MLSTMState]:
    """One token of the mLSTM (module docstring) for B rows.

    state (C [B, H, K, V], n [B, H, K], m [B, H]); q, k [B, H, K]; v [B, H, V]; i, f [B, H].
    Returns (h [B, H, V] fp32, (C', n', m') fp32)."""
    f32 = torch.float32
    c, n, m = (s.to(f32) for s in state)
    q, k, v, i, f = (x.to(f32) for x in (q, k, v, i, f))
    log_f = F.logsigmoid(f)
    m_new = torch.maximum(log_f + m, i)
    decay = torch.exp(log_f + m - m_new)                                    # [B, H]
    gain = torch.exp(i - m_new)
    c = decay[..., None, None] * c + gain[..., None, None] * (k[..., :, None] * v[..., None, :])
    n = decay[..., None] * n + gain[..., None] * k
    qs = q * (q.shape[-1] ** -0.5)
    num = torch.einsum("bhk,bhkv->bhv", qs, c)
    denom = torch.maximum((qs * n).sum(-1).abs(), torch.exp(-m_new)) + eps
    return num / denom[..., None], (c, n, m_new)


def mlstm_update_at_slots(c_state: torch.Tensor, n_state: torch.Tensor, m_state: torch.Tensor, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                          state_indices: torch.Tensor, eps: float = MLSTM_EPS, *,
                          query_start_loc: torch.Tensor | None = None,
                          num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """`mlstm_step` in place at state indices, one token per row: c_state [S, H, K, V], n_state [S, H, K],
    m_state [S, H]; q, k [B, H, K], v [B, H, V], i, f [B, H]; row b reads and writes slot
    state_indices[b] (-1: a padded row, h = 0, nothing touched). Returns h fp32 [B, H, V].
    Verify rows (query_start_loc [R+1], num_accepted_tokens [R], state_indices [R, 1 + k], inputs
    [T, ...]): state_slots_ref.step_rows_at_columns over the three states; h fp32 [T, H, V]."""
    caches = (c_state, n_state, m_state)

    def step(state: MLSTMState, *x: torch.Tensor) -> tuple[torch.Tensor, MLSTMState]:
        return mlstm_step(state, *x, eps=eps)
    if query_start_loc is not None:
        return step_rows_at_columns(caches, state_indices, query_start_loc, num_accepted_tokens, step,
                                    (q, k, v, i, f), v.shape[0])
    h, new = step(tuple(initial_states_at(s, state_indices, None) for s in caches), q, k, v, i, f)
    for cache, s in zip(caches, new):
        write_states_at(cache, state_indices, s)
    return torch.where((state_indices >= 0).view(-1, 1, 1), h, torch.zeros((), dtype=h.dtype, device=h.device))


def mlstm_prefill_at_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                           cu_seqlens: torch.Tensor, c_state: torch.Tensor, n_state: torch.Tensor,
                           m_state: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                           eps: float = MLSTM_EPS, checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """P sequences back to back, token by token: q, k [T, H, K], v [T, H, V], i, f [T, H]; cu_seqlens
    int [P+1]; states as `mlstm_update_at_slots`. Sequence p starts from its slot state_indices[p] if
    has_initial_state[p] (else HF's zero state) and leaves its final state there (-1: computed from
    zeros, nothing written). The sequences advance together, one token each per step of a loop over
    the longest one (a sequence past its end keeps its state: `torch.where`, exact). With
    `checkpoints`, the state after token token_index[m] also goes to slot slots[m] (any token).
    Returns h fp32 [T, H, V]."""
    t, nh, dv = v.shape
    dev = v.device
    caches = (c_state, n_state, m_state)
    h = torch.zeros(t + 1, nh, dv, device=dev, dtype=torch.float32)     # row t: a scratch row for idle sequences
    state = tuple(initial_states_at(s, state_indices, has_initial_state).to(torch.float32) for s in caches)
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    if t == 0 or starts.numel() == 0:
        return h[:t]
    slot_after = None                                                    # token -> checkpoint slot (-1: none)
    if checkpoints is not None and checkpoints.token_index.numel() > 0:
        slot_after = torch.full((t,), -1, dtype=torch.int64, device=dev)
        slot_after[checkpoints.token_index.to(device=dev, dtype=torch.int64)] = checkpoints.slots.to(
            device=dev, dtype=torch.int64)
    for j in range(int(lens.max())):
        live = j < lens                                                    # [P]
        tok = torch.where(live, starts + j, 0)
        y, new = mlstm_step(state, q[tok], k[tok], v[tok], i[tok], f[tok], eps=eps)
        state = tuple(torch.where(live.view(-1, *(1,) * (s.dim() - 1)), s_new, s) for s, s_new in zip(state, new))
        h[torch.where(live, tok, t)] = y
        if slot_after is not None:
            at = torch.where(live, slot_after[tok], -1)
            for cache, s in zip(caches, state):
                write_states_at(cache, at, s)
    for cache, s in zip(caches, state):
        write_states_at(cache, state_indices, s)
    return h[:t]
