"""The gated delta rule (Gated DeltaNet) over per-request state, in torch: the reference of
`gated_delta_rule.py`.

Notation: T tokens, Hk key heads, Hv value heads (head h reads key head h // (Hv // Hk)), K key
head dim, V value head dim, S sequences, C chunks. Per token, per value head:
    S = exp(g_t) * S;   S = S + beta_t * (v_t - S k_t) k_t^T;   o_t = S q_t        (S [V, K])
with q, k l2-normalised (eps `L2NORM_EPS`, FLA's use_qk_l2norm_in_kernel) and q scaled by 1/sqrt(K).
All delta-rule math is fp32.
"""
from __future__ import annotations

import torch

from .state_slots_ref import (
    Checkpoints,
    initial_states_at,
    padded_rows_redirected,
    sequence_of,
    step_rows_at_columns,
    write_states_at,
)

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (HF / FLA `l2norm`)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, K] -> fp32 [T, Hv, K]: each key head repeated for its Hv // Hk value heads,
    l2-normalised (if use_qk_l2norm), and q scaled by K ** -0.5."""
    hk = k.shape[-2]
    if num_v_heads % hk != 0:
        raise ValueError(f"num_v_heads {num_v_heads} is not a multiple of num_k_heads {hk}")
    qf, kf = q.to(torch.float32), k.to(torch.float32)
    if num_v_heads != hk:
        qf = qf.repeat_interleave(num_v_heads // hk, dim=-2)
        kf = kf.repeat_interleave(num_v_heads // hk, dim=-2)
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    return qf * (qf.shape[-1] ** -0.5), kf


def gdn_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token gated delta rule update on prepared inputs (see `gdn_prepare_qk`).

    state [B, Hv, V, K]; q, k [B, Hv, K] (prepared, fp32); v [B, Hv, V]; g [B, Hv] (log decay, <= 0),
    or [B, Hv, K] (Kimi Delta Attention: one log decay per key channel, the state's columns);
    beta [B, Hv].
        S = exp(g) S;  S = S + beta (v - S k) k^T;  y = S q
    Returns (y [B, Hv, V] fp32, new_state [B, Hv, V, K] fp32).
    """
    f32 = torch.float32
    decay = torch.exp(g.to(f32))
    s = state.to(f32) * (decay[..., None, :] if g.dim() == state.dim() - 1 else decay[..., None, None])
    kv_mem = torch.einsum("bhvk,bhk->bhv", s, k)
    delta = (v.to(f32) - kv_mem) * beta.to(f32)[..., None]
    s = s + delta[..., :, None] * k[..., None, :]
    return torch.einsum("bhvk,bhk->bhv", s, q), s


