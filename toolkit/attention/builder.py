"""The interface every metadata builder implements (vLLM `AttentionMetadataBuilder`)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.contracts import FieldSpec, check_required_fields


class AttentionMetadataBuilder(ABC):
    required_fields: ClassVar[tuple[FieldSpec, ...]] = ()

    def build(self, common: CommonAttentionMetadata, *, producer: str) -> Any:
        """Check the contract, then build this backend's metadata for one layer group."""
        check_required_fields(common, self.required_fields, type(self).__name__, producer)
        return self._build(common, producer)

    @abstractmethod
    def _build(self, common: CommonAttentionMetadata, producer: str) -> Any:
        """Backend-specific metadata from a contract-checked common metadata."""
