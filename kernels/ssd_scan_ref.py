"""Mamba2's chunked SSD scan over vLLM's varlen chunk layout, in torch: the reference of
`ssd_scan.py`, and the plain per-token recurrence it is checked against.

Notation: T tokens, H heads, P head_dim, N d_state, G n_groups, S sequences, C chunks.
All SSM math is fp32.
"""
from __future__ import annotations

import torch

from .selective_state_update_ref import heads_from_groups, ssm_step
from .state_slots_ref import Checkpoints, initial_states_at, write_states_at


def ssm_scan_sequential_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the SSM recurrence one token at a time (see `ssm_step`).

    x [T, H, P]; dt [T, H] (processed); A [H]; B, C [T, G, N]; D [H] | None;
    cu_seqlens int [S+1]; initial_states [S, H, P, N] | None (zeros).
    Returns (y [T, H, P] fp32, final_states [S, H, P, N] fp32).
    """
    t, h, p = x.shape
    n = B.shape[-1]
    cu = [int(v) for v in cu_seqlens.tolist()]
    s = len(cu) - 1
    y = torch.zeros(t, h, p, device=x.device, dtype=torch.float32)
    finals = torch.zeros(s, h, p, n, device=x.device, dtype=torch.float32)
    for i in range(s):
        st = (
            initial_states[i : i + 1].to(torch.float32)
            if initial_states is not None
            else torch.zeros(1, h, p, n, device=x.device, dtype=torch.float32)
        )
        for j in range(cu[i], cu[i + 1]):
            yj, st = ssm_step(st, x[j : j + 1], dt[j : j + 1], A, B[j : j + 1], C[j : j + 1], D)
            y[j] = yj[0]
        finals[i] = st[0]
    return y, finals


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L] with out[..., l, s] = sum_{k=s+1..l} a[k] for l >= s, -inf above.

    Built from a cumulative sum of masked copies (not cumsum differences) for stability.
    """
    L = a.shape[-1]
    x = a[..., :, None].expand(*a.shape, L)                                  # x[..., l, s] = a[l]
    strict = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~strict, 0.0)
    seg = torch.cumsum(x, dim=-2)
    incl = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=0)
    return seg.masked_fill(~incl, float("-inf"))


