"""Held-out bits per byte of the shipped demo models, through this toolkit's runner and through
HF transformers on the same folder, plus greedy continuations of a few prompts.

    python scripts/eval_demo_models.py [--models demo-hybrid demo-mamba] [--windows 0]

Bits per byte = mean next-byte cross-entropy / ln 2 over non-overlapping windows of `--seq-len`
bytes of the held-out split (one token = one byte). The runner side serves every window as a
request and reads the hidden states of its prefill steps (all positions) through a step observer,
then applies the model's own `compute_logits`; the HF side runs the same windows in one batch.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_corpus import build_corpus

from toolkit import LLM, SamplingParams
from toolkit.models import model_folder

PROMPTS = ["The ", "A class ", "def "]


class HiddenCollector:
    """A runner StepObserver that keeps each request's final hidden states, position by position."""

    def __init__(self) -> None:
        self.hidden: dict[str, list[torch.Tensor]] = {}

    def before_forward(self, runner, state) -> None:
        pass

    def after_forward(self, runner, state) -> None:
        b = state.input_batch
        qsl = b.query_start_loc_np
        for row, rid in enumerate(b.req_ids):
            self.hidden.setdefault(rid, []).append(state.hidden_states[qsl[row]:qsl[row + 1]].float())

    def after_logits(self, runner, state) -> None:
        pass


def windows_of(tokens: np.ndarray, seq_len: int, limit: int) -> list[list[int]]:
    n = (len(tokens) - 1) // seq_len
    n = min(n, limit) if limit else n
    return [tokens[i * seq_len:(i + 1) * seq_len + 1].tolist() for i in range(n)]


@torch.inference_mode()
def runner_bpb(name: str, windows: list[list[int]]) -> float:
    seq = len(windows[0]) - 1
    with LLM(name, device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=8 * seq,
             inspect="off") as llm:
        collector = HiddenCollector()
        llm.model_runner.observer = collector
        ids = [llm.add_request({"prompt_token_ids": w[:-1]}, SamplingParams(max_tokens=1, temperature=0.0))
               for w in windows]
        while llm.has_unfinished_requests():
            llm.step()
        total, count = 0.0, 0
        for rid, w in zip(ids, windows):
            hidden = torch.cat(collector.hidden[rid])[:seq]
            logits = llm.model.compute_logits(hidden)
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum").item()
            count += seq
    return total / count / math.log(2)


@torch.inference_mode()
def hf_bpb(folder: Path, windows: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), 8):
        batch = torch.tensor(windows[i:i + 8])
        logits = hf(input_ids=batch[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   batch[:, 1:].reshape(-1), reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count / math.log(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["demo-hybrid", "demo-mamba"])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--windows", type=int, default=0, help="windows per split (0: all)")
    args = ap.parse_args()
    corpus = build_corpus()
    print("| model | split | bytes | runner bits/byte | HF bits/byte | |diff| |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        folder = model_folder(name)
        for split in ("heldout_topics", "heldout_docstrings"):
            windows = windows_of(corpus[split].tokens(), args.seq_len, args.windows)
            ours, ref = runner_bpb(name, windows), hf_bpb(folder, windows)
            print(f"| {name} | {split} | {len(windows) * args.seq_len} | {ours:.4f} | {ref:.4f} | "
                  f"{abs(ours - ref):.1e} |", flush=True)
    for name in args.models:
        with LLM(name, device="cpu", dtype="float32", inspect="off") as llm:
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
            for p, o in zip(PROMPTS, outs):
                print(f"{name} greedy {p!r} -> {o.outputs[0].text!r}")


if __name__ == "__main__":
    main()
