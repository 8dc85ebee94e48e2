"""Mamba2 selective state update (the decode step), in place at state indices: the Triton kernel,
its launcher and the torch reference it must equal.

state [S, H, P, N] (fp32 cache); x [B, H, P]; dt [B, H] (already softplus'ed and clamped, > 0; or raw,
with dt_bias [H] and dt_limit given: then prepared in the kernel as `mamba2_dt` does, mamba_ssm's dt_softplus);
A [H] (negative); B, C [B, G, N] (head h reads group h // (H // G)); D [H] or None;
state_indices int [B] (PAD_SLOT_ID = -1: a padded row, nothing read or written). For each real row:
    state[slot] = state[slot] * exp(dt * A) + (dt * x) outer B ;   y = state[slot] . C + D * x
Returns y fp32 [B, H, P] (padded rows 0).

Verify rows (speculative decoding, reference `mamba2_update_at_slots` with the same keywords, i.e.
state_slots_ref.step_rows_at_columns): with query_start_loc int [R+1] and num_accepted_tokens int [R]
given (both or neither), state_indices is int [R, J] (J = 1 + k state columns) and x, dt, B, C are
[T, ...], row r owning tokens query_start_loc[r] : query_start_loc[r+1] (at most J). Row r starts from
state[state_indices[r, num_accepted_tokens[r] - 1]], runs the update above token by token and after
its j-th token writes the state to state[state_indices[r, j]], carrying on from it rounded to the
cache dtype (as the one-token update leaves it). state_indices[r, 0] == -1: a padding row, y = 0,
nothing read or written. Returns y fp32 [T, H, P] (0 at tokens no real row computes). One launch,
program (row, block of heads, block of P), the row's tokens in a loop with the state tile in registers.

Also here, as every Mamba2 prefill needs it before the SSD scan: `mamba2_dt`, the
dt preparation clamp(softplus(dt_raw + dt_bias), lo, hi) in one launch (reference
selective_state_update_ref.mamba2_dt, four to five torch kernels).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher_checks import check_verify_rows, rows_per_program, tile_warps, verify_launch_args
from .state_slots import verify_row, zero_uncomputed_outputs


@triton.jit
def _prepared_dt(v, lo, hi, HAS_CLAMP: tl.constexpr):
    """clamp(softplus(v), lo, hi) for fp32 v, softplus as torch computes it (threshold 20); log1p(e)
    by Goldberg's trick, exact where 1 + e rounds to 1."""
    e = tl.exp(tl.minimum(v, 20.0))
    u = 1.0 + e
    log1p_e = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    dt = tl.where(v > 20.0, v, log1p_e)
    if HAS_CLAMP:
        dt = tl.minimum(tl.maximum(dt, lo), hi)
    return dt


def _dt_bounds(dt_limit) -> tuple[float, float, bool]:
    """(lo, hi, whether to clamp) of a time_step_limit (lo, hi) or None, as `mamba2_dt` reads it."""
    lo, hi = (float(dt_limit[0]), float(dt_limit[1])) if dt_limit is not None else (0.0, float("inf"))
    return lo, hi, lo > 0.0 or hi != float("inf")