def gdn_recurrent_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, initial_states: torch.Tensor | None = None, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the gated delta rule one token at a time (HF `torch_recurrent_gated_delta_rule`).

    q, k [T, Hk, K]; v [T, Hv, V]; g [T, Hv] (log decay); beta [T, Hv]; cu_seqlens int [S+1];
    initial_states [S, Hv, V, K] | None (zeros).
    Returns (y [T, Hv, V] fp32, final_states [S, Hv, V, K] fp32).
    """
    t, hv, vd = v.shape
    qp, kp = gdn_prepare_qk(q, k, hv, use_qk_l2norm)
    cu = [int(x) for x in cu_seqlens.tolist()]
    s = len(cu) - 1
    y = torch.zeros(t, hv, vd, device=v.device, dtype=torch.float32)
    finals = torch.zeros(s, hv, vd, kp.shape[-1], device=v.device, dtype=torch.float32)
    for i in range(s):
        st = (initial_states[i : i + 1].to(torch.float32) if initial_states is not None
              else finals[i : i + 1].clone())
        for j in range(cu[i], cu[i + 1]):
            yj, st = gdn_step(st, qp[j : j + 1], kp[j : j + 1], v[j : j + 1], g[j : j + 1], beta[j : j + 1])
            y[j] = yj[0]
        finals[i] = st[0]
    return y, finals


def gdn_chunk_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor, last_chunk_indices: torch.Tensor,
    chunk_size: int, initial_states: torch.Tensor | None = None, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over a varlen chunk layout (the math of HF
    `torch_chunk_gated_delta_rule`, chunk by chunk over several sequences).

    q, k [T, Hk, K]; v [T, Hv, V]; g [T, Hv] (log decay); beta [T, Hv];
    cu_chunk_seqlens int [C+1]: chunk c covers tokens [cu[c], cu[c+1]) (0 < length <= chunk_size,
        cu[0] == 0, cu[-1] == T, chunks in token order, never crossing a sequence);
    seq_idx int [C]: sequence of each chunk (a sequence's chunks are consecutive);
    last_chunk_indices int [S]: last chunk of each sequence;
    initial_states [S, Hv, V, K] | None: state before each sequence's first token (None = zeros).

    Per chunk (positions i, j < L, cumulative log decay G_i = sum_{l <= i} g_l, state M = S^T [K, V]):
    the UT transform solves (I + tril(diag(beta) K K^T * exp(G_i - G_j), -1)) [U | W] =
    [diag(beta) V | diag(beta exp(G)) K]; with the chunk's start state M0,
        v_new = U - W M0,   y = exp(G) Q M0 + (Q K^T * exp(G_i - G_j), j <= i) v_new,
        M1 = exp(G_last) M0 + (K * exp(G_last - G))^T v_new.
    Chunks shorter than chunk_size are zero-padded (beta = 0, g = 0), which is exact.
    Returns (y [T, Hv, V] fp32, final_states [S, Hv, V, K] fp32).
    """
    t, hv, vd = v.shape
    f32 = torch.float32
    dev = v.device
    qp, kp = gdn_prepare_qk(q, k, hv, use_qk_l2norm)                        # [T, Hv, K]
    kd = kp.shape[-1]
    cu = cu_chunk_seqlens.to(device=dev, dtype=torch.int64)
    nc = cu.numel() - 1
    num_seqs = last_chunk_indices.numel()
    L = int(chunk_size)
    if nc == 0:
        return torch.zeros(t, hv, vd, device=dev, dtype=f32), torch.zeros(num_seqs, hv, vd, kd, device=dev, dtype=f32)

    valid, chunked = chunk_tiles(cu, L)
    qc, kc, vc = chunked(qp), chunked(kp), chunked(v)                         # [C, Hv, L, K|V]
    bc, gc = chunked(beta), chunked(g)                                        # [C, Hv, L]
    k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
    cum = torch.cumsum(gc, dim=-1)                                            # [C, Hv, L]
    upper = torch.ones(L, L, dtype=torch.bool, device=dev).triu(1)
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")))

    # intra-chunk: the UT transform (a unit lower-triangular solve) and the masked q.k "attention"
    ut = (k_beta @ kc.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)        # [C, Hv, L, V]
    w = torch.linalg.solve_triangular(ut, k_beta * torch.exp(cum)[..., None], upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay                                # [C, Hv, L, L]
    q_dec = qc * torch.exp(cum)[..., None]
    k_dec = kc * torch.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = torch.exp(cum[..., -1])[..., None, None]                    # [C, Hv, 1, 1]

    return pass_chunk_states(u, w, q_dec, attn, k_dec, chunk_decay, valid, seq_idx, last_chunk_indices,
                             initial_states, t, "gdn_chunk_varlen")


def chunk_tiles(cu: torch.Tensor, chunk_size: int):
    """The varlen chunk layout as tiles: (valid bool [C, L], chunked: [T, H, ...] -> fp32 [C, H, L, ...]
    zero on padding). cu int64 [C+1]: chunk c covers tokens cu[c] .. cu[c+1]-1."""
    ar = torch.arange(chunk_size, device=cu.device)
    valid = ar[None, :] < (cu[1:] - cu[:-1])[:, None]
    idx = torch.where(valid, cu[:-1, None] + ar[None, :], torch.zeros_like(ar)[None, :])
    vf = valid.to(torch.float32)

    def chunked(x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float32)[idx] * vf.view(*vf.shape, *(1,) * (x.dim() - 1))).transpose(1, 2)
    return valid, chunked


