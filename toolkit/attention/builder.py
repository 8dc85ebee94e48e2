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

    def persistent_buffers(self) -> list:
        """The tensors this builder keeps from step to step and writes in place, which its metadata
        may view (a recorded step copies them: what the record shows must not change with the next
        step). Every other tensor of its metadata is made fresh by the step that builds it."""
        return []
