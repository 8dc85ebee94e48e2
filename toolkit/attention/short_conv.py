"""ShortConv (LFM2) metadata (vLLM `ShortConvAttentionMetadata`): the base Mamba fields only; the
layer keeps a conv state and no SSM state."""
from __future__ import annotations

from dataclasses import dataclass

from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.mamba_base import BaseMambaAttentionMetadata, BaseMambaMetadataBuilder


@dataclass
class ShortConvAttentionMetadata(BaseMambaAttentionMetadata):
    pass


class ShortConvMetadataBuilder(BaseMambaMetadataBuilder):
    def _build(self, common: CommonAttentionMetadata, producer: str) -> ShortConvAttentionMetadata:
        return ShortConvAttentionMetadata(**self.common_fields(common, self.split(common, producer)))
