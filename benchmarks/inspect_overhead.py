"""What recording costs: decode throughput with inspect="off", "metadata" (checks on and off) and
"full", against the same engine with recording removed (a bare schedule -> execute -> sample ->
update step, no record, no checks, no timings, no recovery).

    python benchmarks/inspect_overhead.py [--presets tiny-bamba tiny-mamba2] [--batch 8]

Method: decode step = (t(N tokens) - t(1 token)) / (N - 1) through `LLM.generate`, greedy, no EOS;
the modes are interleaved and each takes the best of --repeats runs, so slow drift of the machine
hits them alike. Run it on an idle machine: on 2 cores another busy process swamps the differences.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

from toolkit import LLM, SamplingParams
from toolkit.outputs import request_output

sys.path.insert(0, os.path.dirname(__file__))   # table.py beside it, also under PYTHONSAFEPATH=1
from table import print_markdown_table


class BareLLM(LLM):
    """The engine with recording removed: what `inspect="off"` is measured against."""

    def _step(self, stage, want_record=False):
        sched_out = self.scheduler.schedule()
        self.model_runner.execute_model(sched_out)
        finished, _ = self.scheduler.update_from_output(sched_out, self.model_runner.sample_tokens())
        self.model_runner.remove_requests([r.request_id for r in finished])
        return None, [request_output(r, self.tokenizer.decode) for r in finished]


MODES = {  # name -> (class, LLM kwargs)
    "removed": (BareLLM, dict(inspect="off")),
    "off": (LLM, dict(inspect="off")),
    "metadata, no checks": (LLM, dict(inspect="metadata", checks=False)),
    "metadata": (LLM, dict(inspect="metadata")),
    "full": (LLM, dict(inspect="full")),
}


def run(llm: LLM, prompts: list[list[int]], k: int) -> float:
    params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny-bamba", "tiny-mamba2"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    print(f"device={args.device} dtype={args.dtype} torch={torch.__version__} threads="
          f"{torch.get_num_threads()} batch={args.batch} prompt_len={args.prompt_len} "
          f"new_tokens={args.new_tokens} repeats={args.repeats}")
    rows = []
    for preset in args.presets:
        llms = {name: cls(preset, device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
                          max_num_batched_tokens=args.batch * args.prompt_len,
                          trace_capacity=64, **kw)
                for name, (cls, kw) in MODES.items()}
        rng = random.Random(0)
        prompts = [[rng.randrange(3, llms["off"].vocab_size) for _ in range(args.prompt_len)]
                   for _ in range(args.batch)]
        best = {name: [float("inf"), float("inf")] for name in llms}
        for llm in llms.values():                            # warm-up
            run(llm, prompts, 2)
        for _ in range(args.repeats):
            for name, llm in llms.items():
                best[name][0] = min(best[name][0], run(llm, prompts, 1))
                best[name][1] = min(best[name][1], run(llm, prompts, args.new_tokens))
        base = None
        for name, (t1, tn) in best.items():
            step = (tn - t1) / (args.new_tokens - 1)
            base = step if base is None else base
            rows.append([preset, name, f"{step * 1e3:.3f}", f"{args.batch / step:,.0f}",
                         f"{(step / base - 1) * 100:+.1f}%"])
            print("  ".join(rows[-1]), flush=True)
        for llm in llms.values():
            llm.shutdown()
    header = ["preset", "mode", "decode step ms", "decode tok/s", "vs removed"]
    print()
    print_markdown_table(header, rows)


if __name__ == "__main__":
    main()
