"""Stop strings on an output text decoded incrementally (toolkit/request.py `check_stop_strings`,
vLLM's incremental detokenization): the text built token by token equals the whole output decoded at
once, multi-byte characters included; each token decodes a window of a few tokens, never the whole
output (so a 4k-token output costs O(new text) per token); a stop string whose last character arrives
in a later token than its first, or spans a multi-byte character, cuts where vLLM cuts."""
from __future__ import annotations

from toolkit.request import Request
from toolkit.sampling import SamplingParams
from toolkit.stop_strings import check_stop_strings
from toolkit.tokenizer import ByteTokenizer

TOK = ByteTokenizer(300)
TEXT = "héllo wörld – ok 🙂 naïve " * 40          # 1-, 2-, 3- and 4-byte characters, one byte a token


def _request(stop: list[str], **params) -> Request:
    return Request("r", [1], SamplingParams(max_tokens=10_000, stop=stop, **params), frozenset())


def _feed(req: Request, ids: list[int], decode) -> str | None:
    for token in ids:
        req.output_token_ids.append(token)
        hit = check_stop_strings(req, decode, drop_last=False)
        if hit is not None:
            return hit
    return None


def test_incremental_text_equals_the_whole_decode_and_decodes_a_window_per_token():
    ids = TOK.encode(TEXT)[1:]
    windows: list[int] = []

    def decode(window: list[int]) -> str:
        windows.append(len(window))
        return TOK.decode(window)

    req = _request(["never there"])
    assert _feed(req, ids, decode) is None
    assert req.output_text == TOK.decode(ids) == TEXT
    assert len(ids) > 1000 and max(windows) <= 8      # a 4-byte character waits for its last byte


def test_a_stop_string_ending_in_a_multi_byte_character_cuts_before_it():
    ids = TOK.encode(TEXT)[1:]
    req = _request(["ld – ok 🙂"])
    assert _feed(req, ids, TOK.decode) == "ld – ok 🙂"
    assert req.output_text == "héllo wör"
    assert len(req.output_token_ids) == len("héllo wörld – ok 🙂".encode())   # found at its last byte


def test_include_stop_str_and_drop_last():
    ids = TOK.encode("abc stop xyz")[1:]
    req = _request(["stop"], include_stop_str_in_output=True)
    assert _feed(req, ids, TOK.decode) == "stop" and req.output_text == "abc stop"
    req = _request(["c s"])
    for token in ids[:5]:
        req.output_token_ids.append(token)
    assert check_stop_strings(req, TOK.decode, drop_last=True) is None     # the 5th token's " s" left out
    assert req.output_text == "abc "
