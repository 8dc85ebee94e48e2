"""Jupyter views of a run: `StepInspector(llm)` and the views it is made of, each usable alone
on a record or a (loaded) Trace. ipywidgets 8 + matplotlib, no custom JavaScript."""
from toolkit.widgets.inspector import StepInspector
from toolkit.widgets.views import (
    BatchView,
    BlockTableView,
    MetadataView,
    PrefixCacheView,
    SpecDecodeView,
    StateView,
    TimelineView,
    WarmupMemoryView,
)

__all__ = ["StepInspector", "BatchView", "MetadataView", "BlockTableView", "StateView", "TimelineView",
           "WarmupMemoryView", "PrefixCacheView", "SpecDecodeView"]
