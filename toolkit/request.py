"""Requests as the scheduler sees them, the outputs the user gets back (vLLM names), and the
checks a request passes before it is queued (so that no step can fail on it).

Also here, because the scheduler applies them: stop strings (`stop_strings_hit`, vLLM's
`check_stop_strings`), the logprobs the runner hands back (`TokenLogprobs`, host arrays) and how
they become the user's `Logprob` dicts, and the parent/children of an `n` > 1 request.
"""
from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from toolkit.errors import InvalidRequestError
from toolkit.sampling import SamplingParams, child_seed, copy_params

if TYPE_CHECKING:       # a sibling floor: request.py does not import the KV manager at run time
    from toolkit.kv_cache_manager import PrefixLookup

Prompt = str | dict     # a text, or {"prompt_token_ids": [...]}


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"   # EOS or a stop token
    FINISHED_LENGTH = "finished_length"     # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"
    FORKED = "forked"                       # an n > 1 parent whose prefill its children now share

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class TokenLogprobs:
    """Logprobs of the tokens at consecutive positions of one request, as the runner computed them
    on the device (log_softmax of the fp32 logits, before min_tokens / temperature / top-k / top-p)
    and brought to the host with the step's sampled ids. Column 0 is the token itself (the sampled
    token, or the prompt token), columns 1..k the k most likely tokens, most likely first.
    N = 1 for a sampled token; a prefill chunk's prompt tokens for prompt logprobs."""
    first_position: int        # the position of row 0's token in the request's sequence
    token_ids: np.ndarray      # int64 [N, 1 + k]
    logprobs: np.ndarray       # float32 [N, 1 + k]
    ranks: np.ndarray          # int64 [N]: rank of the column-0 token (1: the most likely)

    def __len__(self) -> int:
        return len(self.ranks)

    def row(self, i: int) -> TokenLogprobs:
        """Row i alone (the token at first_position + i)."""
        return TokenLogprobs(self.first_position + i, self.token_ids[i:i + 1], self.logprobs[i:i + 1],
                             self.ranks[i:i + 1])

    @property
    def logprob(self) -> float:
        """The column-0 token's logprob (of row 0)."""
        return float(self.logprobs[0, 0])

    @property
    def rank(self) -> int:
        """The column-0 token's rank (of row 0)."""
        return int(self.ranks[0])


@dataclass
class Logprob:
    """vLLM's Logprob: a token's log probability, its rank (1: the most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_dicts(rows: TokenLogprobs, decode: Callable[[list[int]], str]) -> list[dict[int, Logprob]]:
    """One dict per row, as vLLM builds them: the chosen token first (its true rank), then the top
    k with ranks 1..k (a chosen token among them keeps its place and takes the top-k entry)."""
    out = []
    for ids, lps, rank in zip(rows.token_ids.tolist(), rows.logprobs.tolist(), rows.ranks.tolist(),
                              strict=True):
        ranks = [rank] + list(range(1, len(ids)))
        out.append({t: Logprob(lp, r, decode([t])) for t, lp, r in zip(ids, lps, ranks, strict=True)})
    return out


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
    # per kept token when params.logprobs is set; per prompt chunk when params.prompt_logprobs is
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: int | str | None = None      # the stop id or stop string that finished it (vLLM)
    # with stop strings: the output text decoded so far, incrementally (`check_stop_strings`), cut at
    # a stop string on a hit; else None (decoded whole at the end). detok_offsets: (prefix, read)
    # indices into output_token_ids: the text of [prefix, read) is decoded, [read, ...) not yet
    output_text: str | None = None
    detok_offsets: tuple[int, int] = (0, 0)
    # n > 1: the parent prefills all but the last prompt token, then forks into n children
    # (`children`), which copy its KV blocks and state page and each compute that last token
    index: int = 0                            # a child's index among the n (CompletionOutput.index)
    parent: Request | None = field(default=None, repr=False, compare=False)
    children: list[Request] = field(default_factory=list, repr=False, compare=False)
    fork_from: str | None = None              # a child not yet admitted: the parent it copies
    # prefix caching: the chained hashes of its full blocks so far, and the tokens its last admission hit
    block_hashes: list[bytes] = field(default_factory=list, repr=False, compare=False)
    num_cached_tokens: int = 0
    prefix_junction: int = 0                  # "align": where its prefix shared with earlier requests ends
    # what the prefix cache held for it when last looked up (admission; again after a preemption)
    prefix_lookup: PrefixLookup | None = field(default=None, repr=False, compare=False)
    # speculative decoding: the drafts proposed after its last step, verified at its next one
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] (a new list), without joining the whole prompt and output."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def forks(self) -> bool:
        """An n > 1 request that has not forked yet: it computes all but its last prompt token."""
        return self.sampling_params.n > 1 and not self.children

    @property
    def num_tokens_to_compute(self) -> int:
        """The tokens the scheduler runs the request to: all of them, or a parent's fork point."""
        return self.num_tokens - 1 if self.forks else self.num_tokens

    @property
    def has_all_prompt_logprobs(self) -> bool:
        got = sum(len(c) for c in self.prompt_logprobs)
        return got >= len(self.prompt_token_ids) - 1

    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self.status)

    def add_prompt_logprobs(self, chunk: TokenLogprobs) -> None:
        """Keep a prefill chunk's prompt logprobs; a chunk computed again (recompute after a
        preemption) replaces what it covers."""
        kept = [c for c in self.prompt_logprobs if c.first_position < chunk.first_position]
        if kept and kept[-1].first_position + len(kept[-1]) > chunk.first_position:
            last = kept[-1]
            n = chunk.first_position - last.first_position
            kept[-1] = TokenLogprobs(last.first_position, last.token_ids[:n], last.logprobs[:n], last.ranks[:n])
        self.prompt_logprobs = kept + [chunk]


