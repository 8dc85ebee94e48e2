"""xLSTM's mLSTM (matrix LSTM) recurrence, in place at state indices: the decode update (and verify
rows) and the varlen prefill, their Triton kernels and launchers, and the torch references they must
equal (`mlstm_ref.py`: `mlstm_update_at_slots`, `mlstm_prefill_at_slots`, same signatures).

Notation: B decode rows, T prefill tokens, P prefill sequences, S cache slots, H heads, K = qk head
dim, V = v head dim.

Shared: three fp32 state caches, updated in place (mlstm_ref.py's layout):
    c_state [S, H, K, V]   the matrix memory (k v^T), last dim contiguous, any other strides
    n_state [S, H, K]      the normaliser, last dim contiguous
    m_state [S, H]         the stabiliser (a log scale), any strides
q, k [n, H, K] and v [n, H, V] as the projections give them (any row / head strides, last dim
contiguous); i, f [n, H] the soft-capped input / forget gate pre-activations (any strides); inputs
bf16 / fp16 / fp32, all math fp32. Inside the kernels, per token and head, as `mlstm_ref.mlstm_step`:
    log_f = logsigmoid(f);   m' = max(log_f + m, i)
    C' = exp(log_f + m - m') C + exp(i - m') k v^T;   n' = exp(log_f + m - m') n + exp(i - m') k
    h  = (q' C') / (max(|q' . n'|, exp(-m')) + eps),   q' = q * K ** -0.5
PAD_SLOT_ID = -1 marks a padded row / sequence.

mlstm_update (decode, reference `mlstm_update_at_slots`): q, k [B, H, K]; v [B, H, V]; i, f [B, H];
state_indices int [B]. Row b reads and writes slot state_indices[b]; -1: h = 0, nothing read or
written. Returns h fp32 [B, H, V].
Verify rows (speculative decoding; state_slots_ref.step_rows_at_columns, as gated_delta_rule.py):
with query_start_loc int [R+1] and num_accepted_tokens int [R] (both or neither), state_indices is
int [R, J] (J = 1 + k columns) and the inputs are [T, ...]; row r starts from the slot in column
num_accepted_tokens[r] - 1, runs its tokens in order and leaves the state after its j-th token in
the slot of column j (-1: not written). state_indices[r, 0] == -1: a padding row, h = 0, nothing read
or written. Returns h fp32 [T, H, V] (0 at tokens no real row computes).

mlstm_prefill (varlen prefill, reference `mlstm_prefill_at_slots`): q, k [T, H, K]; v [T, H, V];
i, f [T, H]; cu_seqlens int [P+1] (sequence p owns tokens cu_seqlens[p] : cu_seqlens[p+1]);
state_indices int [P]; has_initial_state bool/int [P]. Sequence p starts from its slot's state if
has_initial_state[p] and the index is not -1, else from zeros (HF's fresh state); its final state is
written back there (nothing for -1; its h is still computed, from zeros, as the reference does: the
profile run relies on it). checkpoints (state_slots_ref.Checkpoints or None; prefix caching's internal
checkpoints): besides the final states, the state after token token_index[m] goes to slot slots[m]
(-1: nothing); the launcher scatters them into a per-token save-slot array (int32 [T], -1 = none; on
the device, no host sync) and the kernel (HAS_CKPT) stores its state after that token there.
Returns h fp32 [T, H, V].

Kernels: one program per (row or sequence, head) walks the head's V in blocks, a [BLOCK_K, BLOCK_V]
tile of C in registers at a time (BLOCK_K = K rounded up to a power of 2, masked; BLOCK_V so a tile
is at most 8192 fp32 values: 32 at xLSTM-7b's K = 256, V = 512). n [K] and m do not depend on v:
the program reads them once, before it writes anything, keeps them in registers, and redoes their
recurrence for every block of V (with a row's or sequence's tokens inside the block's loop),
storing them from the first block only. Not a program per block of V: n and m are shared by all the
blocks of a head and updated in place, so a block that read them after another had stored its new
ones would step from the wrong state (on a GPU a race between programs; under the interpreter, which
runs programs in order, always). A decode row computes n and m once, then C block by block. The
prefill kernel is the plain recurrence, sequential over a sequence's tokens (not HF's chunkwise form,
which regroups the same recurrence): exact, but a long prompt is one long loop per program, per
block of V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher_checks import (
    check_checkpoints,
    check_devices,
    check_index,
    check_verify_rows,
    token_save_slots,
    verify_launch_args,
)
from .mlstm_ref import MLSTM_EPS
from .state_slots import verify_row, zero_uncomputed_outputs
from .state_slots_ref import Checkpoints

TILE_ELEMENTS = 8192       # a [BLOCK_K, BLOCK_V] fp32 state tile holds at most this many values


@triton.jit
def _load_nm(n_ptr, m_ptr, slot, k_bound, h, kk, n_slot, n_head, m_slot, m_head):
    """(n [BLOCK_K], m) of head h in `slot`, fp32; zeros where k_bound is 0 (a scalar condition folded
    into the K bound: the interpreter cannot AND a scalar into a mask). m is read by lane 0 of a
    [BLOCK_K] load (the others masked) and summed out: exact."""
    s = tl.maximum(slot, 0)
    n = tl.load(n_ptr + s * n_slot + h * n_head + kk, mask=kk < k_bound, other=0.0).to(tl.float32)
    m = tl.sum(tl.load(m_ptr + s * m_slot + h * m_head + kk * 0, mask=kk < tl.minimum(k_bound, 1),
                       other=0.0).to(tl.float32), axis=0)
    return n, m


@triton.jit
def _store_nm(n_ptr, m_ptr, n, m, slot, k_bound, h, kk, n_slot, n_head, m_slot, m_head):
    """Store n and m (through lane 0 of a [BLOCK_K] store) where k_bound is K; 0: nothing."""
    s = tl.maximum(slot, 0)
    tl.store(n_ptr + s * n_slot + h * n_head + kk, n, mask=kk < k_bound)
    tl.store(m_ptr + s * m_slot + h * m_head + kk * 0, tl.zeros_like(n) + m, mask=kk < tl.minimum(k_bound, 1))


@triton.jit
def _c_tile(c_ptr, slot, h, kk, vv, c_slot, c_head, c_k):
    return c_ptr + tl.maximum(slot, 0) * c_slot + h * c_head + kk[:, None] * c_k + vv[None, :]


@triton.jit
def _mlstm_gates(n, m, q_tok, k_tok, i_tok, f_tok, kk, mk, scale, eps):
    """One token's normaliser and stabiliser step (independent of v): from n [BLOCK_K], m and the
    *_tok pointers at the token's q, k rows of the head and its i, f. Returns (n', m', q', k, decay,
    gain, denom): the memory's step is C' = decay C + gain k v^T, h = q' C' / denom."""
    q = tl.load(q_tok + kk, mask=mk, other=0.0).to(tl.float32) * scale
    k = tl.load(k_tok + kk, mask=mk, other=0.0).to(tl.float32)
    ig = tl.load(i_tok).to(tl.float32)
    fg = tl.load(f_tok).to(tl.float32)
    # logsigmoid(f) = min(f, 0) - log1p(exp(-|f|)), log1p(z) computed accurately as log(u) * z / (u - 1)
    z = tl.exp(-tl.abs(fg))
    u = 1.0 + z
    log1p = tl.where(u == 1.0, z, tl.log(u) * (z / tl.where(u == 1.0, 1.0, u - 1.0)))
    log_f = tl.minimum(fg, 0.0) - log1p
    m_new = tl.maximum(log_f + m, ig)
    decay = tl.exp(log_f + m - m_new)
    gain = tl.exp(ig - m_new)
    n = decay * n + gain * k
    denom = tl.maximum(tl.abs(tl.sum(q * n, axis=0)), tl.exp(-m_new)) + eps
    return n, m_new, q, k, decay, gain, denom


@triton.jit
def _mlstm_memory(c, q, k, v_tok, vv, mv, decay, gain, denom):
    """One token's step of a [BLOCK_K, BLOCK_V] tile of C (v_tok: the token's v row of the head), with
    _mlstm_gates' factors. Returns (C', h [BLOCK_V])."""
    v = tl.load(v_tok + vv, mask=mv, other=0.0).to(tl.float32)
    c = decay * c + gain * (k[:, None] * v[None, :])
    return c, tl.sum(q[:, None] * c, axis=0) / denom


@triton.jit(do_not_specialize=["num_tokens", "n_cols"])     # one compile for every token / column count
def _mlstm_update_kernel(c_ptr, n_ptr, m_ptr, q_ptr, k_ptr, v_ptr, i_ptr, f_ptr, idx_ptr, h_ptr,
                         k_dim, v_dim, scale, eps,
                         c_slot, c_head, c_k, n_slot, n_head, m_slot, m_head,
                         q_b, q_h, k_b, k_h, v_b, v_h, i_b, i_h, f_b, f_h, h_b, h_h,
                         qsl_ptr, acc_ptr, num_tokens, n_cols, idx_r, idx_c,
                         BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, IS_VERIFY: tl.constexpr):
    """Program (row, head): one token's mLSTM step on the row's slot, in place: n and m first (read
    before anything is written), then C block of V by block of V. IS_VERIFY: program (verify row,
    head), the row's tokens in a loop per block of V (n and m redone for each, from the values read
    at the start; stored by the first), the state read from column num_accepted - 1 and stored to
    column j after token j; qsl_ptr .. idx_c are the verify arguments (for a plain launch, idx_r is
    state_indices' stride)."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    mk = kk < k_dim
    if IS_VERIFY:
        start, n_run, ids, src, zero_lo, zero_hi = verify_row(qsl_ptr, acc_ptr, idx_ptr, row, idx_r, idx_c, n_cols,
                                                              num_tokens)
        read = tl.where(src >= 0, k_dim, 0)
        n0, m0 = _load_nm(n_ptr, m_ptr, src, read, h, kk, n_slot, n_head, m_slot, m_head)
        for v0 in range(0, v_dim, BLOCK_V):
            vv = v0 + tl.arange(0, BLOCK_V)
            mv = vv < v_dim
            zero_uncomputed_outputs(h_ptr + h * h_h, h_b, vv, mv, start, n_run, zero_lo, zero_hi)
            c = tl.load(_c_tile(c_ptr, src, h, kk, vv, c_slot, c_head, c_k), mask=(kk < read)[:, None] & mv[None, :],
                        other=0.0)
            n, m = n0, m0
            nm_dim = tl.where(v0 == 0, k_dim, 0)
            for j in range(0, n_run):
                t = start + j
                n, m, q, k, decay, gain, denom = _mlstm_gates(n, m, q_ptr + t * q_b + h * q_h,
                                                              k_ptr + t * k_b + h * k_h, i_ptr + t * i_b + h * i_h,
                                                              f_ptr + t * f_b + h * f_h, kk, mk, scale, eps)
                c, y = _mlstm_memory(c, q, k, v_ptr + t * v_b + h * v_h, vv, mv, decay, gain, denom)
                dst = tl.load(ids + j * idx_c).to(tl.int64)
                tl.store(_c_tile(c_ptr, dst, h, kk, vv, c_slot, c_head, c_k), c,
                         mask=(kk < tl.where(dst >= 0, k_dim, 0))[:, None] & mv[None, :])
                _store_nm(n_ptr, m_ptr, n, m, dst, tl.where(dst >= 0, nm_dim, 0), h, kk, n_slot, n_head, m_slot,
                          m_head)
                tl.store(h_ptr + t * h_b + h * h_h + vv, y, mask=mv)
        return
    slot = tl.load(idx_ptr + row * idx_r).to(tl.int64)
    if slot < 0:
        for v0 in range(0, v_dim, BLOCK_V):
            vv = v0 + tl.arange(0, BLOCK_V)
            tl.store(h_ptr + row * h_b + h * h_h + vv, tl.zeros([BLOCK_V], dtype=tl.float32), mask=vv < v_dim)
        return
    n, m = _load_nm(n_ptr, m_ptr, slot, k_dim, h, kk, n_slot, n_head, m_slot, m_head)
    n, m, q, k, decay, gain, denom = _mlstm_gates(n, m, q_ptr + row * q_b + h * q_h, k_ptr + row * k_b + h * k_h,
                                                  i_ptr + row * i_b + h * i_h, f_ptr + row * f_b + h * f_h, kk, mk,
                                                  scale, eps)
    _store_nm(n_ptr, m_ptr, n, m, slot, k_dim, h, kk, n_slot, n_head, m_slot, m_head)
    for v0 in range(0, v_dim, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        mv = vv < v_dim
        tile = _c_tile(c_ptr, slot, h, kk, vv, c_slot, c_head, c_k)
        m2 = mk[:, None] & mv[None, :]
        c, y = _mlstm_memory(tl.load(tile, mask=m2, other=0.0), q, k, v_ptr + row * v_b + h * v_h, vv, mv, decay,
                             gain, denom)
        tl.store(tile, c, mask=m2)
        tl.store(h_ptr + row * h_b + h * h_h + vv, y, mask=mv)


@triton.jit
def _mlstm_prefill_kernel(c_ptr, n_ptr, m_ptr, q_ptr, k_ptr, v_ptr, i_ptr, f_ptr, cu_ptr, idx_ptr, init_ptr,
                          save_ptr, h_ptr, k_dim, v_dim, scale, eps,
                          c_slot, c_head, c_k, n_slot, n_head, m_slot, m_head,
                          q_t, q_h, k_t, k_h, v_t, v_h, i_t, i_h, f_t, f_h, h_t, h_h, cu_s, idx_s, init_s,
                          HAS_CKPT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (sequence, head): per block of V, the recurrence over the sequence's tokens, one at a
    time, with the C tile, n and m in registers: n and m read once at the start (zeros without an
    initial state) and redone for each block of V, stored by the first; C's tile read first, written
    last (nothing for slot -1). With HAS_CKPT, a token whose save slot (save_ptr [T]) is >= 0 also
    stores the state there."""
    p = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    mk = kk < k_dim
    start = tl.load(cu_ptr + p * cu_s).to(tl.int64)
    end = tl.load(cu_ptr + (p + 1) * cu_s).to(tl.int64)
    slot = tl.load(idx_ptr + p * idx_s).to(tl.int64)
    has_init = tl.load(init_ptr + p * init_s).to(tl.int32) != 0
    # scalar conditions folded into the K bound (the interpreter cannot AND a scalar into a mask)
    read = tl.where(slot >= 0, tl.where(has_init, k_dim, 0), 0)
    write = tl.where(slot >= 0, k_dim, 0)
    n0, m0 = _load_nm(n_ptr, m_ptr, slot, read, h, kk, n_slot, n_head, m_slot, m_head)
    for v0 in range(0, v_dim, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        mv = vv < v_dim
        tile = _c_tile(c_ptr, slot, h, kk, vv, c_slot, c_head, c_k)
        c = tl.load(tile, mask=(kk < read)[:, None] & mv[None, :], other=0.0)
        n, m = n0, m0
        nm_dim = tl.where(v0 == 0, k_dim, 0)
        for t in range(start, end):
            n, m, q, k, decay, gain, denom = _mlstm_gates(n, m, q_ptr + t * q_t + h * q_h, k_ptr + t * k_t + h * k_h,
                                                          i_ptr + t * i_t + h * i_h, f_ptr + t * f_t + h * f_h, kk,
                                                          mk, scale, eps)
            c, y = _mlstm_memory(c, q, k, v_ptr + t * v_t + h * v_h, vv, mv, decay, gain, denom)
            tl.store(h_ptr + t * h_t + h * h_h + vv, y, mask=mv)
            if HAS_CKPT:
                save = tl.load(save_ptr + t).to(tl.int64)
                tl.store(_c_tile(c_ptr, save, h, kk, vv, c_slot, c_head, c_k), c,
                         mask=(kk < tl.where(save >= 0, k_dim, 0))[:, None] & mv[None, :])
                _store_nm(n_ptr, m_ptr, n, m, save, tl.where(save >= 0, nm_dim, 0), h, kk, n_slot, n_head, m_slot,
                          m_head)
        tl.store(tile, c, mask=(kk < write)[:, None] & mv[None, :])
        _store_nm(n_ptr, m_ptr, n, m, slot, tl.where(slot >= 0, nm_dim, 0), h, kk, n_slot, n_head, m_slot, m_head)


def _check_common(c_state: torch.Tensor, n_state: torch.Tensor, m_state: torch.Tensor, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor, rows: str
                  ) -> tuple[int, int, int, int]:
    """Shapes, dtypes, devices and last-dim strides shared by the launchers -> (n, H, K, V)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [{rows}, H, K], got {tuple(q.shape)}")
    n, nh, kd = q.shape
    if tuple(k.shape) != (n, nh, kd):
        raise ValueError(f"k must be [{rows}={n}, H={nh}, K={kd}] like q, got {tuple(k.shape)}")
    if v.dim() != 3 or tuple(v.shape[:2]) != (n, nh):
        raise ValueError(f"v must be [{rows}={n}, H={nh}, V], got {tuple(v.shape)}")
    vd = v.shape[2]
    for name, x in (("i", i), ("f", f)):
        if tuple(x.shape) != (n, nh):
            raise ValueError(f"{name} must be [{rows}={n}, H={nh}] (a gate pre-activation per head), "
                             f"got {tuple(x.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("i", i), ("f", f)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    for name, x, shape in (("c_state", c_state, f"[S, H={nh}, K={kd}, V={vd}]"),
                           ("n_state", n_state, f"[S, H={nh}, K={kd}]"), ("m_state", m_state, f"[S, H={nh}]")):
        want = {"c_state": (nh, kd, vd), "n_state": (nh, kd), "m_state": (nh,)}[name]
        if x.dim() != len(want) + 1 or tuple(x.shape[1:]) != want or x.shape[0] != c_state.shape[0]:
            raise ValueError(f"{name} must be {shape} (S as c_state's), got {tuple(x.shape)}")
        if x.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (the mLSTM state caches), got {x.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v), ("c_state", c_state), ("n_state", n_state)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, strides {tuple(x.stride())}")
    return n, nh, kd, vd


def _blocks(k_dim: int, v_dim: int) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_V, num_warps): the whole K in a tile (h reduces over K), V walked in blocks so
    a tile holds at most TILE_ELEMENTS fp32 values (and at most 32 columns); 8 warps above 4096."""
    block_k = triton.next_power_of_2(k_dim)
    block_v = max(1, min(triton.next_power_of_2(v_dim), TILE_ELEMENTS // block_k, 32))
    return block_k, block_v, 8 if block_k * block_v > 4096 else 4


def _state_strides(c_state: torch.Tensor, n_state: torch.Tensor, m_state: torch.Tensor) -> tuple[int, ...]:
    return (c_state.stride(0), c_state.stride(1), c_state.stride(2), n_state.stride(0), n_state.stride(1),
            m_state.stride(0), m_state.stride(1))


def _input_strides(*xs: torch.Tensor) -> tuple[int, ...]:
    return tuple(s for x in xs for s in (x.stride(0), x.stride(1)))


def mlstm_update(c_state: torch.Tensor, n_state: torch.Tensor, m_state: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor, state_indices: torch.Tensor,
                 eps: float = MLSTM_EPS, *, query_start_loc: torch.Tensor | None = None,
                 num_accepted_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher (decode, one token per row): checks shapes, dtypes, devices and strides; updates the
    three states in place at state_indices; returns h fp32 [B, H, V] (padded rows 0). With
    query_start_loc and num_accepted_tokens: the verify rows (inputs [T, ...], state_indices [R, J]),
    one launch; h fp32 [T, H, V]."""
    verify = check_verify_rows(state_indices, query_start_loc, num_accepted_tokens, v.device)
    b, nh, kd, vd = _check_common(c_state, n_state, m_state, q, k, v, i, f, "B" if verify is None else "T")
    if verify is None:
        check_index("state_indices", state_indices, b, f"B={b}")
    check_devices(v.device, c_state=c_state, n_state=n_state, m_state=m_state, q=q, k=k, i=i, f=f,
                   state_indices=state_indices)
    y = torch.empty(b, nh, vd, dtype=torch.float32, device=v.device)
    rows = b if verify is None else verify[0]
    if b == 0:
        return y
    if rows == 0:                                       # verify rows, none of them: every h is 0
        return y.zero_()
    qsl, acc, n_cols, idx_r, idx_c = verify_launch_args(state_indices, query_start_loc, num_accepted_tokens, verify)
    if verify is None:
        idx_r = state_indices.stride(0)
    block_k, block_v, warps = _blocks(kd, vd)
    _mlstm_update_kernel[(rows, nh)](
        c_state, n_state, m_state, q, k, v, i, f, state_indices, y, kd, vd, kd ** -0.5, float(eps),
        *_state_strides(c_state, n_state, m_state), *_input_strides(q, k, v, i, f, y),
        qsl, acc, b, n_cols, idx_r, idx_c,
        BLOCK_K=block_k, BLOCK_V=block_v, IS_VERIFY=verify is not None, num_warps=warps)
    return y


def mlstm_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                  cu_seqlens: torch.Tensor, c_state: torch.Tensor, n_state: torch.Tensor, m_state: torch.Tensor,
                  state_indices: torch.Tensor, has_initial_state: torch.Tensor, eps: float = MLSTM_EPS,
                  checkpoints: Checkpoints | None = None) -> torch.Tensor:
    """Launcher (varlen prefill; sequential over tokens): checks shapes, dtypes, devices and strides;
    writes each real sequence's final state into the three states in place (and, with `checkpoints`,
    the state after each checkpoint token to its slot); returns h fp32 [T, H, V].

    The sequences must tile [0, T) (the launcher cannot check tensor data without a host sync):
    tokens no sequence covers leave rows of h unwritten."""
    t, nh, kd, vd = _check_common(c_state, n_state, m_state, q, k, v, i, f, "T")
    check_index("state_indices", state_indices, None, "P")
    p = state_indices.shape[0]
    check_index("cu_seqlens", cu_seqlens, p + 1, f"P+1={p + 1}")
    check_index("has_initial_state", has_initial_state, p, f"P={p}", (torch.bool, torch.int32, torch.int64))
    check_devices(v.device, c_state=c_state, n_state=n_state, m_state=m_state, q=q, k=k, i=i, f=f,
                   cu_seqlens=cu_seqlens, state_indices=state_indices, has_initial_state=has_initial_state)
    saving = check_checkpoints(checkpoints, v.device) > 0
    y = torch.empty(t, nh, vd, dtype=torch.float32, device=v.device)
    if t == 0 or p == 0:
        return y
    save = token_save_slots(checkpoints if saving else None, t, state_indices)
    block_k, block_v, warps = _blocks(kd, vd)
    _mlstm_prefill_kernel[(p, nh)](
        c_state, n_state, m_state, q, k, v, i, f, cu_seqlens, state_indices, has_initial_state, save, y,
        kd, vd, kd ** -0.5, float(eps), *_state_strides(c_state, n_state, m_state), *_input_strides(q, k, v, i, f, y),
        cu_seqlens.stride(0), state_indices.stride(0), has_initial_state.stride(0),
        HAS_CKPT=saving, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=warps)
    return y
