"""kernels/kv_cache.py and kernels/paged_attention.py against their torch references, under TRITON_INTERPRET=1 on
the CPU (set in conftest before any kernel is defined) or compiled on CUDA (harness.KERNEL_DEVICE), fp32 / fp16
/ bf16. The KV-cache write: k and v views of a fused tensor, padded tokens. Paged attention: a mixed batch of
decode rows and prefill chunks with earlier context, scattered block ids, a NaN-filled cache outside the written
slots, padded tokens, q a view of a fused projection."""
from __future__ import annotations

import math

import pytest
import torch

from harness import KERNEL_DEVICE as DEV  # the test device: CPU (interpreter) or CUDA (compiled)

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.attention.paged_attn import PagedAttentionMetadata
from toolkit.kernels import (
    kv_cache,
    kv_cache_ref,
    paged_attention_ref,
)
from toolkit.kernels import paged_attention as pa
from toolkit.kernels.kv_cache_ref import write_kv_cache
from toolkit.kernels.launcher_checks import rows_per_program

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# both sides compute in fp32 and round once to the output dtype: about one ulp of it
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
# (q_len, seq_len): decode rows (q_len 1) and prefill chunks, fresh (seq_len == q_len) or with context;
# seq_lens 1, block_size - 1, block_size, multiples of it and between
MIXED = [(1, 7), (3, 3), (1, 1), (9, 14), (1, 12), (4, 8), (7, 16), (1, 4), (2, 10), (5, 5)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_write_equals_reference(dtype):
    g = torch.Generator().manual_seed(0)
    blocks, bs, heads, d = 6, 4, 2, 16
    qkv = torch.randn(9, 3, heads, d, generator=g).to(DEV, dtype)  # k, v are views of a fused tensor
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([5, -1, 0 + 4, 17, -1, 22, 8, 9, 23], device=DEV)   # two padded tokens
    ours = torch.zeros(blocks, 2, bs, heads, d, dtype=dtype, device=DEV)
    ref = ours.clone()
    kv_cache.write_kv_cache(ours, k, v, slots)
    kv_cache_ref.write_kv_cache(ref, k, v, slots)
    assert torch.equal(ours, ref)
    assert ours.abs().sum() > 0



def test_kv_cache_write_tiles_tokens_across_programs():
    """Tokens go BLOCK_M to a program (launcher_checks.rows_per_program): more tokens than two
    programs take, padded ones among them and the last tile part masked, each in its own slot."""
    g = torch.Generator().manual_seed(1)
    heads, d, bs = 3, 16, 4                      # 3 heads: the tile's head columns are masked too
    n = 2 * rows_per_program(4 * d) + 5
    k, v = torch.randn(n, heads, d, generator=g).to(DEV), torch.randn(n, heads, d, generator=g).to(DEV)
    slots = torch.randperm(n + 8, generator=g)[:n]
    slots[::7] = -1
    ours = torch.zeros((n + 8) // bs + 1, 2, bs, heads, d, device=DEV)
    ref = ours.clone()
    kv_cache.write_kv_cache(ours, k, v, slots.to(DEV))
    kv_cache_ref.write_kv_cache(ref, k, v, slots.to(DEV))
    assert torch.equal(ours, ref)


def test_kv_cache_launcher_names_what_is_wrong():
    cache = torch.zeros(4, 2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"k must be \[N=3, Hkv=2, D=8\]"):
        kv_cache.write_kv_cache(cache, torch.zeros(3, 2, 4), torch.zeros(3, 2, 8), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_mapping must be int32/int64"):
        kv_cache.write_kv_cache(cache, torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), torch.zeros(3))


def make_batch(rows, hq, hkv, head_dim, block_size, dtype, *, pad=3, extra_cols=2, device=DEV, seed=0):
    """q (a view of a fused qkv projection, NaN in padded tokens), a NaN-filled cache holding each
    row's K/V at positions 0 .. seq_len-1 in scattered blocks, and the metadata."""
    g = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in rows]
    seq_lens = [s for _, s in rows]
    n_blocks = [math.ceil(s / block_size) for s in seq_lens]
    width = max(n_blocks, default=0) + extra_cols          # trailing entries: the null block 0
    num_blocks = sum(n_blocks) + 5                         # block 0 (null) and a few unused ones
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()   # scattered, never 0
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, nb in enumerate(n_blocks):
        table[i, :nb] = torch.tensor([ids.pop() for _ in range(nb)], dtype=torch.int32)

    cache = torch.full((num_blocks, 2, block_size, hkv, head_dim), float("nan"), dtype=dtype)
    for i, s in enumerate(seq_lens):                      # every row's context and this step's K/V
        pos = torch.arange(s)
        slots = table[i, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(s, hkv, head_dim, generator=g).to(dtype)
        v = torch.randn(s, hkv, head_dim, generator=g).to(dtype)
        write_kv_cache(cache, k, v, slots)

    total = sum(q_lens)
    t = total + pad
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g).to(dtype)
    qkv[total:] = float("nan")                            # padded tokens: must not be read
    q = qkv.to(device)[:, :hq * head_dim].view(t, hq, head_dim)   # a view on the device too
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    slot_mapping = torch.full((t,), -1, dtype=torch.int64)
    for i, (ql, s) in enumerate(rows):
        pos = torch.arange(s - ql, s)
        slot_mapping[qsl[i]:qsl[i + 1]] = table[i, pos // block_size].long() * block_size + pos % block_size
    md = PagedAttentionMetadata(
        num_actual_tokens=total, num_reqs=len(rows), max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0), block_size=block_size,
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device), seq_lens_cpu=seq,
        block_table=table.to(device), slot_mapping=slot_mapping.to(device))
    return q, cache.to(device), md