def stop_strings_hit(text: str, new_chars: int, stop: list[str], include_in_output: bool
                     ) -> tuple[str, int] | None:
    """vLLM's `StopChecker.check_stop_strings`: the first stop string (in list order) that ends in
    the last `new_chars` characters of `text`, and where to cut the text (-1: no cut): before the
    stop string, or after it with `include_in_output`."""
    if not new_chars or not stop:
        return None
    for stop_str in stop:
        index = text.find(stop_str, max(len(text) - new_chars - len(stop_str) + 1, 0))
        if index == -1:
            continue
        if include_in_output:
            index += len(stop_str)
            if index >= len(text):
                return stop_str, -1
        return stop_str, index
    return None


def decode_new_text(req: Request, decode: Callable[[list[int]], str], upto: int) -> str:
    """The text that output tokens [read, upto) add to `req.output_text` (vLLM's incremental
    detokenization): decode the window from the prefix offset with and without them and keep the
    difference, so each token costs the window, not the whole output. A window whose text ends in
    U+FFFD (a multi-byte character not complete yet) waits for the next token."""
    prefix, read = req.detok_offsets
    if upto <= read:
        return ""
    ids = req.output_token_ids
    before = decode(ids[prefix:read]) if read > prefix else ""
    after = decode(ids[prefix:upto])
    if len(after) <= len(before) or after.endswith("\ufffd"):
        return ""
    req.detok_offsets = (read, upto)
    return after[len(before):]


def output_decoder(req: Request, decode: Callable[..., str]) -> Callable[[list[int]], str]:
    """`decode` as the request's output text wants it: special tokens left out unless
    `SamplingParams.skip_special_tokens` is False (vLLM). The flag is passed only then, so a plain
    `decode(ids)` (a tokenizer's, whose default skips them) serves the default."""
    if req.sampling_params.skip_special_tokens:
        return decode
    return functools.partial(decode, skip_special_tokens=False)


def check_stop_strings(req: Request, decode: Callable[[list[int]], str], drop_last: bool) -> str | None:
    """After a token was appended: whether the request's output text now contains one of its stop
    strings, ending in text that the tokens since the last check added (so a stop string spread
    over several tokens is found once its last character arrives). The text grows incrementally
    (`decode_new_text`): O(new text) per token, never the whole output. On a hit, `req.output_text`
    is the text cut as vLLM cuts it and the stop string is returned. `drop_last`: the last token is
    a stop token whose text is left out. Text made by the first `min_tokens` tokens is not
    searched (vLLM)."""
    params = req.sampling_params
    new = decode_new_text(req, output_decoder(req, decode), len(req.output_token_ids) - drop_last)
    text = (req.output_text or "") + new
    req.output_text = text
    if len(req.output_token_ids) <= params.min_tokens:
        return None
    hit = stop_strings_hit(text, len(new), params.stop, params.include_stop_str_in_output)
    if hit is None:
        return None
    stop_str, cut = hit
    if cut != -1:
        req.output_text = text[:cut]
    return stop_str


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's): its text and token ids, why it finished, and its logprobs
    when asked for. `index` is the sample's number among the request's n."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[dict[int, Logprob]] | None = None   # per token, when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None            # the sum of the tokens' logprobs (same)
    stop_reason: int | str | None = None               # the stop id or stop string (None: EOS or length)


