"""Mamba2 SSD chunked scan (varlen prefill), in place at state indices: the Triton kernels, their
launcher and the torch reference they must equal.

T tokens, H heads, P head_dim, N d_state, G groups (head h reads group h // (H // G)), NC chunks,
S cache slots, R sequences (prefill rows).
x [T, H, P] (any row/head strides, last dim contiguous); dt [T, H] (already softplus'ed and clamped,
any strides); A [H] (negative); B, C [T, G, N] (last dim contiguous); D [H] or None;
cu_chunk_seqlens int [NC+1]: chunk c covers tokens [cu[c], cu[c+1]) (1..chunk_size tokens, never
crossing a sequence, chunks in token order and tiling [0, T)); seq_idx int [NC]: the sequence of
each chunk (a sequence's chunks are consecutive; checked for shape only); last_chunk_indices int [R]:
the last chunk of each sequence (sequence i owns chunks last[i-1]+1 .. last[i]); chunk_size: int;
ssm_state [S, H, P, N] fp32 cache, updated in place; state_indices int [R] (PAD_SLOT_ID = -1: read
and write nothing); has_initial_state bool [R].
Sequence i starts from ssm_state[state_indices[i]] if has_initial_state[i] (and the index is not -1)
else from zeros; per token  state = state * exp(dt*A) + (dt*x) outer B ;  y = state . C + D*x.
Its final state is written back to its slot. Returns y fp32 [T, H, P] (a padded sequence still gets
its y, computed from a zero state, as the reference does).
checkpoints (state_slots_ref.Checkpoints or None; prefix caching's internal checkpoints):
token_index int64 [M] (increasing; each the last token of a chunk, never a sequence's last token),
slots int [M] (-1: write nothing). Besides the final states, ssm_state[slots[m]] = the state after
the chunk ending at token_index[m]. After launch 2, states[c] holds the state before chunk c, so that
is states[c + 1] (the next chunk of the same sequence): gathered and written with torch after the
launches (`ssd_scan_ref.chunk_ending_at`), no host sync.

Intermediates, allocated by the launcher from shapes: states fp32 [NC, H, P, N] (each chunk's own
end state, then the state before it), cum fp32 [H, T] (dA cumsum within each chunk), ends fp32
[NC, H] (dA summed over each chunk). Two sequences sharing one slot is not supported (as in vLLM).

Three launches (all math fp32):
  1. `_chunk_state_kernel` (chunk, head, P-block): cumsum of dA = dt*A within the chunk (kept for
     launch 3) and the chunk's own end state  sum_l exp(cum_end - cum_l) dt_l x_l outer B_l.
  2. `_state_passing_kernel` (sequence, block of heads, P-block): walks the sequence's chunks in order,
     overwriting each chunk's state with the state before it; reads the initial state first and
     writes the final state to the slot last (same program, same tile: no race).
  3. `_chunk_scan_kernel` (chunk, head, block of rows x P-block): the causal intra-chunk term
     (C_l . B_s) exp(cum_l - cum_s) dt_s x_s, plus exp(cum_l) C_l . state_before, plus D x_l.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher_checks import check_checkpoints, check_chunk_layout, rows_per_program
from .ssd_scan_ref import chunk_ending_at
from .state_slots_ref import Checkpoints, write_states_at


@triton.jit
def _chunk_state_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, cu_ptr, cum_ptr, end_ptr, st_ptr,
                        heads, heads_per_group, head_dim, d_state,
                        x_t, x_h, dt_t, dt_h, b_t, b_g, cum_h, st_c, st_h, st_p,
                        BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """Program (chunk, head, block of P): dA cumsum of the chunk and its [BLOCK_P, N] end-state tile."""
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    start = tl.load(cu_ptr + c).to(tl.int64)
    length = tl.load(cu_ptr + c + 1).to(tl.int64) - start
    a = tl.load(a_ptr + h).to(tl.float32)
    g = h // heads_per_group
    ar = tl.arange(0, BLOCK_L)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mp, mn = p < head_dim, n < d_state
    dt_base = dt_ptr + h * dt_h
    # pass 1: sum of dA over the chunk (the decay from each token to the chunk's end needs it)
    total = tl.zeros([BLOCK_L], dtype=tl.float32)
    for l0 in range(0, length, BLOCK_L):
        tok = start + l0 + ar
        dtv = tl.load(dt_base + tok * dt_t, mask=(l0 + ar) < length, other=0.0).to(tl.float32)
        total += dtv * a
    total_sum = tl.sum(total, axis=0)
    # pass 2: running cumsum, decay to the end, state = sum_l (w_l x_l) outer B_l
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    run = tl.sum(tl.zeros([BLOCK_L], dtype=tl.float32), axis=0)
    for l0 in range(0, length, BLOCK_L):
        ml = (l0 + ar) < length
        tok = start + l0 + ar
        dtv = tl.load(dt_base + tok * dt_t, mask=ml, other=0.0).to(tl.float32)
        dA = dtv * a
        cum = run + tl.cumsum(dA, axis=0)
        run += tl.sum(dA, axis=0)
        if pb == 0:
            tl.store(cum_ptr + h * cum_h + tok, cum, mask=ml)
        w = tl.where(ml, tl.exp(total_sum - cum) * dtv, 0.0)
        xs = tl.load(x_ptr + tok[:, None] * x_t + h * x_h + p[None, :], mask=ml[:, None] & mp[None, :],
                     other=0.0).to(tl.float32)
        bs = tl.load(b_ptr + tok[:, None] * b_t + g * b_g + n[None, :], mask=ml[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.dot(tl.trans(xs * w[:, None]), bs, input_precision=DOT_PRECISION)
    tl.store(st_ptr + c * st_c + h * st_h + p[:, None] * st_p + n[None, :], acc, mask=mp[:, None] & mn[None, :])
    if pb == 0:
        tl.store(end_ptr + c * heads + h, total_sum)


@triton.jit
def _state_passing_kernel(st_ptr, end_ptr, last_ptr, state_ptr, idx_ptr, init_ptr,
                          heads, head_dim, d_state,
                          st_c, st_h, st_p, s_slot, s_head, s_p,
                          BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (sequence, block of heads, block of P): chunk states -> states before each chunk; final
    -> slot. A [BLOCK_H, BLOCK_P, N] tile (BLOCK_H > 1 only where a head's [BLOCK_P, N] tile is small:
    launcher_checks.rows_per_program)."""
    i = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mh = h < heads
    mn = (n < d_state)[None, None, :]
    m3 = mh[:, None, None] & (p < head_dim)[None, :, None] & mn
    tile = h[:, None, None] * st_h + p[None, :, None] * st_p + n[None, None, :]
    first = tl.where(i > 0, tl.load(last_ptr + tl.maximum(i - 1, 0)).to(tl.int64) + 1, 0)
    last = tl.load(last_ptr + i).to(tl.int64)
    slot = tl.load(idx_ptr + i).to(tl.int64)
    has_init = tl.load(init_ptr + i).to(tl.int32) != 0
    # scalar conditions folded into the P bound (the interpreter cannot AND a scalar into a mask)
    p_read = tl.where(slot >= 0, tl.where(has_init, head_dim, 0), 0)
    p_write = tl.where(slot >= 0, head_dim, 0)
    m_hn = mh[:, None, None] & mn
    cache = state_ptr + tl.maximum(slot, 0) * s_slot + h[:, None, None] * s_head + p[None, :, None] * s_p + \
        n[None, None, :]
    prev = tl.load(cache, mask=(p < p_read)[None, :, None] & m_hn, other=0.0).to(tl.float32)
    for c in range(first, last + 1):
        ptrs = st_ptr + c * st_c + tile
        own = tl.load(ptrs, mask=m3, other=0.0)
        tl.store(ptrs, prev, mask=m3)
        prev = tl.exp(tl.load(end_ptr + c * heads + h, mask=mh, other=0.0))[:, None, None] * prev + own
    tl.store(cache, prev.to(state_ptr.dtype.element_ty), mask=(p < p_write)[None, :, None] & m_hn)


