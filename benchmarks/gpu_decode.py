"""Decode and prefill on a GPU: this runner eager, this runner with CUDA graphs, and HF `generate`, in one
process with the same config and weights (issue "CUDA graphs and the GPU path").

    python benchmarks/gpu_decode.py [--presets mamba2-130m-shape lfm2-350m-shape bamba-300m-shape]
                                    [--batches 1 32 128] [--dtype bfloat16]

Per preset and batch it prints the decode step (method of the H200 HF baseline: t1 = generate 1 token,
tN = generate N; step = (tN - t1) / (N - 1), best of --repeats after a warm-up run, the device synchronised
around each timed call), the ratio to HF, and the fraction of the memory roofline: the bytes a decode
step must move at least (the weights once, plus every sequence's recurrent state read and written, plus
its KV cache read) over the measured copy bandwidth, divided by the measured step; for the graph engine
also the GPU time of one graph replay (CUDA events), which splits the step into device forward and
the rest (host work, eager launches, sampling, the sync). Then the prefill of
128 prompts x 64 tokens (generate with max_tokens=1). Targets (mamba2-130m shape, bf16): decode step at
batch 1 <= 0.5 ms; batch 128 >= 60% of the roofline.
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

sys.path.insert(0, os.path.dirname(__file__))
from toolkit import LLM, SamplingParams
from toolkit.models import save_hf_folder

from table import print_markdown_table


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(device: str) -> float:
    """bytes/s of a 1 GiB device-to-device copy, read + write counted."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = best_time(lambda: dst.copy_(src), 5)
    return 2 * src.numel() * 4 / seconds


def min_step_bytes(llm: LLM, batch: int, context: int) -> int:
    """Weights once + each sequence's recurrent state read and written + its KV cache read."""
    weights = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    state = kv = 0
    for spec in llm.model.kv_cache_specs().values():
        if hasattr(spec, "shapes"):            # a recurrent layer: its states per sequence
            for shape, dtype in zip(spec.shapes, spec.dtypes):
                n = 1
                for d in shape:
                    n *= d
                state += n * torch.empty((), dtype=dtype).element_size()
        else:                                   # attention: K and V of the context
            kv += 2 * spec.num_kv_heads * spec.head_dim * torch.empty((), dtype=spec.dtype).element_size()
    return weights + batch * (2 * state + kv * context)


def graph_gpu_time(llm: LLM, run) -> tuple[float, int]:
    """(mean GPU milliseconds of one decode-graph replay, replays) over `run()`, timed with CUDA
    events around each replay: the part of a decode step the device spends in the forward. The
    rest of the step (host Python, eager launches, LM head, sampling, the one sync) is the step
    minus this. (nan, 0) where no graph replays (eager engines, CPU)."""
    graphs = llm.model_runner.cudagraph_manager
    if not torch.cuda.is_available() or not graphs.captured:
        return float("nan"), 0
    pairs = []
    replay = graphs.replay

    def timed(size: int):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = replay(size)
        end.record()
        pairs.append((start, end))
        return out

    graphs.replay = timed
    try:
        run()
    finally:
        del graphs.replay                   # back to the class's method
    torch.cuda.synchronize()
    return sum(a.elapsed_time(b) for a, b in pairs) / max(len(pairs), 1), len(pairs)


