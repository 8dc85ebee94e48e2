"""Requests as the scheduler sees them, the outputs the user gets back (vLLM names), and the
checks a request passes before it is queued (so that no step can fail on it)."""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from toolkit.errors import InvalidRequestError
from toolkit.sampling import SamplingParams

Prompt = str | dict     # a text, or {"prompt_token_ids": [...]}


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


def request_output(req: Request, decode: Callable[[list[int]], str]) -> RequestOutput:
    """The RequestOutput of a finished request. As in vLLM, a stop token stays in `token_ids` but
    its text is left out of `text` (unless `include_stop_str_in_output`)."""
    shown = req.output_token_ids
    if req.finish_reason() == "stop" and not req.sampling_params.include_stop_str_in_output:
        shown = shown[:-1]
    return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids),
                         [CompletionOutput(0, decode(shown), list(req.output_token_ids), req.finish_reason())],
                         finished=True)


# ---- checks before a request is queued ------------------------------------------------------------
def own_params(params: SamplingParams | None) -> SamplingParams:
    """The request's own copy of its sampling params, validated again: the caller may change or
    reuse the object."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    return dataclasses.replace(params)


def prompt_token_ids(prompt: Prompt, encode: Callable[[str], list[int]]) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt; an empty prompt or a malformed one is refused."""
    if isinstance(prompt, str):
        text, ids = prompt, encode(prompt)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = None, prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of ints")
        ids = list(ids)
    else:
        raise InvalidRequestError("a prompt is a string or {'prompt_token_ids': [...]}, "
                                  f"got {type(prompt).__name__}")
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    return text, ids


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can serve, checked before a request is queued."""
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int | None           # KV blocks a request can hold; None: no attention layer

    def check(self, ids: list[int], params: SamplingParams) -> None:
        bad_stops = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stops:
            raise InvalidRequestError(f"SamplingParams.stop_token_ids {bad_stops[:5]} are outside the "
                                      f"vocabulary [0, {self.vocab_size}): they could never stop a request")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are out of range [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens; max_model_len="
                                      f"{self.max_model_len} leaves no room for an output token")
        if self.num_kv_blocks is not None:
            # every token but the last sampled one goes through the model and into the cache
            cached = min(len(ids) + params.max_tokens, self.max_model_len) - 1
            need = -(-cached // self.block_size)
            if need > self.num_kv_blocks:
                raise InvalidRequestError(f"the request can need {need} KV blocks but the cache "
                                          f"has {self.num_kv_blocks} (num_kv_blocks)")


class RequestIds:
    """The request ids of one engine: vLLM-style counters ("0", "1", ...) that skip ids chosen by
    hand, and ids chosen by hand checked. An id is never used again once its request finished
    (the trace refers to requests by id); warmup's own ids are not kept."""

    def __init__(self) -> None:
        self.next_auto = 0
        self.finished: set[str] = set()

    def claim(self, request_id: str | None, in_use: Collection[str], taken: Collection[str] = ()) -> str:
        """`request_id`, checked, or the next free counter id; `in_use`: ids of running or waiting
        requests; `taken`: ids claimed earlier in the same call."""
        if request_id is None:
            while True:
                rid = str(self.next_auto)
                self.next_auto += 1
                if rid not in in_use and rid not in taken and rid not in self.finished:
                    return rid
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id={request_id!r}: must be a non-empty str")
        if request_id in in_use or request_id in taken:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if request_id in self.finished:
            raise InvalidRequestError(f"request id {request_id!r} was used by a request that finished; "
                                      "ids are unique per LLM (the trace refers to them): choose another")
        return request_id
