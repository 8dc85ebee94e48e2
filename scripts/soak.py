"""Soak test: many steps of random traffic on a tiny preset (CPU), watching memory and the books.

    python scripts/soak.py                       # 10_000 steps on tiny-bamba, inspect="off"
    python scripts/soak.py --preset tiny-jamba --steps 2000 --inspect metadata --checks
    python scripts/soak.py --tracemalloc --check-every 10

Traffic: requests arrive while fewer than --max-live are unfinished (random prompt length,
max_tokens, greedy / seeded / unseeded sampling, sometimes stop ids), random aborts, one
`llm.step()` per iteration; the KV cache is small enough that requests get preempted.

Every --report-every steps it prints steps/s, live requests, the process RSS (/proc/self/statm),
the number of torch tensors alive (gc), the pools' free ids, the engine's finished-id set and its
trace; with --tracemalloc also the Python heap traced since the start. The ledger checks (pools,
ledger, runner rows and block tables agree; see `ledger_violations`) run every --check-every
steps (default 1), plus the engine's own runtime checks with --checks. At the end: RSS growth from
the first report to the end, and whether any invariant failed (exit status 1 if one did).
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from toolkit import LLM, InvalidRequestError, InvariantError, SamplingParams
from toolkit.inspect import checks

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size now (Linux /proc/self/statm; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def tensors_alive() -> tuple[int, int]:
    """(count, bytes) of torch tensors reachable by the garbage collector."""
    n = size = 0
    with warnings.catch_warnings():  # isinstance on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    n += 1
                    size += obj.numel() * obj.element_size()
            except Exception:        # objects that fail isinstance (lazy proxies)
                pass
    return n, size


def set_bytes(s: set[str]) -> int:
    return sys.getsizeof(s) + sum(sys.getsizeof(x) for x in s)


def ledger_violations(llm: LLM) -> list[str]:
    """The scheduler's queues and pools, its ledger and the runner's rows agree (after a step)."""
    out: list[str] = []
    sched, runner = llm.scheduler, llm.model_runner
    kv = sched.kv
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    if len(set(running)) != len(running) or set(running) & set(waiting):
        out.append(f"queues: running {running}, waiting {waiting}")
    if set(sched.requests) != set(running) | set(waiting):
        out.append(f"requests {sorted(sched.requests)} != running + waiting")
    if len(running) > llm.cfg.max_num_seqs:
        out.append(f"{len(running)} running > max_num_seqs={llm.cfg.max_num_seqs}")
    holdings = kv.holdings()
    if set(holdings) != set(running):
        out.append(f"ledger holders {sorted(holdings)} != running {sorted(running)}")
    for pool in (kv.kv_pool, kv.state_pool):
        free = list(pool._free)
        if 0 in pool.owner or 0 in free:
            out.append(f"{pool.name}: the null id 0 was handed out or freed")
        if len(set(free)) != len(free) or set(free) & set(pool.owner):
            out.append(f"{pool.name}: an id is free twice or free and owned")
        if len(free) + len(pool.owner) != pool.num_total:
            out.append(f"{pool.name}: {len(free)} free + {len(pool.owner)} owned != {pool.num_total}")
        if not set(pool.owner.values()) <= set(running):
            out.append(f"{pool.name}: owners {sorted(set(pool.owner.values()) - set(running))} are not running")
    for g in range(len(kv.groups)):
        seen: dict[int, str] = {}
        for rid, held in holdings.items():
            for i in held[g]:
                if i == 0 or i in seen:
                    out.append(f"group {g}: id {i} held by {rid!r}" + (f" and {seen[i]!r}" if i in seen else ""))
                seen[i] = rid
    rs, bt = runner.req_states, runner.block_tables
    if set(rs.req_id_to_index) != set(running):
        out.append(f"runner rows {sorted(rs.req_id_to_index)} != running {sorted(running)}")
    for req in sched.running:
        idx = rs.req_id_to_index.get(req.request_id)
        if idx is None:
            continue
        if int(rs.num_computed_tokens[idx]) != req.num_computed_tokens or int(rs.total_len[idx]) != req.num_tokens:
            out.append(f"{req.request_id!r}: runner row counts differ from the scheduler's")
        for g, ids in enumerate(holdings.get(req.request_id, ())):
            row = bt.tables[g][idx, :bt.num_blocks[g][idx]].tolist()
            if row != ids:
                out.append(f"{req.request_id!r}: group {g} block table {row} != ledger {ids}")
    for idx in set(range(llm.cfg.max_num_seqs)) - set(rs.req_id_to_index.values()):
        if any(bt.num_blocks[g][idx] or bt.tables[g][idx].any() for g in range(bt.num_groups)):
            out.append(f"released runner row {idx} not cleared")
    out += [str(v) for v in checks.check_ledger(sched, runner, "soak")]
    return out


def random_params(rng: random.Random, vocab: int, max_tokens: int) -> SamplingParams:
    kind = rng.choice(["greedy", "seeded", "unseeded"])
    stops = [rng.randrange(3, vocab)] if rng.random() < 0.2 else []
    common = dict(max_tokens=rng.randint(1, max_tokens), ignore_eos=rng.random() < 0.5,
                  stop_token_ids=stops)
    if kind == "greedy":
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(temperature=rng.uniform(0.5, 1.5), top_k=rng.choice([0, 0, 20]),
                          top_p=rng.choice([1.0, 1.0, 0.9]),
                          seed=rng.randrange(2**64) if kind == "seeded" else None, **common)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-bamba")
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0, help="traffic seed (and the LLM's)")
    ap.add_argument("--inspect", default="off", choices=["off", "metadata", "full"],
                    help="the LLM's inspect mode (default off: measure the engine)")
    ap.add_argument("--checks", action="store_true", help="the engine's runtime checks (LLM(checks=True))")
    ap.add_argument("--check-every", type=int, default=1, help="run the ledger checks every k steps (0: never)")
    ap.add_argument("--report-every", type=int, default=1000)
    ap.add_argument("--tracemalloc", action="store_true", help="also report the traced Python heap")
    ap.add_argument("--max-live", type=int, default=6, help="add requests while fewer are unfinished")
    ap.add_argument("--abort-prob", type=float, default=0.03, help="chance per step to abort a live request")
    ap.add_argument("--max-prompt", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--num-kv-blocks", type=int, default=32, help="small: requests get preempted")
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--trace-capacity", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--cudagraph-mode", default="auto", choices=["auto", "padded_eager", "none"],
                    help="padded_eager: decode batches padded to CUDA-graph capture sizes")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.tracemalloc:
        tracemalloc.start()
    rng = random.Random(args.seed)
    llm = LLM(args.preset, device="cpu", dtype="float32", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len, seed=args.seed,
              inspect=args.inspect, checks=args.checks, trace_capacity=args.trace_capacity,
              cudagraph_mode=args.cudagraph_mode)
    kv_total = llm.stats()["kv_blocks_total"]
    max_prompt = min(args.max_prompt, args.max_model_len - 1)
    print(f"soak: {args.preset}, {args.steps} steps, inspect={args.inspect!r}, checks={llm.checks}, "
          f"ledger checks every {args.check_every or 'never'}; max_num_seqs={args.max_num_seqs}, "
          f"budget={args.max_num_batched_tokens}, block_size={args.block_size}, "
          f"kv blocks={kv_total}, max_live={args.max_live}", flush=True)

    live: set[str] = set()
    added = finished = aborted = refused = preempted = 0
    failures: list[str] = []
    marks: list[dict] = []                 # one per report
    header = (f"{'step':>6} {'steps/s':>8} {'live':>4} {'run':>3} {'wait':>4} {'RSS MiB':>8} "
              f"{'tensors':>7} {'kv free':>9} {'slots':>7} {'finished':>8} {'preempt':>7} "
              f"{'fin_ids':>7} {'fin_ids KiB':>11} {'trace':>5}" + ("  heap MiB" if args.tracemalloc else ""))
    print(header, flush=True)
    t_last, start = time.perf_counter(), time.perf_counter()
    step = 0
    for step in range(1, args.steps + 1):
        while len(live) < args.max_live and rng.random() < 0.7:
            prompt = [rng.randrange(3, llm.vocab_size) for _ in range(rng.randint(1, max_prompt))]
            try:
                live.add(llm.add_request({"prompt_token_ids": prompt},
                                         random_params(rng, llm.vocab_size, args.max_tokens)))
                added += 1
            except InvalidRequestError:    # too large for the KV cache: a valid refusal
                refused += 1
        if live and rng.random() < args.abort_prob:
            rid = rng.choice(sorted(live))
            if llm.abort_request(rid):
                aborted += 1
                live.discard(rid)
        try:
            rec = llm.step()
        except InvariantError as err:
            failures.append(f"step {step}: runtime checks: {err}")
            print(failures[-1], flush=True)
            break
        preempted += len(rec.preempted_request_ids)
        for out in rec.outputs:
            live.discard(out.request_id)
            finished += 1
        if args.check_every and step % args.check_every == 0:
            bad = ledger_violations(llm)
            if set(llm.scheduler.requests) != live:
                bad.append(f"live requests {sorted(live)} != engine {sorted(llm.scheduler.requests)}")
            if bad:
                failures += [f"step {step}: {b}" for b in bad]
                print("\n".join(failures[-len(bad):]), flush=True)
                break
        if step % args.report_every == 0 or step == args.steps:
            now = time.perf_counter()
            n_steps = step - (marks[-1]["step"] if marks else 0)
            gc.collect()
            n_tensors, _ = tensors_alive()
            stats = llm.stats()
            fin_ids = llm._request_ids.finished
            mark = dict(step=step, rate=n_steps / (now - t_last), rss=rss_bytes(), tensors=n_tensors,
                        fin_ids=len(fin_ids), fin_bytes=set_bytes(fin_ids), trace=len(llm.trace),
                        heap=tracemalloc.get_traced_memory()[0] if args.tracemalloc else 0)
            marks.append(mark)
            print(f"{step:>6} {mark['rate']:>8.1f} {len(live):>4} {stats['num_running']:>3} "
                  f"{stats['num_waiting']:>4} {mark['rss'] / 2**20:>8.1f} {n_tensors:>7} "
                  f"{stats['kv_blocks_free']:>4}/{stats['kv_blocks_total']:<4} "
                  f"{stats['state_pages_free']:>3}/{stats['state_pages_total']:<3} {finished:>8} "
                  f"{preempted:>7} {mark['fin_ids']:>7} {mark['fin_bytes'] / 1024:>11.1f} {mark['trace']:>5}"
                  + (f"  {mark['heap'] / 2**20:>8.2f}" if args.tracemalloc else ""), flush=True)
            t_last = time.perf_counter()       # the report's own cost is not counted
    elapsed = time.perf_counter() - start

    # drain, then the pools must be whole and the runner empty; shutdown checks (with --checks)
    if not failures:
        for _ in range(100_000):
            if not llm.has_unfinished_requests():
                break
            llm.step()
        llm.step()
        stats = llm.stats()
        if (stats["kv_blocks_free"], stats["state_pages_free"], stats["runner_rows_in_use"]) != (
                stats["kv_blocks_total"], stats["state_pages_total"], 0):
            failures.append(f"after draining: {stats}")
        try:
            llm.shutdown()
        except InvariantError as err:
            failures.append(f"shutdown: {err}")

    print(f"\n{step} steps in {elapsed:.1f} s ({step / elapsed:.1f} steps/s incl. reports); requests: "
          f"{added} added, {finished} finished, {aborted} aborted, {refused} refused; {preempted} preemptions")
    if len(marks) >= 2:
        first, last = marks[0], marks[-1]
        k = (last["step"] - first["step"]) / 1000
        growth = last["rss"] - first["rss"]
        print(f"RSS: {first['rss'] / 2**20:.1f} MiB at step {first['step']} -> {last['rss'] / 2**20:.1f} MiB "
              f"at step {last['step']}: {growth / 2**20:+.2f} MiB "
              f"({growth / 1024 / max(k, 1e-9):+.1f} KiB per 1000 steps)")
        print(f"torch tensors alive: {first['tensors']} -> {last['tensors']}; llm.trace: {first['trace']} -> "
              f"{last['trace']} records (capacity {args.trace_capacity})")
        print(f"finished request ids (by design: one id per finished or aborted request, never pruned): "
              f"{first['fin_ids']} -> {last['fin_ids']} ids, {first['fin_bytes'] / 1024:.1f} -> "
              f"{last['fin_bytes'] / 1024:.1f} KiB "
              f"({(last['fin_bytes'] - first['fin_bytes']) / max(k, 1e-9) / 1024:+.1f} "
              f"KiB per 1000 steps, about {last['fin_bytes'] / max(last['fin_ids'], 1):.0f} bytes per id)")
        if args.tracemalloc:
            print(f"traced Python heap: {first['heap'] / 2**20:.2f} -> {last['heap'] / 2**20:.2f} MiB")
    if failures:
        print(f"INVARIANT FAILED ({len(failures)}):\n  " + "\n  ".join(failures[:20]))
        return 1
    print("invariants: all held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
