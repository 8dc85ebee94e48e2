"""runnerscope: a steppable, inspectable MRV2-style runner for hybrid and attention-free LLMs.

The public names load on first use (PEP 562), so importing a part of the package (a kernel, a
layer, the errors) does not load the engine.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "LLM": "toolkit.llm",
    "SamplingParams": "toolkit.sampling",
    "RequestOutput": "toolkit.outputs",
    "CompletionOutput": "toolkit.outputs",
    "StepRecord": "toolkit.inspect.step_record",
    **{name: "toolkit.errors" for name in (
        "ToolkitError", "EngineClosedError", "InvariantError", "MetadataContractError", "InvalidRequestError",
        "UnknownModelError", "UnsupportedArchitectureError", "CheckpointError", "NotSupportedYetError",
        "ModelStateError", "TraceBudgetWarning", "TensorParallelError")},
}
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StepRecord",
           "ToolkitError", "EngineClosedError", "InvariantError", "MetadataContractError", "InvalidRequestError",
           "UnknownModelError", "UnsupportedArchitectureError", "CheckpointError", "NotSupportedYetError",
           "ModelStateError", "TraceBudgetWarning", "TensorParallelError"]

if TYPE_CHECKING:
    from toolkit.errors import (
        CheckpointError,
        EngineClosedError,
        InvalidRequestError,
        InvariantError,
        MetadataContractError,
        ModelStateError,
        NotSupportedYetError,
        TensorParallelError,
        ToolkitError,
        TraceBudgetWarning,
        UnknownModelError,
        UnsupportedArchitectureError,
    )
    from toolkit.inspect.step_record import StepRecord
    from toolkit.llm import LLM
    from toolkit.outputs import CompletionOutput, RequestOutput
    from toolkit.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'toolkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value             # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
