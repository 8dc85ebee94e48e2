"""Depthwise causal conv1d over per-request conv state, in torch: the reference of
`causal_conv1d.py` and the op set the CPU runs (the Mamba1 / Mamba2 / ShortConv / GDN front end).

Conv state layout is vLLM's "SD": [K-1, D], the K-1 inputs preceding the next token, oldest first.
Plain torch, fp32 math.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .state_slots_ref import Checkpoints, initial_states_at, sequence_of, step_rows_at_columns, write_states_at

ACTIVATIONS = {"silu": F.silu, "swish": F.silu}     # HF `hidden_act` names the kernels support


def _act(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: the conv applies {sorted(ACTIVATIONS)} or None")
    return ACTIVATIONS[activation](x)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of S concatenated sequences, each continuing from a conv state.

    x [T, Dc] (sequences back to back); weight [Dc, K]; bias [Dc] | None;
    cu_seqlens int [S+1] (cu_seqlens[0] == 0, cu_seqlens[-1] == T);
    initial_states [S, K-1, Dc] ("SD" layout: the K-1 inputs preceding each sequence, oldest first)
    or None for zeros.
    out[t] = act(bias + sum_k weight[:, k] * u[t - (K-1) + k]) where u is the sequence's inputs
    preceded by its initial state. Math in fp32, out in x.dtype.
    Returns (out [T, Dc], final_states [S, K-1, Dc]): final = the last K-1 entries of
    [initial_state; x_seq] (so a sequence shorter than K-1 keeps part of its initial state).
    """
    t, dc = x.shape
    k = weight.shape[-1]
    km1 = k - 1
    dev = x.device
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    s = cu.numel() - 1
    state_dtype = initial_states.dtype if initial_states is not None else x.dtype
    if initial_states is None:
        initial_states = torch.zeros(s, km1, dc, device=dev, dtype=x.dtype)
    # history buffer: all initial states first, then all tokens
    hist = torch.cat([initial_states.reshape(s * km1, dc).to(torch.float32), x.to(torch.float32)], dim=0)
    lens = cu[1:] - cu[:-1]

    def hist_index(seq: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
        # rel = position inside the sequence (negative: inside the initial state)
        return torch.where(rel >= 0, s * km1 + cu[seq] + rel, seq * km1 + km1 + rel)

    taps = torch.arange(k, device=dev) - km1                                   # [K]: -(K-1) .. 0
    seq_of_tok = torch.repeat_interleave(torch.arange(s, device=dev), lens, output_size=t)
    j = torch.arange(t, device=dev) - cu[seq_of_tok]
    win = hist[hist_index(seq_of_tok[:, None], j[:, None] + taps[None, :])]    # [T, K, Dc]
    out = (win * weight.to(torch.float32).t()[None]).sum(dim=1)
    if bias is not None:
        out = out + bias.to(torch.float32)
    out = _act(out, activation).to(x.dtype)

    seqs = torch.arange(s, device=dev)
    rel = lens[:, None] - km1 + torch.arange(km1, device=dev)[None, :]        # [S, K-1]
    final = hist[hist_index(seqs[:, None], rel)].to(state_dtype)              # [S, K-1, Dc]
    return out, final


def causal_conv1d_step(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per row. x [B, Dc], conv_state [B, K-1, Dc], weight [Dc, K].

    Returns (out [B, Dc] in x.dtype, new_state [B, K-1, Dc] in conv_state.dtype).
    """
    win = torch.cat([conv_state.to(torch.float32), x.to(torch.float32)[:, None, :]], dim=1)  # [B, K, Dc]
    out = (win * weight.to(torch.float32).t()[None]).sum(dim=1)
    if bias is not None:
        out = out + bias.to(torch.float32)
    out = _act(out, activation).to(x.dtype)
    return out, win[:, 1:].to(conv_state.dtype)


def conv_update_at_slots(x: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None = "silu", *, query_start_loc: torch.Tensor | None = None,
                         num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, Dc], conv_state [S, K-1, Dc] (updated in place), state_indices int [B] -> out [B, Dc].
    Padded rows (state index -1) get out = 0 and touch no state.
    Verify rows (query_start_loc [R+1], num_accepted_tokens [R], state_indices [R, 1 + k], x [T, Dc]):
    state_slots_ref.step_rows_at_columns; out [T, Dc]."""
    if query_start_loc is not None:
        def step(state, x_):
            return causal_conv1d_step(x_, state, weight, bias, activation)
        return step_rows_at_columns(conv_state, state_indices, query_start_loc, num_accepted_tokens, step,
                                    (x,), x.shape[0])
    out, new = causal_conv1d_step(x, initial_states_at(conv_state, state_indices, None), weight, bias, activation)
    write_states_at(conv_state, state_indices, new)
    return torch.where((state_indices >= 0).view(-1, 1), out, torch.zeros((), dtype=out.dtype, device=out.device))


def conv_windows_at(x: torch.Tensor, initial_states: torch.Tensor, cu_seqlens: torch.Tensor,
                    token_index: torch.Tensor) -> torch.Tensor:
    """[M, K-1, Dc] in initial_states' dtype: the conv state after each token of `token_index`
    (the K-1 inputs ending at it, reaching into its sequence's initial state near the start).
    x [T, Dc]; initial_states [S, K-1, Dc]; cu_seqlens int [S+1]; token_index int64 [M]."""
    km1 = initial_states.shape[1]
    seq = sequence_of(cu_seqlens, token_index)
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
    rel = (token_index - cu[seq])[:, None] - km1 + 1 + torch.arange(km1, device=x.device)[None, :]   # [M, K-1]
    from_x = x[(cu[seq][:, None] + rel).clamp(min=0)]
    from_init = initial_states[seq[:, None], (km1 + rel).clamp(min=0, max=km1 - 1)]
    return torch.where((rel >= 0)[..., None], from_x.to(initial_states.dtype), from_init)


def conv_prefill_at_slots(x: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor,
                          has_initial_state: torch.Tensor, cu_seqlens: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None, activation: str | None = "silu",
                          checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """x [T, Dc] (P sequences back to back, cu_seqlens int [P+1]); sequence i starts from
    conv_state[state_indices[i]] if has_initial_state[i] else zeros, and its final state (the last
    K-1 inputs of [initial; x_i]) is written back there; with `checkpoints`, the state after each
    of their tokens goes to their slots. Returns out [T, Dc] in x.dtype."""
    init = initial_states_at(conv_state, state_indices, has_initial_state)
    out, final = causal_conv1d_varlen(x, weight, bias, cu_seqlens, init, activation)
    write_states_at(conv_state, state_indices, final)
    if checkpoints is not None:
        write_states_at(conv_state, checkpoints.slots,
                        conv_windows_at(x, init, cu_seqlens, checkpoints.token_index))
    return out
