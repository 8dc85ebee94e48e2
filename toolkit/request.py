"""Requests as the scheduler sees them (vLLM's `Request`): their status, the logprobs the runner
hands back for them (`TokenLogprobs`, host arrays), and the parent/children of an `n` > 1 request.

Beside it: what the user gets back (outputs.py), stop strings and incremental detokenization
(stop_strings.py), the checks a request passes before it is queued (admission.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from toolkit.sampling import SamplingParams, child_seed, copy_params

if TYPE_CHECKING:       # a sibling floor: request.py does not import the KV manager at run time
    from toolkit.kv_cache_manager import PrefixLookup

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