def build_engine(preset: str, kwargs: dict) -> LLM | None:
    """The engine, warmed up; if the default backend fails to build or warm up (a kernel that does
    not compile, say), the error's last line is printed and the torch backend is tried, so that one
    failure still leaves figures to read."""
    for backend in ("auto", "torch"):
        try:
            llm = LLM(preset, backend=backend, **kwargs)
            llm.warmup(progress=False)
            return llm
        except Exception as exc:                  # reported, then the fallback
            print(f"{preset} backend={backend} {kwargs.get('enforce_eager') and 'eager' or 'graphs'}: "
                  f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["mamba2-130m-shape", "lfm2-350m-shape", "bamba-300m-shape"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill", nargs=2, type=int, default=[128, 64], metavar=("SEQS", "TOKENS"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-repeats", type=int, default=None,
                    help="timed runs of HF generate (default --repeats): HF at batch 128 takes seconds a call")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    bw = copy_bandwidth(device)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"dtype {args.dtype}, copy bandwidth {bw / 1e12:.2f} TB/s, prompt {args.prompt_len}, "
          f"new tokens {args.new_tokens}")
    max_batch = max(args.batches + [args.prefill[0]])
    limits = dict(device=device, dtype=args.dtype, max_num_seqs=max_batch,
                  max_num_batched_tokens=max(max_batch * args.prompt_len, args.prefill[0] * args.prefill[1]),
                  max_model_len=args.prompt_len + args.new_tokens + 16, inspect="off")
    decode_rows, prefill_rows = [], []
    for preset in args.presets:
        eager = build_engine(preset, dict(enforce_eager=True, **limits))
        graphs = build_engine(preset, limits)
        if eager is None or graphs is None:
            print(f"{preset}: no engine could be built, skipped", flush=True)
            continue
        # on CUDA with the Triton backend "auto" captures graphs; elsewhere both engines run eagerly
        engines = {f"runner eager ({eager.backend})": eager,
                   f"runner {graphs.cudagraph_mode} ({graphs.backend})": graphs}
        with tempfile.TemporaryDirectory() as folder:
            save_hf_folder(eager, folder)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        rng = random.Random(0)
        vocab = min(eager.vocab_size, 1000)
        hf_repeats = args.hf_repeats or args.repeats
        t1_of: dict[tuple[int, str], float] = {}     # (batch, engine) -> prefill+1 seconds

        def runner_gen(llm, prompts, k):
            params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
            return lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

        @torch.inference_mode()
        def hf_gen(prompts, k, model=hf):
            ids = torch.tensor(prompts, device=device)
            return lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                                          min_new_tokens=k, do_sample=False, pad_token_id=0)

        for batch in args.batches:
            prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
            floor = min_step_bytes(eager, batch, args.prompt_len + args.new_tokens // 2) / bw
            steps = {}
            for name, make in [*[(n, lambda k, e=e, p=prompts: runner_gen(e, p, k)) for n, e in engines.items()],
                               ("hf generate", lambda k, p=prompts: hf_gen(p, k))]:
                repeats = hf_repeats if name == "hf generate" else args.repeats
                try:
                    t1 = t1_of[batch, name] = best_time(make(1), repeats)
                    tn = best_time(make(args.new_tokens), repeats)
                    steps[name] = (tn - t1) / (args.new_tokens - 1)
                except torch.OutOfMemoryError:          # HF's bamba at batch 128 did in the baseline
                    steps[name] = t1_of[batch, name] = float("nan")
                    torch.cuda.empty_cache()
            graph_ms, replays = graph_gpu_time(graphs, runner_gen(graphs, prompts, args.new_tokens))
            for name, step in steps.items():
                replayed = name.startswith("runner") and replays and engines[name] is graphs
                in_graph = f"{graph_ms:.3f}" if replayed else ""
                decode_rows.append([preset, str(batch), name, f"{step * 1e3:.3f}", in_graph,
                                    f"{steps['hf generate'] / step:.1f}x", f"{100 * floor / step:.0f}%"])
                print("  ".join(decode_rows[-1]), flush=True)
        seqs, toks = args.prefill
        if toks == args.prompt_len and seqs in args.batches:
            # the same work as that batch's prefill+1 (t1) above: read, not run again
            times = {name: t1_of[seqs, name] for name in [*engines, "hf generate"]}
        else:
            prompts = [[rng.randrange(3, vocab) for _ in range(toks)] for _ in range(seqs)]
            times = {name: best_time(runner_gen(e, prompts, 1), args.repeats) for name, e in engines.items()}
            try:
                times["hf generate"] = best_time(hf_gen(prompts, 1), hf_repeats)
            except torch.OutOfMemoryError:
                times["hf generate"] = float("nan")
                torch.cuda.empty_cache()
        for name, t in times.items():
            prefill_rows.append([preset, f"{seqs}x{toks}", name, f"{t * 1e3:.1f}", f"{times['hf generate'] / t:.1f}x"])
            print("  ".join(prefill_rows[-1]), flush=True)
        for llm in engines.values():
            llm.shutdown()
        del hf, engines
        torch.cuda.empty_cache() if device == "cuda" else None
    print()
    print_markdown_table(["preset", "batch", "engine", "decode step ms", "graph GPU ms", "vs HF", "of roofline"],
                         decode_rows)
    print("graph GPU ms: the device time of one graph replay (CUDA events); the step minus it is the host,\n"
          "the eager launches (inputs, LM head, sampling) and the one sync: what async scheduling would hide.")
    print()
    print_markdown_table(["preset", "prefill", "engine", "prefill+1 ms", "vs HF"], prefill_rows)


if __name__ == "__main__":
    main()
