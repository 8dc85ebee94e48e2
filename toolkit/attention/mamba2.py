"""Mamba2 metadata (vLLM `Mamba2AttentionMetadata`), built per step by `Mamba2MetadataBuilder`.

Token order contract (see mamba_base.py): [decode tokens | prefill tokens].

Chunking (vLLM `_compute_chunk_metadata`): a chunk never crosses a sequence boundary, and a
sequence whose num_computed_tokens is not a multiple of chunk_size first tops up to the next
chunk boundary, so states always sit on chunk boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.mamba_base import BaseMambaAttentionMetadata, BaseMambaMetadataBuilder
from toolkit.host import to_device


@dataclass
class Mamba2AttentionMetadata(BaseMambaAttentionMetadata):
    chunk_size: int
    prep_initial_states: bool                   # any prefill row starts from a saved state
    # prefill-only; None when num_prefills == 0. C = number of prefill chunks.
    seq_idx_p: torch.Tensor | None              # device int32 [C]: prefill row of each chunk
    cu_chunk_seqlen_p: torch.Tensor | None      # device int32 [C+1]: chunk boundaries (prefill-token offsets)
    last_chunk_indices_p: torch.Tensor | None   # device int32 [P]: index of each row's last chunk


def compute_chunk_metadata(query_lens_p: np.ndarray, num_computed_p: np.ndarray, chunk_size: int
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cu_chunk_seqlen [C+1], seq_idx [C], last_chunk_indices [P]) for the prefill rows."""
    bounds, seq_idx, last = [0], [], []
    offset = 0
    for row, (q, computed) in enumerate(zip(query_lens_p.tolist(), num_computed_p.tolist())):
        first = chunk_size - computed % chunk_size     # top up to the next chunk boundary
        remaining = q
        while remaining > 0:
            n = min(first, remaining)
            offset += n
            remaining -= n
            bounds.append(offset)
            seq_idx.append(row)
            first = chunk_size
        last.append(len(seq_idx) - 1)
    return (np.array(bounds, dtype=np.int32), np.array(seq_idx, dtype=np.int32),
            np.array(last, dtype=np.int32))


class Mamba2MetadataBuilder(BaseMambaMetadataBuilder):
    def __init__(self, chunk_size: int, *, mamba_block_size: int | None = None, prefill_checkpoints: bool = False,
                 num_speculative_tokens: int = 0):
        if chunk_size < 1 or chunk_size & (chunk_size - 1):
            raise ValueError(f"Mamba2 chunk_size must be a power of two, got {chunk_size}")
        if prefill_checkpoints and mamba_block_size % chunk_size:
            raise ValueError(f"internal checkpoints need chunk ends on every block boundary: Mamba2 chunk_size "
                             f"{chunk_size} does not divide the block size {mamba_block_size}")
        super().__init__(mamba_block_size=mamba_block_size, prefill_checkpoints=prefill_checkpoints,
                         num_speculative_tokens=num_speculative_tokens)
        self.chunk_size = chunk_size

    def _build(self, common: CommonAttentionMetadata, producer: str) -> Mamba2AttentionMetadata:
        s = self.split(common, producer)
        fields = self.common_fields(common, s)
        chunk = dict(seq_idx_p=None, cu_chunk_seqlen_p=None, last_chunk_indices_p=None)
        if s.num_prefills:
            device = common.query_start_loc.device
            cu, seq_idx, last = compute_chunk_metadata(s.query_lens[s.num_decodes:],
                                                       s.num_computed_p, self.chunk_size)
            chunk = dict(seq_idx_p=to_device(seq_idx, device),
                         cu_chunk_seqlen_p=to_device(cu, device),
                         last_chunk_indices_p=to_device(last, device))
        return Mamba2AttentionMetadata(
            chunk_size=self.chunk_size, prep_initial_states=bool((s.num_computed_p > 0).any()),
            **fields, **chunk)
