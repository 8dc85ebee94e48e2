"""Decode throughput of the runner vs HF `generate`, same weights, greedy, no EOS.

    python benchmarks/decode_throughput.py [--presets tiny-llama tiny-mamba2 tiny-bamba]
                                           [--batches 1 16] [--prompt-len 32] [--new-tokens 32]

Method (the one used for the H200 HF baseline): t1 = time to generate 1 token (prefill + 1),
tN = time to generate N tokens; decode step = (tN - t1) / (N - 1); decode tok/s = batch / step.
Each measurement is the best of --repeats runs after one warm-up run. The runner is used through
`LLM.generate` (eager torch path on CPU, no CUDA graphs yet) with `inspect="off"`.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from toolkit import LLM, SamplingParams
from toolkit.models import save_hf_folder

sys.path.insert(0, os.path.dirname(__file__))   # table.py beside it, also under PYTHONSAFEPATH=1
from table import print_markdown_table


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def runner_times(llm: LLM, prompts: list[list[int]], n: int, repeats: int) -> tuple[float, float]:
    def gen(k: int):
        params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        return lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return best_time(gen(1), repeats), best_time(gen(n), repeats)


@torch.inference_mode()
def hf_times(hf, prompts: list[list[int]], n: int, repeats: int) -> tuple[float, float]:
    ids = torch.tensor(prompts, device=hf.device)
    mask = torch.ones_like(ids)

    def gen(k: int):
        return lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k,
                                   do_sample=False, pad_token_id=0)
    return best_time(gen(1), repeats), best_time(gen(n), repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny-llama", "tiny-mamba2", "tiny-bamba"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    print(f"device={args.device} dtype={args.dtype} torch={torch.__version__} "
          f"threads={torch.get_num_threads()} prompt_len={args.prompt_len} new_tokens={args.new_tokens}")
    header = ["preset", "batch", "engine", "prefill+1 ms", "decode step ms", "decode tok/s"]
    rows = []
    for preset in args.presets:
        max_batch = max(args.batches)
        with LLM(preset, device=args.device, dtype=args.dtype, max_num_seqs=max_batch,
                 max_num_batched_tokens=max_batch * args.prompt_len, inspect="off") as llm, \
                tempfile.TemporaryDirectory() as folder:
            save_hf_folder(llm, folder)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()
            rng = random.Random(0)
            for batch in args.batches:
                prompts = [[rng.randrange(3, llm.vocab_size) for _ in range(args.prompt_len)]
                           for _ in range(batch)]
                for engine, times in (("runner", runner_times(llm, prompts, args.new_tokens, args.repeats)),
                                      ("hf", hf_times(hf, prompts, args.new_tokens, args.repeats))):
                    t1, tn = times
                    step = (tn - t1) / (args.new_tokens - 1)
                    rows.append([preset, str(batch), engine, f"{t1 * 1e3:.1f}", f"{step * 1e3:.2f}",
                                 f"{batch / step:,.0f}"])
                    print("  ".join(rows[-1]), flush=True)
    print()
    print_markdown_table(header, rows)


if __name__ == "__main__":
    main()
