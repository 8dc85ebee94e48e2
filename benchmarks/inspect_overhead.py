"""What recording costs: decode throughput with inspect="off", "metadata" (checks on and off) and
"full", against the same engine with recording removed (a bare schedule -> execute -> sample ->
update step, no record, no checks, no timings, no recovery).

    python benchmarks/inspect_overhead.py [--presets tiny-bamba tiny-mamba2] [--batch 8] [--breakdown] [--ablate]
                                          [--processes 8] [--toggled 20]

Method: decode step = (t(N tokens) - t(1 token)) / (N - 1) through `LLM.generate`, greedy, no EOS;
the modes are interleaved and each takes the best of --repeats runs, so slow drift of the machine
hits them alike. Run it on an idle machine: on 2 cores another busy process swamps the differences.

`--breakdown`: then, for inspect="metadata", where the recording's time goes inside a step: each
part timed by a wrapper around it over one generate() of --new-tokens decode steps, in us per step
(nested parts are inside their parents: the snapshots inside step_record, the checks inside
record_step). These are the figures to compare when one part changes: a 30 us change is 1% of a
tiny-bamba batch-8 step, below what the end-to-end difference resolves from run to run. And the
median engine step (`LLM._step`, every step of --repeats generate() calls per mode, the modes
alternated) of "off" and "metadata": a median is not moved by the occasional slow step that the
best-of-repeats totals above keep.

`--ablate`: what each runtime check costs where the 5% aim is judged, the median engine step. Engines
alike but for one check replaced by a no-op, and a second plain "metadata" engine as the control,
their generate() calls alternated --repeats times: each check's median step against "metadata". Inside
a step a part costs more than its `--breakdown` wrapper shows (code and data the forward evicted from
the caches): compare a change here, where the control says how far two equal engines drift apart.
One more engine keeps every record the trace pushes out (never freed, so its memory grows over the
run): what freeing a record 64 steps old (the trace_capacity here) costs inside a step; and one whose
trace holds 2 records (each freed 2 steps old, while its memory is still in the caches). The last column,
each engine's median forward: no recording code runs inside it, yet it runs slower where records are
kept (RESULTS.md, stop 65: the small tensors a record keeps alive cost, not the age of what is freed).

`--processes N`: the figures a user with one engine sees. Every mode above shares one process with the
others, which dilutes what a mode does to the memory the others use; here each engine runs alone in a
fresh process (one per mode and round, the modes alternated, N rounds): 5 warm-up generate() calls, then
the median engine step and median forward of 20 more. Besides "off", "metadata" and "metadata" without
its runtime checks, "off, step objects kept" is "off" keeping each step's `ExecuteModelState` (the
runner's batch, metadata and logits, as a record holds them by reference) for 64 steps and doing
nothing else: what holding them costs alone.
Each cell: the median over the N processes (processes differ by a few percent, memory layout).

`--toggled ROUNDS`: the most precise difference, for judging a change of a few us. One "metadata"
engine alone in this process, its recording detached ("off": no recorder, no runner observer, the
trace emptied) and attached again for each generate() call of --toggled-tokens tokens, the two
alternated; per call the median of its steps after the first 80 (a "metadata" call has by then
filled its 64-record trace and frees one record a step). The machine's drift hits both modes of a
round alike, so the per-round ratio varies by ~1% where the other methods' cells vary by a few; its
"off" runs in a heap the recording shaped, where `--processes` gives each mode a fresh process.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from unittest import mock

import torch

import toolkit.inspect.recorder as recorder_module
import toolkit.inspect.trace as trace_module
from toolkit import LLM, SamplingParams
from toolkit.inspect import checks
from toolkit.inspect.ledger_book import LedgerBook
from toolkit.outputs import request_output

sys.path.insert(0, os.path.dirname(__file__))   # table.py beside it, also under PYTHONSAFEPATH=1
from table import print_markdown_table


class BareLLM(LLM):
    """The engine with recording removed: what `inspect="off"` is measured against."""

    def _step(self, stage, want_record=False):
        sched_out = self.scheduler.schedule()
        self.model_runner.execute_model(sched_out)
        finished, _ = self.scheduler.update_from_output(sched_out, self.model_runner.sample_tokens())
        self.model_runner.remove_requests([r.request_id for r in finished])
        return None, [request_output(r, self.tokenizer.decode) for r in finished]


MODES = {  # name -> (class, LLM kwargs)
    "removed": (BareLLM, dict(inspect="off")),
    "off": (LLM, dict(inspect="off")),
    "metadata, no checks": (LLM, dict(inspect="metadata", checks=False)),
    "metadata": (LLM, dict(inspect="metadata")),
    "full": (LLM, dict(inspect="full")),
}


def make_prompts(vocab: int, args) -> list[list[int]]:
    """--batch prompts of --prompt-len random ids (the same in every process)."""
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]


def run(llm: LLM, prompts: list[list[int]], k: int) -> float:
    params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start


# the parts --breakdown times: (owner, attribute, label); a method is wrapped on its class
PARTS = [(recorder_module.Recorder, hook, f"Recorder.{hook}")
         for hook in ("begin", "before_forward", "after_forward", "after_logits", "record_step")] + [
    (recorder_module.Freezer, "__call__", "  Freezer (the persistent buffers' copy)"),
    (recorder_module, "step_record", "  step_record"),
    (recorder_module, "snapshot", "    snapshot (batch, metadata)"),
    (recorder_module, "scheduled_rows", "    scheduled_rows"),
    (trace_module.Trace, "append", "  Trace.append"),
    (trace_module, "record_sizes", "    record_sizes"),
    (trace_module.Trace, "_pop_oldest", "    Trace._pop_oldest (the record pushed out, freed)"),
    (trace_module.Trace, "_fit", "    Trace._fit"),
] + [(LedgerBook, name, f"  LedgerBook.{name}") for name in ("refresh", "audit")] + [
    (checks, name, f"  checks.{name}") for name in ("check_metadata", "check_logits", "check_fresh_slots")]


def timed(fn, took):
    """`fn`, calling `took(seconds)` after each call."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took(time.perf_counter() - start)
    return wrapper


