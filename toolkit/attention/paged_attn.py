"""Paged attention: metadata and its builder (torch reference path).

KV cache of one attention layer: [num_blocks, 2, block_size, num_kv_heads, head_dim]; index 1 is
0 for K and 1 for V. Block 0 is the null block: padded block-table entries point there.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.attention.builder import AttentionMetadataBuilder
from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.contracts import FieldSpec
from toolkit.host import to_device


@dataclass
class PagedAttentionMetadata:
    num_actual_tokens: int           # T
    num_reqs: int                    # B
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor    # device int32 [B+1]
    query_start_loc_cpu: torch.Tensor  # CPU int32 [B+1]
    seq_lens: torch.Tensor           # device int32 [B]: context length including this step's tokens
    seq_lens_cpu: torch.Tensor       # CPU int32 [B]: same values, for host-side loops
    block_table: torch.Tensor        # device int32 [B, max_blocks]
    slot_mapping: torch.Tensor       # device int64 [T]: KV slot of each token, -1 = skip write

    # Rows with a single query token, batched together by the torch reference. Derived from the
    # host copies on first use (once per step, not per layer; the Triton kernel never asks, so a
    # step on the Triton backend makes no host-to-device copy for them).
    @functools.cached_property
    def _single_token_host_rows(self) -> np.ndarray:
        return np.flatnonzero(np.diff(self.query_start_loc_cpu.numpy()) == 1).astype(np.int64)

    @functools.cached_property
    def single_token_rows(self) -> torch.Tensor:
        """device int64 [D]."""
        return to_device(self._single_token_host_rows, self.query_start_loc.device)

    @functools.cached_property
    def single_token_max_seq_len(self) -> int:
        """0 when D == 0."""
        rows = self._single_token_host_rows
        return int(self.seq_lens_cpu.numpy()[rows].max()) if len(rows) else 0


class PagedAttentionMetadataBuilder(AttentionMetadataBuilder):
    required_fields = (
        FieldSpec("query_start_loc", torch.int32, shape="[B+1]"),
        FieldSpec("query_start_loc_cpu", torch.int32, on_cpu=True, shape="[B+1]"),
        FieldSpec("seq_lens", torch.int32, shape="[B]"),
        FieldSpec("seq_lens_cpu_upper_bound", torch.int32, on_cpu=True, shape="[B]"),
        FieldSpec("block_table_tensor", torch.int32, shape="[B, *]"),
        FieldSpec("slot_mapping", torch.int64, shape="[T]"),
    )

    def __init__(self, block_size: int):
        self.block_size = block_size

    def _build(self, common: CommonAttentionMetadata, producer: str) -> PagedAttentionMetadata:
        return PagedAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens, num_reqs=common.num_reqs,
            max_query_len=common.max_query_len, max_seq_len=common.max_seq_len,
            block_size=self.block_size, query_start_loc=common.query_start_loc,
            query_start_loc_cpu=common.query_start_loc_cpu, seq_lens=common.seq_lens,
            seq_lens_cpu=common.seq_lens_cpu_upper_bound, block_table=common.block_table_tensor,
            slot_mapping=common.slot_mapping)
