"""Stop strings, as vLLM checks them, over text detokenized incrementally: each new token costs
the text it adds (a small window of the output decoded with and without it), never the whole
output. The scheduler calls `check_stop_strings` after appending a token (scheduler.py)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toolkit.request import Request


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
