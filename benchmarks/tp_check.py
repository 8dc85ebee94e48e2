"""Tensor parallelism on a device: TP=2 against TP=1, one line per check, exit 1 on any failure.

    python benchmarks/tp_check.py --device cuda     # NCCL, one GPU per rank (gpu_check.sh part `tp`)
    python benchmarks/tp_check.py --device cpu      # the same checks on gloo (what CI's tests cover)

With fewer than two GPUs the CUDA run prints `tp: not run (...)` and exits 0: the state is "not run",
never "passed". Checks, per preset: TP=2's greedy and seeded tokens equal TP=1's and every step's
logits are within 1e-4 (fp32; TF32 off in every process through NVIDIA_TF32_OVERRIDE=0, which the
spawned worker inherits); inspect="full" on tiny-mamba2: the states gathered from both ranks equal
TP=1's (`diff_traces`), every rank's metadata equal (no violation); a row per rank in
`memory_report()`; a killed worker makes `step()` raise TensorParallelError naming rank 1 within 30 s.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")       # before CUDA starts here or in a worker

import torch
import torch.multiprocessing as mp

from toolkit import LLM, SamplingParams, TensorParallelError
from toolkit.inspect.trace_diff import diff_traces

PRESETS = ["tiny-llama", "tiny-mamba2", "tiny-bamba", "tiny-jamba", "tiny-qwen3-next", "demo-hybrid"]
PROMPTS = [list(range(5, 26)), list(range(30, 39)), list(range(40, 54))]
PARAMS = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)]
ATOL = 1e-4


def run(preset: str, tp: int, device: str, inspect: str = "metadata") -> tuple[LLM, list, list]:
    llm = LLM(preset, tensor_parallel_size=tp, device=device, dtype="float32", max_num_seqs=4,
              max_num_batched_tokens=16, inspect=inspect)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    logits = [r.logits.float().cpu() for r in llm.trace if r.logits is not None and not r.is_warmup]
    return llm, [list(o.outputs[0].token_ids) for o in outs], logits


def line(name: str, ok: bool, detail: str) -> bool:
    print(f"{name:<34} {'PASS' if ok else 'FAIL'}  {detail}", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--presets", nargs="+", default=PRESETS)
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"tp: not run (needs at least 2 GPUs for TP=2 on NCCL; this machine has {torch.cuda.device_count()})")
        return 0
    start, ok = time.perf_counter(), True
    for preset in args.presets:
        one, want, ref = run(preset, 1, args.device)
        one.shutdown()
        two, got, logits = run(preset, 2, args.device)
        clean = all(not r.violations for r in two.trace)
        two.shutdown()
        diff = max((a - b).abs().max().item() for a, b in zip(logits, ref, strict=True))
        ok &= line(f"tp2_vs_tp1 {preset}", got == want and diff <= ATOL and clean,
                   f"tokens {'equal' if got == want else 'DIFFER'}, max |logit diff| {diff:.2e} (<= {ATOL:g}), "
                   f"{'no' if clean else 'SOME'} check violations")
    one, _, _ = run("tiny-mamba2", 1, args.device, "full")
    two, _, _ = run("tiny-mamba2", 2, args.device, "full")
    diff = diff_traces(one.trace, two.trace)
    report = two.memory_report()
    ok &= line("gathered_states tiny-mamba2", diff.identical, str(diff))
    ok &= line("memory_per_rank tiny-mamba2", report.ranks is not None and len(report.ranks) == 2,
               "; ".join(f"rank {r}: weights {m['weights']} B, state_cache {m['state_cache']} B"
                         for r, m in enumerate(report.ranks or [])))
    one.shutdown()
    two.shutdown()
    llm = LLM("tiny-llama", tensor_parallel_size=2, device=args.device, dtype="float32")
    llm.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=50, ignore_eos=True))
    llm.step()
    os.kill(mp.active_children()[0].pid, signal.SIGKILL)
    began = time.monotonic()
    try:
        llm.step()
        ok &= line("killed_worker_named", False, "step() did not raise")
    except TensorParallelError as err:
        seconds = time.monotonic() - began
        ok &= line("killed_worker_named", "rank 1" in str(err) and seconds < 30, f"{seconds:.1f} s: {err}"[:160])
    llm.shutdown()
    ok &= line("no_process_left", not mp.active_children(), f"{len(mp.active_children())} children")
    print(f"tp_check: {'all passed' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s on {args.device}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