@triton.jit
def _chunk_scan_kernel(x_ptr, dt_ptr, b_ptr, c_ptr, d_ptr, cu_ptr, cum_ptr, st_ptr, y_ptr,
                       heads_per_group, head_dim, d_state, p_blocks,
                       x_t, x_h, dt_t, dt_h, b_t, b_g, c_t, c_g, cum_h, st_c, st_h, st_p, y_t, y_h,
                       HAS_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (chunk, head, block of rows x block of P): y rows = intra-chunk + start-state + D terms."""
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    mb = tl.program_id(2) // p_blocks
    pb = tl.program_id(2) % p_blocks
    start = tl.load(cu_ptr + c).to(tl.int64)
    length = tl.load(cu_ptr + c + 1).to(tl.int64) - start
    m0 = mb * BLOCK_M
    if m0 >= length:
        return
    g = h // heads_per_group
    row = m0 + tl.arange(0, BLOCK_M)            # the chunk's output positions l
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    ml, mp, mn = row < length, p < head_dim, n < d_state
    tok_l = start + row
    cum_l = tl.load(cum_ptr + h * cum_h + tok_l, mask=ml, other=0.0)
    cl = tl.load(c_ptr + tok_l[:, None] * c_t + g * c_g + n[None, :], mask=ml[:, None] & mn[None, :],
                 other=0.0).to(tl.float32)
    # the chunk's start state: exp(cum_l) * C_l . state_before
    st = tl.load(st_ptr + c * st_c + h * st_h + p[:, None] * st_p + n[None, :], mask=mp[:, None] & mn[None, :],
                 other=0.0)
    acc = tl.dot(cl, tl.trans(st), input_precision=DOT_PRECISION) * tl.exp(cum_l)[:, None]
    # intra-chunk, causal: sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s
    hi = tl.minimum(m0 + BLOCK_M, length)
    ks = tl.arange(0, BLOCK_K)
    for s0 in range(0, hi, BLOCK_K):
        s = s0 + ks
        ms = s < hi
        tok_s = start + s
        bs = tl.load(b_ptr + tok_s[:, None] * b_t + g * b_g + n[None, :], mask=ms[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)
        cum_s = tl.load(cum_ptr + h * cum_h + tok_s, mask=ms, other=0.0)
        dt_s = tl.load(dt_ptr + tok_s * dt_t + h * dt_h, mask=ms, other=0.0).to(tl.float32)
        keep = (row[:, None] >= s[None, :]) & ml[:, None] & ms[None, :]
        decay = tl.exp(tl.where(keep, cum_l[:, None] - cum_s[None, :], float("-inf")))
        cb = tl.dot(cl, tl.trans(bs), input_precision=DOT_PRECISION) * decay * dt_s[None, :]
        xs = tl.load(x_ptr + tok_s[:, None] * x_t + h * x_h + p[None, :], mask=ms[:, None] & mp[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.dot(cb, xs, input_precision=DOT_PRECISION)
    m2 = ml[:, None] & mp[None, :]
    if HAS_D:
        xl = tl.load(x_ptr + tok_l[:, None] * x_t + h * x_h + p[None, :], mask=m2, other=0.0).to(tl.float32)
        acc += tl.load(d_ptr + h).to(tl.float32) * xl
    tl.store(y_ptr + tok_l[:, None] * y_t + h * y_h + p[None, :], acc, mask=m2)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None, cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor,
             last_chunk_indices: torch.Tensor, chunk_size: int, ssm_state: torch.Tensor,
             state_indices: torch.Tensor, has_initial_state: torch.Tensor,
             checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """Launcher: checks shapes, dtypes, devices and strides; updates `ssm_state` in place (final states,
    and with `checkpoints` the state after each checkpoint's chunk); returns y fp32.

    Chunk lengths must be 1..chunk_size and the chunks must tile [0, T) (the launcher cannot check
    tensor data without a host sync): a longer chunk leaves rows of y unwritten.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [T, H, P], got {tuple(x.shape)}")
    t, heads, head_dim = x.shape
    if ssm_state.dim() != 4 or tuple(ssm_state.shape[1:3]) != (heads, head_dim):
        raise ValueError(f"ssm_state must be [S, H={heads}, P={head_dim}, N], got {tuple(ssm_state.shape)}")
    d_state = ssm_state.shape[3]
    if ssm_state.dtype != torch.float32:
        raise ValueError(f"ssm_state must be float32 (the SSM state cache), got {ssm_state.dtype}")
    if tuple(dt.shape) != (t, heads) or not dt.is_floating_point():
        raise ValueError(f"dt must be float [T={t}, H={heads}], got {dt.dtype} {tuple(dt.shape)}")
    if tuple(A.shape) != (heads,) or (D is not None and tuple(D.shape) != (heads,)):
        raise ValueError(f"A and D must be [H={heads}], got {tuple(A.shape)} and "
                         f"{None if D is None else tuple(D.shape)}")
    if B.shape != C.shape or B.dim() != 3 or B.shape[0] != t or B.shape[2] != d_state:
        raise ValueError(f"B and C must be [T={t}, G, N={d_state}], got {tuple(B.shape)} and {tuple(C.shape)}")
    groups = B.shape[1]
    if groups == 0 or heads % groups:
        raise ValueError(f"H={heads} is not a multiple of the {groups} groups of B and C")
    if not x.is_floating_point() or not B.is_floating_point() or not C.is_floating_point():
        raise ValueError(f"x, B and C must be floating point, got {x.dtype}, {B.dtype}, {C.dtype}")
    nc, rows = check_chunk_layout(chunk_size, cu_chunk_seqlens, seq_idx, last_chunk_indices, state_indices,
                                  has_initial_state)
    for name, v in (("x", x), ("B", B), ("C", C), ("ssm_state", ssm_state)):
        if v.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, strides {v.stride()}")
    for name, v in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("cu_chunk_seqlens", cu_chunk_seqlens),
                    ("seq_idx", seq_idx), ("last_chunk_indices", last_chunk_indices),
                    ("ssm_state", ssm_state), ("state_indices", state_indices),
                    ("has_initial_state", has_initial_state)):
        if v is not None and v.device != x.device:
            raise ValueError(f"{name} is on {v.device}, x on {x.device}: all inputs must share a device")
    check_checkpoints(checkpoints, x.device)

    dev, f32 = x.device, torch.float32
    y = torch.empty(t, heads, head_dim, dtype=f32, device=dev)
    if t == 0 or nc == 0:
        return y
    states = torch.empty(nc, heads, head_dim, d_state, dtype=f32, device=dev)  # chunk -> before-chunk states
    cum = torch.empty(heads, t, dtype=f32, device=dev)                           # dA cumsum within each chunk
    ends = torch.empty(nc, heads, dtype=f32, device=dev)                         # dA sum over each chunk

    # fp32 tl.dot: three-pass tf32 on NVIDIA keeps fp32 accuracy on tensor cores; plain fp32 elsewhere.
    # Tiles stay small (32, or 16 when N > 128): every fp32 operand of a 3xTF32 dot is split in two in
    # shared memory, and the whole [rows, N] C tile and [P, N] state tile are held per program.
    precision = "tf32x3" if dev.type == "cuda" and torch.version.hip is None else "ieee"
    block_n = max(16, triton.next_power_of_2(d_state))
    tile = 32 if block_n <= 128 else 16
    chunk_p2 = max(16, triton.next_power_of_2(chunk_size))
    block_p = max(16, min(tile, triton.next_power_of_2(head_dim)))
    block_l = block_m = block_k = min(tile, chunk_p2)
    p_blocks = triton.cdiv(head_dim, block_p)
    hpg = heads // groups
    launch = dict(num_warps=4, num_stages=2)

    _chunk_state_kernel[(nc, heads, p_blocks)](
        x, dt, A, B, cu_chunk_seqlens, cum, ends, states,
        heads, hpg, head_dim, d_state,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), cum.stride(0),
        states.stride(0), states.stride(1), states.stride(2),
        BLOCK_L=block_l, BLOCK_P=block_p, BLOCK_N=block_n, DOT_PRECISION=precision, **launch)

    if rows:
        block_ps = max(1, min(triton.next_power_of_2(head_dim), 4096 // block_n))
        block_hs = min(triton.next_power_of_2(heads), rows_per_program(block_ps * block_n))
        _state_passing_kernel[(rows, triton.cdiv(heads, block_hs), triton.cdiv(head_dim, block_ps))](
            states, ends, last_chunk_indices, ssm_state, state_indices, has_initial_state,
            heads, head_dim, d_state,
            states.stride(0), states.stride(1), states.stride(2),
            ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
            BLOCK_H=block_hs, BLOCK_P=block_ps, BLOCK_N=block_n, num_warps=4)

    _chunk_scan_kernel[(nc, heads, triton.cdiv(chunk_size, block_m) * p_blocks)](
        x, dt, B, C, D if D is not None else A, cu_chunk_seqlens, cum, states, y,
        hpg, head_dim, d_state, p_blocks,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1),
        C.stride(0), C.stride(1), cum.stride(0), states.stride(0), states.stride(1), states.stride(2),
        y.stride(0), y.stride(1),
        HAS_D=D is not None, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_P=block_p, BLOCK_N=block_n,
        DOT_PRECISION=precision, **launch)

    if checkpoints is not None and checkpoints.token_index.numel() > 0:
        # states[c + 1] is the state before chunk c + 1, i.e. after the checkpoint's chunk c
        after = chunk_ending_at(cu_chunk_seqlens, checkpoints.token_index) + 1
        write_states_at(ssm_state, checkpoints.slots, states[after])
    return y
