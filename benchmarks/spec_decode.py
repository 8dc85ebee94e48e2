"""Speculative decoding (n-gram prompt lookup, and a draft model): tokens per target forward and
decode speed, off and on, in one run, with the outputs checked equal to plain decoding's (asserted in
float32; in bfloat16 the last column says how far they agree, see `agreement`).

    python benchmarks/spec_decode.py [--presets demo-hybrid demo-mamba bamba-300m-shape]
                                     [--ks 2 4] [--requests 8] [--max-tokens 64] [--repeats 3]
                                     [--draft demo-hybrid=demo-mamba ...] [--device cuda --dtype bfloat16]

Each of --requests prompts repeats itself (a code listing, a table, a chant: the kind of text prompt
lookup is for), greedy, --max-tokens output tokens each, all arriving together. Per engine:
- tokens per target forward: output tokens / decode rows run (each verify row is one forward of the
  target for its request, however many drafts it carries);
- acceptance rate and mean accepted length (`llm.stats()`: drafts accepted / proposed; tokens a
  verify row keeps);
- decode speed: output tokens / seconds from the first token of every request to the last, the
  best of --repeats serves (one serve is about 0.2 s on a tiny model: a stall of the machine or a
  garbage collection can double it, and the best is what the engine does when nothing interferes).
--draft TARGET=DRAFT adds rows with method "draft_model" (DRAFT proposes k greedy tokens inside the
target's step; it must share TARGET's vocabulary: the two demo models do). Their last column is the
draft's host time over the time of its own forwards (k per target step at most): what the draft
costs around its forwards (batches, metadata, the copy of its state to the scratch rows), 1.00x
being none. `bamba-300m-shape` has random weights
(shape-true: a real model's layer sizes): its outputs rarely repeat, so few drafts are proposed or
accepted; the trained demo models are where prompt lookup works. CPU, fp32, inspect="off",
prompt_lookup_min 2, prompt_lookup_max 5. Each engine serves the prompts once untimed first. On a
CPU the verify rows' extra positions cost more than they save (the torch verify runs a row's positions
one after another in each recurrent layer; the Triton kernels take them in one launch, on a GPU; tiny
models are op-bound): the point of these numbers is tokens per target forward, which is what a GPU
turns into speed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from toolkit import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))   # table.py beside it, also under PYTHONSAFEPATH=1
from table import print_markdown_table

TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "| name | kind | size |\n| conv | state | 3 |\n| ssm | state | 16 |\n| kv | cache | 16 |\n| ",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the ",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
]


def serve(llm: LLM, prompts: list, max_tokens: int) -> tuple[list[list[int]], int, float]:
    """(output tokens per request, decode rows run, seconds of the decode phase)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    reqs = {rid: llm.scheduler.requests[rid] for rid in ids}
    decode_rows, decode_start = 0, None
    while llm.has_unfinished_requests():
        rec = llm.step()
        decode_rows += rec.num_decodes
        if decode_start is None and all(r.output_token_ids for r in reqs.values()):
            decode_start = time.perf_counter()
    seconds = time.perf_counter() - decode_start if decode_start else float("nan")
    return [list(reqs[r].output_token_ids) for r in ids], decode_rows, seconds


def agreement(out: list[list[int]], plain: list[list[int]]) -> str:
    """"yes" when the outputs equal plain decoding's; else the share of output tokens before each
    request's first difference, and how many requests differ."""
    if out == plain:
        return "yes"
    same = sum(next((i for i, (a, b) in enumerate(zip(o, p)) if a != b), min(len(o), len(p)))
               for o, p in zip(out, plain))
    differ = sum(o != p for o, p in zip(out, plain))
    return f"{same / sum(len(p) for p in plain):.0%} before parting ({differ} of {len(plain)} requests part)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["demo-hybrid", "demo-mamba", "bamba-300m-shape"])
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed serves per engine (the best is reported)")
    ap.add_argument("--draft", nargs="*", default=["demo-hybrid=demo-mamba"],
                    help="TARGET=DRAFT pairs for method draft_model")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (Triton ops and decode graphs)")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    drafts = dict(pair.split("=", 1) for pair in args.draft)
    rows = []
    for preset in args.presets:
        tokens, speed = {}, {}
        runs = [(0, None)] + [(k, "ngram") for k in args.ks]
        runs += [(k, "draft_model") for k in args.ks if preset in drafts]
        for k, method in runs:
            spec = None
            if method == "ngram":
                spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
            elif method == "draft_model":
                spec = {"method": "draft_model", "model": drafts[preset], "num_speculative_tokens": k}
            llm = LLM(preset, device=args.device, dtype=args.dtype, inspect="off", max_num_seqs=args.requests,
                      max_num_batched_tokens=512, max_model_len=512, speculative_config=spec)
            prompts = [TEXTS[i % len(TEXTS)] for i in range(args.requests)]
            llm.warmup(progress=False)
            serve(llm, prompts, args.max_tokens)      # untimed: a process's first run pays one-off costs
            # (the rates in stats() are the same over every run: greedy, the same prompts)
            runs = [serve(llm, prompts, args.max_tokens) for _ in range(args.repeats)]
            out, decode_rows, seconds = min(runs, key=lambda run: run[2])
            stats = llm.stats()
            llm.shutdown()
            label = "off" if not k else f"n-gram k={k}" if method == "ngram" else f"draft {drafts[preset]} k={k}"
            tokens[label] = out
            after_first = sum(len(o) - 1 for o in out)          # the decode phase's tokens
            speed[label] = after_first / seconds
            around = (f"{stats['draft_seconds'] / stats['draft_forward_seconds']:.2f}x "
                      f"({stats['draft_forwards'] / stats['draft_steps']:.2f} fwd/step)"
                      if method == "draft_model" else "")
            rows.append([preset, label, f"{after_first / max(decode_rows, 1):.2f}",
                         f"{stats['spec_acceptance_rate']:.1%}" if k else "",
                         f"{stats['spec_mean_accepted_length']:.2f}" if k else "",
                         f"{speed[label]:.0f} tok/s", f"{speed[label] / speed['off']:.2f}x", around])
            rows[-1].append(agreement(out, tokens["off"]))
            # fp32: equal, or the verify path is wrong. Lower precision: a verify row's positions run
            # in other kernels and batch shapes than plain decoding's, so a near-tie of two logits
            # (frequent with random weights) may round the other way and the greedy texts part there,
            # as in vLLM; the column says how much of the output came before the first parting.
            assert out == tokens["off"] or args.dtype != "float32", \
                f"{preset}, {label}: outputs differ from plain decoding"
    print(f"\n### Speculative decoding: {args.requests} repetitive prompts together, "
          f"{args.max_tokens} greedy tokens each; {args.device} {args.dtype}\n")
    print_markdown_table(["preset", "speculation", "tokens per target forward", "acceptance",
                          "mean accepted length", "decode speed", "vs off", "draft time / its forwards",
                          "equals off"], rows)


if __name__ == "__main__":
    main()
