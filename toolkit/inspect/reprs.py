"""`install_reprs()`: the notebook reprs of the record classes, attached in one explicit call.

The record classes (StepRecord, Trace, GroupMetadata, InputBatch, the attention metadata) live
on lower floors and know nothing of HTML; `toolkit.inspect` calls `install_reprs()` once when it
is imported (the engine imports it), so every record shows a short `__repr__` and a
`_repr_html_` from `record_views` / `summaries`.
"""
from __future__ import annotations

from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.mamba_base import BaseMambaAttentionMetadata
from toolkit.attention.paged_attn import PagedAttentionMetadata
from toolkit.inspect import record_views as V
from toolkit.inspect.step_record import LayerState, StepRecord, Violation
from toolkit.inspect.summaries import compact_repr, dataclass_html
from toolkit.inspect.trace import Trace
from toolkit.runner.attn_utils import GroupMetadata
from toolkit.runner.input_batch import InputBatch


def _all_subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _all_subclasses(sub)
    return out


def install_reprs() -> None:
    """Attach `_repr_html_` (and a short `__repr__` where the dataclass one would dump tensors) to
    the record classes. Idempotent; assigning on the class overrides the dataclass-made method."""
    StepRecord.__repr__ = V.step_record_repr
    StepRecord._repr_html_ = V.step_record_html
    GroupMetadata.__repr__ = V.group_metadata_repr
    GroupMetadata._repr_html_ = V.group_metadata_html
    InputBatch.__repr__ = V.input_batch_repr
    InputBatch._repr_html_ = dataclass_html
    LayerState.__repr__ = V.layer_state_repr
    LayerState._repr_html_ = V.layer_state_html
    Violation._repr_html_ = V.violation_html
    Trace._repr_html_ = V.trace_html
    for cls in [CommonAttentionMetadata, PagedAttentionMetadata, *_all_subclasses(BaseMambaAttentionMetadata)]:
        cls.__repr__ = compact_repr
        cls._repr_html_ = dataclass_html
