"""Causal conv1d (Mamba1 / Mamba2 / short-conv front end), in place at state indices: the decode
update and the varlen prefill, their Triton kernels, launchers and the torch references they must equal.

Shared: conv_state [S, K-1, Dc] (vLLM "SD" layout, oldest first) in the model dtype;
weight [Dc, K] (e.g. the view conv1d.weight[:, 0, :]; the update needs unit stride along K, the
prefill takes any strides); bias [Dc] or None;
activation None or "silu" ("swish" is silu). Math in fp32; out in x.dtype; the state keeps its dtype.
PAD_SLOT_ID = -1 marks a padded row / sequence.

causal_conv1d_update (decode, reference `conv_update_at_slots`):
x [B, Dc] (one new token per row); state_indices int [B] (a row's slot; -1: nothing read or written,
out = 0). For each real row:
    out = act(bias + sum_k weight[:, k] * window[k]),  window = [conv_state[slot]; x]  (K inputs)
    conv_state[slot] = window[1:]
Verify rows (speculative decoding, reference `conv_update_at_slots` with the same keywords, i.e.
state_slots_ref.step_rows_at_columns): with query_start_loc int [R+1] and num_accepted_tokens int [R]
given (both or neither), state_indices is int [R, J] (J = 1 + k state columns) and x is [T, Dc], row r
owning tokens query_start_loc[r] : query_start_loc[r+1] (at most J). Row r starts from
conv_state[state_indices[r, num_accepted_tokens[r] - 1]], runs the update above token by token and
after its j-th token writes the state to conv_state[state_indices[r, j]] (each state entry is an
input cast to the cache dtype, as the one-token update leaves it). state_indices[r, 0] == -1: a
padding row, out = 0, nothing read or written. out [T, Dc]: 0 at tokens no real row computes. One
launch, program (row, block of channels), the row's tokens in a loop with the window in registers.

causal_conv1d_prefill (varlen prefill, reference `conv_prefill_at_slots`):
x [T, Dc] (P sequences back to back, row stride may exceed Dc); cu_seqlens int32/int64 [P+1]
(cu_seqlens[0] = 0, cu_seqlens[P] <= T); state_indices int32/int64 [P]; has_initial_state bool [P]
or None (None: every real sequence has one). Sequence i reads u = [init; x_i] with
init = conv_state[state_indices[i]] if has_initial_state[i] and state_indices[i] >= 0 else zeros:
    out[t] = act(bias + sum_k weight[:, k] * u[t - (K-1) + k])          (every token of x_i)
    conv_state[state_indices[i]] = the last K-1 entries of u   (a copy, cast to the cache dtype;
                                   a sequence shorter than K-1 keeps part of its initial state)
A padded sequence (state index -1) still gets outputs, from a zero initial state (as the reference
does: the profile run passes one), and writes no state. Rows of x past cu_seqlens[P] get no output
(out there is uninitialised).
checkpoints (state_slots_ref.Checkpoints or None; prefix caching's internal checkpoints):
token_index int64 [M] (increasing, never a sequence's last token), slots int [M] (-1: write nothing).
Besides the final states, conv_state[slots[m]] = the conv state after token token_index[m] (the K-1
inputs of [init; x_i] ending at it, as `causal_conv1d_ref.conv_windows_at` gathers them). The windows
depend only on x and the initial states, so the launcher gathers the initial states (torch) before
the kernel overwrites the slots, and writes the windows with torch after it: no host sync.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .causal_conv1d_ref import conv_windows_at
from .launcher_checks import check_checkpoints, check_verify_rows, verify_launch_args
from .state_slots import verify_row, zero_uncomputed_outputs
from .state_slots_ref import Checkpoints, initial_states_at, write_states_at


@triton.jit
def _conv_verify_row(x_ptr, state_ptr, idx_ptr, w_ptr, b_ptr, out_ptr, qsl_ptr, acc_ptr, row, d, mask, dim,
                     num_tokens, n_cols, stride_xb, stride_ss, stride_sk, stride_wd, stride_ob, stride_ir, stride_ic,
                     KM1: tl.constexpr, BLOCK_KM1: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """One verify row's tokens on a block of channels (state_slots_ref.step_rows_at_columns). The K-1
    window is a ring in registers, [BLOCK_KM1, BLOCK_D] fp32 (the values rounded to the cache dtype):
    before token j, logical entry k (oldest first) is physical row (j + k) % (K-1); token j's input
    replaces the oldest, row j % (K-1). The sums run in the plain kernel's order."""
    start, n_run, ids, src, zero_lo, zero_hi = verify_row(qsl_ptr, acc_ptr, idx_ptr, row, stride_ir, stride_ic, n_cols,
                                                          num_tokens)
    zero_uncomputed_outputs(out_ptr, stride_ob, d, mask, start, n_run, zero_lo, zero_hi)
    p = tl.arange(0, BLOCK_KM1)
    # scalar conditions enter masks as bounds (the interpreter cannot `&` a scalar bool into a block)
    win = tl.load(state_ptr + tl.maximum(src, 0) * stride_ss + p[:, None] * stride_sk + d[None, :],
                  mask=(p < tl.where(src >= 0, KM1, 0))[:, None] & mask[None, :], other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + d * stride_wd + KM1, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + d, mask=mask, other=0.0).to(tl.float32)
    for j in range(0, n_run):
        t = start + j
        x = tl.load(x_ptr + t * stride_xb + d, mask=mask, other=0.0).to(tl.float32)
        acc = x * w_last
        if HAS_BIAS:
            acc += bias
        for k in tl.static_range(KM1):
            u = tl.sum(tl.where(p[:, None] == (j + k) % KM1, win, 0.0), axis=0)     # logical entry k
            acc += u * tl.load(w_ptr + d * stride_wd + k, mask=mask, other=0.0).to(tl.float32)
        win = tl.where(p[:, None] == j % KM1, x.to(state_ptr.dtype.element_ty).to(tl.float32)[None, :], win)
        dst = tl.load(ids + j * stride_ic).to(tl.int64)
        logical = (p + KM1 - (j + 1) % KM1) % KM1                                      # of physical row p
        tl.store(state_ptr + tl.maximum(dst, 0) * stride_ss + logical[:, None] * stride_sk + d[None, :],
                 win.to(state_ptr.dtype.element_ty), mask=(p < tl.where(dst >= 0, KM1, 0))[:, None] & mask[None, :])
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + t * stride_ob + d, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens", "n_cols"])     # one compile for every token / column count
def _conv_update_kernel(x_ptr, state_ptr, idx_ptr, w_ptr, b_ptr, out_ptr, dim,
                        stride_xb, stride_ss, stride_sk, stride_wd, stride_ob,
                        qsl_ptr, acc_ptr, num_tokens, n_cols, stride_ir, stride_ic,
                        KM1: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_D: tl.constexpr, IS_VERIFY: tl.constexpr, BLOCK_KM1: tl.constexpr):
    """Program (row, block of channels): K-tap dot product, then shift the window into the state.
    IS_VERIFY: program (verify row, block of channels), the row's tokens in a loop (_conv_verify_row);
    qsl_ptr .. stride_ic are the verify arguments (unused otherwise)."""
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < dim
    if IS_VERIFY:
        _conv_verify_row(x_ptr, state_ptr, idx_ptr, w_ptr, b_ptr, out_ptr, qsl_ptr, acc_ptr, row, d, mask, dim,
                         num_tokens, n_cols, stride_xb, stride_ss, stride_sk, stride_wd, stride_ob, stride_ir,
                         stride_ic, KM1, BLOCK_KM1, HAS_BIAS, SILU, BLOCK_D)
        return
    slot = tl.load(idx_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(out_ptr + row * stride_ob + d, tl.zeros([BLOCK_D], dtype=tl.float32).to(out_ptr.dtype.element_ty),
                 mask=mask)
        return
    x = tl.load(x_ptr + row * stride_xb + d, mask=mask, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + d * stride_wd + KM1, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=mask, other=0.0).to(tl.float32)
    state = state_ptr + slot * stride_ss + d
    prev = tl.load(state, mask=mask, other=0.0)            # window[0], dropped after use
    acc += prev.to(tl.float32) * tl.load(w_ptr + d * stride_wd, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(1, KM1):
        cur = tl.load(state + k * stride_sk, mask=mask, other=0.0)
        acc += cur.to(tl.float32) * tl.load(w_ptr + d * stride_wd + k, mask=mask, other=0.0).to(tl.float32)
        tl.store(state + (k - 1) * stride_sk, cur, mask=mask)   # shift left by one
    tl.store(state + (KM1 - 1) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=mask)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + row * stride_ob + d, acc.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None = "silu", *, query_start_loc: torch.Tensor | None = None,
                         num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: checks shapes, dtypes and strides; updates `conv_state` in place; returns out.
    With query_start_loc and num_accepted_tokens: the verify rows (x [T, Dc], state_indices [R, J]),
    one launch; out [T, Dc]."""
    verify = check_verify_rows(state_indices, query_start_loc, num_accepted_tokens, x.device)
    if x.dim() != 2:
        raise ValueError(f"x must be [{'B' if verify is None else 'T'}, Dc], got {tuple(x.shape)}")
    b, dim = x.shape
    if conv_state.dim() != 3 or conv_state.shape[2] != dim:
        raise ValueError(f"conv_state must be [S, K-1, Dc={dim}], got {tuple(conv_state.shape)}")
    km1 = conv_state.shape[1]
    if tuple(weight.shape) != (dim, km1 + 1):
        raise ValueError(f"weight must be [Dc={dim}, K={km1 + 1}] (K-1 from conv_state), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must be [Dc={dim}], got {tuple(bias.shape)}")
    if verify is None and (tuple(state_indices.shape) != (b,)
                           or state_indices.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"state_indices must be int32/int64 [B={b}], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation={activation!r}: the kernel has None and 'silu'")
    for name, t in (("x", x), ("conv_state", conv_state), ("weight", weight)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, strides {t.stride()}")
    if km1 < 1:
        raise ValueError("a conv kernel of width 1 has no state")
    out = torch.empty_like(x)
    rows = b if verify is None else verify[0]
    if b == 0:
        return out
    if rows == 0:                                       # verify rows, none of them: every out is 0
        return out.zero_()
    block = min(triton.next_power_of_2(dim), 256)
    qsl, acc, n_cols, stride_ir, stride_ic = verify_launch_args(state_indices, query_start_loc,
                                                                 num_accepted_tokens, verify)
    _conv_update_kernel[(rows, triton.cdiv(dim, block))](
        x, conv_state, state_indices, weight, bias if bias is not None else x, out, dim,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), out.stride(0),
        qsl, acc, b, n_cols, stride_ir, stride_ic,
        KM1=km1, HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_D=block,
        IS_VERIFY=verify is not None, BLOCK_KM1=triton.next_power_of_2(km1))
    return out


# ---- varlen prefill -------------------------------------------------------------------------------
# One program per (sequence, block of channels, token split). Split j handles the sequence's token
# blocks j, j + splits, j + 2 * splits, ...; only split 0 touches the state slot: the first K-1 tokens
# (the only ones that read the initial state) lie in token block 0, and split 0 also writes the final
# state, after a CTA barrier that orders every read of the slot before the write (the initial state
# and the final state share the slot). The grid depends on shapes only: P, Dc and T.
_PREFILL_BLOCK_T = 32
_PREFILL_MAX_PROGRAMS = 512      # splits per (sequence, channel block): until about this many programs


@triton.jit
def _conv_prefill_kernel(x_ptr, state_ptr, idx_ptr, has_init_ptr, cu_ptr, w_ptr, b_ptr, out_ptr, dim,
                         stride_xt, stride_ss, stride_sk, stride_wd, stride_wk, stride_ot,
                         KM1: tl.constexpr, BLOCK_KM1: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (sequence, block of channels, token split): conv over its token blocks; split 0 also
    reads the initial state and writes the final state."""
    seq = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    md = d < dim
    start = tl.load(cu_ptr + seq).to(tl.int64)
    seqlen = (tl.load(cu_ptr + seq + 1).to(tl.int64) - start).to(tl.int32)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    # masks are built from integer bounds: the interpreter cannot `&` a scalar bool with a block of bools
    # the state is read at input positions p in [init_lo, 0): -(K-1) with an initial state, else none
    init_lo = tl.where(slot >= 0, -KM1, 0)
    if HAS_INIT_FLAGS:
        init_lo = tl.where(tl.load(has_init_ptr + seq) != 0, init_lo, 0)
    state = state_ptr + tl.maximum(slot, 0) * stride_ss + d[None, :]       # [1, BLOCK_D]; slot 0 if padded
    xcol = x_ptr + d[None, :]
    if HAS_BIAS:
        bias = tl.load(b_ptr + d, mask=md, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)

    offs_t = tl.arange(0, BLOCK_T)
    for tb in range(split, tl.cdiv(seqlen, BLOCK_T), splits):
        t = tb * BLOCK_T + offs_t                                           # position in the sequence
        mt = t < seqlen
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32) + bias[None, :]
        for k in tl.static_range(KM1 + 1):
            p = t - KM1 + k                                                 # input position: < 0 is the state
            in_x = (mt & (p >= 0))[:, None] & md[None, :]
            in_s = (mt & (p >= init_lo) & (p < 0))[:, None] & md[None, :]
            xv = tl.load(xcol + (start + tl.maximum(p, 0))[:, None] * stride_xt, mask=in_x, other=0.0)
            sv = tl.load(state + tl.maximum(p + KM1, 0)[:, None] * stride_sk, mask=in_s, other=0.0)
            u = tl.where(in_x, xv.to(tl.float32), sv.to(tl.float32))
            wk = tl.load(w_ptr + d * stride_wd + k * stride_wk, mask=md, other=0.0).to(tl.float32)
            acc += u * wk[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (start + t)[:, None] * stride_ot + d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mt[:, None] & md[None, :])

    # final state: the last K-1 entries of [init; x_i], read into registers, then written after a barrier
    j = tl.arange(0, BLOCK_KM1)
    p = seqlen - KM1 + j                                                    # input position, < 0: the state
    n_write = tl.where(split == 0, tl.where(slot >= 0, KM1, 0), 0)         # rows of the state split 0 writes
    rows = j < n_write
    in_x = (rows & (p >= 0))[:, None] & md[None, :]
    in_s = (rows & (p >= init_lo) & (p < 0))[:, None] & md[None, :]
    xv = tl.load(xcol + (start + tl.maximum(p, 0))[:, None] * stride_xt, mask=in_x, other=0.0)
    sv = tl.load(state + tl.maximum(p + KM1, 0)[:, None] * stride_sk, mask=in_s, other=0.0)
    final = tl.where(in_x, xv.to(tl.float32).to(state_ptr.dtype.element_ty), sv)   # zeros where no init
    tl.debug_barrier()                  # every thread's reads of the slot happen before any write to it
    tl.store(state + j[:, None] * stride_sk, final, mask=rows[:, None] & md[None, :])


def causal_conv1d_prefill(x: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor,
                          has_initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor,
                          weight: torch.Tensor, bias: torch.Tensor | None,
                          activation: str | None = "silu",
                          checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """Launcher: checks shapes, dtypes, devices and strides; writes the P final states into
    `conv_state` in place (and, with `checkpoints`, the state after each checkpoint token to its
    slot); returns out [T, Dc] in x.dtype."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, Dc], got {tuple(x.shape)}")
    t, dim = x.shape
    if conv_state.dim() != 3 or conv_state.shape[2] != dim:
        raise ValueError(f"conv_state must be [S, K-1, Dc={dim}], got {tuple(conv_state.shape)}")
    km1 = conv_state.shape[1]
    if km1 < 1:
        raise ValueError("a conv kernel of width 1 has no state")
    if tuple(weight.shape) != (dim, km1 + 1):
        raise ValueError(f"weight must be [Dc={dim}, K={km1 + 1}] (K-1 from conv_state), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must be [Dc={dim}], got {tuple(bias.shape)}")
    if state_indices.dim() != 1 or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices must be int32/int64 [P], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    p = state_indices.shape[0]
    if tuple(cu_seqlens.shape) != (p + 1,) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32/int64 [P+1={p + 1}], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if has_initial_state is not None and (tuple(has_initial_state.shape) != (p,)
                                          or has_initial_state.dtype != torch.bool):
        raise ValueError(f"has_initial_state must be bool [P={p}], got {has_initial_state.dtype} "
                         f"{tuple(has_initial_state.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation={activation!r}: the kernel has None and 'silu'")
    named = [("x", x), ("conv_state", conv_state), ("state_indices", state_indices),
             ("cu_seqlens", cu_seqlens), ("weight", weight), ("bias", bias), ("has_initial_state", has_initial_state)]
    for name, v in named:
        if v is not None and v.device != x.device:
            raise ValueError(f"{name} is on {v.device}, x on {x.device}: all must be on one device")
    for name, v in (("x", x), ("conv_state", conv_state)):
        if v.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, strides {tuple(v.stride())}")
    if bias is not None and bias.stride(0) != 1:
        raise ValueError(f"bias must be contiguous, stride {bias.stride(0)}")
    for name, v in (("state_indices", state_indices), ("cu_seqlens", cu_seqlens),
                    ("has_initial_state", has_initial_state)):
        if v is not None and v.numel() > 1 and v.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, stride {v.stride(0)}")
    check_checkpoints(checkpoints, x.device)
    out = torch.empty(t, dim, dtype=x.dtype, device=x.device)
    if p == 0 or t == 0:
        return out
    # checkpoint windows read the initial states, which the kernel overwrites in place: gather them first
    saving = checkpoints is not None and checkpoints.token_index.numel() > 0
    init = initial_states_at(conv_state, state_indices, has_initial_state) if saving else None
    block_d = min(triton.next_power_of_2(dim), 128)
    n_d = triton.cdiv(dim, block_d)
    splits = max(1, min(triton.cdiv(t, _PREFILL_BLOCK_T), _PREFILL_MAX_PROGRAMS // (p * n_d)))
    flags = has_initial_state.view(torch.uint8) if has_initial_state is not None else state_indices
    _conv_prefill_kernel[(p, n_d, splits)](
        x, conv_state, state_indices, flags, cu_seqlens, weight, bias if bias is not None else x, out, dim,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        KM1=km1, BLOCK_KM1=triton.next_power_of_2(km1), HAS_INIT_FLAGS=has_initial_state is not None,
        HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_T=_PREFILL_BLOCK_T, BLOCK_D=block_d)
    if saving:
        write_states_at(conv_state, checkpoints.slots,
                        conv_windows_at(x, init, cu_seqlens, checkpoints.token_index))
    return out