@triton.jit
def _ssu_verify_row(state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, idx_ptr, y_ptr, dt_bias_ptr, qsl_ptr,
                    acc_ptr, row, h, p, n, mh, mp, mn, m_hp, hp, heads, heads_per_group, num_tokens, n_cols,
                    s_slot, s_head, s_p, x_b, x_h, dt_b, bc_b, bc_g, y_b, dt_lo, dt_hi, idx_r, idx_c,
                    HAS_D: tl.constexpr, DT_BIAS: tl.constexpr, DT_CLAMP: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """One verify row's tokens on a [BLOCK_H, BLOCK_P, N] state tile kept in registers
    (state_slots_ref.step_rows_at_columns): read from column num_accepted - 1, stored to column j after
    token j, and carried on rounded to the cache dtype, as the one-token update leaves it. The plain
    kernel's math."""
    start, n_run, ids, src, zero_lo, zero_hi = verify_row(qsl_ptr, acc_ptr, idx_ptr, row, idx_r, idx_c, n_cols,
                                                          num_tokens)
    zero_uncomputed_outputs(y_ptr, y_b, hp, m_hp, start, n_run, zero_lo, zero_hi)
    g = h // heads_per_group
    A = tl.load(a_ptr + h, mask=mh, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(d_ptr + h, mask=mh, other=0.0).to(tl.float32)
    if DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + h, mask=mh, other=0.0).to(tl.float32)
    m_hn = mh[:, None] & mn[None, :]
    offs = h[:, None, None] * s_head + p[None, :, None] * s_p + n[None, None, :]
    m_pn = mp[None, :, None] & mn[None, None, :]
    # scalar conditions enter masks as bounds (the interpreter cannot `&` a scalar bool into a block)
    s = tl.load(state_ptr + tl.maximum(src, 0) * s_slot + offs,
                mask=(h < tl.where(src >= 0, heads, 0))[:, None, None] & m_pn, other=0.0).to(tl.float32)
    for j in range(0, n_run):
        t = start + j
        x = tl.load(x_ptr + t * x_b + h[:, None] * x_h + p[None, :], mask=m_hp, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * dt_b + h, mask=mh, other=0.0).to(tl.float32)
        if DT_BIAS:                                          # raw dt: prepare it here (mamba2_dt)
            dt = _prepared_dt(dt + dt_bias, dt_lo, dt_hi, DT_CLAMP)
        dA = tl.exp(dt * A)
        gn = t * bc_b + g[:, None] * bc_g + n[None, :]
        Bv = tl.load(b_ptr + gn, mask=m_hn, other=0.0).to(tl.float32)
        Cv = tl.load(c_ptr + gn, mask=m_hn, other=0.0).to(tl.float32)
        s = s * dA[:, None, None] + (dt[:, None] * x)[:, :, None] * Bv[:, None, :]
        dst = tl.load(ids + j * idx_c).to(tl.int64)
        tl.store(state_ptr + tl.maximum(dst, 0) * s_slot + offs, s.to(state_ptr.dtype.element_ty),
                 mask=(h < tl.where(dst >= 0, heads, 0))[:, None, None] & m_pn)
        y = tl.sum(s * Cv[:, None, :], axis=2)
        if HAS_D:
            y += Dv[:, None] * x
        tl.store(y_ptr + t * y_b + hp, y, mask=m_hp)
        s = s.to(state_ptr.dtype.element_ty).to(tl.float32)


@triton.jit(do_not_specialize=["num_tokens", "n_cols"])     # one compile for every token / column count
def _ssu_kernel(state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, idx_ptr, y_ptr, dt_bias_ptr,
                heads, heads_per_group, head_dim, d_state,
                s_slot, s_head, s_p, x_b, x_h, dt_b, bc_b, bc_g, y_b, y_h, dt_lo, dt_hi,
                qsl_ptr, acc_ptr, num_tokens, n_cols, idx_r, idx_c,
                HAS_D: tl.constexpr, DT_BIAS: tl.constexpr, DT_CLAMP: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, IS_VERIFY: tl.constexpr):
    """Program (row, block of BLOCK_H heads, block of P): a [BLOCK_H, BLOCK_P, N] tile of the state
    (BLOCK_H > 1 only where a head's [BLOCK_P, N] tile is small: launcher_checks.rows_per_program).
    IS_VERIFY: program (verify row, block of heads, block of P), the row's tokens in a loop
    (_ssu_verify_row); qsl_ptr .. idx_c are the verify arguments (unused otherwise)."""
    row = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mh, mp, mn = h < heads, p < head_dim, n < d_state
    m_hp = mh[:, None] & mp[None, :]
    hp = h[:, None] * y_h + p[None, :]                       # y's [BLOCK_H, BLOCK_P] offsets
    if IS_VERIFY:
        _ssu_verify_row(state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, idx_ptr, y_ptr, dt_bias_ptr, qsl_ptr,
                        acc_ptr, row, h, p, n, mh, mp, mn, m_hp, hp, heads, heads_per_group, num_tokens, n_cols,
                        s_slot, s_head, s_p, x_b, x_h, dt_b, bc_b, bc_g, y_b, dt_lo, dt_hi, idx_r, idx_c,
                        HAS_D, DT_BIAS, DT_CLAMP, BLOCK_H, BLOCK_P)
        return
    slot = tl.load(idx_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(y_ptr + row * y_b + hp, tl.zeros([BLOCK_H, BLOCK_P], dtype=tl.float32), mask=m_hp)
        return
    g = h // heads_per_group
    x = tl.load(x_ptr + row * x_b + h[:, None] * x_h + p[None, :], mask=m_hp, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * dt_b + h, mask=mh, other=0.0).to(tl.float32)
    if DT_BIAS:                                              # raw dt: prepare it here (mamba2_dt)
        dt = _prepared_dt(dt + tl.load(dt_bias_ptr + h, mask=mh, other=0.0).to(tl.float32), dt_lo, dt_hi,
                          DT_CLAMP)
    dA = tl.exp(dt * tl.load(a_ptr + h, mask=mh, other=0.0).to(tl.float32))
    m_hn = mh[:, None] & mn[None, :]
    gn = row * bc_b + g[:, None] * bc_g + n[None, :]
    Bv = tl.load(b_ptr + gn, mask=m_hn, other=0.0).to(tl.float32)
    Cv = tl.load(c_ptr + gn, mask=m_hn, other=0.0).to(tl.float32)
    tile = state_ptr + slot * s_slot + h[:, None, None] * s_head + p[None, :, None] * s_p + n[None, None, :]
    m3 = m_hp[:, :, None] & mn[None, None, :]
    s = tl.load(tile, mask=m3, other=0.0).to(tl.float32)
    s = s * dA[:, None, None] + (dt[:, None] * x)[:, :, None] * Bv[:, None, :]
    tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=m3)
    y = tl.sum(s * Cv[:, None, :], axis=2)
    if HAS_D:
        y += tl.load(d_ptr + h, mask=mh, other=0.0).to(tl.float32)[:, None] * x
    tl.store(y_ptr + row * y_b + hp, y, mask=m_hp)


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
                           state_indices: torch.Tensor, dt_bias: torch.Tensor | None = None,
                           dt_limit=None, *, query_start_loc: torch.Tensor | None = None,
                           num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: checks shapes, dtypes and strides; updates `state` in place; returns y fp32.
    With dt_bias [H], dt is raw and prepared in the kernel as `mamba2_dt(dt, dt_bias, dt_limit)`.
    With query_start_loc and num_accepted_tokens: the verify rows (x, dt, B, C [T, ...],
    state_indices [R, J]), one launch; y fp32 [T, H, P]."""
    verify = check_verify_rows(state_indices, query_start_loc, num_accepted_tokens, x.device)
    rows_name = "B" if verify is None else "T"
    if state.dim() != 4:
        raise ValueError(f"state must be [S, H, P, N], got {tuple(state.shape)}")
    _, heads, head_dim, d_state = state.shape
    if x.dim() != 3 or tuple(x.shape[1:]) != (heads, head_dim):
        raise ValueError(f"x must be [{rows_name}, H={heads}, P={head_dim}], got {tuple(x.shape)}")
    b = x.shape[0]
    if tuple(dt.shape) != (b, heads):
        raise ValueError(f"dt must be [{rows_name}={b}, H={heads}], got {tuple(dt.shape)}")
    if tuple(A.shape) != (heads,) or (D is not None and tuple(D.shape) != (heads,)):
        raise ValueError(f"A and D must be [H={heads}], got {tuple(A.shape)} and "
                         f"{None if D is None else tuple(D.shape)}")
    if B.shape != C.shape or B.dim() != 3 or B.shape[0] != b or B.shape[2] != d_state:
        raise ValueError(f"B and C must be [{rows_name}={b}, G, N={d_state}], got {tuple(B.shape)} and "
                         f"{tuple(C.shape)}")
    groups = B.shape[1]
    if heads % groups:
        raise ValueError(f"H={heads} is not a multiple of the {groups} groups of B and C")
    if verify is None and (tuple(state_indices.shape) != (b,)
                           or state_indices.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"state_indices must be int32/int64 [B={b}], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    vectors = (("dt", dt), ("A", A), ("D", D), ("dt_bias", dt_bias))
    present = tuple((n, v) for n, v in vectors if v is not None)
    for name, t in (("state", state), ("x", x), ("B", B), ("C", C)) + present:
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, strides {t.stride()}")
    if B.stride() != C.stride():
        raise ValueError(f"B and C must share strides, got {B.stride()} and {C.stride()}")
    if dt_bias is not None and (tuple(dt_bias.shape) != (heads,) or dt_bias.device != x.device):
        raise ValueError(f"dt_bias must be [H={heads}] on {x.device}, got {tuple(dt_bias.shape)} on {dt_bias.device}")
    lo, hi, clamp = _dt_bounds(dt_limit)
    y = torch.empty(b, heads, head_dim, dtype=torch.float32, device=x.device)
    rows = b if verify is None else verify[0]
    if b == 0:
        return y
    if rows == 0:                                       # verify rows, none of them: every y is 0
        return y.zero_()
    qsl, acc, n_cols, idx_r, idx_c = verify_launch_args(state_indices, query_start_loc, num_accepted_tokens, verify)
    block_p, block_n = min(triton.next_power_of_2(head_dim), 32), triton.next_power_of_2(d_state)
    block_h = min(triton.next_power_of_2(heads), rows_per_program(block_p * block_n))
    _ssu_kernel[(rows, triton.cdiv(heads, block_h), triton.cdiv(head_dim, block_p))](
        state, x, dt, A, B, C, D if D is not None else A, state_indices, y,
        dt_bias if dt_bias is not None else A, heads, heads // groups, head_dim, d_state,
        state.stride(0), state.stride(1), state.stride(2), x.stride(0), x.stride(1), dt.stride(0),
        B.stride(0), B.stride(1), y.stride(0), y.stride(1), lo, hi, qsl, acc, b, n_cols, idx_r, idx_c,
        HAS_D=D is not None, DT_BIAS=dt_bias is not None, DT_CLAMP=dt_bias is not None and clamp,
        BLOCK_H=block_h, BLOCK_P=block_p, BLOCK_N=block_n, IS_VERIFY=verify is not None)
    return y


@triton.jit(do_not_specialize=["num_tokens"])      # one compile for every row count
def _dt_kernel(dt_ptr, bias_ptr, out_ptr, num_tokens, heads, stride_t, lo, hi, HAS_CLAMP: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program: BLOCK_M tokens."""
    t = (tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    h = tl.arange(0, BLOCK_H)[None, :]
    mask = (t < num_tokens) & (h < heads)
    v = (tl.load(dt_ptr + t * stride_t + h, mask=mask, other=0.0).to(tl.float32)
         + tl.load(bias_ptr + h, mask=h < heads, other=0.0).to(tl.float32))
    dt = _prepared_dt(v, lo, hi, HAS_CLAMP)
    tl.store(out_ptr + t * heads + h, dt, mask=mask)


def mamba2_dt(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_limit=None) -> torch.Tensor:
    """Launcher: dt_raw [T, H] (unit stride along H, e.g. a column slice of in_proj's output), dt_bias [H],
    dt_limit (lo, hi) or None -> fp32 [T, H]."""
    if dt_raw.dim() != 2 or dt_raw.stride(-1) != 1:
        raise ValueError(f"dt_raw must be [T, H] with unit stride along H, got {tuple(dt_raw.shape)} "
                         f"strides {dt_raw.stride()}")
    t, heads = dt_raw.shape
    if tuple(dt_bias.shape) != (heads,) or dt_bias.stride(0) != 1 or dt_bias.device != dt_raw.device:
        raise ValueError(f"dt_bias must be a contiguous [H={heads}] on {dt_raw.device}, got {tuple(dt_bias.shape)} "
                         f"on {dt_bias.device}")
    lo, hi, clamp = _dt_bounds(dt_limit)
    out = torch.empty(t, heads, dtype=torch.float32, device=dt_raw.device)
    if t:
        block_h = triton.next_power_of_2(heads)
        block_m = rows_per_program(block_h)
        _dt_kernel[(triton.cdiv(t, block_m),)](dt_raw, dt_bias, out, t, heads, dt_raw.stride(0), lo, hi,
                                               HAS_CLAMP=clamp, BLOCK_M=block_m, BLOCK_H=block_h,
                                               num_warps=tile_warps(block_m * block_h))
    return out
