"""Kernels per decode step, per preset and backend: the number that decides a CUDA-graph decode step at
small batch on a GPU (each kernel costs a few microseconds however little it does), counted on any
device (toolkit/inspect/launches.py: torch ops that launch a kernel on a GPU, plus Triton launches).

    python benchmarks/launch_count.py [--presets tiny-mamba2 tiny-bamba ...] [--backends torch triton]

For one decode step at batch 1 it prints the kernels of the model forward (what a CUDA graph replays),
per layer, and of the rest of the runner step (inputs, metadata, logits, sampling: eager on every
device). On a CPU the Triton backend runs under the interpreter: use the tiny presets there (the
count per layer does not depend on the sizes).
"""
from __future__ import annotations

import argparse
import os
import sys

if "--device" not in sys.argv or sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")    # before anything imports triton (a dispatch mode does)
sys.path.insert(0, os.path.dirname(__file__))
from toolkit import LLM
from toolkit.inspect.launches import LaunchCounter, count_decode_step

from table import print_markdown_table


def decode_step_launches(preset: str, backend: str, device: str = "cpu") -> tuple[LaunchCounter, LaunchCounter, int]:
    """(forward counter, whole runner step counter, number of layers) of a decode step at batch 1."""
    llm = LLM(preset, inspect="off", backend=backend, device=device, enforce_eager=True, max_num_seqs=4,
              max_model_len=64, max_num_batched_tokens=64)
    forward, step = count_decode_step(llm)
    layers = len(llm.model.body.layers)
    llm.shutdown()
    return forward, step, layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny-mamba2", "tiny-bamba", "tiny-lfm2", "tiny-llama"])
    ap.add_argument("--backends", nargs="+", default=["torch", "triton"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--top", type=int, default=6, help="kernels listed per row")
    args = ap.parse_args()
    rows = []
    for preset in args.presets:
        for backend in args.backends:
            fwd, step, layers = decode_step_launches(preset, backend, args.device)
            top = ", ".join(f"{n} {c}" for n, c in fwd.table()[:args.top])
            rows.append([preset, backend, str(layers), str(fwd.total), f"{fwd.total / layers:.1f}",
                         str(step.total - fwd.total), top])
            print("  ".join(rows[-1]), flush=True)
    print()
    print_markdown_table(["preset", "backend", "layers", "forward kernels", "per layer", "rest of step",
                          "most launched in the forward"], rows)


if __name__ == "__main__":
    main()
