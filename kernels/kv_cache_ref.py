"""Writing K/V into the paged cache, in torch: the reference of `kv_cache.py`.

Cache layout: kv [num_blocks, 2, block_size, num_kv_heads, head_dim] (index 1: 0 for K, 1 for V);
token slot s lives in block s // block_size at offset s % block_size.
"""
from __future__ import annotations

import torch

from .state_slots_ref import padded_rows_redirected


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter K/V of this step into the paged cache, in place.

    kv_cache [num_blocks, 2, block_size, Hkv, D]; k, v [N, Hkv, D]; slot_mapping int [N]
    (entries == -1 are skipped).
    """
    block_size = kv_cache.shape[2]
    if slot_mapping.numel() == 0:
        return
    src, slots, keep = padded_rows_redirected(slot_mapping)
    blk = torch.div(slots, block_size, rounding_mode="floor")
    off = slots % block_size
    keep = keep[:, None, None]
    kv_cache[blk, 0, off] = torch.where(keep, k[src].to(kv_cache.dtype), kv_cache[blk, 0, off])
    kv_cache[blk, 1, off] = torch.where(keep, v[src].to(kv_cache.dtype), kv_cache[blk, 1, off])
