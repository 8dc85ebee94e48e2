"""Paged attention of a mixed batch (decode rows and varlen prefill chunks in one launch), causal,
GQA: the Triton kernel, its launcher and the torch reference it must equal.

q [T, Hq, D] (may be a view of a fused projection: last dim contiguous, other strides free);
kv_cache [num_blocks, 2, block_size, Hkv, D] (index 1: 0 = K, 1 = V), this step's K/V already
written; md: PagedAttentionMetadata (toolkit/attention/paged_attn.py):
    query_start_loc int32 [B+1]  row i's queries are tokens query_start_loc[i] .. [i+1]-1
    seq_lens        int32 [B]    context length of row i including this step's tokens
    block_table     int32 [B, M] key position n of row i lives in block block_table[i, n // block_size]
                                 at offset n % block_size
    num_reqs (B), max_query_len, max_seq_len: python ints, upper bounds for the grid
Row i's queries sit at positions seq_len - q_len .. seq_len - 1; the query at position p attends keys
0 .. p, or with `sliding_window` W keys p - W + 1 .. p only (key tiles wholly before a query block's
windows are skipped and keys before them never loaded, so released pages are never read); query head
h reads kv head h // (Hq // Hkv). Tokens at or past query_start_loc[B] (padding) get 0. Returns
out [T, Hq, D] in q.dtype; scores and softmax in fp32 (online softmax over key tiles).

Cache slots past a row's seq_len (and the null block 0 that pads a block table) are never loaded,
so whatever they hold (even NaN) cannot reach the output.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634


@triton.jit
def _round_to_tf32(x):
    """Round fp32 values >= 0 to the nearest tf32 (10 mantissa bits), so a tf32 dot is exact on them."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x1000) & -8192          # -8192 = ~0x1FFF: drop the 13 low mantissa bits, rounded
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _paged_attn_kernel(q_ptr, cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
                       num_reqs, num_tokens, block_size, max_blocks, qk_scale, window,
                       s_qt, s_qh, s_cb, s_ckv, s_cs, s_ch, s_ot, s_oh, s_bt,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       PRECISION: tl.constexpr, ROUND_P: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Program (request, block of BLOCK_M query tokens, kv head): the GROUP query heads of that kv
    head for those tokens, as BLOCK_M * BLOCK_G tile rows, against the request's key tiles up to
    the last query's position. Programs of request index num_reqs zero the padding tokens."""
    b = tl.program_id(0)
    mb = tl.program_id(1)
    kvh = tl.program_id(2)
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    tok = r // BLOCK_G                      # token within the block
    g = r % BLOCK_G                         # query head within the kv head's group
    d = tl.arange(0, BLOCK_D)
    head = kvh * GROUP + g
    head_ok = g < GROUP
    d_ok = d < HEAD_DIM

    if b == num_reqs:                       # padding tokens [query_start_loc[B], T): output 0
        pad_start = tl.load(qsl_ptr + num_reqs)
        zeros = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=out_ptr.dtype.element_ty)
        for start in range(pad_start + mb * BLOCK_M, num_tokens, tl.num_programs(1) * BLOCK_M):
            t = (start + tok).to(tl.int64)
            ok = (t < num_tokens) & head_ok
            tl.store(out_ptr + t[:, None] * s_ot + head[:, None] * s_oh + d[None, :], zeros,
                     mask=ok[:, None] & d_ok[None, :])
        return

    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    m0 = mb * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len                   # position of the row's first query token
    t = q_start + m0 + tok
    row_ok = (m0 + tok < q_len) & (t < num_tokens) & head_ok
    t = t.to(tl.int64)
    q_pos = ctx + m0 + tok
    q = tl.load(q_ptr + t[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)     # keys past the block's last query: unused
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    head_off = kvh * s_ch
    first_key = 0                           # the first key any query of the block sees
    if HAS_WINDOW:
        first_key = tl.maximum(ctx + m0 - window + 1, 0)
    for start in range((first_key // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        col = n // block_size
        n_ok = (n < kv_end) & (col < max_blocks) & (n >= first_key)   # earlier keys: maybe released pages
        blk = tl.load(bt_row + col, mask=n_ok, other=0).to(tl.int64)
        kv_off = blk * s_cb + (n % block_size) * s_cs + head_off
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(cache_ptr + s_ckv + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale     # log2 units
        valid = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if HAS_WINDOW:
            valid = valid & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep 0s, not NaN
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if ROUND_P:                         # make the tf32 dot exact: the CPU interpreter sees its rounding
            p = _round_to_tf32(p)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + t[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _tiles(max_query_len: int, max_seq_len: int, group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 16 tile rows for decode-only batches, 64 when a row has more queries."""
    block_g = triton.next_power_of_2(group)
    rows = 16 if max_query_len * block_g <= 16 else 64
    block_m = max(1, rows // block_g)
    block_n = max(16, min(64, triton.next_power_of_2(max(max_seq_len, 1))))
    return block_m, block_n


def _launch(q: torch.Tensor, kv_cache: torch.Tensor, md, scale: float, block_m: int, block_n: int,
            sliding_window: int | None = None) -> torch.Tensor:
    """Launch with given tile sizes (no checks: `paged_attention` checks, tests vary the tiles)."""
    num_tokens, hq, head_dim = q.shape
    block_size, hkv = kv_cache.shape[2], kv_cache.shape[3]
    group = hq // hkv
    out = torch.empty((num_tokens, hq, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    num_reqs = int(md.num_reqs)
    bt = md.block_table
    fp32 = q.dtype == torch.float32 or kv_cache.dtype == torch.float32
    grid = (num_reqs + 1, max(1, triton.cdiv(int(md.max_query_len), block_m)), hkv)
    _paged_attn_kernel[grid](
        q, kv_cache, out, md.query_start_loc, md.seq_lens, bt,
        num_reqs, num_tokens, block_size, bt.shape[1], float(scale) * _LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), out.stride(0), out.stride(1), bt.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        # fp32: exact fp32 dots. fp16/bf16: operands are upcast (exact in tf32) and P is rounded to
        # tf32 in the kernel, so tf32 tensor-core dots give the same numbers as the interpreter.
        PRECISION="ieee" if fp32 else "tf32", ROUND_P=not fp32, HAS_WINDOW=sliding_window is not None)
    return out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, md, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Launcher: checks shapes, dtypes, devices and strides; returns out [T, Hq, D] in q.dtype."""
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    num_tokens, hq, head_dim = q.shape
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, Hkv, D={head_dim}], "
                         f"got {tuple(kv_cache.shape)}")
    block_size, hkv = kv_cache.shape[2], kv_cache.shape[3]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"kv_cache must have Hkv dividing Hq={hq} (q {tuple(q.shape)}), "
                         f"got {tuple(kv_cache.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float32/float16/bfloat16, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache must have q's dtype {q.dtype}, got {kv_cache.dtype}")
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension, strides {t.stride()}")
    b = int(md.num_reqs)
    qsl, seq_lens, bt = md.query_start_loc, md.seq_lens, md.block_table
    for name, t, label, n in (("md.query_start_loc", qsl, "B+1", b + 1), ("md.seq_lens", seq_lens, "B", b)):
        if tuple(t.shape) != (n,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 [{label}={n}], got {t.dtype} {tuple(t.shape)}")
    if bt.dim() != 2 or bt.shape[0] != b or bt.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"md.block_table must be int32/int64 [B={b}, M], got {bt.dtype} {tuple(bt.shape)}")
    for name, t in (("md.query_start_loc", qsl), ("md.seq_lens", seq_lens), ("md.block_table", bt)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, strides {t.stride()}")
    need = math.ceil(int(md.max_seq_len) / block_size)
    if b and bt.shape[1] < need:
        raise ValueError(f"md.block_table must be [B={b}, M>={need}] (max_seq_len {md.max_seq_len}, "
                         f"block_size {block_size}), got {tuple(bt.shape)}")
    for name, t in (("kv_cache", kv_cache), ("md.query_start_loc", qsl), ("md.seq_lens", seq_lens),
                    ("md.block_table", bt)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    block_m, block_n = _tiles(int(md.max_query_len), int(md.max_seq_len), hq // hkv)
    return _launch(q, kv_cache, md, scale, block_m, block_n, sliding_window)