@dataclass
class RequestOutput:
    """A finished request as `generate`, `chat` and `step().outputs` return it (vLLM's): the prompt,
    one CompletionOutput per sample, the prompt logprobs when asked for, and the prompt tokens its
    admission took from the prefix cache."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # None for the first prompt token
    num_cached_tokens: int = 0          # prompt tokens its (last) admission took from the prefix cache


def completion_output(req: Request, decode: Callable[[list[int]], str]) -> CompletionOutput:
    """A finished request's CompletionOutput. As in vLLM, a stop token stays in `token_ids` but its
    text is left out of `text` (unless `include_stop_str_in_output`); a stop string cuts `text`."""
    params = req.sampling_params
    if isinstance(req.stop_reason, str):
        text = req.output_text
    else:
        shown = req.output_token_ids
        if req.finish_reason() == "stop" and not params.include_stop_str_in_output:
            shown = shown[:-1]
        text = output_decoder(req, decode)(shown)
    logprobs = cumulative = None
    if params.logprobs is not None:
        logprobs = [d for rows in req.logprobs for d in logprob_dicts(rows, decode)]
        cumulative = float(sum(float(rows.logprobs[:, 0].astype(np.float64).sum()) for rows in req.logprobs))
    return CompletionOutput(req.index, text, list(req.output_token_ids), req.finish_reason(), logprobs,
                            cumulative, req.stop_reason)


def request_output(req: Request, decode: Callable[[list[int]], str]) -> RequestOutput:
    """The RequestOutput of a finished request, or of an n > 1 parent whose children all finished
    (one CompletionOutput per child, by index)."""
    source = req.parent or req
    outputs = [completion_output(c, decode) for c in source.children] if source.children else \
        [completion_output(req, decode)]
    prompt_logprobs = None
    if source.sampling_params.prompt_logprobs is not None:
        prompt_logprobs = [None] + [d for c in source.prompt_logprobs for d in logprob_dicts(c, decode)]
    return RequestOutput(source.request_id, source.prompt, list(source.prompt_token_ids), outputs,
                         finished=True, prompt_logprobs=prompt_logprobs,
                         num_cached_tokens=max(c.num_cached_tokens for c in (source.children or [req])))


def finished_outputs(finished: list[Request], decode: Callable[[list[int]], str]) -> list[RequestOutput]:
    """The RequestOutputs that the requests finished in a step complete: a plain request's own, and
    an n > 1 parent's once all its children have finished (once, however many finished together)."""
    outputs, done = [], set()
    for req in finished:
        parent = req.parent
        if parent is None:
            outputs.append(request_output(req, decode))
        elif id(parent) not in done and all(c.status.is_finished for c in parent.children):
            done.add(id(parent))
            outputs.append(request_output(parent, decode))
    return outputs


def make_children(parent: Request) -> list[Request]:
    """The n children of an n > 1 request: child i has the parent's prompt and params (n=1, no
    prompt logprobs: the parent computes them) and the seed parent seed + i; id "i_<parent id>"
    (vLLM's)."""
    params = parent.sampling_params
    children = []
    for i in range(params.n):
        seed = child_seed(parent.sampling_seed, i)
        child_params = copy_params(params, n=1, prompt_logprobs=None,
                                    seed=None if params.seed is None else seed)
        children.append(Request(child_id(parent.request_id, i), list(parent.prompt_token_ids), child_params,
                                parent.eos_token_ids, prompt=parent.prompt, sampling_seed=seed, index=i,
                                parent=parent))
    return children


def child_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


# ---- checks before a request is queued ------------------------------------------------------------
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
