"""What the user gets back for a finished request (vLLM's `RequestOutput`, `CompletionOutput`,
`Logprob`), assembled from the scheduler's `Request`: its text (a stop token's text left out, a
stop string's cut), its token ids, its logprobs as vLLM's dicts."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from toolkit.request import Request, TokenLogprobs
from toolkit.stop_strings import output_decoder


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
