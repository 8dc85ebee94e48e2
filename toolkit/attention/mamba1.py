"""Mamba1 metadata (vLLM `Mamba1AttentionMetadata`): the base Mamba fields only. vLLM's base
metadata also has chunk fields (cu_chunk_seqlen_p, last_chunk_indices_p); its Mamba1 builder leaves
them None in both cache modes ("none" and "align"), so they are not here. Both cache modes:
`Mamba1MetadataBuilder(mamba_block_size=...)`, see mamba_base.py."""
from __future__ import annotations

from dataclasses import dataclass

from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.mamba_base import BaseMambaAttentionMetadata, BaseMambaMetadataBuilder


@dataclass
class Mamba1AttentionMetadata(BaseMambaAttentionMetadata):
    pass


class Mamba1MetadataBuilder(BaseMambaMetadataBuilder):
    def _build(self, common: CommonAttentionMetadata, producer: str) -> Mamba1AttentionMetadata:
        return Mamba1AttentionMetadata(**self.common_fields(common, self.split(common, producer)))