def ssd_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    cu_chunk_seqlens: torch.Tensor,
    seq_idx: torch.Tensor,
    last_chunk_indices: torch.Tensor,
    chunk_size: int,
    initial_states: torch.Tensor | None = None,
    return_chunk_states: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Chunked SSD (state-space duality) scan over a varlen chunk layout.

    x [T, H, P]; dt [T, H] (processed, fp32); A [H]; B, C [T, G, N]; D [H] | None;
    cu_chunk_seqlens int [C+1]: chunk c covers tokens [cu[c], cu[c+1]) (0 < length <= chunk_size,
        cu[0] == 0, cu[-1] == T, chunks in token order, never crossing a sequence);
    seq_idx int [C]: sequence of each chunk (sequences' chunks are consecutive);
    last_chunk_indices int [S]: last chunk of each sequence;
    initial_states [S, H, P, N] | None: state before each sequence's first token (None = zeros).
    Per chunk: the intra-chunk (diagonal) term is a masked "attention" C_l.B_s * exp(sum dA(s, l])
    * dt_s * x_s; each chunk's start state comes from a recurrence over the chunks of its
    sequence (state_after = exp(sum dA over chunk) * state_before + chunk_state), and adds
    exp(cumsum dA)_l * C_l . state_before. Chunks shorter than chunk_size are zero-padded with dt = 0,
    which makes padding exact (decay 1, no input).
    Returns (y [T, H, P] fp32, final_states [S, H, P, N] fp32), and with `return_chunk_states`
    also the state after each chunk [C, H, P, N] fp32.
    """
    t, h, p = x.shape
    n = B.shape[-1]
    dev = x.device
    f32 = torch.float32
    cu = cu_chunk_seqlens.to(device=dev, dtype=torch.int64)
    nc = cu.numel() - 1
    num_seqs = last_chunk_indices.numel()
    L = int(chunk_size)
    if nc == 0:
        empty = (torch.zeros(t, h, p, device=dev, dtype=f32), torch.zeros(num_seqs, h, p, n, device=dev, dtype=f32))
        return (*empty, torch.zeros(0, h, p, n, device=dev, dtype=f32)) if return_chunk_states else empty

    lens = cu[1:] - cu[:-1]
    ar = torch.arange(L, device=dev)
    valid = ar[None, :] < lens[:, None]                                       # [C, L]
    idx = torch.where(valid, cu[:-1, None] + ar[None, :], torch.zeros_like(ar)[None, :])
    vf = valid.to(f32)
    xc = x.to(f32)[idx] * vf[:, :, None, None]                                # [C, L, H, P]
    dtc = dt.to(f32)[idx] * vf[:, :, None]                                    # [C, L, H]
    Bc = heads_from_groups(B.to(f32)[idx], h)                                # [C, L, H, N]
    Cc = heads_from_groups(C.to(f32)[idx], h)

    dA = dtc * A.to(f32)[None, None, :]                                       # [C, L, H]
    cum = torch.cumsum(dA, dim=1)                                             # [C, L, H]
    xdt = xc * dtc[..., None]                                                 # [C, L, H, P]

    # 1. intra-chunk (diagonal blocks)
    decay_ls = torch.exp(_segsum(dA.permute(0, 2, 1)))                        # [C, H, L, L]
    cb = torch.einsum("clhn,cshn->chls", Cc, Bc)
    y = torch.einsum("chls,cshp->clhp", cb * decay_ls, xdt)

    # 2. each chunk's own contribution to its end state (from a zero start)
    decay_to_end = torch.exp(cum[:, -1:, :] - cum)                            # [C, L, H]
    chunk_states = torch.einsum("clhn,clhp->chpn", Bc * decay_to_end[..., None], xdt)  # [C, H, P, N]
    chunk_decay = torch.exp(cum[:, -1, :])                                    # [C, H]

    # 3. state passing across the chunks of each sequence
    seq_list = [int(v) for v in seq_idx.tolist()]
    states_before = torch.empty(nc, h, p, n, device=dev, dtype=f32)
    states_after = torch.empty(nc, h, p, n, device=dev, dtype=f32)
    prev = None
    for c in range(nc):
        if c == 0 or seq_list[c] != seq_list[c - 1]:
            prev = (
                initial_states[seq_list[c]].to(f32)
                if initial_states is not None
                else torch.zeros(h, p, n, device=dev, dtype=f32)
            )
        states_before[c] = prev
        prev = chunk_decay[c][:, None, None] * prev + chunk_states[c]
        states_after[c] = prev

    # 4. contribution of each chunk's start state
    y = y + torch.einsum("clhn,chpn->clhp", Cc, states_before) * torch.exp(cum)[..., None]
    if D is not None:
        y = y + D.to(f32)[None, None, :, None] * xc

    y_tok = y[valid]                                                          # [T, H, P], token order
    if y_tok.shape[0] != t:
        raise ValueError(
            f"ssd_chunk_scan_varlen: chunk layout covers {y_tok.shape[0]} of {t} tokens "
            f"(chunks must tile [0, T) and be at most chunk_size={L} long)"
        )
    finals = states_after[last_chunk_indices.to(device=dev, dtype=torch.int64)]
    if return_chunk_states:
        return y_tok, finals, states_after
    return y_tok, finals


def chunk_ending_at(cu_chunk_seqlens: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """int64 [M]: the chunk whose last token is each token of `token_index` (a checkpoint must be
    the last token of a chunk: chunks end at multiples of chunk_size, and so does every block
    boundary when chunk_size divides the block size)."""
    cu = cu_chunk_seqlens.to(device=token_index.device, dtype=torch.int64)
    return torch.searchsorted(cu[1:], token_index.to(torch.int64) + 1)


def ssd_scan_at_slots(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor | None, cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor,
                      last_chunk_indices: torch.Tensor, chunk_size: int, ssm_state: torch.Tensor,
                      state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                      checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """`ssd_chunk_scan_varlen` in place at state indices: sequence i starts from
    ssm_state[state_indices[i]] if has_initial_state[i] else zeros; its final state is written
    back there; with `checkpoints` (each the last token of a chunk), the state after each of their
    tokens goes to their slots. Returns y fp32 [T, H, P]."""
    init = initial_states_at(ssm_state, state_indices, has_initial_state)
    y, final, after = ssd_chunk_scan_varlen(x, dt, A, B, C, D, cu_chunk_seqlens, seq_idx, last_chunk_indices,
                                            chunk_size, init, return_chunk_states=True)
    write_states_at(ssm_state, state_indices, final)
    if checkpoints is not None:
        write_states_at(ssm_state, checkpoints.slots, after[chunk_ending_at(cu_chunk_seqlens, checkpoints.token_index)])
    return y
