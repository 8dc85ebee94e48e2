"""Gated DeltaNet (Qwen3-Next) gated delta rule, in place at state indices: the decode update and the
varlen prefill, their Triton kernels, launchers and the torch references they must equal.

Notation: B decode rows, T prefill tokens, R prefill sequences, NC chunks, S cache slots, Hk key
heads (q / k), Hv value heads (Hv = r * Hk: value head h reads key head h // r), K key head dim,
V value head dim.

Shared: ssm_state [S, Hv, V, K] fp32 cache (vLLM's "K-last" layout, last dim contiguous), updated
in place; q, k raw (as the conv gives them; any row / head strides, last dim contiguous); v likewise;
g fp32 log decay (<= 0) and beta (sigmoid(b), any float dtype), any strides; use_qk_l2norm: bool.
Inside the kernels, as the references do (`gdn_prepare_qk`), per token and value head:
    q, k = l2norm(q), l2norm(k)  (if use_qk_l2norm; x * rsqrt(sum x^2 + 1e-6));   q = q * K ** -0.5
    S    = exp(g) * S;   S = S + beta * (v - S k) k^T;   y = S q          (S [V, K], all fp32)
PAD_SLOT_ID = -1 marks a padded row / sequence.

gdn_update (decode, reference `gdn_update_at_slots`): q, k [B, Hk, K]; v [B, Hv, V]; g, beta [B, Hv];
state_indices int [B]. Row i reads and writes ssm_state[state_indices[i]]; -1: y = 0, nothing
read or written. Returns y fp32 [B, Hv, V].
Verify rows (speculative decoding, reference `gdn_update_at_slots` with the same keywords, i.e.
state_slots_ref.step_rows_at_columns): with query_start_loc int [R+1] and num_accepted_tokens int [R]
given (both or neither), state_indices is int [R, J] (J = 1 + k state columns) and q, k, v, g, beta
are [T, ...], row r owning tokens query_start_loc[r] : query_start_loc[r+1] (at most J). Row r starts
from ssm_state[state_indices[r, num_accepted_tokens[r] - 1]], runs the update token by token and
after its j-th token writes S to ssm_state[state_indices[r, j]]. state_indices[r, 0] == -1: a padding
row, y = 0, nothing read or written. Returns y fp32 [T, Hv, V] (0 at tokens no real row computes).
One launch, program (row, value head, block of V), the row's tokens in a loop with the state tile in
registers (as vLLM's fused_recurrent_gated_delta_rule with num_accepted_tokens).

gdn_prefill (varlen prefill, reference `gdn_prefill_at_slots`): q, k [T, Hk, K]; v [T, Hv, V];
g, beta [T, Hv]; the chunk layout of the reference: cu_chunk_seqlens int [NC+1] (chunks tile [0, T),
never crossing a sequence), seq_idx int [NC] (checked for shape only), last_chunk_indices int [R]
(sequence i owns chunks last[i-1]+1 .. last[i], so its tokens are [cu[last[i-1]+1], cu[last[i]+1]));
chunk_size python int (checked only: the kernel is sequential over tokens and needs no chunks);
state_indices int [R]; has_initial_state bool/int [R]. Sequence i starts from
ssm_state[state_indices[i]] if has_initial_state[i] and the index is not -1, else from zeros; its
final state is written back there (nothing written for -1; its y is still computed, from zeros, as
the reference does: the profile run relies on it). Returns y fp32 [T, Hv, V].
checkpoints (state_slots_ref.Checkpoints or None; prefix caching's internal checkpoints):
token_index int64 [M] (increasing, never a sequence's last token; any token, chunk end or not),
slots int [M] (-1: write nothing). Besides the final states, ssm_state[slots[m]] = the state after
token token_index[m]. The launcher scatters them into a per-token save-slot array (int32 [T], -1 =
none; on the device, no host sync) and the kernel (HAS_CKPT) stores its state tile to a token's save
slot right after advancing it by that token.

The prefill kernel is the plain recurrence, sequential over a sequence's tokens (no chunked WY / UT
transform): one program per (sequence, value head, block of V) keeps its [BLOCK_V, K] state tile in
registers for the whole sequence. Exact, but a long prompt is one long loop per program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gated_delta_rule_ref import L2NORM_EPS
from .launcher_checks import (
    check_checkpoints,
    check_chunk_layout,
    check_devices,
    check_index,
    check_verify_rows,
    token_save_slots,
    verify_launch_args,
)
from .state_slots import verify_row, zero_uncomputed_outputs
from .state_slots_ref import Checkpoints


@triton.jit
def _prepared_qk(q_ptr, k_ptr, kk, mk, scale, eps, USE_L2NORM: tl.constexpr):
    """q, k [BLOCK_K] of one token and key head, in fp32: l2-normalised (if asked), q scaled."""
    q = tl.load(q_ptr + kk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + kk, mask=mk, other=0.0).to(tl.float32)
    if USE_L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    return q * scale, k


@triton.jit
def _delta_rule_token(s, q_tok, k_tok, v_tok, g_tok, beta_tok, kk, mk, vv, mv, scale, eps,
                      USE_L2NORM: tl.constexpr, G_PER_K: tl.constexpr):
    """One token of the gated delta rule on a fp32 [BLOCK_V, K] state tile `s` (the *_tok pointers at
    the token's q, k, v rows of its heads and its g, beta): s *= exp(g); s += beta (v - s k) (x) k.
    G_PER_K (Kimi Delta Attention, kernels/kda.py): g is a row of K log decays, one per key channel
    (the tile's columns), else one per head. Returns (the new tile, the token's prepared q)."""
    q, k = _prepared_qk(q_tok, k_tok, kk, mk, scale, eps, USE_L2NORM)
    v = tl.load(v_tok + vv, mask=mv, other=0.0).to(tl.float32)
    beta = tl.load(beta_tok).to(tl.float32)
    if G_PER_K:
        s = s * tl.exp(tl.load(g_tok + kk, mask=mk, other=0.0).to(tl.float32))[None, :]
    else:
        s = s * tl.exp(tl.load(g_tok).to(tl.float32))
    delta = (v - tl.sum(s * k[None, :], axis=1)) * beta
    return s + delta[:, None] * k[None, :], q


@triton.jit
def _gdn_verify_row(state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, idx_ptr, y_ptr, qsl_ptr, acc_ptr,
                    row, h, vv, kk, mv, mk, heads_per_k, v_dim, scale, eps, num_tokens, n_cols,
                    s_slot, s_head, s_v, q_b, q_h, k_b, k_h, v_b, v_h, g_b, g_h, b_b, b_h, y_b, y_h, idx_r, idx_c,
                    USE_L2NORM: tl.constexpr, BLOCK_V: tl.constexpr, G_PER_K: tl.constexpr):
    """One verify row's tokens on a [BLOCK_V, K] state tile kept in registers (state_slots_ref.
    step_rows_at_columns): read from column num_accepted - 1, stored to column j after token j, and
    carried on rounded to the cache dtype, as the one-token update leaves it. The plain kernel's math."""
    start, n_run, ids, src, zero_lo, zero_hi = verify_row(qsl_ptr, acc_ptr, idx_ptr, row, idx_r, idx_c, n_cols,
                                                          num_tokens)
    zero_uncomputed_outputs(y_ptr + h * y_h, y_b, vv, mv, start, n_run, zero_lo, zero_hi)
    hk = h // heads_per_k
    offs = h * s_head + vv[:, None] * s_v + kk[None, :]
    # scalar conditions folded into the V bound (the interpreter cannot AND a scalar into a mask)
    s = tl.load(state_ptr + tl.maximum(src, 0) * s_slot + offs,
                mask=(vv < tl.where(src >= 0, v_dim, 0))[:, None] & mk[None, :], other=0.0).to(tl.float32)
    for j in range(0, n_run):
        t = start + j
        s, q = _delta_rule_token(s, q_ptr + t * q_b + hk * q_h, k_ptr + t * k_b + hk * k_h, v_ptr + t * v_b + h * v_h,
                                 g_ptr + t * g_b + h * g_h, beta_ptr + t * b_b + h * b_h, kk, mk, vv, mv, scale, eps,
                                 USE_L2NORM, G_PER_K)
        dst = tl.load(ids + j * idx_c).to(tl.int64)
        tl.store(state_ptr + tl.maximum(dst, 0) * s_slot + offs, s.to(state_ptr.dtype.element_ty),
                 mask=(vv < tl.where(dst >= 0, v_dim, 0))[:, None] & mk[None, :])
        tl.store(y_ptr + t * y_b + h * y_h + vv, tl.sum(s * q[None, :], axis=1), mask=mv)
        s = s.to(state_ptr.dtype.element_ty).to(tl.float32)