def pass_chunk_states(u: torch.Tensor, w: torch.Tensor, q_dec: torch.Tensor, attn: torch.Tensor,
                      k_dec: torch.Tensor, chunk_decay: torch.Tensor, valid: torch.Tensor, seq_idx: torch.Tensor,
                      last_chunk_indices: torch.Tensor, initial_states: torch.Tensor | None, t: int, what: str
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked delta rule's state passing across each sequence's chunks (state as M = S^T [H, K, V]):
    v_new = U - W M;  y = Q_dec M + attn v_new;  M = chunk_decay * M + K_dec^T v_new. Shapes [C, H, L, ...];
    chunk_decay [C, H, 1, 1] (a decay per head) or [C, H, K, 1] (per key channel). Returns (y [T, H, V]
    in token order, the final states [S, H, V, K])."""
    nc, h, L, vd = u.shape
    kd = w.shape[-1]
    seq_list = [int(x) for x in seq_idx.tolist()]
    out = torch.empty(nc, h, L, vd, device=u.device, dtype=u.dtype)
    after = torch.empty(nc, h, kd, vd, device=u.device, dtype=u.dtype)
    m = None
    for c in range(nc):
        if c == 0 or seq_list[c] != seq_list[c - 1]:
            m = (initial_states[seq_list[c]].to(u.dtype).transpose(-1, -2) if initial_states is not None
                 else torch.zeros(h, kd, vd, device=u.device, dtype=u.dtype))
        v_new = u[c] - w[c] @ m
        out[c] = q_dec[c] @ m + attn[c] @ v_new
        m = m * chunk_decay[c] + k_dec[c].transpose(-1, -2) @ v_new
        after[c] = m
    y = out.transpose(1, 2)[valid]
    if y.shape[0] != t:
        raise ValueError(f"{what}: chunk layout covers {y.shape[0]} of {t} tokens "
                         f"(chunks must tile [0, T) and be at most chunk_size={L} long)")
    finals = after[last_chunk_indices.to(device=u.device, dtype=torch.int64)].transpose(-1, -2)
    return y, finals.contiguous()


def gdn_update_at_slots(ssm_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        g: torch.Tensor, beta: torch.Tensor, state_indices: torch.Tensor,
                        use_qk_l2norm: bool = True, *, query_start_loc: torch.Tensor | None = None,
                        num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """`gdn_step` in place at state indices (one token per row): ssm_state [S, Hv, V, K], q, k
    [B, Hk, K] (raw: prepared here), v [B, Hv, V], g, beta [B, Hv]; row i reads and writes slot
    state_indices[i] (-1: padded row, y = 0, nothing touched). Returns y fp32 [B, Hv, V].
    Verify rows (query_start_loc [R+1], num_accepted_tokens [R], state_indices [R, 1 + k], q ... beta
    [T, ...]): state_slots_ref.step_rows_at_columns; y fp32 [T, Hv, V]."""
    qp, kp = gdn_prepare_qk(q, k, v.shape[-2], use_qk_l2norm)
    if query_start_loc is not None:
        return step_rows_at_columns(ssm_state, state_indices, query_start_loc, num_accepted_tokens, gdn_step,
                                    (qp, kp, v, g, beta), v.shape[0])
    y, new = gdn_step(initial_states_at(ssm_state, state_indices, None), qp, kp, v, g, beta)
    write_states_at(ssm_state, state_indices, new)
    return torch.where((state_indices >= 0).view(-1, 1, 1), y, torch.zeros((), dtype=y.dtype, device=y.device))


def gdn_states_after(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, initial_states: torch.Tensor, token_index: torch.Tensor, use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """[M, Hv, V, K] fp32: the state after each token of `token_index` (int64 [M]), by the plain
    recurrence (`gdn_step`) from its sequence's initial state (initial_states [S, Hv, V, K];
    cu_seqlens int [S+1]). The sequences advance together, each only up to its last such token
    (a sequence past it, or without any, keeps its state: `torch.where`, exact)."""
    t, hv, vd = v.shape
    kd = q.shape[-1]
    f32 = torch.float32
    dev = v.device
    m = token_index.numel()
    out = torch.zeros(m, hv, vd, kd, device=dev, dtype=f32)
    if m == 0:
        return out
    qp, kp = gdn_prepare_qk(q, k, hv, use_qk_l2norm)
    tok = token_index.to(device=dev, dtype=torch.int64)
    starts = cu_seqlens.to(device=dev, dtype=torch.int64)[:-1]
    seq = sequence_of(cu_seqlens, tok)
    need = torch.zeros_like(starts).scatter_reduce_(0, seq, tok - starts[seq] + 1, "amax")    # [S] steps
    save = torch.full((t,), -1, dtype=torch.int64, device=dev)
    save[tok] = torch.arange(m, device=dev)                    # token -> its checkpoint, -1 = none
    state = initial_states.to(f32)
    for j in range(int(need.max())):
        live = j < need                                        # [S]
        ti = torch.where(live, starts + j, 0)
        _, new = gdn_step(state, qp[ti], kp[ti], v[ti], g[ti], beta[ti])
        state = torch.where(live.view(-1, 1, 1, 1), new, state)
        rows, targets, keep = padded_rows_redirected(torch.where(live, save[ti], -1))
        out[targets] = torch.where(keep.view(-1, 1, 1, 1), state[rows], out[targets])
    return out


def gdn_prefill_at_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor,
                         last_chunk_indices: torch.Tensor, chunk_size: int, ssm_state: torch.Tensor,
                         state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                         use_qk_l2norm: bool = True, checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """`gdn_chunk_varlen` in place at state indices: sequence i starts from
    ssm_state[state_indices[i]] if has_initial_state[i] else zeros; its final state is written
    back there. With `checkpoints`, the state after each of their tokens goes to their slots: the
    chunks (row-relative, FLA's layout) need not end there, so those states come from the plain
    recurrence (`gdn_states_after`) from the same initial states. Returns y fp32 [T, Hv, V]."""
    init = initial_states_at(ssm_state, state_indices, has_initial_state)      # a copy: read before the writes
    y, final = gdn_chunk_varlen(q, k, v, g, beta, cu_chunk_seqlens, seq_idx, last_chunk_indices, chunk_size,
                                init, use_qk_l2norm)
    write_states_at(ssm_state, state_indices, final)
    if checkpoints is not None and checkpoints.token_index.numel() > 0:
        cu = cu_chunk_seqlens.to(device=v.device, dtype=torch.int64)
        ends = cu[last_chunk_indices.to(device=v.device, dtype=torch.int64) + 1]
        cu_seqlens = torch.cat([ends.new_zeros(1), ends])      # sequence i: [cu[last[i-1]+1], cu[last[i]+1])
        write_states_at(ssm_state, checkpoints.slots,
                        gdn_states_after(q, k, v, g, beta, cu_seqlens, init, checkpoints.token_index,
                                         use_qk_l2norm))
    return y
