"""KV-cache write by slot mapping (vLLM `reshape_and_cache`): the Triton kernel, its launcher and
the torch reference it must equal.

kv_cache [num_blocks, 2, block_size, Hkv, D] (index 1: 0 = K, 1 = V); k, v [N, Hkv, D];
slot_mapping int [N]: token n goes to block slot // block_size, offset slot % block_size;
PAD_SLOT_ID (-1) means "write nothing" (padded tokens).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher_checks import rows_per_program, tile_warps


@triton.jit(do_not_specialize=["num_tokens"])      # one compile for every row count
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, num_tokens, heads, head_dim,
                     stride_kn, stride_kh, stride_vn, stride_vh,
                     stride_cb, stride_ckv, stride_cs, stride_ch,
                     block_size, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program: BLOCK_M tokens, each row of the tile one token's K (and V) over all heads (column
    c = head * BLOCK_D + channel), copied into the token's cache slot. Padded tokens write nothing."""
    n = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slot_ptr + n, mask=n < num_tokens, other=-1).to(tl.int64)
    ok = slot >= 0
    slot = tl.where(ok, slot, 0)
    c = tl.arange(0, BLOCK_H * BLOCK_D)
    h, d = c // BLOCK_D, c % BLOCK_D
    mask = ok[:, None] & ((h < heads) & (d < head_dim))[None, :]
    k = tl.load(k_ptr + n[:, None] * stride_kn + (h * stride_kh + d)[None, :], mask=mask)
    v = tl.load(v_ptr + n[:, None] * stride_vn + (h * stride_vh + d)[None, :], mask=mask)
    base = (cache_ptr + ((slot // block_size) * stride_cb + (slot % block_size) * stride_cs)[:, None]
            + (h * stride_ch + d)[None, :])
    tl.store(base, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(base + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Launcher: checks shapes, dtypes and strides, then writes K/V in place (PAD slots skipped)."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    _, _, block_size, heads, head_dim = kv_cache.shape
    n = slot_mapping.shape[0]
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (n, heads, head_dim):
            raise ValueError(f"{name} must be [N={n}, Hkv={heads}, D={head_dim}], got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension, strides {t.stride()}")
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device}, the cache on {kv_cache.device}")
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be contiguous in head_dim, strides {kv_cache.stride()}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [N], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if n == 0:
        return
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    block_m = rows_per_program(block_h * block_d)
    _write_kv_kernel[(triton.cdiv(n, block_m),)](
        k, v, kv_cache, slot_mapping, n, heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_size, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=tile_warps(block_m * block_h * block_d))