@triton.jit(do_not_specialize=["num_tokens", "n_cols"])     # one compile for every token / column count
def _gdn_update_kernel(state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, idx_ptr, y_ptr,
                       heads_per_k, v_dim, k_dim, scale, eps,
                       s_slot, s_head, s_v, q_b, q_h, k_b, k_h, v_b, v_h, g_b, g_h, b_b, b_h, y_b, y_h,
                       qsl_ptr, acc_ptr, num_tokens, n_cols, idx_r, idx_c,
                       USE_L2NORM: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                       IS_VERIFY: tl.constexpr, G_PER_K: tl.constexpr):
    """Program (row, value head, block of V): one token's delta-rule update of a [BLOCK_V, K] state tile.
    IS_VERIFY: program (verify row, value head, block of V), the row's tokens in a loop
    (_gdn_verify_row); qsl_ptr .. idx_c are the verify arguments (unused otherwise)."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kk = tl.arange(0, BLOCK_K)
    mv, mk = vv < v_dim, kk < k_dim
    if IS_VERIFY:
        _gdn_verify_row(state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, idx_ptr, y_ptr, qsl_ptr, acc_ptr,
                        row, h, vv, kk, mv, mk, heads_per_k, v_dim, scale, eps, num_tokens, n_cols,
                        s_slot, s_head, s_v, q_b, q_h, k_b, k_h, v_b, v_h, g_b, g_h, b_b, b_h, y_b, y_h, idx_r,
                        idx_c, USE_L2NORM, BLOCK_V, G_PER_K)
        return
    slot = tl.load(idx_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(y_ptr + row * y_b + h * y_h + vv, tl.zeros([BLOCK_V], dtype=tl.float32), mask=mv)
        return
    hk = h // heads_per_k
    tile = state_ptr + slot * s_slot + h * s_head + vv[:, None] * s_v + kk[None, :]
    m2 = mv[:, None] & mk[None, :]
    s, q = _delta_rule_token(tl.load(tile, mask=m2, other=0.0).to(tl.float32), q_ptr + row * q_b + hk * q_h,
                             k_ptr + row * k_b + hk * k_h, v_ptr + row * v_b + h * v_h, g_ptr + row * g_b + h * g_h,
                             beta_ptr + row * b_b + h * b_h, kk, mk, vv, mv, scale, eps, USE_L2NORM, G_PER_K)
    tl.store(tile, s, mask=m2)
    tl.store(y_ptr + row * y_b + h * y_h + vv, tl.sum(s * q[None, :], axis=1), mask=mv)


@triton.jit
def _gdn_prefill_kernel(state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cu_ptr, last_ptr, idx_ptr, init_ptr,
                        save_ptr, y_ptr, heads_per_k, v_dim, k_dim, scale, eps,
                        s_slot, s_head, s_v, q_t, q_h, k_t, k_h, v_t, v_h, g_t, g_h, b_t, b_h, y_t, y_h,
                        USE_L2NORM: tl.constexpr, HAS_CKPT: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, G_PER_K: tl.constexpr):
    """Program (sequence, value head, block of V): the recurrence over the sequence's tokens, one at a
    time, on a [BLOCK_V, K] state tile in registers; initial state read first, final state written last.
    With HAS_CKPT, a token whose save slot (save_ptr [T]) is >= 0 also stores the tile there."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kk = tl.arange(0, BLOCK_K)
    mv, mk = vv < v_dim, kk < k_dim
    first_chunk = tl.where(i > 0, tl.load(last_ptr + tl.maximum(i - 1, 0)).to(tl.int64) + 1, 0)
    start = tl.load(cu_ptr + first_chunk).to(tl.int64)
    end = tl.load(cu_ptr + tl.load(last_ptr + i).to(tl.int64) + 1).to(tl.int64)
    slot = tl.load(idx_ptr + i).to(tl.int64)
    has_init = tl.load(init_ptr + i).to(tl.int32) != 0
    # scalar conditions folded into the V bound (the interpreter cannot AND a scalar into a mask)
    v_read = tl.where(slot >= 0, tl.where(has_init, v_dim, 0), 0)
    v_write = tl.where(slot >= 0, v_dim, 0)
    mk2 = mk[None, :]
    tile = state_ptr + tl.maximum(slot, 0) * s_slot + h * s_head + vv[:, None] * s_v + kk[None, :]
    s = tl.load(tile, mask=(vv < v_read)[:, None] & mk2, other=0.0)
    hk = h // heads_per_k
    for t in range(start, end):
        s, q = _delta_rule_token(s, q_ptr + t * q_t + hk * q_h, k_ptr + t * k_t + hk * k_h, v_ptr + t * v_t + h * v_h,
                                 g_ptr + t * g_t + h * g_h, beta_ptr + t * b_t + h * b_h, kk, mk, vv, mv, scale, eps,
                                 USE_L2NORM, G_PER_K)
        tl.store(y_ptr + t * y_t + h * y_h + vv, tl.sum(s * q[None, :], axis=1), mask=mv)
        if HAS_CKPT:
            save = tl.load(save_ptr + t).to(tl.int64)
            tl.store(state_ptr + tl.maximum(save, 0) * s_slot + h * s_head + vv[:, None] * s_v + kk[None, :], s,
                     mask=(vv < tl.where(save >= 0, v_dim, 0))[:, None] & mk2)
    tl.store(tile, s, mask=(vv < v_write)[:, None] & mk2)


