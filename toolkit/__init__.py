"""runnerscope: a steppable, inspectable MRV2-style runner for hybrid and attention-free LLMs."""
from toolkit.errors import (CheckpointError, EngineClosedError, InvalidRequestError, InvariantError, MetadataContractError,
                            ModelStateError, NotSupportedYetError, ToolkitError,
                            UnknownModelError, UnsupportedArchitectureError)
from toolkit.inspect.step_record import StepRecord
from toolkit.llm import LLM
from toolkit.request import CompletionOutput, RequestOutput
from toolkit.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StepRecord",
           "ToolkitError", "EngineClosedError", "InvariantError", "MetadataContractError", "InvalidRequestError", "UnknownModelError",
           "UnsupportedArchitectureError", "CheckpointError", "NotSupportedYetError", "ModelStateError"]
