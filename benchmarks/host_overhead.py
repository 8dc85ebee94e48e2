"""Host seconds per decode step by stage, the forward excluded: schedule, prepare (prepare_inputs),
metadata (build_metadata), sample (logits, sampling, verification and the next drafts), update (the
scheduler's books) and other (the rest of the engine's step: outputs, released rows). Batches of 1,
32, 64, 128 and 256 rows at contexts of 1k and 16k tokens, prefix caching off and on, speculation off
and on (n-gram, k = 3), in one run (issue "Cost that grows with the new tokens, not with the context").

    python benchmarks/host_overhead.py [--preset tiny-mamba2] [--batches 1 32 64 128 256]
                                       [--contexts 1024 16384] [--steps 20] [--threads 1]
                                       [--caching off on] [--spec off ngram] [--inspect off]

Method: one torch thread, inspect="off" (`--inspect metadata`: the recording and its checks, which
land in "other"). The model's forward is replaced by a stub returning zero
hidden states: the forward is excluded from what is measured anyway, and the stub lets 256 rows of
16k-token prompts prefill in seconds. Zero hidden states make every logits row equal, so greedy
decoding repeats one token: n-gram speculation then proposes and keeps k drafts every step (the
host work of a verify step that accepts everything). Each configuration admits its rows, runs until
every row decodes, then times `--steps` decode steps (each must run every row: checked) and reports
the median of each stage over them (the runner's StageClock and the engine's own step timings) and
of the step's wall time minus its forward; "other" is that total minus the stages.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from toolkit import LLM, SamplingParams
from toolkit.models import PRESETS

sys.path.insert(0, os.path.dirname(__file__))   # table.py beside it, also under PYTHONSAFEPATH=1
from table import print_markdown_table

STAGES = ("schedule", "prepare_inputs", "build_metadata", "sample", "update")
# Row r's prompt is `context - r % PHASES` tokens long, so that in every configuration about
# rows / block_size rows enter a new block each step, as in a server whose requests arrived at
# different times (PHASES is a multiple of every block size used). With equal lengths the phases
# came from the prefill chunking instead: at 1k the rows entered blocks in two groups every 16
# steps, so the median step had no block entries, while at 16k (4 rows per prefill step) every step
# had 8: the 16k / 1k comparison measured the chunking, not the context.
PHASES = 64


def stub_forward(llm: LLM) -> None:
    """The model's forward returns zeros [T, hidden] (what the LM head reads)."""
    model = llm.model_runner.model
    hidden = model.lm_head.weight.shape[1]

    def forward(input_ids, positions, *args, **kwargs):
        return torch.zeros(input_ids.shape[0], hidden, dtype=model.lm_head.weight.dtype)
    model.forward = forward


def long_context(preset: str, max_len: int) -> str:
    """A preset name for `preset` with room for `max_len` positions (the tiny presets' configs say 2048;
    a recurrent model has no position limit, and the stub forward reads no position)."""
    name = f"{preset}-long"
    cfg = PRESETS[preset]()
    PRESETS[name] = lambda: type(cfg)(**{**cfg.to_dict(), "max_position_embeddings": max_len})
    return name


def timed(fn, seconds: dict[str, float], stage: str):
    """`fn`, adding the seconds each call takes to seconds[stage]."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[stage] += time.perf_counter() - start
    return wrapper


def measure(preset: str, rows: int, context: int, caching: bool, spec: bool, steps: int,
            inspect: str = "off") -> dict[str, float]:
    """Median host seconds per decode step by stage (and "other", "total")."""
    budget = max(4096, min(rows * context, 65536))
    # rows prefilled early decode (up to 4 tokens a step with n-gram drafts) while the rest prefill:
    # room for those steps too, so that no row finishes before the timed steps end
    decode_steps = -(-rows * context // budget) + 8 + steps + 4
    max_tokens = 4 * decode_steps + 48
    max_len = context + max_tokens + 16
    llm = LLM(long_context(preset, max_len), device="cpu", dtype="float32", inspect=inspect, max_num_seqs=rows,
              max_model_len=max_len, max_num_batched_tokens=budget,
              enable_prefix_caching=caching,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3} if spec else None)
    stub_forward(llm)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for r in range(rows):      # distinct prompts (no prefix shared between rows), staggered lengths
        length = context - r % PHASES
        llm.add_request({"prompt_token_ids": [(r * 7919 + i * 31) % 200 + 3 for i in range(length)]}, params)
    runner = llm.model_runner
    requests = list(llm.scheduler.requests.values())
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in requests):   # prefill every row
        llm._step("step")
    for _ in range(8):             # settle: one token repeated long enough that the n-gram index matches it
        llm._step("step")
    per_step: dict[str, list[float]] = {k: [] for k in (*STAGES, "forward", "total")}
    seconds = {"schedule": 0.0, "update": 0.0}         # the engine's own stages, timed around its calls
    for stage, name in (("schedule", "schedule"), ("update", "update_from_output")):
        setattr(llm.scheduler, name, timed(getattr(llm.scheduler, name), seconds, stage))
    for _ in range(steps):
        seconds.update(schedule=0.0, update=0.0)
        start = time.perf_counter()
        llm._step("step")
        wall = time.perf_counter() - start
        if runner.execute_state.input_batch.num_reqs != rows:
            raise RuntimeError(f"a timed step ran {runner.execute_state.input_batch.num_reqs} rows, not {rows}")
        host = runner.execute_state.timings
        per_step["schedule"].append(seconds["schedule"])
        per_step["update"].append(seconds["update"])
        for stage in ("prepare_inputs", "build_metadata", "sample", "forward"):
            per_step[stage].append(host.get(stage, 0.0))
        per_step["total"].append(wall - host.get("forward", 0.0))
    llm.shutdown()
    out = {k: statistics.median(v) for k, v in per_step.items()}      # the median step: robust to a GC pause
    out["other"] = out["total"] - sum(out[s] for s in STAGES)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-mamba2")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32, 64, 128, 256])
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 16384])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--caching", nargs="+", choices=("off", "on"), default=["off", "on"])
    ap.add_argument("--spec", nargs="+", choices=("off", "ngram"), default=["off", "ngram"])
    ap.add_argument("--inspect", choices=("off", "metadata"), default="off",
                    help='"metadata": the recording and its checks land in "other" (the issue\'s figures are "off")')
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"preset={args.preset} torch={torch.__version__} threads={torch.get_num_threads()} steps={args.steps} "
          f"inspect={args.inspect}")
    header = ["rows", "context", "caching", "spec", *STAGES, "other", "total ms"]
    out = []
    for spec in [s == "ngram" for s in args.spec]:
        for caching in [c == "on" for c in args.caching]:
            for rows in args.batches:
                for context in args.contexts:
                    m = measure(args.preset, rows, context, caching, spec, args.steps, args.inspect)
                    out.append([str(rows), str(context), "on" if caching else "off", "ngram k=3" if spec else "off",
                                *(f"{m[s] * 1e3:.2f}" for s in STAGES), f"{m['other'] * 1e3:.2f}",
                                f"**{m['total'] * 1e3:.2f}**"])
                    print("  ".join(str(c) for c in out[-1]), flush=True)
    print()
    print_markdown_table(header, out)


if __name__ == "__main__":
    main()
