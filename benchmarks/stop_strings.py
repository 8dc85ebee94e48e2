"""Host cost of stop-string matching per generated token (toolkit/request.py `check_stop_strings`, text
decoded incrementally): microseconds per token per request over the last 256 tokens of outputs of 1k,
4k and 16k tokens, byte tokenizer (the presets' and demo models'), two stop strings that never match.
The cost must not grow with the output's length.

    python benchmarks/stop_strings.py
"""
from __future__ import annotations

import random
import time

from toolkit.request import Request
from toolkit.sampling import SamplingParams
from toolkit.stop_strings import check_stop_strings
from toolkit.tokenizer import ByteTokenizer

WORDS = ["the", "runner", "state", "cache", "héllo", "–", "prefix", "step", "🙂"]


def us_per_token(length: int, tail: int = 256) -> float:
    tok = ByteTokenizer(300)
    rng = random.Random(0)
    ids: list[int] = []
    while len(ids) < length:
        ids += tok.encode(" " + rng.choice(WORDS))[1:]
    ids = ids[:length]
    req = Request("r", [1], SamplingParams(max_tokens=length + 1, stop=["never there", "zzz"]), frozenset())
    for token in ids[:-tail]:
        req.output_token_ids.append(token)
        check_stop_strings(req, tok.decode, drop_last=False)
    start = time.perf_counter()
    for token in ids[-tail:]:
        req.output_token_ids.append(token)
        check_stop_strings(req, tok.decode, drop_last=False)
    return (time.perf_counter() - start) / tail * 1e6


if __name__ == "__main__":
    print("| output tokens | stop-string check, us per token |")
    print("|---|---|")
    for n in (1024, 4096, 16384):
        print(f"| {n} | {min(us_per_token(n) for _ in range(3)):.1f} |")
