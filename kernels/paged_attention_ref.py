"""Causal attention over the paged KV cache, in torch: the reference of `paged_attention.py`.

Cache layout: see kv_cache_ref.py. `sliding_window` W (None: no window): the query at position p
attends keys p - W + 1 .. p only (HF's sliding-window mask, `q_idx - kv_idx < W`); keys before every
query's window are never read, so their pages may be released (the null block 0 in their columns).
"""
from __future__ import annotations

import math

import torch


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of positions [0, seq_len) of one request: each [seq_len, Hkv, D].

    block_ids int [>= ceil(seq_len / block_size)]: the request's block-table row.
    """
    block_size = kv_cache.shape[2]
    nb = math.ceil(seq_len / block_size)
    blocks = kv_cache[block_ids[:nb].to(torch.int64)]  # [nb, 2, bs, Hkv, D]
    k = blocks[:, 0].reshape(nb * block_size, *blocks.shape[-2:])[:seq_len]
    v = blocks[:, 1].reshape(nb * block_size, *blocks.shape[-2:])[:seq_len]
    return k, v


def causal_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_start: int, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of one request, math in fp32.

    q [Q, Hq, D] sits at positions context_start .. context_start + Q - 1; k, v [L, Hkv, D] hold
    positions 0 .. L-1 (L = context_start + Q). Query head h reads kv head h // (Hq // Hkv)
    (HF `repeat_kv`). Returns [Q, Hq, D] in q.dtype.
    """
    nq, hq, _ = q.shape
    seq_len, hkv, _ = k.shape
    rep = hq // hkv
    qf = q.to(torch.float32).transpose(0, 1)                                   # [Hq, Q, D]
    kf = k.to(torch.float32).repeat_interleave(rep, dim=1).transpose(0, 1)     # [Hq, L, D]
    vf = v.to(torch.float32).repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale                      # [Hq, Q, L]
    q_pos = torch.arange(nq, device=q.device)[:, None] + context_start
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    hidden = k_pos > q_pos
    if sliding_window is not None:
        hidden = hidden | (k_pos <= q_pos - sliding_window)
        # keys before the first query's window may sit in released pages (anything, even NaN): not read
        vf = vf.masked_fill((k_pos[0] <= context_start - sliding_window)[None, :, None], 0.0)
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)                                              # [Hq, Q, D]
    return out.transpose(0, 1).to(q.dtype)


def decode_attention_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    max_seq_len: int, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """Batched attention of rows with one query token each (the token at position seq_len - 1).

    q [R, Hq, D]; block_table int [R, >= ceil(max_seq_len / block_size)]; seq_lens int [R].
    Math in fp32 (same as `causal_attention_ref`); returns [R, Hq, D] in q.dtype.
    """
    rows, hq, dim = q.shape
    block_size, hkv = kv_cache.shape[2], kv_cache.shape[3]
    nb = math.ceil(max_seq_len / block_size)
    blocks = kv_cache[block_table[:, :nb].to(torch.int64)]              # [R, nb, 2, bs, Hkv, D]
    k = blocks[:, :, 0].reshape(rows, nb * block_size, hkv, dim).to(torch.float32)
    v = blocks[:, :, 1].reshape(rows, nb * block_size, hkv, dim).to(torch.float32)
    qf = q.to(torch.float32).view(rows, hkv, hq // hkv, dim)           # head h reads kv head h // rep
    scores = torch.einsum("bgrd,bsgd->bgrs", qf, k) * scale
    pos = torch.arange(nb * block_size, device=q.device)[None, :]
    past_end = pos >= seq_lens[:, None]
    if sliding_window is not None:           # and before the window of the query at seq_len - 1
        past_end = past_end | (pos <= seq_lens[:, None] - 1 - sliding_window)
    scores = scores.masked_fill(past_end[:, None, None, :], float("-inf"))
    v = v.masked_fill(past_end[:, :, None, None], 0.0)        # unwritten slots may hold anything
    out = torch.einsum("bgrs,bsgd->bgrd", torch.softmax(scores, dim=-1), v)
    return out.reshape(rows, hq, dim).to(q.dtype)


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, md, scale: float,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Causal GQA attention of a mixed batch over the paged cache (this step's K/V already written).

    q [T, Hq, D]; md: PagedAttentionMetadata (query_start_loc [B+1], seq_lens [B], block_table
    [B, M], and their host copies). Row i's queries are tokens query_start_loc[i] .. [i+1] at
    positions seq_len - q_len .. seq_len - 1. Tokens past num_actual_tokens (padding) get 0.
    Returns [T, Hq, D] in q.dtype.
    """
    out = torch.zeros_like(q)
    qsl = md.query_start_loc_cpu.numpy().tolist()      # host copies: no device sync
    seq_lens = md.seq_lens_cpu.numpy().tolist()
    rows = md.single_token_rows
    if len(rows):                   # one-token rows (decodes) in one batched op
        tok = md.query_start_loc[rows].to(torch.int64)
        out[tok] = decode_attention_ref(q[tok], kv_cache, md.block_table[rows], md.seq_lens[rows],
                                        md.single_token_max_seq_len, scale, sliding_window)
    for i in range(int(md.num_reqs)):
        qs, qe = qsl[i], qsl[i + 1]
        q_len = qe - qs
        if q_len <= 1:
            continue
        seq_len = seq_lens[i]
        kc, vc = gather_kv(kv_cache, md.block_table[i], seq_len)
        out[qs:qe] = causal_attention_ref(q[qs:qe], kc, vc, seq_len - q_len, scale, sliding_window)
    return out
