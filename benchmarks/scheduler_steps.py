"""Host time of the scheduler's books per decode step (schedule + update_from_output; no model, no
runner): 128 rows at contexts of 1k and 16k tokens, one attention group (block 16), with and without
prefix caching. A step's books must not grow with the context (issue "Cost that grows with the new
tokens"); `benchmarks/host_overhead.py`, with every stage, is still to come.

    python benchmarks/scheduler_steps.py
"""
from __future__ import annotations

import time

from toolkit.kv_cache_manager import CacheGroupKind
from toolkit.request import Request
from toolkit.sampling import SamplingParams
from toolkit.scheduler import ModelRunnerOutput, Scheduler

BS = 16


def ms_per_step(context: int, rows: int = 128, caching: bool = True, steps: int = 20) -> float:
    s = Scheduler(max_num_seqs=rows, max_num_batched_tokens=rows * context, max_model_len=context + 100,
                  groups=[CacheGroupKind("attention", BS)], num_kv_blocks=rows * (context // BS + 10),
                  enable_prefix_caching=caching, num_state_pages=None)
    params = SamplingParams(max_tokens=steps + 5, ignore_eos=True)
    for r in range(rows):
        s.add_request(Request(str(r), [(r * 7 + i) % 251 + 3 for i in range(context)], params, frozenset()))
    out = s.schedule()                                   # every prompt in one step
    s.update_from_output(out, ModelRunnerOutput.one_token_a_row({r: 5 for r in out.num_scheduled_tokens}))
    start = time.perf_counter()
    for _ in range(steps):
        out = s.schedule()
        s.update_from_output(out, ModelRunnerOutput.one_token_a_row({r: 5 for r in out.num_scheduled_tokens}))
    return (time.perf_counter() - start) / steps * 1e3


if __name__ == "__main__":
    print("| context | prefix caching, ms/step | no caching, ms/step |")
    print("|---|---|---|")
    for context in (1024, 16384):
        print(f"| {context} | {ms_per_step(context):.1f} | {ms_per_step(context, caching=False):.1f} |")
