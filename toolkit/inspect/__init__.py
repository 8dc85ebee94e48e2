"""Inspection: what the runner did, step by step, and tools to find where it went wrong.

- `StepRecord` / `Trace` (`llm.trace`): the recorded steps (step_record.py, trace.py, recorder.py)
- runtime checks raising `toolkit.InvariantError` (checks.py)
- `faults`: the fault catalogue, `faults.catalogue()`, `faults.inject(name)` (faults.py)
- `compare_with_hf`, `diff_traces`: first divergence vs HF transformers / between two traces
- `MemoryReport` (`llm.memory_report()`), render functions behind every `_repr_html_` (render.py)
"""
from toolkit.inspect import faults
from toolkit.inspect import render as _render  # installs _repr_html_/__repr__ on the records
from toolkit.inspect.compare import DivergenceReport, TraceDiff, compare_with_hf, diff_traces
from toolkit.inspect.memory import MemoryReport
from toolkit.inspect.step_record import CacheLedger, LayerState, StepRecord, Violation
from toolkit.inspect.trace import Trace

__all__ = ["StepRecord", "Trace", "LayerState", "CacheLedger", "Violation", "faults",
           "compare_with_hf", "diff_traces", "DivergenceReport", "TraceDiff", "MemoryReport"]
