"""Host time of the n-gram proposer per row per step (toolkit/runner/spec_decode.py): the scan of the
whole context (`propose` without a request id, the reference) against the per-request NgramIndex fed
with one new token a step, at contexts of 1k, 8k and 32k tokens; k=3, n in [1, 3]
(three n-gram sizes), random tokens of a 2k vocabulary (mostly misses, the costly case for the scan).

    python benchmarks/ngram_lookup.py
"""
from __future__ import annotations

import time

import numpy as np

from toolkit.runner.spec_decode import NgramProposer

STEPS = 200


def us_per_row(length: int, indexed: bool) -> float:
    tokens = np.random.default_rng(0).integers(0, 2000, size=length + STEPS)
    p = NgramProposer(k=3, min_n=1, max_n=3)
    rid = "r" if indexed else None
    p.propose(tokens[:length], rid)                      # the prompt, indexed once
    start = time.perf_counter()
    for n in range(length + 1, length + STEPS + 1):
        p.propose(tokens[:n], rid)
    return (time.perf_counter() - start) / STEPS * 1e6


if __name__ == "__main__":
    print("| context | scan, us per row per step | NgramIndex, us per row per step |")
    print("|---|---|---|")
    for length in (1024, 8192, 32768):
        print(f"| {length} | {us_per_row(length, False):.0f} | {us_per_row(length, True):.1f} |")
