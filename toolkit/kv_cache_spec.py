"""The cache vocabulary shared by layers, attention builders and the runner (vLLM's
`kv_cache_interface.py`): what each cache-holding layer asks the runner to allocate
(`AttentionSpec` / `MambaSpec`) and the ids that address the caches.

Layers report a spec; the runner groups layers by spec kind into KV-cache groups, allocates, and
binds the tensors back into the layers with `layer.bind_kv_cache(...)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_SLOT_ID = -1   # a slot mapping / state index of a padded token or row: nothing is read or written


@dataclass(frozen=True)
class AttentionSpec:
    """Paged K/V: the runner allocates [num_blocks, kv_parts, block_size, num_kv_heads, head_dim].
    kv_parts 2: a K and a V per token and KV head; 1: one vector per token (multi-head latent
    attention caches the compressed latent, kv_lora_rank + rope dims, and expands it per step)."""
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_parts: int = 2

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes one block of one layer takes."""
        return self.kv_parts * block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Paged K/V of a sliding-window layer (vLLM's `SlidingWindowSpec`): the query at position p reads
    keys p - W + 1 .. p only, so a block whose tokens all lie before every scheduled query's window
    is released back to the pool (its row keeps the null id 0 there). Such layers form a KV cache
    group of their own, with a pool sized for windows rather than whole contexts."""
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")


@dataclass(frozen=True)
class MambaSpec:
    """Per-request recurrent state: one tensor per entry of `shapes`, each [num_slots, *shape].

    Slot 0 is the null slot (dummy and padded rows point there). `mamba_type` picks the metadata
    builder: "mamba2", "mamba1", "short_conv", "gdn" (Gated DeltaNet), "linear_attention" (MiniMax's
    lightning attention) or "mlstm" (xLSTM).
    Conv state layout is vLLM's "SD": (state_len = conv_kernel - 1, conv_dim).
    """
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    mamba_type: str
    chunk_size: int | None = None     # Mamba2 SSD chunk size (power of two)

    def page_size_bytes(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = 1
            for s in shape:
                n *= s
            total += n * torch.tensor([], dtype=dtype).element_size()
        return total


KVCacheSpec = AttentionSpec | SlidingWindowSpec | MambaSpec