def check(ours, q, cache, md, scale, dtype):
    ref = paged_attention_ref.paged_attention_ref(q, cache, md, scale)
    n = md.num_actual_tokens
    assert ours.shape == q.shape and ours.dtype == q.dtype
    assert not ours.isnan().any()
    assert (ours[n:] == 0).all()                          # padded tokens
    torch.testing.assert_close(ours, ref, **TOL[dtype])


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv", [(4, 2), (4, 4), (4, 1)])
def test_paged_attention_equals_reference(dtype, hq, hkv):
    q, cache, md = make_batch(MIXED, hq, hkv, 16, 4, dtype)
    before = bits(cache).clone()
    ours = pa.paged_attention(q, cache, md, 16 ** -0.5)
    check(ours, q, cache, md, 16 ** -0.5, dtype)
    assert torch.equal(bits(cache), before)               # the cache is only read


@pytest.mark.parametrize("block_m, block_n", [(1, 16), (2, 32), (4, 16), (8, 64)])
def test_paged_attention_tile_sizes(block_m, block_n):
    """Rows longer than a query block and than a key tile, tile edges inside and across blocks."""
    rows = [(20, 26), (1, 33), (13, 13), (1, 5), (17, 40)]
    q, cache, md = make_batch(rows, 4, 2, 16, 4, torch.float32, seed=1)
    ours = pa._launch(q, cache, md, 0.3, block_m, block_n)
    check(ours, q, cache, md, 0.3, torch.float32)


def release_out_of_window_pages(md, block_size: int, window: int) -> int:
    """Point every block-table column wholly before all of a row's query windows at the null block 0
    (NaN-filled in make_batch), as a sliding-window cache releases them. Returns how many were."""
    qsl, seq = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
    table = md.block_table.cpu()
    released = 0
    for i, s in enumerate(seq):
        first_seen = max(s - (qsl[i + 1] - qsl[i]) - window + 1, 0)     # the first query's window start
        cols = first_seen // block_size                                  # columns wholly before it
        released += int((table[i, :cols] != 0).sum())
        table[i, :cols] = 0
    md.block_table = table.to(md.block_table.device)
    return released


