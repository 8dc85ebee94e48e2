"""Every Triton kernel specialization the engine launches, compiled for GPUs ahead of time on a CPU
machine (toolkit/inspect/kernel_specs.py): per kernel, its specializations and, per target, the
registers, spill bytes (ptxas -v) and shared memory; a Markdown table for benchmarks/RESULTS.md.

    python benchmarks/kernel_compile.py [--archs 80 90] [--workers 2] [--save specs.json] [--results out.json]
    python benchmarks/kernel_compile.py --specs specs.json      # compile a saved set (e.g. with another triton)

It records what tests/test_compile_for_gpus.py compiles: the workloads of tests/kernel_workloads.py
(the backend-parity runs of tests/test_backend_triton.py, fp16 / bf16 engines with padded decode and
sampling, the shape-true presets cut to one layer of each kind) under the Triton interpreter, then
compiles each distinct specialization once per target in fresh processes. Exits 1 if a compile
fails or a kernel needs more shared memory or registers than a block has.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")      # before anything imports triton
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--specs", help="compile the specializations saved in this JSON file (no recording)")
    ap.add_argument("--save", help="save the recorded specializations to this JSON file")
    ap.add_argument("--results", help="save every compile's result (registers, spills, ...) to this JSON file")
    args = ap.parse_args()

    import triton

    from toolkit.inspect.kernel_specs import KernelSpecs, compile_specs, launched_kernels, markdown_table, problems
    start = time.perf_counter()
    if args.specs:
        specs = KernelSpecs.load(args.specs)
    else:
        import torch
        torch.set_num_threads(1)
        sys.path.insert(0, str(ROOT / "tests"))
        from kernel_workloads import RECORDED, record_all
        record_all()
        specs = RECORDED
    recorded = time.perf_counter() - start
    if args.save:
        specs.save(args.save)
    results = compile_specs(specs.specs.values(), args.archs, workers=args.workers)
    compiled = time.perf_counter() - start - recorded
    if args.results:
        Path(args.results).write_text(json.dumps([{k: v for k, v in asdict(r).items() if k != "ptxas_log"}
                                                  for r in results], indent=1))
    missing = sorted(set(launched_kernels()) - specs.kernels)
    print(f"triton {triton.__version__}: {len(specs.kernels)} kernels, {len(specs.specs)} specializations "
          f"({sum(specs.launches.values())} launches{'' if args.specs else f' recorded in {recorded:.0f} s'}), "
          f"{len(results)} compiles for {', '.join(f'sm_{a}' for a in args.archs)} in {compiled:.0f} s "
          f"({args.workers} workers, {sum(r.seconds for r in results):.0f} s of compiling)\n")
    print(markdown_table(results))
    bad = problems(results) + [f"no workload launched {k}" for k in missing]
    for p in bad:
        print(p)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
