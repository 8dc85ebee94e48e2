"""Prefix caching on a shared-prefix workload: prompt tokens computed and time to first token,
`enable_prefix_caching` off and on (cache modes "align" and "all"), in one run.

    python benchmarks/prefix_caching.py [--presets tiny-bamba tiny-mamba2 demo-hybrid]
                                        [--requests 16] [--prefix 480] [--unique 32]

Each of --requests prompts is one shared --prefix-token prefix (a system prompt) followed by
--unique tokens of its own; 8 greedy output tokens each. Two arrival patterns:
- "one by one": a request arrives when the one before has its first token (users of a chat app);
- "together": all arrive at once (a batch job): those admitted before anything is cached compute
  the prefix themselves.
Cache modes: "align" (vLLM MRV2's: a recurrent state is saved where a prefill chunk ends on a block
boundary) and "all" (`mamba_cache_mode="all"`: also at every block boundary inside a chunk).
Prompt tokens computed = prompt tokens - tokens taken from the cache (`llm.stats()`); TTFT = seconds
from `add_request` to the step that produced the request's first token (mean over requests).
Tokens with the cache on must equal tokens with it off (checked). CPU, fp32, inspect="off".
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

from toolkit import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))   # table.py beside it, also under PYTHONSAFEPATH=1
from table import print_markdown_table


def prompts(vocab: int, n: int, prefix: int, unique: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(prefix)]
    return [shared + [rng.randrange(3, vocab) for _ in range(unique)] for _ in range(n)]


def serve(llm: LLM, batch: list[list[int]], arrival: str) -> tuple[list[list[int]], list[float]]:
    """(output tokens, TTFT seconds) per request."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    reqs = {}

    def add(i: int) -> None:
        rid = llm.add_request({"prompt_token_ids": batch[i]}, params, request_id=f"r{i}")
        reqs[rid] = llm.scheduler.requests[rid]
        added[rid] = time.perf_counter()

    pending = list(range(len(batch)))
    if arrival == "together":
        for i in pending:
            add(i)
        pending = []
    else:
        add(pending.pop(0))
    while llm.has_unfinished_requests() or pending:
        llm.step()
        now = time.perf_counter()
        for rid, req in reqs.items():
            if rid not in first and req.output_token_ids:
                first[rid] = now
        if pending and f"r{pending[0] - 1}" in first:
            add(pending.pop(0))
    ids = [f"r{i}" for i in range(len(batch))]
    return [list(reqs[r].output_token_ids) for r in ids], [first[r] - added[r] for r in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny-bamba", "tiny-mamba2", "demo-hybrid"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=480)
    ap.add_argument("--unique", type=int, default=32)
    args = ap.parse_args()
    rows = []
    for preset in args.presets:
        for arrival in ("one by one", "together"):
            tokens, ttft = {}, {}
            for mode in ("off", "align", "all"):
                caching = mode != "off"
                llm = LLM(preset, device="cpu", dtype="float32", inspect="off", max_num_seqs=16,
                          max_num_batched_tokens=512, block_size=16,
                          max_model_len=args.prefix + args.unique + 16, enable_prefix_caching=caching,
                          mamba_cache_mode=mode if caching else None)
                llm.warmup(progress=False)
                batch = prompts(llm.vocab_size, args.requests, args.prefix, args.unique)
                start = time.perf_counter()
                tokens[mode], ttft[mode] = serve(llm, batch, arrival)
                seconds = time.perf_counter() - start
                total = sum(len(p) for p in batch)
                skipped = llm.stats().get("prompt_tokens_skipped", 0)
                ratio = f"{sum(ttft['off']) / sum(ttft[mode]):.2f}x" if caching else ""
                rows.append([preset, arrival, mode, f"{total - skipped:,} of {total:,}",
                             f"{100 * skipped / total:.1f}%", f"{1e3 * sum(ttft[mode]) / len(batch):.0f} ms",
                             f"{seconds:.1f} s", ratio])
                llm.shutdown()
                assert tokens[mode] == tokens["off"], f"{preset}, {arrival}, {mode}: outputs differ with the cache on"
    print(f"\n### Prefix caching: {args.requests} requests, a {args.prefix}-token shared prefix + "
          f"{args.unique} own tokens, 8 output tokens; CPU fp32, block_size 16\n")
    print_markdown_table(["preset", "arrival", "cache", "prompt tokens computed", "skipped",
                          "mean TTFT", "wall time", "TTFT off / on"], rows)


if __name__ == "__main__":
    main()
