"""Every error the toolkit raises on purpose. All derive from `ToolkitError` (and from the builtin
type a user would catch for the same mistake), so `except ValueError` keeps working."""
from __future__ import annotations


class ToolkitError(Exception):
    """Base class of the toolkit's own errors."""


class EngineClosedError(ToolkitError, RuntimeError):
    """A call on an LLM after `shutdown()`: build a new one (`LLM(**llm.init_args)`)."""


class UnknownModelError(ToolkitError, ValueError):
    """`LLM(model)` got neither a preset name nor an existing folder."""


class UnsupportedArchitectureError(ToolkitError, ValueError):
    """The config names an architecture the toolkit does not implement."""


class CheckpointError(ToolkitError, ValueError):
    """A model folder is malformed: no config.json, missing/unexpected/misshapen tensors, pickles."""


class InvalidRequestError(ToolkitError, ValueError):
    """A prompt or SamplingParams value that cannot be served. The LLM keeps serving other requests."""


class NotSupportedYetError(ToolkitError, NotImplementedError):
    """A model kind whose runner path (model state) this toolkit does not have yet."""


class MetadataContractError(ToolkitError, ValueError):
    """A metadata builder got a missing or malformed field.

    Names the field, the builder that requires it and the model state that produced the metadata,
    so a bookkeeping bug (vLLM #46759: a field computed but never forwarded) is found at warmup.
    """

    def __init__(self, field: str, builder: str, producer: str, problem: str):
        self.field, self.builder, self.producer, self.problem = field, builder, producer, problem
        super().__init__(
            f"field '{field}' required by {builder} {problem} "
            f"(metadata produced by {producer})"
        )


class ModelStateError(ToolkitError, RuntimeError):
    """A model state was given caches it cannot manage (a routing bug, cf. vLLM #52374)."""


class TensorParallelError(ToolkitError, RuntimeError):
    """A tensor-parallel worker failed (raised, died or hung); the message names the rank and its error."""


class InvariantError(ToolkitError, RuntimeError):
    """A runtime check (`LLM(checks=True)`) found the engine's books wrong: a live request on the
    null slot, a state index that is not the request's slot, a reused slot not zeroed, ...

    `violations` lists each failure (check, where: step / request / group or layer, field, values).
    The step that showed it has completed and is in `llm.trace` with the same violations.
    """

    def __init__(self, violations: list) -> None:
        self.violations = list(violations)
        lines = [str(v) for v in self.violations[:10]]
        more = len(self.violations) - len(lines)
        super().__init__(f"{len(self.violations)} invariant violation(s):\n  " + "\n  ".join(lines)
                         + (f"\n  ... and {more} more" if more > 0 else ""))


class TraceBudgetWarning(UserWarning):
    """`llm.trace` passed its byte budget (`LLM(trace_max_bytes=...)`): the oldest records lost
    their states (then their logits). Shown once per trace."""
