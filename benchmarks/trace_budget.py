"""What full-mode inspection costs, and that the trace's byte budget bounds it.

    python benchmarks/trace_budget.py [--preset mamba2-130m-shape] [--requests 16] [--steps 300]
                                      [--budget "1 GiB"] [--timing-steps 12]

Part 1 (memory): an `inspect="full"` engine under `trace_max_bytes=--budget` serves --requests
requests for --steps decode steps (one request-step of state is about 37 MiB on mamba2-130m). The
process's resident memory (RSS, /proc/self/statm) is sampled after every step; it must stay within
the RSS after warmup (model, caches, buffers) plus the budget, plus STEP_SLACK for what a step holds
while it runs (the trace reserves room for a step's states before gathering them, so they are inside
the budget). Prints the figures and checks that the oldest
records say "states dropped" in their HTML and in the State tab.

Part 2 (time): seconds per decode step at batch --requests with inspect="metadata", "full", and
"full" narrowed to one layer (`inspect_layers`) and to one request (`inspect_requests`).
Linux only (RSS from /proc).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

from toolkit import LLM, SamplingParams, TraceBudgetWarning
from toolkit.inspect.memory import fmt_bytes, resolve_trace_budget
from toolkit.inspect.record_views import step_record_html
from toolkit.widgets.panes import why_no_states

sys.path.insert(0, os.path.dirname(__file__))   # table.py beside it, also under PYTHONSAFEPATH=1
from table import print_markdown_table

PAGE = os.sysconf("SC_PAGE_SIZE")
# What one decode step may hold beside the trace while it runs (activations, logits, the allocator's
# free lists): the records' bytes are the budget's; this is not.
STEP_SLACK = 64 * 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def engine(preset: str, requests: int, steps: int, **kw) -> LLM:
    return LLM(preset, device="cpu", dtype="float32", max_num_seqs=requests,
               max_num_batched_tokens=max(256, requests * 8), max_model_len=steps + 16, **kw)


def add_requests(llm: LLM, n: int, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        llm.add_request({"prompt_token_ids": [1 + i, 2, 3, 4]}, params)


def state_bytes_per_request_step(llm: LLM) -> int:
    """One row's states in every recurrent layer, before and after: what full mode copies per request-step."""
    runner = llm.model_runner
    return 2 * sum(t[0].nbytes for g in runner.kv_cache_groups if g.kind == "mamba"
                   for n in g.layer_names for t in runner.kv_caches[n])


def memory_part(args) -> None:
    budget = resolve_trace_budget(args.budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TraceBudgetWarning)
        llm = engine(args.preset, args.requests, args.steps, inspect="full", trace_max_bytes=budget,
                     trace_capacity=None)
        llm.warmup(progress=False)
        llm.trace.clear()                           # the baseline: model, caches, buffers, an empty trace
        base = rss()
        add_requests(llm, args.requests, args.steps)
        peak = base
        beside_trace = 0                            # RSS growth the trace's own bytes do not explain
        start = time.perf_counter()
        for _ in range(args.steps):
            if not llm.has_unfinished_requests():
                break
            llm.step()
            now = rss()
            peak = max(peak, now)
            beside_trace = max(beside_trace, now - base - llm.trace.host_bytes)
        seconds = time.perf_counter() - start
    warned = [w for w in caught if issubclass(w.category, TraceBudgetWarning)]
    per_request_step = state_bytes_per_request_step(llm)
    step_states = per_request_step * args.requests
    records = list(llm.trace.user_steps())
    oldest = records[0]
    rows = [
        ["steps run, requests", f"{len(records)}, {args.requests}"],
        ["states per request-step (before + after)", fmt_bytes(per_request_step)],
        ["states per step (all rows)", fmt_bytes(step_states)],
        ["trace budget (trace_max_bytes)", fmt_bytes(budget)],
        ["RSS after warmup, trace emptied (model, caches, buffers)", fmt_bytes(base)],
        ["peak RSS while stepping", fmt_bytes(peak)],
        ["peak RSS - that baseline", f"{(peak - base) / 2**20:.0f} MiB"],
        ["largest RSS growth beside the trace's bytes (a step's own work; the prefill's forward)",
         f"{beside_trace / 2**20:.0f} MiB"],
        ["trace host bytes at the end", fmt_bytes(llm.trace.host_bytes)],
        ["records trimmed (states dropped)", f"{llm.trace.num_trimmed} of {len(llm.trace)}"],
        ["TraceBudgetWarning shown", f"{len(warned)} time(s)"],
        ["oldest record's HTML says 'states dropped'", str("states dropped" in step_record_html(oldest))],
        ["oldest record's State tab says so", str("states dropped" in (why_no_states(oldest, "full") or ""))],
        ["wall time", f"{seconds:.0f} s"],
    ]
    print(f"\n### Full-mode trace under a byte budget: {args.preset}, {args.requests} requests, CPU fp32\n")
    print_markdown_table(["", "value"], rows)
    print(f"\npeak RSS within the baseline + the budget + {fmt_bytes(STEP_SLACK)} for a step's own "
          f"work: {peak - base <= budget + STEP_SLACK} ({(peak - base) / 2**20:.0f} MiB of "
          f"{budget / 2**20:.0f} MiB + {STEP_SLACK / 2**20:.0f} MiB)")
    llm.shutdown()


def timing_part(args) -> None:
    variants = [("inspect='metadata'", dict(inspect="metadata")),
                ("inspect='full', every layer and request", dict(inspect="full")),
                ("inspect='full', inspect_layers=<one layer>", dict(inspect="full", inspect_layers=r"\.0\.")),
                ("inspect='full', inspect_requests=['0']", dict(inspect="full", inspect_requests=["0"]))]
    rows = []
    for name, kw in variants:
        llm = engine(args.preset, args.requests, args.timing_steps + 4, trace_max_bytes=None, **kw)
        add_requests(llm, args.requests, args.timing_steps + 2)
        llm.step()                                   # the prefill
        llm.step()
        start = time.perf_counter()
        for _ in range(args.timing_steps):
            llm.step()
        per_step = (time.perf_counter() - start) / args.timing_steps
        held = sum(t.nbytes for s in llm.trace[-1].states for t in s.before + s.after)
        rows.append([name, f"{per_step * 1e3:.0f} ms", fmt_bytes(held)])
        llm.shutdown()
    print(f"\n### Cost of a decode step by capture: {args.preset}, batch {args.requests}, CPU fp32, "
          f"{os.cpu_count()} cores\n")
    print_markdown_table(["recording", "time per decode step", "states recorded per step"], rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mamba2-130m-shape")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--budget", default="1 GiB")
    ap.add_argument("--timing-steps", type=int, default=12)
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args()
    if not args.skip_memory:
        memory_part(args)
    timing_part(args)


if __name__ == "__main__":
    main()
