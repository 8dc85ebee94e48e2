"""Gated DeltaNet metadata (vLLM `GDNAttentionMetadata`), built per step by `GDNMetadataBuilder`.

Token order contract (see mamba_base.py): [decode tokens | prefill tokens]. A GDN layer reads the
base Mamba fields (state pages, prefill boundaries, initial-state flags) plus the chunk layout of
its chunked gated-delta-rule prefill.

Chunking follows FLA's varlen layout (`chunk_indices` / `chunk_offsets`, which vLLM's builder
precomputes on the CPU): every prefill row is cut into chunks of `chunk_size` tokens starting at
its own first scheduled token, so a chunk never crosses a sequence and only a row's last chunk
may be short. (Mamba2 instead tops a continuing row up to the next multiple of chunk_size, for
prefix caching; the GDN scan is exact for any layout, it just needs one.) The chunk fields carry
Mamba2's names, so a layer can take its chunk layout from either metadata class.

State pages come from the shared base builder in both cache modes (`mamba_block_size`, see
mamba_base.py), as vLLM's GDN builder takes them from the same `mamba_get_block_table_tensor`.
Cache mode "all" (`prefill_checkpoints=True`): the base builder's internal checkpoints
(`checkpoint_token_index_p`, `checkpoint_slots_p`); the GDN prefill saves a state after any token,
so, unlike Mamba2, they need not fall on chunk ends.

Fields required from the common metadata: the base Mamba set. vLLM's GDN builder does not read
`seq_lens_cpu_upper_bound`; here the shared decode/prefill split does (a one-token prefill chunk
on top of saved state runs as a decode, vLLM #42430), so it is required like `is_prefilling`.
With speculative decoding the builder also requires vLLM's spec-decode fields
(`num_accepted_tokens`, `num_decode_draft_tokens_cpu`), and lays out the verify rows' state columns
with the base builder's fields (mamba_base.py), not vLLM GDN's own spec/non-spec split.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.mamba2 import compute_chunk_metadata
from toolkit.attention.mamba_base import MAMBA_REQUIRED_FIELDS, BaseMambaAttentionMetadata, BaseMambaMetadataBuilder
from toolkit.host import to_device

# FLA's chunk size for the gated delta rule (BT = 64 in `chunk_gated_delta_rule`)
GDN_CHUNK_SIZE = 64
GDN_REQUIRED_FIELDS = MAMBA_REQUIRED_FIELDS


@dataclass
class GDNAttentionMetadata(BaseMambaAttentionMetadata):
    chunk_size: int
    # prefill-only; None when num_prefills == 0. C = number of prefill chunks.
    seq_idx_p: torch.Tensor | None              # device int32 [C]: prefill row of each chunk
    cu_chunk_seqlen_p: torch.Tensor | None      # device int32 [C+1]: chunk boundaries (prefill-token offsets)
    last_chunk_indices_p: torch.Tensor | None   # device int32 [P]: index of each row's last chunk


def compute_gdn_chunk_metadata(query_lens_p: np.ndarray, chunk_size: int
                               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cu_chunk_seqlen [C+1], seq_idx [C], last_chunk_indices [P]): each row chunked from its own
    first token (FLA's varlen layout)."""
    q = np.asarray(query_lens_p)
    return compute_chunk_metadata(q, np.zeros_like(q), chunk_size)


class GDNMetadataBuilder(BaseMambaMetadataBuilder):
    required_fields = GDN_REQUIRED_FIELDS

    def __init__(self, chunk_size: int = GDN_CHUNK_SIZE, *, mamba_block_size: int | None = None,
                 prefill_checkpoints: bool = False, num_speculative_tokens: int = 0):
        if chunk_size < 1:
            raise ValueError(f"GDN chunk_size must be positive, got {chunk_size}")
        # internal checkpoints need no chunk alignment: the GDN prefill saves a state after any token
        super().__init__(mamba_block_size=mamba_block_size, prefill_checkpoints=prefill_checkpoints,
                         num_speculative_tokens=num_speculative_tokens)
        self.chunk_size = chunk_size

    def _build(self, common: CommonAttentionMetadata, producer: str) -> GDNAttentionMetadata:
        s = self.split(common, producer)
        fields = self.common_fields(common, s)
        chunk = dict(seq_idx_p=None, cu_chunk_seqlen_p=None, last_chunk_indices_p=None)
        if s.num_prefills:
            device = common.query_start_loc.device
            cu, seq_idx, last = compute_gdn_chunk_metadata(s.query_lens[s.num_decodes:], self.chunk_size)
            chunk = dict(seq_idx_p=to_device(seq_idx, device),
                         cu_chunk_seqlen_p=to_device(cu, device),
                         last_chunk_indices_p=to_device(last, device))
        return GDNAttentionMetadata(chunk_size=self.chunk_size, **fields, **chunk)
