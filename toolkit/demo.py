"""The main job: `python -m toolkit demo [--model tiny-bamba]`.

Builds a preset, warms it up, serves 4 requests of mixed lengths under a small token budget (so
prefills are chunked and steps mix prefills with decodes), prints one row per step and the outputs.
"""
from __future__ import annotations

import argparse

from toolkit.inspect.step_record import StepRecord
from toolkit.llm import LLM
from toolkit.sampling import SamplingParams

PROMPTS = ["Hi", "A hybrid model mixes attention and Mamba layers.",
           "Continuous batching keeps the GPU busy by mixing prefills with decodes every step.",
           "Mamba2"]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit demo")
    parser.add_argument("--model", default="tiny-bamba", help="preset name or HF folder")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)

    with LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs,
             max_num_batched_tokens=args.max_num_batched_tokens) as llm:
        print(f"model {args.model}: {type(llm.model).__name__}, model state "
              f"{llm.stats()['model_state']}, device {llm.cfg.device}, dtype {llm.cfg.dtype}")
        timings = llm.warmup()
        print("warmup: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items()))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        ids = [llm.add_request(p, params) for p in PROMPTS]
        rows, outputs = [], {}
        while llm.has_unfinished_requests():
            rec = llm.step()
            rows.append(step_row(rec))
            outputs.update({o.request_id: o for o in rec.outputs})
        print(f"\n{len(PROMPTS)} requests, max_num_batched_tokens={args.max_num_batched_tokens}, "
              f"max_num_seqs={args.max_num_seqs}")
        print_table(["step", "prefill/decode", "tokens", "state slots", "query_start_loc", "seq_lens"], rows)
        print()
        for rid in ids:
            out = outputs[rid]
            print(f"request {rid}: {len(out.prompt_token_ids)} prompt tokens -> "
                  f"{out.outputs[0].token_ids} ({out.outputs[0].finish_reason})")
        stats = llm.stats()
        print(f"\nafter: {stats['kv_blocks_free']}/{stats['kv_blocks_total']} KV blocks free, "
              f"{stats['state_slots_free']}/{stats['state_slots_total']} state slots free")
    return 0
