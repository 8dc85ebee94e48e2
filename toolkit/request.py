"""Requests as the scheduler sees them, and the outputs the user gets back (vLLM names)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from toolkit.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"   # EOS or a stop token
    FINISHED_LENGTH = "finished_length"     # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams           # the request's own copy
    eos_token_ids: frozenset[int]             # every id that ends generation (unless ignore_eos)
    prompt: str | None = None
    sampling_seed: int = 0                    # params.seed, or derived from the LLM seed at arrival
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self.status)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
