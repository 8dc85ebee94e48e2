"""Mamba1 metadata (vLLM `Mamba1AttentionMetadata`): the base Mamba fields only. Chunk fields
exist in vLLM only for prefix caching ("all" mode), which this toolkit does not do."""
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
