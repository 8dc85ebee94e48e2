"""The ops a model's forward calls, as one of two interchangeable sets with the same signatures:
`TORCH_OPS` (plain torch, every platform: the references, `toolkit/kernels/*_ref.py`) and the
Triton kernels beside them (`triton_ops()`). Every layer that calls ops starts with TORCH_OPS;
`set_ops(model, ops)` hands a set to every layer (the runner does, for its backend).

Recurrent-state ops work *in place at state indices*, as vLLM's kernels do: they read a row's
initial state from `cache[state_indices[row]]` and write its new state back there. A state index of
PAD_SLOT_ID (-1) marks a padded row: no state is read or written; a padded decode row's output is 0,
a padded prefill sequence is computed from a zero state (the profile run relies on it).

    conv_update(x [B, Dc], conv_state [S, K-1, Dc], state_indices [B], weight [Dc, K], bias, act)
        -> out [B, Dc] (x.dtype)                                      one token per row
    conv_prefill(x [T, Dc], conv_state, state_indices [P], has_initial_state [P], cu_seqlens [P+1],
                 weight, bias, act, checkpoints=None) -> out [T, Dc]  P sequences back to back
    mamba1_update(ssm_state [S, Di, N], x [B, Di], dt [B, Di], A [Di, N], B [B, N], C [B, N], D,
                  state_indices) -> y fp32 [B, Di]
    mamba1_scan(x [T, Di], dt [T, Di], A, B [T, N], C [T, N], D, cu_seqlens [P+1],
                ssm_state, state_indices [P], has_initial_state [P], checkpoints=None) -> y fp32 [T, Di]
    mamba2_update(ssm_state [S, H, P, N], x [B, H, P], dt [B, H], A [H], B [B, G, N], C, D,
                  state_indices, dt_bias [H] | None = None, dt_limit = None) -> y fp32 [B, H, P]
        with dt_bias, dt is raw and prepared inside (mamba2_dt below)
    ssd_scan(x [T, H, P], dt [T, H], A, B [T, G, N], C, D, cu_chunk_seqlens [C+1], seq_idx [C],
             last_chunk_indices [P], chunk_size, ssm_state, state_indices [P],
             has_initial_state [P], checkpoints=None) -> y fp32 [T, H, P]
        checkpoints (kernels/state_slots_ref.Checkpoints: token_index int64 [M], slots [M]; prefix
        caching's internal checkpoints): conv_prefill, mamba1_scan, ssd_scan and gdn_prefill (below)
        also write the state after token token_index[m] to slot slots[m] (-1: nothing); for
        ssd_scan each such token ends a chunk
    write_kv_cache(kv_cache, k [N, Hkv, D], v, slot_mapping [N]) -> None
    paged_attention(q [T, Hq, D], kv_cache, md: PagedAttentionMetadata, scale, sliding_window=None)
        -> out [T, Hq, D]   (sliding_window W: the query at p sees keys p - W + 1 .. p)
    gumbel_argmax(scaled [B, V] fp32, seeds int64 [B, 2], positions [B]) -> int64 [B]
        argmax(scaled + gumbel(seed, position, token)) (see toolkit/sampling.py)
    gdn_update(ssm_state [S, Hv, V, K], q [B, Hk, K], k, v [B, Hv, V], g [B, Hv], beta [B, Hv],
               state_indices [B], use_qk_l2norm=True) -> y fp32 [B, Hv, V]      (Gated DeltaNet decode)
    gdn_prefill(q [T, Hk, K], k, v [T, Hv, V], g [T, Hv], beta [T, Hv], cu_chunk_seqlens [C+1],
                seq_idx [C], last_chunk_indices [P], chunk_size, ssm_state, state_indices [P],
                has_initial_state [P], use_qk_l2norm=True, checkpoints=None) -> y fp32 [T, Hv, V]
        q, k raw (l2-normalised and q scaled inside the op); g is the fp32 log decay; checkpoints
        as for mamba1_scan (any token, chunk end or not)
    kda_update, kda_prefill: as gdn_update / gdn_prefill, for Kimi Delta Attention: g [n, H, K] (a log
        decay per key channel) and as many key heads as value heads (kda_ref.py)
    mlstm_update(C_state [S, H, K, V], n_state [S, H, K], m_state [S, H], q [B, H, K], k, v [B, H, V],
                 i [B, H], f [B, H], state_indices [B], eps=1e-6) -> h fp32 [B, H, V]     (xLSTM's mLSTM decode)
    mlstm_prefill(q [T, H, K], k, v [T, H, V], i [T, H], f [T, H], cu_seqlens [P+1], C_state, n_state,
                  m_state, state_indices [P], has_initial_state [P], eps=1e-6, checkpoints=None)
        -> h fp32 [T, H, V]
        i, f: the soft-capped gate pre-activations; q scaled by K ** -0.5 inside; three fp32 states
        (mlstm_ref.py); checkpoints as for mamba1_scan (any token). Triton: kernels/mlstm.py (the
        prefill sequential over a sequence's tokens, as the reference)
    rms_norm(x [..., D], weight [D], eps) -> [..., D]                   (rms_norm_ref.rms_norm)
    rms_norm_gated(x [..., D], gate | None, weight [D], group_size, eps, norm_before_gate,
                   cast_normed, out_dtype | None) -> [..., D]           (rms_norm_ref.rms_norm_gated_op)
    mamba2_dt(dt_raw [T, H], dt_bias [H], dt_limit (lo, hi) | None) -> fp32 [T, H]
        clamp(softplus(dt_raw + dt_bias), lo, hi)
    rotary(positions [T], q [T, Hq, D], k [T, Hkv, D], inv_freq fp32 [R/2], scaling, rotary_dim R)
        -> (q, k) with RoPE on their first R channels                   (rotary_ref.apply_rotary)
    silu_and_mul(gate [..., D], up [..., D]) -> silu(gate) * up          (activation_ref.silu_and_mul)

The Triton set does each of these in one launch, which is what a CUDA-graph decode step needs:
its time at batch 1 is the number of kernels times a few microseconds (benchmarks/launch_count.py).

Verify rows (speculative decoding): conv_update, mamba1_update, mamba2_update, gdn_update and mlstm_update also
take the keywords query_start_loc [R+1] and num_accepted_tokens [R], with state_indices [R, 1 + k]
(a row's state columns) and per-token inputs [T, ...]: every row's 1 + k tokens at most in one call,
starting from column num_accepted - 1, the state after token j left in column j
(kernels/state_slots_ref.step_rows_at_columns); outputs [T, ...].

dt is already softplus'ed (and clamped) unless an op takes dt_bias; A is already -exp(A_log). SSM math is fp32.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.config import triton_installed
from toolkit.kernels import (
    activation_ref,
    causal_conv1d_ref,
    gated_delta_rule_ref,
    gumbel_ref,
    kda_ref,
    kv_cache_ref,
    mlstm_ref,
    paged_attention_ref,
    rms_norm_ref,
    rotary_ref,
    selective_scan_ref,
    selective_state_update_ref,
    ssd_scan_ref,
)


@dataclass(frozen=True)
class Ops:
    name: str                    # "torch" or "triton": what the StepRecord reports
    conv_update: Callable
    conv_prefill: Callable
    mamba1_update: Callable
    mamba1_scan: Callable
    mamba2_update: Callable
    ssd_scan: Callable
    write_kv_cache: Callable
    paged_attention: Callable
    gumbel_argmax: Callable
    gdn_update: Callable
    gdn_prefill: Callable
    kda_update: Callable
    kda_prefill: Callable
    mlstm_update: Callable
    mlstm_prefill: Callable
    rms_norm: Callable
    rms_norm_gated: Callable
    mamba2_dt: Callable
    rotary: Callable
    silu_and_mul: Callable


TORCH_OPS = Ops(
    name="torch",
    conv_update=causal_conv1d_ref.conv_update_at_slots,
    conv_prefill=causal_conv1d_ref.conv_prefill_at_slots,
    mamba1_update=selective_scan_ref.mamba1_update_at_slots,
    mamba1_scan=selective_scan_ref.mamba1_scan_at_slots,
    mamba2_update=selective_state_update_ref.mamba2_update_at_slots,
    ssd_scan=ssd_scan_ref.ssd_scan_at_slots,
    write_kv_cache=kv_cache_ref.write_kv_cache,
    paged_attention=paged_attention_ref.paged_attention_ref,
    gumbel_argmax=gumbel_ref.gumbel_argmax_ref,
    gdn_update=gated_delta_rule_ref.gdn_update_at_slots,
    gdn_prefill=gated_delta_rule_ref.gdn_prefill_at_slots,
    kda_update=kda_ref.kda_update_at_slots,
    kda_prefill=kda_ref.kda_prefill_at_slots,
    mlstm_update=mlstm_ref.mlstm_update_at_slots,
    mlstm_prefill=mlstm_ref.mlstm_prefill_at_slots,
    rms_norm=rms_norm_ref.rms_norm,
    rms_norm_gated=rms_norm_ref.rms_norm_gated_op,
    mamba2_dt=selective_state_update_ref.mamba2_dt,
    rotary=rotary_ref.apply_rotary,
    silu_and_mul=activation_ref.silu_and_mul,
)


def triton_ops(device: torch.device) -> Ops:
    """The Triton kernels. On a CPU they run under the Triton interpreter (TRITON_INTERPRET=1), slow
    and meant for tests. Triton reads the variable when it is imported, so it is set here when
    nothing has imported triton yet, and refused with the reason when something has."""
    if not triton_installed():
        raise ValueError("backend='triton' but triton is not installed (no wheels for macOS and "
                         "Windows); use backend='auto' or 'torch'")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise ValueError("backend='triton' on the CPU runs the Triton interpreter, which needs "
                             "TRITON_INTERPRET=1 before triton is imported; triton was imported without "
                             "it. Set the variable at the top of the script or notebook.")
        os.environ["TRITON_INTERPRET"] = "1"
    # imported here, not at the top: triton may be missing (macOS, Windows), and on a CPU it must
    # be imported after TRITON_INTERPRET is set above
    from toolkit.kernels import (
        activation,
        causal_conv1d,
        gated_delta_rule,
        gumbel,
        kda,
        kv_cache,
        mlstm,
        paged_attention,
        rms_norm,
        rotary,
        selective_scan,
        selective_state_update,
        ssd_scan,
    )
    return Ops(
        name="triton",
        conv_update=causal_conv1d.causal_conv1d_update,
        conv_prefill=causal_conv1d.causal_conv1d_prefill,
        mamba1_update=selective_scan.selective_state_update,
        mamba1_scan=selective_scan.selective_scan,
        mamba2_update=selective_state_update.selective_state_update,
        ssd_scan=ssd_scan.ssd_scan,
        write_kv_cache=kv_cache.write_kv_cache,
        paged_attention=paged_attention.paged_attention,
        gumbel_argmax=gumbel.gumbel_argmax,
        gdn_update=gated_delta_rule.gdn_update,
        gdn_prefill=gated_delta_rule.gdn_prefill,
        kda_update=kda.kda_update,
        kda_prefill=kda.kda_prefill,
        mlstm_update=mlstm.mlstm_update,
        mlstm_prefill=mlstm.mlstm_prefill,
        rms_norm=rms_norm.rms_norm,
        rms_norm_gated=rms_norm.rms_norm_gated,
        mamba2_dt=selective_state_update.mamba2_dt,
        rotary=rotary.apply_rotary,
        silu_and_mul=activation.silu_and_mul,
    )


def set_ops(model: nn.Module, ops: Ops) -> None:
    """Give every layer that calls ops (it has an `ops` attribute) this set."""
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
