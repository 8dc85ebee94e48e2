"""Inspection: what the runner did, step by step, and tools to find where it went wrong.

- `StepRecord` / `Trace` (`llm.trace`): the recorded steps (step_record.py, trace.py, recorder.py)
- runtime checks raising `toolkit.InvariantError` (checks.py)
- `faults`: the fault catalogue, `faults.catalogue()`, `faults.inject(name)` (faults.py)
- `compare_with_hf` (compare_hf.py, hf_reference.py): first divergence vs HF transformers
- `diff_traces` (trace_diff.py): where two traces of the same workload part
- `check_logprobs_close` (logprobs.py): two runs are the same model by vLLM's top-k logprob rule
- `MemoryReport` (`llm.memory_report()`, memory.py); kernel launch counts (launches.py)
- views: html.py (the one HTML style), summaries.py (tensors and values in a few words),
  record_views.py (StepRecord, Trace, ... as text and HTML), prefix_views.py (a step's prefix-cache
  lookups and state copies), prefix_cache.py (`llm.prefix_cache`), reprs.py (`install_reprs()`,
  called once below, attaches them as the records' `__repr__` / `_repr_html_`)
"""
from toolkit.inspect import faults
from toolkit.inspect.compare_hf import DivergenceReport, compare_with_hf
from toolkit.inspect.logprobs import LogprobsCloseReport, check_logprobs_close
from toolkit.inspect.memory import MemoryReport
from toolkit.inspect.reprs import install_reprs
from toolkit.inspect.step_record import CacheLedger, LayerState, StepRecord, Violation
from toolkit.inspect.trace import Trace
from toolkit.inspect.trace_diff import Difference, TraceDiff, diff_traces

install_reprs()

__all__ = ["StepRecord", "Trace", "LayerState", "CacheLedger", "Violation", "faults",
           "compare_with_hf", "diff_traces", "DivergenceReport", "TraceDiff", "Difference", "MemoryReport",
           "check_logprobs_close", "LogprobsCloseReport"]
