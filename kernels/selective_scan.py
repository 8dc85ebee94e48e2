"""Mamba1 selective scan (varlen prefill) and selective state update (decode), in place at state
indices: the Triton kernels, their launchers and the torch references they must equal.

Notation: S state slots, Di = d_inner (channels), N = d_state, T tokens, P prefill sequences,
Bt decode rows.

selective_state_update (decode, one token per row):
    ssm_state [S, Di, N] fp32 cache (updated in place); x [Bt, Di]; dt [Bt, Di] (already softplus'ed);
    A [Di, N] (negative); B, C [Bt, N]; D [Di] or None; state_indices int [Bt] (PAD_SLOT_ID = -1:
    a padded row, nothing read or written, y = 0). For each real row, with h = ssm_state[slot]:
        h = exp(dt * A) * h + (dt * B) * x ;   y = h . C + D * x
    Returns y fp32 [Bt, Di].
    Verify rows (speculative decoding, reference `mamba1_update_at_slots` with the same keywords, i.e.
    state_slots_ref.step_rows_at_columns): with query_start_loc int [R+1] and num_accepted_tokens
    int [R] given (both or neither), state_indices is int [R, J] (J = 1 + k state columns) and x, dt,
    B, C are [T, ...], row r owning tokens query_start_loc[r] : query_start_loc[r+1] (at most J). Row r
    starts from ssm_state[state_indices[r, num_accepted_tokens[r] - 1]], runs the update above token
    by token and after its j-th token writes h to ssm_state[state_indices[r, j]].
    state_indices[r, 0] == -1: a padding row, y = 0, nothing read or written. Returns y fp32 [T, Di]
    (0 at tokens no real row computes). One launch, program (row, block of channels), the row's
    tokens in a loop with the state tile in registers.

selective_scan (varlen prefill, P sequences back to back):
    x [T, Di]; dt [T, Di]; A [Di, N]; B, C [T, N]; D [Di] or None; cu_seqlens int [P+1]
    (cu[0] == 0, cu[P] == T, non-decreasing: sequence i is tokens cu[i] .. cu[i+1]-1);
    ssm_state [S, Di, N] fp32 cache; state_indices int [P]; has_initial_state bool [P] or None
    (None: every sequence with a slot reads it). Sequence i starts from ssm_state[state_indices[i]]
    if has_initial_state[i] (and its slot is not -1) else from zeros, runs the recurrence above token
    by token (y for every token), and writes its final state back to its slot (not for slot -1; a
    zero-length sequence writes its initial state). Returns y fp32 [T, Di].
    checkpoints (state_slots_ref.Checkpoints or None; prefix caching's internal checkpoints):
    token_index int64 [M] (increasing, never a sequence's last token), slots int [M] (-1: write
    nothing). Besides the final states, ssm_state[slots[m]] = the state after token token_index[m].
    The launcher scatters them into a per-token save-slot array (int32 [T], -1 = none; on the
    device, no host sync) and the kernel (HAS_CKPT) stores its state tile to a token's save slot
    right after advancing it by that token.

x, B, C may be row-strided views (the conv output; B and C column slices of the x_proj output) in
fp32 / fp16 / bf16; every input is read as fp32 and all math is fp32. Each last dimension must be
contiguous. Slots must lie in [-1, S) and differ between rows: the launchers cannot check values
without synchronising host and device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher_checks import check_checkpoints, check_verify_rows, token_save_slots, verify_launch_args
from .state_slots import verify_row, zero_uncomputed_outputs
from .state_slots_ref import Checkpoints

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


@triton.jit
def _update_verify_row(state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, idx_ptr, y_ptr, qsl_ptr, acc_ptr,
                       row, d, n, md, mn, dim, num_tokens, n_cols, s_slot, s_sd, x_b, dt_b, a_d, b_b, c_b, y_b,
                       idx_r, idx_c, HAS_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """One verify row's tokens on a [BLOCK_D, N] state tile kept in registers (state_slots_ref.
    step_rows_at_columns): read from column num_accepted - 1, stored to column j after token j, and
    carried on rounded to the cache dtype, as the one-token update leaves it. The plain kernel's math."""
    start, n_run, ids, src, zero_lo, zero_hi = verify_row(qsl_ptr, acc_ptr, idx_ptr, row, idx_r, idx_c, n_cols,
                                                          num_tokens)
    zero_uncomputed_outputs(y_ptr, y_b, d, md, start, n_run, zero_lo, zero_hi)
    A = tl.load(a_ptr + d[:, None] * a_d + n[None, :], mask=md[:, None] & mn[None, :], other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(d_ptr + d, mask=md, other=0.0).to(tl.float32)
    # scalar conditions enter masks as bounds (the interpreter cannot `&` a scalar bool into a block)
    h = tl.load(state_ptr + tl.maximum(src, 0) * s_slot + d[:, None] * s_sd + n[None, :],
                mask=(d < tl.where(src >= 0, dim, 0))[:, None] & mn[None, :], other=0.0).to(tl.float32)
    for j in range(0, n_run):
        t = start + j
        x = tl.load(x_ptr + t * x_b + d, mask=md, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * dt_b + d, mask=md, other=0.0).to(tl.float32)
        Bv = tl.load(b_ptr + t * b_b + n, mask=mn, other=0.0).to(tl.float32)
        Cv = tl.load(c_ptr + t * c_b + n, mask=mn, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * A) * h + (dt[:, None] * Bv[None, :]) * x[:, None]
        dst = tl.load(ids + j * idx_c).to(tl.int64)
        tl.store(state_ptr + tl.maximum(dst, 0) * s_slot + d[:, None] * s_sd + n[None, :],
                 h.to(state_ptr.dtype.element_ty), mask=(d < tl.where(dst >= 0, dim, 0))[:, None] & mn[None, :])
        y = tl.sum(h * Cv[None, :], axis=1)
        if HAS_D:
            y += Dv * x
        tl.store(y_ptr + t * y_b + d, y, mask=md)
        h = h.to(state_ptr.dtype.element_ty).to(tl.float32)


@triton.jit(do_not_specialize=["num_tokens", "n_cols"])     # one compile for every token / column count
def _update_kernel(state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, idx_ptr, y_ptr,
                   dim, d_state, s_slot, s_sd, x_b, dt_b, a_d, b_b, c_b, y_b,
                   qsl_ptr, acc_ptr, num_tokens, n_cols, idx_r, idx_c,
                   HAS_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IS_VERIFY: tl.constexpr):
    """Program (row, block of channels): one [BLOCK_D, N] state tile advanced by one token.
    IS_VERIFY: program (verify row, block of channels), the row's tokens in a loop (_update_verify_row);
    qsl_ptr .. idx_c are the verify arguments (unused otherwise)."""
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    md, mn = d < dim, n < d_state
    if IS_VERIFY:
        _update_verify_row(state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, idx_ptr, y_ptr, qsl_ptr, acc_ptr,
                           row, d, n, md, mn, dim, num_tokens, n_cols, s_slot, s_sd, x_b, dt_b, a_d, b_b, c_b, y_b,
                           idx_r, idx_c, HAS_D, BLOCK_D)
        return
    m2 = md[:, None] & mn[None, :]
    slot = tl.load(idx_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(y_ptr + row * y_b + d, tl.zeros([BLOCK_D], dtype=tl.float32), mask=md)
        return
    x = tl.load(x_ptr + row * x_b + d, mask=md, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * dt_b + d, mask=md, other=0.0).to(tl.float32)
    Bv = tl.load(b_ptr + row * b_b + n, mask=mn, other=0.0).to(tl.float32)
    Cv = tl.load(c_ptr + row * c_b + n, mask=mn, other=0.0).to(tl.float32)
    A = tl.load(a_ptr + d[:, None] * a_d + n[None, :], mask=m2, other=0.0).to(tl.float32)
    tile = state_ptr + slot * s_slot + d[:, None] * s_sd + n[None, :]
    h = tl.load(tile, mask=m2, other=0.0)
    h = tl.exp(dt[:, None] * A) * h + (dt[:, None] * Bv[None, :]) * x[:, None]
    tl.store(tile, h, mask=m2)
    y = tl.sum(h * Cv[None, :], axis=1)
    if HAS_D:
        y += tl.load(d_ptr + d, mask=md, other=0.0).to(tl.float32) * x
    tl.store(y_ptr + row * y_b + d, y, mask=md)


@triton.jit
def _scan_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, cu_ptr, state_ptr, idx_ptr, init_ptr, save_ptr, y_ptr,
                 dim, d_state, x_t, dt_t, a_d, b_t, c_t, s_slot, s_sd, y_t,
                 HAS_D: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, HAS_CKPT: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (sequence, block of channels): a [BLOCK_D, N] state tile in registers, carried through
    the sequence's tokens one by one (the next token's inputs loaded ahead), then written back once.
    With HAS_CKPT, a token whose save slot (save_ptr [T]) is >= 0 also stores the tile there."""
    seq = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    md, mn = d < dim, n < d_state
    m2 = md[:, None] & mn[None, :]
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    # scalar conditions enter masks as bounds (d < where(cond, dim, 0)): the interpreter rejects a
    # scalar bool broadcast into a block mask
    has_slot = slot >= 0
    read = has_slot
    if HAS_INIT_FLAGS:
        read = read & (tl.load(init_ptr + seq) != 0)
    tile = state_ptr + tl.maximum(slot, 0) * s_slot + d[:, None] * s_sd + n[None, :]
    h = tl.load(tile, mask=(d < tl.where(read, dim, 0))[:, None] & mn[None, :], other=0.0)
    A = tl.load(a_ptr + d[:, None] * a_d + n[None, :], mask=m2, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(d_ptr + d, mask=md, other=0.0).to(tl.float32)
    # token `start`'s inputs (nothing when the sequence is empty)
    live = start < end
    md_t, mn_t = d < tl.where(live, dim, 0), n < tl.where(live, d_state, 0)
    x = tl.load(x_ptr + start * x_t + d, mask=md_t, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + start * dt_t + d, mask=md_t, other=0.0).to(tl.float32)
    Bv = tl.load(b_ptr + start * b_t + n, mask=mn_t, other=0.0).to(tl.float32)
    Cv = tl.load(c_ptr + start * c_t + n, mask=mn_t, other=0.0).to(tl.float32)
    for t in range(start, end):
        nxt = t + 1
        more = nxt < end
        md_t, mn_t = d < tl.where(more, dim, 0), n < tl.where(more, d_state, 0)
        x_n = tl.load(x_ptr + nxt * x_t + d, mask=md_t, other=0.0).to(tl.float32)
        dt_n = tl.load(dt_ptr + nxt * dt_t + d, mask=md_t, other=0.0).to(tl.float32)
        B_n = tl.load(b_ptr + nxt * b_t + n, mask=mn_t, other=0.0).to(tl.float32)
        C_n = tl.load(c_ptr + nxt * c_t + n, mask=mn_t, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * A) * h + (dt[:, None] * Bv[None, :]) * x[:, None]
        y = tl.sum(h * Cv[None, :], axis=1)
        if HAS_D:
            y += Dv * x
        tl.store(y_ptr + t * y_t + d, y, mask=md)
        if HAS_CKPT:
            save = tl.load(save_ptr + t).to(tl.int64)
            tl.store(state_ptr + tl.maximum(save, 0) * s_slot + d[:, None] * s_sd + n[None, :], h,
                     mask=(d < tl.where(save >= 0, dim, 0))[:, None] & mn[None, :])
        x, dt, Bv, Cv = x_n, dt_n, B_n, C_n
    tl.store(tile, h, mask=(d < tl.where(has_slot, dim, 0))[:, None] & mn[None, :])


def _check_common(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                  B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, rows: str) -> tuple[int, int, int]:
    """Shapes, dtypes, devices and strides shared by both launchers; returns (rows, Di, N)."""
    if ssm_state.dim() != 3:
        raise ValueError(f"ssm_state must be [S, Di, N], got {tuple(ssm_state.shape)}")
    if ssm_state.dtype != torch.float32:
        raise ValueError(f"ssm_state must be float32 (the SSM state cache), got {ssm_state.dtype}")
    _, di, n = ssm_state.shape
    if x.dim() != 2 or x.shape[1] != di:
        raise ValueError(f"x must be [{rows}, Di={di}], got {tuple(x.shape)}")
    t = x.shape[0]
    if tuple(dt.shape) != (t, di):
        raise ValueError(f"dt must be [{rows}={t}, Di={di}], got {tuple(dt.shape)}")
    if tuple(A.shape) != (di, n):
        raise ValueError(f"A must be [Di={di}, N={n}], got {tuple(A.shape)}")
    for name, v in (("B", B), ("C", C)):
        if tuple(v.shape) != (t, n):
            raise ValueError(f"{name} must be [{rows}={t}, N={n}], got {tuple(v.shape)}")
    if D is not None and tuple(D.shape) != (di,):
        raise ValueError(f"D must be [Di={di}] or None, got {tuple(D.shape)}")
    named = [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)] + ([("D", D)] if D is not None else [])
    for name, v in named:
        if v.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float32/float16/bfloat16, got {v.dtype}")
    for name, v in named + [("ssm_state", ssm_state)]:
        if v.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, strides {v.stride()}")
        if v.device != ssm_state.device:
            raise ValueError(f"{name} is on {v.device}, ssm_state on {ssm_state.device}")
    return t, di, n


def _check_index(name: str, v: torch.Tensor, length: int, what: str, dtypes: tuple[torch.dtype, ...],
                 device: torch.device) -> None:
    if tuple(v.shape) != (length,) or v.dtype not in dtypes:
        kinds = "/".join(str(dt).removeprefix("torch.") for dt in dtypes)
        raise ValueError(f"{name} must be {kinds} [{what}={length}], got {v.dtype} {tuple(v.shape)}")
    if v.device != device:
        raise ValueError(f"{name} is on {v.device}, ssm_state on {device}")
    if length > 1 and v.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, strides {v.stride()}")


def selective_state_update(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
                           state_indices: torch.Tensor, *, query_start_loc: torch.Tensor | None = None,
                           num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher (decode): checks shapes, dtypes, devices and strides; updates `ssm_state` in place at
    `state_indices`; returns y fp32 [Bt, Di] (padded rows 0). With query_start_loc and
    num_accepted_tokens: the verify rows (x, dt, B, C [T, ...], state_indices [R, J]), one launch;
    y fp32 [T, Di]."""
    verify = check_verify_rows(state_indices, query_start_loc, num_accepted_tokens, ssm_state.device)
    b, di, n = _check_common(ssm_state, x, dt, A, B, C, D, "Bt" if verify is None else "T")
    if verify is None:
        _check_index("state_indices", state_indices, b, "Bt", _INTS, ssm_state.device)
    y = torch.empty(b, di, dtype=torch.float32, device=x.device)
    rows = b if verify is None else verify[0]
    if b == 0 or di == 0:
        return y
    if rows == 0:                                       # verify rows, none of them: every y is 0
        return y.zero_()
    qsl, acc, n_cols, idx_r, idx_c = verify_launch_args(state_indices, query_start_loc, num_accepted_tokens, verify)
    block_d = min(triton.next_power_of_2(di), 64)
    _update_kernel[(rows, triton.cdiv(di, block_d))](
        ssm_state, x, dt, A, B, C, D if D is not None else A, state_indices, y,
        di, n, ssm_state.stride(0), ssm_state.stride(1), x.stride(0), dt.stride(0), A.stride(0),
        B.stride(0), C.stride(0), y.stride(0), qsl, acc, b, n_cols, idx_r, idx_c,
        HAS_D=D is not None, BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(n), IS_VERIFY=verify is not None)
    return y


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
                   state_indices: torch.Tensor, has_initial_state: torch.Tensor | None,
                   checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """Launcher (varlen prefill): checks shapes, dtypes, devices and strides; runs each sequence from its
    initial state, writes its final state to its slot in place (and, with `checkpoints`, the state
    after each checkpoint token to its slot); returns y fp32 [T, Di]."""
    t, di, n = _check_common(ssm_state, x, dt, A, B, C, D, "T")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be int32/int64 [P+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    p = cu_seqlens.shape[0] - 1
    _check_index("cu_seqlens", cu_seqlens, p + 1, "P+1", _INTS, ssm_state.device)
    _check_index("state_indices", state_indices, p, "P", _INTS, ssm_state.device)
    if has_initial_state is not None:
        _check_index("has_initial_state", has_initial_state, p, "P", (torch.bool,) + _INTS, ssm_state.device)
    saving = check_checkpoints(checkpoints, ssm_state.device) > 0
    y = torch.empty(t, di, dtype=torch.float32, device=x.device)
    if p == 0 or di == 0:
        return y
    save = token_save_slots(checkpoints if saving else None, t, state_indices)
    block_d = min(triton.next_power_of_2(di), 32)
    _scan_kernel[(p, triton.cdiv(di, block_d))](
        x, dt, A, B, C, D if D is not None else A, cu_seqlens, ssm_state, state_indices,
        has_initial_state if has_initial_state is not None else state_indices, save, y,
        di, n, x.stride(0), dt.stride(0), A.stride(0), B.stride(0), C.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), y.stride(0),
        HAS_D=D is not None, HAS_INIT_FLAGS=has_initial_state is not None, HAS_CKPT=saving,
        BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(n))
    return y
