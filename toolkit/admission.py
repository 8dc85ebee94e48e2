"""The checks a request passes before it is queued, so that no step can fail on it: its prompt,
its sampling params (the request's own copy), what the engine can serve (`RequestLimits`), and its
id (`RequestIds`, vLLM's counters)."""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from toolkit.errors import InvalidRequestError
from toolkit.sampling import SamplingParams, copy_params

Prompt = str | dict     # a text, or {"prompt_token_ids": [...]}


def own_params(params: SamplingParams | None) -> SamplingParams:
    """The request's own copy of its sampling params, validated again: the caller may change or
    reuse the object."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    return copy_params(params)


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
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise InvalidRequestError(f"SamplingParams.{name}={k}: more than the vocabulary "
                                          f"({self.vocab_size} tokens)")
        for name, ids_of in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            outside = sorted(t for t in ids_of or () if t >= self.vocab_size)
            if outside:
                raise InvalidRequestError(f"SamplingParams.{name} has token ids {outside[:5]} outside the "
                                          f"vocabulary [0, {self.vocab_size})")
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