@pytest.mark.parametrize("window", [1, 3, 6, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_equals_reference_with_released_pages(window, dtype):
    """Windows shorter than a block, than a row's context and longer than some rows; the pages wholly
    out of every query's window released to the NaN-filled null block: never read by either side."""
    rows = MIXED + [(1, 33), (20, 40), (3, 26)]
    q, cache, md = make_batch(rows, 4, 2, 16, 4, dtype, seed=2)
    assert release_out_of_window_pages(md, 4, window) > (0 if window < 16 else -1)
    ours = pa.paged_attention(q, cache, md, 0.25, sliding_window=window)
    ref = paged_attention_ref.paged_attention_ref(q, cache, md, 0.25, sliding_window=window)
    assert not ours.isnan().any() and not ref.isnan().any()
    torch.testing.assert_close(ours, ref, **TOL[dtype])
    for block_m, block_n in ((1, 16), (4, 32)):           # tiles starting inside and before a window
        torch.testing.assert_close(pa._launch(q, cache, md, 0.25, block_m, block_n, window), ref, **TOL[dtype])


def test_sliding_window_reference_is_hfs_mask():
    """The reference's window is HF's sliding-window mask: query p sees key j iff 0 <= p - j < W
    (checked against a dense softmax with that boolean mask)."""
    g = torch.Generator().manual_seed(4)
    ctx, nq, w = 9, 6, 4
    q, k, v = (torch.randn(n, h, 8, generator=g) for n, h in ((nq, 4), (ctx + nq, 2), (ctx + nq, 2)))
    ours = paged_attention_ref.causal_attention_ref(q, k, v, ctx, 0.5, sliding_window=w)
    p = torch.arange(ctx, ctx + nq)[:, None]
    j = torch.arange(ctx + nq)[None, :]
    allowed = (p - j >= 0) & (p - j < w)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1)) * 0.5
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    want = torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(ours, want)
    assert not torch.allclose(ours, paged_attention_ref.causal_attention_ref(q, k, v, ctx, 0.5))


def test_paged_attention_only_padding():
    q, cache, md = make_batch([], 4, 2, 16, 4, torch.float16, pad=5)
    ours = pa.paged_attention(q, cache, md, 0.25)
    assert ours.shape == (5, 4, 16) and (ours == 0).all()


def test_paged_attention_launcher_names_what_is_wrong():
    q, cache, md = make_batch([(1, 3), (2, 6)], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_blocks, 2, block_size, Hkv, D=16\]"):
        pa.paged_attention(q, cache[..., :8], md, 1.0)
    with pytest.raises(ValueError, match=r"kv_cache must have Hkv dividing Hq=4"):
        pa.paged_attention(q, torch.zeros(4, 2, 4, 3, 16, device=DEV), md, 1.0)
    with pytest.raises(ValueError, match="kv_cache must have q's dtype torch.float32, got torch.float16"):
        pa.paged_attention(q, cache.half(), md, 1.0)
    with pytest.raises(ValueError, match="q must be float32/float16/bfloat16"):
        pa.paged_attention(q.double(), cache.double(), md, 1.0)
    table = md.block_table
    md.block_table = table.t().contiguous().t()            # column-major: not contiguous per row
    with pytest.raises(ValueError, match="md.block_table must be contiguous in its last dimension"):
        pa.paged_attention(q, cache, md, 1.0)
    md.block_table = table[:, :1]
    with pytest.raises(ValueError, match=r"md.block_table must be \[B=2, M>=2\]"):
        pa.paged_attention(q, cache, md, 1.0)
    md.seq_lens = md.seq_lens[:1]
    with pytest.raises(ValueError, match=r"md.seq_lens must be int32/int64 \[B=2\]"):
        pa.paged_attention(q, cache, md, 1.0)
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1, got 0"):
        pa.paged_attention(q, cache, md, 1.0, sliding_window=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: real shapes")
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_real_shape_cuda(dtype):
    """lfm2-350m attention: Hq 16, Hkv 8, D 64, block_size 16; 32 decode rows with seq_len up to
    1000 and two prefill chunks of 256 tokens (one fresh, one after 300 tokens of context)."""
    g = torch.Generator().manual_seed(3)
    decode = [(1, int(s)) for s in torch.randint(1, 1001, (32,), generator=g)]
    rows = decode[:16] + [(256, 256)] + decode[16:] + [(256, 556)]
    q, cache, md = make_batch(rows, 16, 8, 64, 16, dtype, pad=7, device="cuda", seed=4)
    ours = pa.paged_attention(q, cache, md, 64 ** -0.5)
    check(ours, q, cache, md, 64 ** -0.5, dtype)
