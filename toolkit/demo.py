"""The main job: `python -m toolkit demo [--model NAME] [--revision R]`.

Builds a model, warms it up, serves 4 requests of mixed lengths under a small token budget (so
prefills are chunked and steps mix prefills with decodes), prints one row per step, then each
request's continuation as text and token ids.
"""
from __future__ import annotations

import argparse
import sys

from toolkit.inspect.step_record import StepRecord
from toolkit.llm import LLM
from toolkit.models import DEMO_MODELS, PRESETS
from toolkit.models.hub import HubSource
from toolkit.sampling import SamplingParams

DEFAULT_MODEL = "demo-hybrid"
PROMPTS = ["The ", "A hybrid model mixes attention and Mamba layers. ",
           "Continuous batching keeps the GPU busy by mixing prefills with decodes every step. ",
           "def "]


def _fmt(values) -> str:
    return "[" + ",".join(str(int(v)) for v in values) + "]"


def step_row(rec: StepRecord) -> list[str]:
    slots = "-"
    if any(g.kind == "mamba" for g in rec.attn_metadata):
        slots = _fmt(rec.metadata("mamba").common.block_table_tensor[:, 0].tolist())
    batch = rec.input_batch
    return [str(rec.step_index), f"{rec.num_prefills}/{rec.num_decodes}", str(rec.num_tokens), slots,
            _fmt(batch.query_start_loc_np) if batch else "-",
            _fmt(batch.seq_lens_cpu_upper_bound.tolist()) if batch else "-"]


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def hub_line(hub: HubSource) -> str:
    """Which commit of a Hub repo runs (a branch moves) and where its files are."""
    asked = hub.revision_requested or "the default branch"
    return f"hub   {hub.repo_id} at commit {hub.commit_sha} ({asked}), files in {hub.folder}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME",
                        help=f"a trained demo model ({', '.join(DEMO_MODELS)}), a preset (random "
                             f"weights), an HF model folder (config.json + *.safetensors) or a Hugging Face Hub "
                             f"repo id org/name (safetensors only; HF_HUB_OFFLINE=1: from the cache only); "
                             f"default {DEFAULT_MODEL}. Presets: {', '.join(PRESETS)}")
    parser.add_argument("--revision", default=None, metavar="R",
                        help="a Hub repo's branch, tag or commit sha (default: its default branch)")
    parser.add_argument("--download-dir", default=None, metavar="DIR",
                        help="the cache folder of Hub downloads (default: HF_HUB_CACHE, ~/.cache/huggingface/hub)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens to generate per request (default 24)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=32,
                        help="token budget of one step; small values chunk the prompts (default 32)")
    parser.add_argument("--max-num-seqs", type=int, default=3,
                        help="requests running at once; the 4th waits for a free row (default 3)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (CUDA when present; default)")
    parser.add_argument("--progress", action="store_true",
                        help="show the warmup progress bar even when the output is not a terminal")


def run(args: argparse.Namespace) -> int:
    with LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs,
             max_num_batched_tokens=args.max_num_batched_tokens, inspect="off", revision=args.revision,
             download_dir=args.download_dir) as llm:
        print(f"model {args.model}: {type(llm.model).__name__}, model state "
              f"{llm.stats()['model_state']}, device {llm.cfg.device}, dtype {llm.cfg.dtype}")
        if llm.hub_source is not None:
            print(hub_line(llm.hub_source))
        timings = llm.warmup(progress=args.progress or sys.stderr.isatty())
        print("warmup: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items()))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        ids = [llm.add_request(p, params) for p in PROMPTS]
        rows, outputs = [], {}
        while llm.has_unfinished_requests():
            rec = llm.step()
            rows.append(step_row(rec))
            outputs.update({o.request_id: o for o in rec.outputs})
        print(f"\n{len(PROMPTS)} requests, max_num_batched_tokens={args.max_num_batched_tokens}, "
              f"max_num_seqs={args.max_num_seqs}")
        print_table(["step", "prefill/decode", "tokens", "state pages", "query_start_loc", "seq_lens"], rows)
        print()
        for rid, prompt in zip(ids, PROMPTS):
            out = outputs[rid].outputs[0]
            print(f"request {rid}: {prompt!r} -> {out.text!r}")
            print(f"  {len(outputs[rid].prompt_token_ids)} prompt tokens -> {out.token_ids} ({out.finish_reason})")
        stats = llm.stats()
        pools = []
        if stats["kv_blocks_total"]:
            pools.append(f"{stats['kv_blocks_free']}/{stats['kv_blocks_total']} KV blocks free")
        if stats["state_pages_total"]:
            pools.append(f"{stats['state_pages_free']}/{stats['state_pages_total']} state pages free")
        print(f"\nafter: {', '.join(pools)}, {stats['runner_rows_in_use']} runner rows in use")
    return 0