def breakdown(llm: LLM, prompts: list[list[int]], k: int) -> list[tuple[str, float, float]]:
    """(part, us per decode step, calls per step) over one generate() of k tokens."""
    times: dict[str, list[float]] = {label: [] for _, _, label in PARTS}
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in PARTS]
    for (owner, name, fn), (_, _, label) in zip(originals, PARTS):
        setattr(owner, name, timed(fn, times[label].append))
    try:
        run(llm, prompts, k)
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    steps = len(times["Recorder.record_step"])
    return [(label, sum(t) / steps * 1e6, len(t) / steps) for label, t in times.items() if t]


def timing_steps(llms: dict[str, LLM]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Name -> the seconds of each engine step from now on, and of each step's forward (the runner's
    own "forward" stage time, which no recording hook runs inside: where it differs between engines,
    that is the memory the recording left behind, not its work). Each engine's `_step` wrapped on
    the instance (`del llm._step` gives it back the class's method)."""
    times: dict[str, list[float]] = {name: [] for name in llms}
    forwards: dict[str, list[float]] = {name: [] for name in llms}
    for name, llm in llms.items():
        step = llm._step

        def timed_step(*args, _step=step, _times=times[name], _forwards=forwards[name], _runner=llm.model_runner,
                  **kwargs):
            start = time.perf_counter()
            try:
                return _step(*args, **kwargs)
            finally:
                _times.append(time.perf_counter() - start)
                state = _runner.execute_state
                if state is not None and "forward" in state.timings:
                    _forwards.append(state.timings["forward"])
        llm._step = timed_step
    return times, forwards


def step_medians(llms: dict[str, LLM], prompts: list[list[int]], k: int, repeats: int
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """Mode -> the median seconds of one engine step, and of its forward, over `repeats` generate()
    calls of k tokens."""
    times, forwards = timing_steps(llms)
    try:
        for _ in range(repeats):
            for llm in llms.values():
                run(llm, prompts, k)
    finally:
        for llm in llms.values():
            del llm._step                   # the class's method again
    return ({name: statistics.median(t) for name, t in times.items()},
            {name: statistics.median(t) for name, t in forwards.items()})


# --ablate: the checks each replaced by a no-op in an engine of its own (label -> (owner, attribute))
ABLATED = {"no check_metadata": (checks, "check_metadata"), "no check_logits": (checks, "check_logits"),
           "no check_fresh_slots": (checks, "check_fresh_slots"), "no ledger audit": (LedgerBook, "audit")}
NOT_FREED = "pushed-out records kept"
YOUNG = "trace_capacity=2 (records freed 2 steps old)"


def records_kept(kept: list) -> contextlib.AbstractContextManager:
    """Trace._pop_oldest patched to put the record it pushes out in `kept` (alive: not freed)."""
    pop = trace_module.Trace._pop_oldest

    def keep_then_pop(trace):
        kept.append(trace._records[0])
        pop(trace)
    return mock.patch.object(trace_module.Trace, "_pop_oldest", keep_then_pop)


def ablation_medians(make_llm, prompts: list[list[int]], k: int, repeats: int
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """Label -> the median engine step and the median forward (seconds) of "off", "metadata", its
    control copy, each ABLATED engine, the NOT_FREED one and the YOUNG one; the engines' generate()
    calls alternated (each round starting one engine later), each ablation swapped in around its own
    engine's calls only."""
    labels = ["off", "metadata", "metadata (control)", *ABLATED, NOT_FREED, YOUNG]
    young = {"trace_capacity": 2}
    llms = {label: make_llm(inspect="off" if label == "off" else "metadata", **(young if label == YOUNG else {}))
            for label in labels}
    times, forwards = timing_steps(llms)
    kept: list = []
    try:
        for i, warm in enumerate([True] + [False] * repeats):
            for label in labels[i % len(labels):] + labels[:i % len(labels)]:   # each round in another order
                ablated = (mock.patch.object(*ABLATED[label], lambda *args, **kwargs: []) if label in ABLATED
                           else records_kept(kept) if label == NOT_FREED else contextlib.nullcontext())
                with ablated:
                    run(llms[label], prompts, k)
            if warm:
                for t in [*times.values(), *forwards.values()]:
                    t.clear()
    finally:
        for llm in llms.values():
            llm.shutdown()
    return ({label: statistics.median(t) for label, t in times.items()},
            {label: statistics.median(t) for label, t in forwards.items()})


TOGGLED_SKIP = 80      # steps of a --toggled call left out: by then a "metadata" call's trace has turned over


def toggled_medians(llm: LLM, prompts: list[list[int]], k: int, rounds: int) -> dict[str, list[float]]:
    """--toggled: one "metadata" engine whose recording is detached ("off": no recorder, no runner
    observer, the trace emptied) or attached again for each generate() call of k tokens, the two
    alternated `rounds` times after one warm-up round (each round in the other order). "<mode> step"
    -> per round, the median seconds of that call's steps after the first TOGGLED_SKIP (a "metadata"
    call has then filled its trace and frees a record each step, as a long run does); "<mode> forward"
    and "<mode> rest" likewise: the runner's forward stage, and the step less its schedule, execute,
    sample and update (the recording's hooks outside the runner, and the facade's own few us)."""
    recorder, runner, trace = llm._recorder, llm.model_runner, llm.trace
    steps, forwards = timing_steps({"step": llm})
    parts = {"step": steps["step"], "forward": forwards["step"]}
    stages = {"schedule": (llm.scheduler, "schedule"), "update": (llm.scheduler, "update_from_output"),
              "execute": (runner, "execute_model"), "sample": (runner, "sample_tokens")}
    for name, (owner, attr) in stages.items():
        parts[name] = []
        setattr(owner, attr, timed(getattr(owner, attr), parts[name].append))
    out: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for r in range(rounds + 1):
            for mode in ("off", "metadata") if r % 2 else ("metadata", "off"):
                if mode == "off":
                    llm._recorder, runner.observer = None, None
                    trace.clear()
                else:
                    llm._recorder, runner.observer = recorder, recorder
                for times in parts.values():
                    times.clear()
                run(llm, prompts, k)
                if r:
                    steady = {name: times[TOGGLED_SKIP:] for name, times in parts.items()}
                    rest = [t - sum(steady[n][i] for n in ("schedule", "execute", "sample", "update"))
                            for i, t in enumerate(steady["step"])]
                    for name in ("step", "forward"):
                        out[f"{mode} {name}"].append(statistics.median(steady[name]))
                    out[f"{mode} rest"].append(statistics.median(rest))
    finally:
        llm._recorder, runner.observer = recorder, recorder
        del llm._step
        for owner, attr in stages.values():
            delattr(owner, attr)            # the class's method again
    return out


PROCESS_MODES = {"off": dict(inspect="off"), "metadata": dict(inspect="metadata"),
                 "metadata, no checks": dict(inspect="metadata", checks=False),
                 "off, step objects kept": dict(inspect="off")}
HELD_STEPS = 64            # as the trace_capacity the engines here use


def child(preset: str, mode: str, engine: dict, args) -> dict[str, float]:
    """One engine alone in this process: its median step and forward (seconds) over 20 generate()
    calls after 5 warm-up ones."""
    llm = LLM(preset, **engine, **PROCESS_MODES[mode])
    prompts, k = make_prompts(llm.vocab_size, args), args.new_tokens
    if mode == "off, step objects kept":
        held: collections.deque = collections.deque(maxlen=HELD_STEPS)
        step = llm._step

        def step_then_hold(*args, **kwargs):
            out = step(*args, **kwargs)
            held.append(llm.model_runner.execute_state)
            return out
        llm._step = step_then_hold
    times, forwards = timing_steps({mode: llm})
    for i in range(25):
        if i == 5:
            times[mode].clear()
            forwards[mode].clear()
        run(llm, prompts, k)
    llm.shutdown()
    return {"step": statistics.median(times[mode]), "forward": statistics.median(forwards[mode])}


def process_medians(args, preset: str) -> dict[str, dict[str, float]]:
    """Mode -> {"step", "forward"}: the median over --processes fresh processes of each one's medians."""
    got: dict[str, list[dict[str, float]]] = {mode: [] for mode in PROCESS_MODES}
    for i in range(args.processes):
        modes = list(PROCESS_MODES)
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:      # each round in another order
            cmd = [sys.executable, __file__, "--child", preset, mode, "--batch", str(args.batch),
                   "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
                   "--device", args.device, "--dtype", args.dtype]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            got[mode].append(json.loads(out.strip().splitlines()[-1]))
    return {mode: {key: statistics.median(r[key] for r in runs) for key in ("step", "forward")}
            for mode, runs in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny-bamba", "tiny-mamba2"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--breakdown", action="store_true", help="also time the parts of a recorded step")
    ap.add_argument("--ablate", action="store_true",
                    help="also the median step with each runtime check replaced by a no-op, with the "
                         "trace's pushed-out records kept alive, and a control")
    ap.add_argument("--processes", type=int, default=0,
                    help="also each mode alone in a fresh process, this many rounds (what one engine sees)")
    ap.add_argument("--toggled", type=int, default=0, metavar="ROUNDS",
                    help="also one engine with its recording detached and attached per generate() call, "
                         "this many rounds (the most precise difference)")
    ap.add_argument("--toggled-tokens", type=int, default=193, help="tokens of each --toggled generate() call")
    ap.add_argument("--child", nargs=2, metavar=("PRESET", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    engine = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
                  max_num_batched_tokens=args.batch * args.prompt_len, trace_capacity=HELD_STEPS)
    if args.child:
        preset, mode = args.child
        print(json.dumps(child(preset, mode, engine, args)))
        return
    print(f"device={args.device} dtype={args.dtype} torch={torch.__version__} threads="
          f"{torch.get_num_threads()} batch={args.batch} prompt_len={args.prompt_len} "
          f"new_tokens={args.new_tokens} repeats={args.repeats}")
    rows, parts_rows, ablate_rows, process_rows, toggled_rows = [], [], [], [], []
    for preset in args.presets:
        llms = {name: cls(preset, **engine, **kw) for name, (cls, kw) in MODES.items()}
        prompts = make_prompts(llms["off"].vocab_size, args)
        best = {name: [float("inf"), float("inf")] for name in llms}
        for llm in llms.values():                            # warm-up
            run(llm, prompts, 2)
        for _ in range(args.repeats):
            for name, llm in llms.items():
                best[name][0] = min(best[name][0], run(llm, prompts, 1))
                best[name][1] = min(best[name][1], run(llm, prompts, args.new_tokens))
        base = None
        for name, (t1, tn) in best.items():
            step = (tn - t1) / (args.new_tokens - 1)
            base = step if base is None else base
            rows.append([preset, name, f"{step * 1e3:.3f}", f"{args.batch / step:,.0f}",
                         f"{(step / base - 1) * 100:+.1f}%"])
            print("  ".join(rows[-1]), flush=True)
        if args.breakdown:
            parts = breakdown(llms["metadata"], prompts, args.new_tokens)
            parts_rows += [[preset, label, f"{us:.1f}", f"{calls:g}"] for label, us, calls in parts]
            med, fwd = step_medians({m: llms[m] for m in ("off", "metadata")}, prompts, args.new_tokens, args.repeats)
            parts_rows.append([preset, "median engine step, off -> metadata",
                               f"{med['off'] * 1e6:.0f} -> {med['metadata'] * 1e6:.0f} "
                               f"({(med['metadata'] / med['off'] - 1) * 100:+.1f}%)", ""])
            parts_rows.append([preset, "  of which the forward (no hook inside), off -> metadata",
                               f"{fwd['off'] * 1e6:.0f} -> {fwd['metadata'] * 1e6:.0f} "
                               f"({(fwd['metadata'] - fwd['off']) * 1e6:+.0f} us)", ""])
        for llm in llms.values():
            llm.shutdown()
        if args.ablate:
            med, fwd = ablation_medians(functools.partial(LLM, preset, **engine), prompts, args.new_tokens,
                                        args.repeats)
            base, off = med["metadata"], med["off"]
            ablate_rows += [[preset, label, f"{m * 1e6:.0f}", f"{(m / off - 1) * 100:+.1f}%",
                             "" if label == "metadata" else f"{(m - base) * 1e6:+.0f}",
                             f"{fwd[label] * 1e6:.0f} ({(fwd[label] - fwd['off']) * 1e6:+.0f})"]
                            for label, m in med.items()]
        if args.toggled:
            llm = LLM(preset, **engine, inspect="metadata")
            got = toggled_medians(llm, prompts, args.toggled_tokens, args.toggled)
            llm.shutdown()
            ratios = [m / o - 1 for m, o in zip(got["metadata step"], got["off step"])]
            med = {key: statistics.median(v) * 1e6 for key, v in got.items()}
            toggled_rows.append([preset, f"{med['off step']:.0f}", f"{med['metadata step']:.0f}",
                                 f"{statistics.median(ratios) * 100:+.1f}% (sd {statistics.pstdev(ratios) * 100:.1f})",
                                 f"{med['metadata forward'] - med['off forward']:+.0f}",
                                 f"{med['metadata rest'] - med['off rest']:+.0f}"])
        if args.processes:
            med = process_medians(args, preset)
            off = med["off"]
            process_rows += [[preset, mode, f"{m['step'] * 1e6:.0f}", f"{(m['step'] / off['step'] - 1) * 100:+.1f}%",
                              f"{m['forward'] * 1e6:.0f} ({(m['forward'] - off['forward']) * 1e6:+.0f})"]
                             for mode, m in med.items()]
    header = ["preset", "mode", "decode step ms", "decode tok/s", "vs removed"]
    print()
    print_markdown_table(header, rows)
    if parts_rows:
        print()
        print_markdown_table(["preset", 'inspect="metadata": part of a step', "us per step", "calls per step"],
                             parts_rows)
    if ablate_rows:
        print()
        print_markdown_table(["preset", "engine (median step)", "us", "vs off", "us vs metadata",
                              "its forward, us (vs off)"], ablate_rows)
    if toggled_rows:
        print()
        print(f"one engine, its recording detached / attached per generate() call of {args.toggled_tokens} tokens, "
              f"{args.toggled} rounds (medians of the steps after the first {TOGGLED_SKIP}; the rounds' median):")
        print_markdown_table(["preset", "off step us", "metadata step us", "metadata vs off (per round)",
                              "forward us, metadata - off", "outside the runner us, metadata - off"], toggled_rows)
    if process_rows:
        print()
        print(f"each engine alone in a fresh process, median of {args.processes}:")
        print_markdown_table(["preset", "engine (median step)", "us", "vs off", "its forward, us (vs off)"],
                             process_rows)


if __name__ == "__main__":
    main()
