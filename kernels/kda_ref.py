"""Kimi Delta Attention (KDA: Kimi Linear, Ling-3, GLM-5.3-Flash) over per-request state, in torch: the
reference of `kda.py`.

KDA is the gated delta rule with a log decay per key channel instead of per head. Notation: T tokens,
H heads (q, k and v alike: no grouped values), K key head dim, V value head dim, S sequences, C chunks.
Per token, per head (S [V, K], vLLM's "K-last" layout; HF keeps its transpose):
    S = S * exp(g_t)[None, :];   S = S + beta_t * (v_t - S k_t) k_t^T;   o_t = S q_t
with g_t [K] <= 0 (fp32), q, k l2-normalised (eps 1e-6) and q scaled by 1/sqrt(K); all math fp32.
The one-token step, the recurrence and the states after chosen tokens are the gated delta rule's own
(`gated_delta_rule_ref`, whose `gdn_step` takes g [.., H, K] as well as [.., H]); the chunked prefill
needs its own form (`kda_chunk_varlen`): within a chunk the decay between two positions is a vector
over K, so the UT transform's and the intra-chunk attention's products carry it channel by channel.
"""
from __future__ import annotations

import torch

from .gated_delta_rule_ref import (
    chunk_tiles,
    gdn_prepare_qk,
    gdn_recurrent_varlen,
    gdn_states_after,
    gdn_update_at_slots,
    pass_chunk_states,
)
from .state_slots_ref import Checkpoints, initial_states_at, write_states_at


def _check_kda(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
    if q.shape[-2] != v.shape[-2]:
        raise ValueError(f"KDA has as many key heads as value heads: q/k have {q.shape[-2]}, v {v.shape[-2]}")
    if tuple(g.shape) != tuple(q.shape):
        raise ValueError(f"g must be [..., H, K] like q (one log decay per key channel), got {tuple(g.shape)} "
                         f"for q {tuple(q.shape)}")


def kda_recurrent_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, initial_states: torch.Tensor | None = None, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: KDA one token at a time (HF `recurrent_kimi_delta_attention`, over varlen sequences).
    q, k [T, H, K]; v [T, H, V]; g [T, H, K]; beta [T, H]; cu_seqlens int [S+1]; initial_states
    [S, H, V, K] | None. Returns (y [T, H, V] fp32, final_states [S, H, V, K] fp32)."""
    _check_kda(q, v, g)
    return gdn_recurrent_varlen(q, k, v, g, beta, cu_seqlens, initial_states, use_qk_l2norm)


def kda_chunk_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor, last_chunk_indices: torch.Tensor,
    chunk_size: int, initial_states: torch.Tensor | None = None, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA over the varlen chunk layout of `gdn_chunk_varlen` (the math of HF
    `chunk_kimi_delta_attention`, chunk by chunk over several sequences).

    q, k [T, H, K]; v [T, H, V]; g [T, H, K] (log decay per key channel); beta [T, H];
    cu_chunk_seqlens int [C+1], seq_idx int [C], last_chunk_indices int [S]: as `gdn_chunk_varlen`;
    initial_states [S, H, V, K] | None (zeros).

    Per chunk (positions i, j < L; G_i [K] = sum_{l <= i} g_l, the cumulative log decay per channel;
    D_ij [K] = exp(G_i - G_j) for j <= i; state M = S^T [K, V]):
        A_ij = beta_i sum_k K_ik K_jk D_ijk (j < i);   [U | W] = (I + A)^-1 [diag(beta) V | diag(beta) K * exp(G)]
        v_new = U - W M0;   y_i = (Q_i * exp(G_i)) M0 + sum_{j <= i} (sum_k Q_ik K_jk D_ijk) v_new_j
        M1 = exp(G_last)[:, None] * M0 + (K * exp(G_last - G))^T v_new
    Padding positions (a chunk shorter than chunk_size) get beta = 0 and g = 0, which is exact.
    Returns (y [T, H, V] fp32, final_states [S, H, V, K] fp32).
    """
    _check_kda(q, v, g)
    t, h, vd = v.shape
    f32 = torch.float32
    dev = v.device
    qp, kp = gdn_prepare_qk(q, k, h, use_qk_l2norm)                          # [T, H, K]
    kd = kp.shape[-1]
    cu = cu_chunk_seqlens.to(device=dev, dtype=torch.int64)
    nc = cu.numel() - 1
    num_seqs = last_chunk_indices.numel()
    L = int(chunk_size)
    if nc == 0:
        return torch.zeros(t, h, vd, device=dev, dtype=f32), torch.zeros(num_seqs, h, vd, kd, device=dev, dtype=f32)

    valid, chunked = chunk_tiles(cu, L)
    qc, kc, vc, gc = chunked(qp), chunked(kp), chunked(v), chunked(g)       # [C, H, L, K|V]
    bc = chunked(beta)                                                        # [C, H, L]
    k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
    cum = torch.cumsum(gc, dim=-2)                                            # [C, H, L, K]
    upper = torch.ones(L, L, dtype=torch.bool, device=dev).triu(1)
    # D [C, H, L, L, K]: exp(G_i - G_j) on and below the diagonal, 0 above (exponent -inf)
    diff = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(upper[..., None], float("-inf"))
    decay = torch.exp(diff)

    # intra-chunk: the UT transform (a unit lower-triangular solve) and the masked q.k "attention"
    # (the solves read only the strict lower triangle: the diagonal is taken as 1, the upper part ignored)
    ut = torch.einsum("chik,chjk,chijk->chij", k_beta, kc, decay)
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)          # [C, H, L, V]
    w = torch.linalg.solve_triangular(ut, k_beta * torch.exp(cum), upper=False, unitriangular=True)   # [C, H, L, K]
    attn = torch.einsum("chik,chjk,chijk->chij", qc, kc, decay)              # [C, H, L, L], 0 above the diagonal
    q_dec = qc * torch.exp(cum)
    k_dec = kc * torch.exp(cum[..., -1:, :] - cum)
    chunk_decay = torch.exp(cum[..., -1, :])[..., :, None]                    # [C, H, K, 1]

    return pass_chunk_states(u, w, q_dec, attn, k_dec, chunk_decay, valid, seq_idx, last_chunk_indices,
                             initial_states, t, "kda_chunk_varlen")