def _check_common(ssm_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  g: torch.Tensor, beta: torch.Tensor, rows: str, g_per_k: bool = False
                  ) -> tuple[int, int, int, int, int, int]:
    """Shapes, dtypes and last-dim strides shared by the launchers -> (n, Hk, Hv, K, V, Hv // Hk).
    g_per_k (KDA): g is [n, Hv, K] with a contiguous last dim, else [n, Hv]."""
    if q.dim() != 3:
        raise ValueError(f"q must be [{rows}, Hk, K], got {tuple(q.shape)}")
    n, hk, kd = q.shape
    if tuple(k.shape) != (n, hk, kd):
        raise ValueError(f"k must be [{rows}={n}, Hk={hk}, K={kd}] like q, got {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != n:
        raise ValueError(f"v must be [{rows}={n}, Hv, V], got {tuple(v.shape)}")
    hv, vd = v.shape[1], v.shape[2]
    if hk == 0 or hv % hk:
        raise ValueError(f"v's Hv={hv} value heads are not a multiple of q/k's Hk={hk} key heads")
    if ssm_state.dim() != 4 or tuple(ssm_state.shape[1:]) != (hv, vd, kd):
        raise ValueError(f"ssm_state must be [S, Hv={hv}, V={vd}, K={kd}], got {tuple(ssm_state.shape)}")
    if ssm_state.dtype != torch.float32:
        raise ValueError(f"ssm_state must be float32 (the SSM state cache), got {ssm_state.dtype}")
    if g_per_k and (tuple(g.shape) != (n, hv, kd) or g.stride(-1) != 1):
        raise ValueError(f"g must be [{rows}={n}, H={hv}, K={kd}] (one log decay per key channel), contiguous in "
                         f"its last dimension, got {tuple(g.shape)} strides {tuple(g.stride())}")
    for name, x in ((("beta", beta),) if g_per_k else (("g", g), ("beta", beta))):
        if tuple(x.shape) != (n, hv):
            raise ValueError(f"{name} must be [{rows}={n}, Hv={hv}], got {tuple(x.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v), ("ssm_state", ssm_state)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, strides {tuple(x.stride())}")
    return n, hk, hv, kd, vd, hv // hk


def _blocks(k_dim: int, v_dim: int) -> tuple[int, int]:
    """(BLOCK_V, BLOCK_K): the whole K in a tile (the delta rule reduces over K), V split so a tile
    holds at most 4096 fp32 values."""
    block_k = triton.next_power_of_2(k_dim)
    return max(1, min(triton.next_power_of_2(v_dim), 4096 // block_k, 32)), block_k


def gdn_update(ssm_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               g: torch.Tensor, beta: torch.Tensor, state_indices: torch.Tensor,
               use_qk_l2norm: bool = True, *, query_start_loc: torch.Tensor | None = None,
               num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher (decode, one token per row): checks shapes, dtypes, devices and strides; updates
    `ssm_state` in place at state_indices; returns y fp32 [B, Hv, V] (padded rows 0). With
    query_start_loc and num_accepted_tokens: the verify rows (q ... beta [T, ...], state_indices
    [R, J]), one launch; y fp32 [T, Hv, V]."""
    return delta_rule_update(ssm_state, q, k, v, g, beta, state_indices, use_qk_l2norm, False,
                             query_start_loc=query_start_loc, num_accepted_tokens=num_accepted_tokens)


def delta_rule_update(ssm_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      g: torch.Tensor, beta: torch.Tensor, state_indices: torch.Tensor, use_qk_l2norm: bool,
                      g_per_k: bool, *, query_start_loc: torch.Tensor | None = None,
                      num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """`gdn_update`, and with g_per_k (g [n, Hv, K]) KDA's `kda_update`."""
    verify = check_verify_rows(state_indices, query_start_loc, num_accepted_tokens, v.device)
    b, _, hv, kd, vd, r = _check_common(ssm_state, q, k, v, g, beta, "B" if verify is None else "T", g_per_k)
    if verify is None:
        check_index("state_indices", state_indices, b, f"B={b}")
    check_devices(v.device, ssm_state=ssm_state, q=q, k=k, g=g, beta=beta, state_indices=state_indices)
    y = torch.empty(b, hv, vd, dtype=torch.float32, device=v.device)
    rows = b if verify is None else verify[0]
    if b == 0:
        return y
    if rows == 0:                                       # verify rows, none of them: every y is 0
        return y.zero_()
    qsl, acc, n_cols, idx_r, idx_c = verify_launch_args(state_indices, query_start_loc, num_accepted_tokens, verify)
    block_v, block_k = _blocks(kd, vd)
    _gdn_update_kernel[(rows, hv, triton.cdiv(vd, block_v))](
        ssm_state, q, k, v, g, beta, state_indices, y,
        r, vd, kd, kd ** -0.5, L2NORM_EPS,
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), y.stride(0), y.stride(1), qsl, acc, b, n_cols, idx_r, idx_c,
        USE_L2NORM=bool(use_qk_l2norm), BLOCK_V=block_v, BLOCK_K=block_k, IS_VERIFY=verify is not None,
        G_PER_K=g_per_k, num_warps=4)
    return y


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor, last_chunk_indices: torch.Tensor,
                chunk_size: int, ssm_state: torch.Tensor, state_indices: torch.Tensor,
                has_initial_state: torch.Tensor, use_qk_l2norm: bool = True,
                checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """Launcher (varlen prefill; sequential over tokens): checks shapes, dtypes, devices and strides;
    writes each real sequence's final state into `ssm_state` in place (and, with `checkpoints`, the
    state after each checkpoint token to its slot); returns y fp32 [T, Hv, V].

    The chunks must tile [0, T) and a sequence's chunks be consecutive (the launcher cannot check
    tensor data without a host sync): tokens no sequence covers leave rows of y unwritten.
    """
    return delta_rule_prefill(q, k, v, g, beta, cu_chunk_seqlens, seq_idx, last_chunk_indices, chunk_size, ssm_state,
                              state_indices, has_initial_state, use_qk_l2norm, False, checkpoints)


def delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor, last_chunk_indices: torch.Tensor,
                       chunk_size: int, ssm_state: torch.Tensor, state_indices: torch.Tensor,
                       has_initial_state: torch.Tensor, use_qk_l2norm: bool, g_per_k: bool,
                       checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """`gdn_prefill`, and with g_per_k (g [T, Hv, K]) KDA's `kda_prefill`."""
    t, _, hv, kd, vd, r = _check_common(ssm_state, q, k, v, g, beta, "T", g_per_k)
    nc, rows = check_chunk_layout(chunk_size, cu_chunk_seqlens, seq_idx, last_chunk_indices, state_indices,
                                  has_initial_state)
    check_devices(v.device, ssm_state=ssm_state, q=q, k=k, g=g, beta=beta, cu_chunk_seqlens=cu_chunk_seqlens,
                   seq_idx=seq_idx, last_chunk_indices=last_chunk_indices, state_indices=state_indices,
                   has_initial_state=has_initial_state)
    saving = check_checkpoints(checkpoints, v.device) > 0
    y = torch.empty(t, hv, vd, dtype=torch.float32, device=v.device)
    if t == 0 or nc == 0 or rows == 0:
        return y
    save = token_save_slots(checkpoints if saving else None, t, state_indices)
    block_v, block_k = _blocks(kd, vd)
    _gdn_prefill_kernel[(rows, hv, triton.cdiv(vd, block_v))](
        ssm_state, q, k, v, g, beta, cu_chunk_seqlens, last_chunk_indices, state_indices, has_initial_state, save,
        y, r, vd, kd, kd ** -0.5, L2NORM_EPS,
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), y.stride(0), y.stride(1),
        USE_L2NORM=bool(use_qk_l2norm), HAS_CKPT=saving, BLOCK_V=block_v, BLOCK_K=block_k, G_PER_K=g_per_k,
        num_warps=4)
    return y
