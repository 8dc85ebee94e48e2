"""Kimi Delta Attention (KDA), in place at state indices: the decode update (and verify rows) and the
varlen prefill, their launchers, and the torch references they must equal (`kda_ref.py`).

KDA is the gated delta rule with one log decay per key channel: g is [n, H, K] (fp32, <= 0, last dim
contiguous) where Gated DeltaNet's is [n, Hv]; q, k and v have the same H heads. Everything else is
Gated DeltaNet's contract (see gated_delta_rule.py: ssm_state [S, H, V, K] fp32 updated in place,
state_indices with -1 for padded rows, verify rows with query_start_loc / num_accepted_tokens, the
prefill's chunk layout and checkpoints), and so are the kernels: the same Triton programs, compiled
with G_PER_K, which scales the [BLOCK_V, K] state tile column by column (exp(g) [K]) where the
per-head form scales it by one number. One program per (row or sequence, head, block of V); the
prefill is sequential over a sequence's tokens (the chunked form is the torch reference's).

kda_update (reference `kda_update_at_slots`): q, k [B, H, K]; v [B, H, V]; g [B, H, K]; beta [B, H].
kda_prefill (reference `kda_prefill_at_slots`): q, k [T, H, K]; v [T, H, V]; g [T, H, K]; beta [T, H].
"""
from __future__ import annotations

import torch

from .gated_delta_rule import delta_rule_prefill, delta_rule_update
from .state_slots_ref import Checkpoints


def _check_heads(q: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() == 3 and v.dim() == 3 and q.shape[1] != v.shape[1]:
        raise ValueError(f"KDA has as many key heads as value heads: q/k have H={q.shape[1]}, v has {v.shape[1]}")


def kda_update(ssm_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               g: torch.Tensor, beta: torch.Tensor, state_indices: torch.Tensor,
               use_qk_l2norm: bool = True, *, query_start_loc: torch.Tensor | None = None,
               num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher (decode, one token per row; or verify rows): checks shapes (g [n, H, K]), dtypes,
    devices and strides; updates `ssm_state` in place; returns y fp32 [B|T, H, V]."""
    _check_heads(q, v)
    return delta_rule_update(ssm_state, q, k, v, g, beta, state_indices, use_qk_l2norm, True,
                             query_start_loc=query_start_loc, num_accepted_tokens=num_accepted_tokens)


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor, last_chunk_indices: torch.Tensor,
                chunk_size: int, ssm_state: torch.Tensor, state_indices: torch.Tensor,
                has_initial_state: torch.Tensor, use_qk_l2norm: bool = True,
                checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """Launcher (varlen prefill; sequential over tokens): as `gdn_prefill`, with g [T, H, K]."""
    _check_heads(q, v)
    return delta_rule_prefill(q, k, v, g, beta, cu_chunk_seqlens, seq_idx, last_chunk_indices, chunk_size, ssm_state,
                              state_indices, has_initial_state, use_qk_l2norm, True, checkpoints)