def kda_update_at_slots(ssm_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        g: torch.Tensor, beta: torch.Tensor, state_indices: torch.Tensor,
                        use_qk_l2norm: bool = True, *, query_start_loc: torch.Tensor | None = None,
                        num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The one-token KDA update in place at state indices (decode rows, or verify rows with
    query_start_loc / num_accepted_tokens): `gdn_update_at_slots` with g [B|T, H, K]."""
    _check_kda(q, v, g)
    return gdn_update_at_slots(ssm_state, q, k, v, g, beta, state_indices, use_qk_l2norm,
                               query_start_loc=query_start_loc, num_accepted_tokens=num_accepted_tokens)


def kda_prefill_at_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor,
                         last_chunk_indices: torch.Tensor, chunk_size: int, ssm_state: torch.Tensor,
                         state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                         use_qk_l2norm: bool = True, checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """`kda_chunk_varlen` in place at state indices (as `gdn_prefill_at_slots`: initial states read
    where has_initial_state, final states written back, `checkpoints` from the plain recurrence).
    Returns y fp32 [T, H, V]."""
    init = initial_states_at(ssm_state, state_indices, has_initial_state)      # a copy: read before the writes
    y, final = kda_chunk_varlen(q, k, v, g, beta, cu_chunk_seqlens, seq_idx, last_chunk_indices, chunk_size,
                                init, use_qk_l2norm)
    write_states_at(ssm_state, state_indices, final)
    if checkpoints is not None and checkpoints.token_index.numel() > 0:
        cu = cu_chunk_seqlens.to(device=v.device, dtype=torch.int64)
        ends = cu[last_chunk_indices.to(device=v.device, dtype=torch.int64) + 1]
        cu_seqlens = torch.cat([ends.new_zeros(1), ends])
        write_states_at(ssm_state, checkpoints.slots,
                        gdn_states_after(q, k, v, g, beta, cu_seqlens, init, checkpoints.token_index,
                                         use_qk_l2norm))
    return y
