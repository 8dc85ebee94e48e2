"""`python -m toolkit doctor`: the first thing to run on a new machine.

It prints the versions (python, torch, CUDA, triton, transformers; and huggingface_hub with the
Hub cache folder that `LLM("org/name")` downloads into, and whether HF_HUB_OFFLINE keeps it to that
cache) and the device (its compute capability on a GPU), then runs each check and prints one line per check:

    NAME  PASS|FAIL|SKIP  VALUE  DETAIL

VALUE is the check's number (a max |logit difference|, milliseconds of a decode step; "-" when it
has none). Exit code 1 when any check fails, 0 otherwise; `--json` prints one JSON object instead
(versions, device, checks) and nothing else on stdout.

The checks (each one isolated: an exception is that check's FAIL, with the exception's type and
message, and the others still run):

  kernel_compile          GPU: Triton kernels compiled and launched on CUDA tensors, against their
                          torch references
  triton_vs_torch         backend="triton" vs backend="torch" on the device, fp32: greedy tokens equal,
                          logits within 1e-4 (on a CPU the kernels run under the Triton interpreter:
                          one preset, it is slow)
  device_vs_cpu           GPU: the presets on the device (backend "auto", fp32, TF32 off) vs the CPU
                          (fp32, torch ops): tokens equal, logits within 1e-4
  padded_decode_vs_eager  decode batches padded to a graph size and run eagerly (cudagraph_mode=
                          "padded_eager") vs unpadded ("none"): tokens equal, logits within 1e-5;
                          the CPU's stand-in for graphs vs eager
  graphs_vs_eager         GPU: CUDA graphs ("full_decode") vs eager: tokens equal, logits within 1e-4
  decode_b{1,16}_{hf,eager,graphs}
                          the decode step in ms at batch 1 and 16 (dtype "auto": bf16 on CUDA, fp32 on
                          a CPU): HF `generate` on the same weights, this runner eager, with CUDA graphs
                          (GPU). Method of benchmarks/decode_throughput.py: t1 = generate 1 token,
                          tN = generate N; step = (tN - t1) / (N - 1), best of a few runs after a warm-up.

Greedy tokens are compared with the tie rule of the parity tests: where the two runs pick different
tokens whose reference logits are within 1e-5, both are right and that request's comparison stops.
On a CPU the GPU-only lines say "skipped: needs a GPU".
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from toolkit.config import triton_installed
from toolkit.llm import LLM
from toolkit.models import save_hf_folder
from toolkit.models.hub import cache_dir, offline_variable
from toolkit.sampling import SamplingParams

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
NEEDS_GPU = "skipped: needs a GPU"
# The parity presets on a GPU: every kind of sequence mixer, so every kernel runs (attention; Mamba1;
# Mamba2; the Bamba hybrid; LFM2's short conv; Qwen3-Next's Gated DeltaNet).
GPU_PRESETS = ["tiny-llama", "tiny-mamba", "tiny-mamba2", "tiny-bamba", "tiny-lfm2", "tiny-qwen3-next"]
# On a CPU the Triton interpreter takes seconds per preset: one hybrid, whose layers use most kernels
# (paged attention, KV write, rotary, RMS norms, SwiGLU, conv, Mamba2's scan and update).
CPU_PRESETS = ["tiny-bamba"]
TIMING_PRESET = "tiny-llama"
LOGIT_ATOL = 1e-4        # fp32 on both sides, as the parity tests (tests/harness.py)
PAD_ATOL = 1e-5          # the same ops on a padded batch (tests/test_cudagraph.py)
TIE_ATOL = 1e-5
KERNEL_ATOL = 1e-5       # fp32 kernel vs its torch reference (tests/test_kernel_*.py)
# The parity workload: 2 requests (17 and 5 tokens), 4 tokens each, under a 16-token budget: the long
# prompt is chunked, a step mixes a prefill with a decode (small: the interpreter is slow on a CPU).
PROMPT_LENS = [17, 5]
MAX_TOKENS = 4
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
# padded decode: 5 requests decode together, padded to the capture size 8
PAD_PROMPT_LENS = [5, 9, 3, 7, 4]
TIMING_BATCHES = (1, 16)


class Skip(Exception):
    """A check that does not apply here; its message is the reason."""


@dataclass
class Check:
    name: str
    status: str                 # PASS, FAIL or SKIP
    value: float | None         # the check's number (None: none)
    unit: str                   # "" or "ms"
    detail: str
    seconds: float = 0.0


@dataclass
class Context:
    """What the checks share: the device, the presets, and results measured once (timings)."""
    cuda: bool
    presets: list[str]
    timing_preset: str = TIMING_PRESET
    new_tokens: int = 16          # timing: tokens generated (N); 32 on a GPU
    repeats: int = 3
    busy: str = ""                  # busy_note() at the start, appended to the timing lines
    cache: dict = field(default_factory=dict)
    closers: list = field(default_factory=list)

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def close(self) -> None:
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):
                close()
        self.closers.clear()
        self.cache.clear()


# ---- versions and device -------------------------------------------------------------------------

def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Read from the installed distributions: importing triton here would fix TRITON_INTERPRET."""
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": _dist_version("triton") if triton_installed() else None,
            "transformers": _dist_version("transformers")}


def device_info() -> dict:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        props = torch.cuda.get_device_properties(0)
        return {"type": "cuda", "name": torch.cuda.get_device_name(0), "capability": f"{major}.{minor}",
                "memory_gib": round(props.total_memory / 2**30, 1), "count": torch.cuda.device_count(),
                "bf16": torch.cuda.is_bf16_supported()}
    return {"type": "cpu", "name": platform.machine() or "cpu", "capability": None,
            "cores": os.cpu_count(), "threads": torch.get_num_threads()}


def busy_note() -> str:
    """A warning for the timing lines when other work keeps the host's cores busy (the tiny models are
    host-bound, on a GPU too), else ""."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):          # not on Windows
        return ""
    cores = os.cpu_count() or 1
    return f"; load average {load:.1f} on {cores} cores: timings unreliable" if load > 0.75 * cores else ""


def _version_line(v: dict) -> str:
    return (f"versions  python {v['python']} | torch {v['torch']} | CUDA {v['cuda'] or 'none (CPU build)'} | "
            f"triton {v['triton'] or 'not installed'} | transformers {v['transformers']}")


def hub_note() -> str:
    """The Hub client's part of the versions line: where Hub ids are cached, and whether an offline
    variable (read now, as the loader reads it) keeps loading to that cache."""
    offline = offline_variable()
    mode = f"{offline} set: cache only" if offline else "HF_HUB_OFFLINE unset: downloads allowed"
    return f" | huggingface_hub {_dist_version('huggingface_hub')} (cache {cache_dir()}, {mode})"


def _device_line(d: dict) -> str:
    if d["type"] == "cuda":
        return (f"device    cuda: {d['name']}, compute capability {d['capability']}, {d['memory_gib']} GiB, "
                f"{d['count']} GPU(s), bf16 {'yes' if d['bf16'] else 'no'}")
    return (f"device    cpu: {d['name']}, {d['cores']} cores, torch threads {d['threads']}; no CUDA GPU, "
            "so the GPU checks are skipped")


# ---- runs and comparisons ------------------------------------------------------------------------

@dataclass
class Run:
    tokens: list[list[int]]
    logits: list[list[torch.Tensor]]        # per request, one float32 [V] per token, on the CPU
    records: list


def _prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run_engine(model: str, lengths: list[int], max_tokens: int = MAX_TOKENS, seed: int = 0,
               warmup: bool = False, **kw) -> Run:
    """Greedy requests stepped by hand: each request's tokens and the logits they were sampled from."""
    with LLM(model, **kw) as llm:
        if warmup:
            llm.warmup(progress=False)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = [llm.add_request({"prompt_token_ids": p}, params) for p in _prompts(lengths, llm.vocab_size, seed)]
        run = Run([[] for _ in ids], [[] for _ in ids], [])
        while llm.has_unfinished_requests():
            rec = llm.step()
            run.records.append(rec)
            for rid, tok in rec.kept_token_ids.items():
                i = ids.index(rid)
                run.tokens[i].append(tok)
                run.logits[i].append(rec.logits_of(rid).detach().float().cpu())
        return run


def compare(ref: Run, ours: Run, atol: float) -> tuple[float, str | None]:
    """(max |logit difference|, what differs or None). Tokens: equal, or a tie in the reference's
    logits (within TIE_ATOL: both are right, that request's comparison stops); logits within atol."""
    worst = 0.0
    for i, (ref_toks, our_toks) in enumerate(zip(ref.tokens, ours.tokens, strict=True)):
        if len(ref_toks) != len(our_toks):
            return worst, f"request {i}: {len(our_toks)} tokens vs {len(ref_toks)}"
        for k, (a, b) in enumerate(zip(ref_toks, our_toks, strict=True)):
            ref_logits = ref.logits[i][k]
            diff = (ref_logits - ours.logits[i][k]).abs().max().item()
            if math.isnan(diff):
                return math.nan, f"request {i}, token {k}: NaN in the logits"
            worst = max(worst, diff)
            if diff > atol:
                return worst, f"request {i}, token {k}: logits differ by {diff:.1e} > {atol:.0e}"
            if a != b:
                gap = (ref_logits[a] - ref_logits[b]).abs().item()
                if gap > TIE_ATOL:
                    return worst, f"request {i}, token {k}: token {b} vs {a} (logit gap {gap:.1e})"
                break
    return worst, None


def _parity(presets: list[str], ref_kw: dict, our_kw: dict, atol: float, what: str,
            ours_check: Callable[[Run], str | None] | None = None,
            lengths: list[int] = PROMPT_LENS) -> tuple[bool, float, str, str]:
    """Every preset run with ref_kw and with our_kw (run_engine) and compared; the line's result."""
    worst, worst_preset, tokens = 0.0, presets[0], 0
    for preset in presets:
        ref = run_engine(preset, lengths, **ref_kw)
        ours = run_engine(preset, lengths, **our_kw)
        diff, problem = compare(ref, ours, atol)
        problem = problem or (ours_check(ours) if ours_check else None)
        if problem:
            return False, diff, "", f"{preset}, {what}: {problem}"
        if diff >= worst:
            worst, worst_preset = diff, preset
        tokens += sum(len(t) for t in ours.tokens)
    name = presets[0] if len(presets) == 1 else f"{len(presets)} presets (largest diff: {worst_preset})"
    return True, worst, "", f"{name}, {what}: {tokens} greedy tokens equal, max |logit diff| <= {atol:.0e}"


@contextlib.contextmanager
def _no_tf32():
    """fp32 parity means real fp32 matmuls and convolutions (as tests/harness.py sets on a GPU)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _needs_gpu(ctx: Context, what: str) -> None:
    if not ctx.cuda:
        raise Skip(f"{NEEDS_GPU} ({what})")


def _needs_triton(what: str) -> None:
    if not triton_installed():
        raise Skip(f"skipped: triton is not installed, the torch ops run ({what})")


# ---- the checks ----------------------------------------------------------------------------------
# Each returns (passed, value, unit, detail) or raises Skip; any other exception is its FAIL.

CHECKS: dict[str, Callable[[Context], tuple[bool, float | None, str, str]]] = {}


def check(name: str):
    def register(fn):
        CHECKS[name] = fn
        return fn
    return register


@check("kernel_compile")
def kernel_compile(ctx: Context):
    _needs_gpu(ctx, "compiled kernels; on a CPU triton_vs_torch runs them in the interpreter")
    _needs_triton("no compiled kernels")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False, None, "", "TRITON_INTERPRET=1 is set: the kernels run in the interpreter; unset it"
    from toolkit.kernels import (
        activation,
        activation_ref,
        rms_norm,
        rms_norm_ref,
        rotary,
        rotary_ref,
    )
    from toolkit.layers.rotary import default_inv_freq
    g = torch.Generator().manual_seed(0)
    dev = ctx.device
    x = torch.randn(7, 72, generator=g).to(dev)[:, 5:45]             # a column slice, D = 40
    w = (1 + 0.3 * torch.randn(40, generator=g)).to(dev)
    proj = torch.randn(5, 80, generator=g).to(dev)
    qkv = torch.randn(7, 8 * 16 + 8, generator=g).to(dev)
    q, k = qkv[:, :64].view(7, 4, 16), qkv[:, 64:96].view(7, 2, 16)
    positions = torch.tensor([0, 1, 2, 17, 300, 4095, 65000], device=dev)
    inv = default_inv_freq(16, 10000.0).to(dev)
    cases = {"rms_norm": (lambda m: m.rms_norm(x, w, 1e-6), rms_norm, rms_norm_ref),
             "silu_and_mul": (lambda m: m.silu_and_mul(proj[:, :40], proj[:, 40:]), activation, activation_ref),
             "rotary": (lambda m: torch.cat([t.flatten() for t in m.apply_rotary(positions, q, k, inv, 1.0, 16)]),
                        rotary, rotary_ref)}
    worst, start = 0.0, time.perf_counter()
    for name, (call, kernel, ref) in cases.items():
        ours, expected = call(kernel), call(ref)
        torch.cuda.synchronize()
        if not ours.is_cuda:
            return False, None, "", f"{name}: the kernel's output is not on the GPU"
        diff = (ours.float() - expected.float()).abs().max().item()
        if not diff <= KERNEL_ATOL:
            return False, diff, "", f"{name}: differs from its torch reference by {diff:.1e} > {KERNEL_ATOL:.0e}"
        worst = max(worst, diff)
    seconds = time.perf_counter() - start
    return True, worst, "", (f"{', '.join(cases)} compiled and run on CUDA tensors in {seconds:.1f} s; "
                             f"max |diff| vs the torch references <= {KERNEL_ATOL:.0e}")


@check("triton_vs_torch")
def triton_vs_torch(ctx: Context):
    _needs_triton("nothing to compare")
    base = dict(device=ctx.device, dtype="float32", **LIMITS)
    where = "CUDA (compiled)" if ctx.cuda else "the CPU (Triton interpreter)"
    with _no_tf32() if ctx.cuda else contextlib.nullcontext():
        return _parity(ctx.presets, dict(base, backend="torch"), dict(base, backend="triton"), LOGIT_ATOL,
                       f"fp32 on {where}")


@check("device_vs_cpu")
def device_vs_cpu(ctx: Context):
    _needs_gpu(ctx, "the device against the CPU")
    cpu = dict(device="cpu", dtype="float32", backend="torch", **LIMITS)
    gpu = dict(device="cuda", dtype="float32", backend="auto", **LIMITS)
    backend = "triton" if triton_installed() else "torch"
    with _no_tf32():
        return _parity(ctx.presets, cpu, gpu, LOGIT_ATOL,
                       f"fp32, CUDA ({backend} ops, TF32 off) vs the CPU (torch ops)")


def _padded_rows(run: Run) -> str | None:
    if not any(r.padded_size is not None for r in run.records):
        return "no decode batch was padded"
    return None


def _graph_replays(run: Run) -> str | None:
    if not any(r.graph == "graph" for r in run.records):
        return "no step replayed a CUDA graph"
    return None


@check("padded_decode_vs_eager")
def padded_decode_vs_eager(ctx: Context):
    base = dict(device=ctx.device, dtype="float32", max_num_seqs=8)
    with _no_tf32() if ctx.cuda else contextlib.nullcontext():
        return _parity(ctx.presets, dict(base, cudagraph_mode="none"), dict(base, cudagraph_mode="padded_eager"),
                       # on a GPU a matmul's kernel (and its sums) may change with the row count
                       LOGIT_ATOL if ctx.cuda else PAD_ATOL,
                       f"fp32 on {ctx.device}, decode batches of 5 padded to 8 vs unpadded", _padded_rows,
                       PAD_PROMPT_LENS)


@check("graphs_vs_eager")
def graphs_vs_eager(ctx: Context):
    _needs_gpu(ctx, "CUDA graphs")
    _needs_triton("CUDA graphs need the Triton ops")
    base = dict(device="cuda", dtype="float32", backend="triton", max_num_seqs=8)
    with _no_tf32():
        return _parity(ctx.presets, dict(base, cudagraph_mode="none"),
                       dict(base, cudagraph_mode="full_decode", warmup=True),
                       LOGIT_ATOL, "fp32 on CUDA, decode graphs (sizes 1, 2, 4, 8) vs eager", _graph_replays,
                       PAD_PROMPT_LENS)


# ---- timing --------------------------------------------------------------------------------------

def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _best(fn, repeats: int) -> float:
    fn()                                        # warm-up
    best = math.inf
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - start)
    return best


def _step_ms(make: Callable[[int], Callable], ctx: Context) -> float:
    t1 = _best(make(1), ctx.repeats)
    tn = _best(make(ctx.new_tokens), ctx.repeats)
    return max(tn - t1, 0.0) / (ctx.new_tokens - 1) * 1e3


def _engine(ctx: Context, kind: str) -> LLM:
    """The timing engine of a kind ("eager" or "graphs"), built once."""
    key = ("engine", kind)
    if key not in ctx.cache:
        kw = dict(device=ctx.device, dtype="auto", max_num_seqs=max(TIMING_BATCHES), inspect="off",
                  max_num_batched_tokens=max(TIMING_BATCHES) * 16, max_model_len=128)
        llm = LLM(ctx.timing_preset, **kw, **({"enforce_eager": True} if kind == "eager" else {}))
        ctx.closers.append(llm.shutdown)
        if kind == "graphs" and llm.cudagraph_mode != "full_decode":
            raise Skip(f"skipped: cudagraph_mode 'auto' is {llm.cudagraph_mode!r} here (backend {llm.backend})")
        llm.warmup(progress=False)
        ctx.cache[key] = llm
    return ctx.cache[key]


def _batch_prompts(ctx: Context, batch: int, vocab: int) -> list[list[int]]:
    return _prompts([16] * batch, min(vocab, 1000), seed=batch)


def _runner_ms(ctx: Context, kind: str, batch: int) -> float:
    key = ("ms", kind, batch)
    if key not in ctx.cache:
        llm = _engine(ctx, kind)
        prompts = [{"prompt_token_ids": p} for p in _batch_prompts(ctx, batch, llm.vocab_size)]

        def make(k: int):
            params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
            return lambda: llm.generate(prompts, params)
        ctx.cache[key] = _step_ms(make, ctx)
    return ctx.cache[key]


def _hf_ms(ctx: Context, batch: int) -> float:
    key = ("ms", "hf", batch)
    if key not in ctx.cache:
        if "hf" not in ctx.cache:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging
            llm = _engine(ctx, "eager")
            bar = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()           # no "Loading weights" bar between the lines
            try:
                with tempfile.TemporaryDirectory() as folder:
                    save_hf_folder(llm, folder)
                    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=llm.cfg.dtype)
                    ctx.cache["hf"] = hf.to(ctx.device).eval()
            finally:
                if bar:
                    hf_logging.enable_progress_bar()
        hf = ctx.cache["hf"]
        ids = torch.tensor(_batch_prompts(ctx, batch, hf.config.vocab_size), device=ctx.device)

        def make(k: int):
            @torch.inference_mode()
            def gen():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                            do_sample=False, pad_token_id=0)
            return gen
        ctx.cache[key] = _step_ms(make, ctx)
    return ctx.cache[key]


def _timing_check(kind: str, batch: int):
    def run(ctx: Context):
        if kind == "graphs":
            _needs_gpu(ctx, "CUDA graphs")
            _needs_triton("CUDA graphs need the Triton ops")
        ms = _hf_ms(ctx, batch) if kind == "hf" else _runner_ms(ctx, kind, batch)
        dtype = str(_engine(ctx, "eager").cfg.dtype).removeprefix("torch.")
        detail = (f"{ctx.timing_preset} {dtype} on {ctx.device}, batch {batch}, prompt 16, "
                  f"{ctx.new_tokens} new tokens: {batch / max(ms, 1e-9) * 1e3:,.0f} tok/s")
        if ms == 0:
            return True, ms, "ms", detail.split(":")[0] + ": below the timer's noise here" + ctx.busy
        hf = ctx.cache.get(("ms", "hf", batch))
        if kind != "hf" and hf:
            detail += f", {hf / ms:.1f}x HF"
        return True, ms, "ms", detail + ctx.busy
    return run


for _batch in TIMING_BATCHES:
    for _kind in ("hf", "eager", "graphs"):
        CHECKS[f"decode_b{_batch}_{_kind}"] = _timing_check(_kind, _batch)


# ---- running and reporting -----------------------------------------------------------------------

def run_check(name: str, fn: Callable, ctx: Context) -> Check:
    start = time.perf_counter()
    try:
        passed, value, unit, detail = fn(ctx)
        status = PASS if passed else FAIL
        if value is not None and not math.isfinite(value):
            value = None                        # JSON has no NaN; the detail says what happened
    except Skip as reason:
        status, value, unit, detail = SKIP, None, "", str(reason)
    except Exception as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        status, value, unit, detail = FAIL, None, "", f"{type(err).__name__}: {message}"[:300]
    return Check(name, status, value, unit, detail, round(time.perf_counter() - start, 2))


def _fmt_value(c: Check) -> str:
    if c.value is None:
        return "-"
    if c.unit == "ms":
        return f"{c.value:.3f}ms"
    if math.isnan(c.value):
        return "nan"
    return "0" if c.value == 0 else f"{c.value:.1e}"


def format_line(c: Check, width: int = 24) -> str:
    return f"{c.name:<{width}} {c.status}  {_fmt_value(c):<10} {c.detail}"


def select(names: list[str] | None) -> list[str]:
    """The checks named (a name, or a prefix such as "decode"), in their order; all when None."""
    if not names:
        return list(CHECKS)
    unknown = [n for n in names if not any(c == n or c.startswith(n) for c in CHECKS)]
    if unknown:
        raise ValueError(f"--check {unknown[0]!r}: no such check; the checks are {', '.join(CHECKS)}")
    return [c for c in CHECKS if any(c == n or c.startswith(n) for n in names)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (versions, device, checks with name/status/value/unit/"
                             "detail) and nothing else on stdout")
    parser.add_argument("--check", action="append", metavar="NAME",
                        help="run only this check (a name or a prefix, e.g. 'decode'); repeatable. "
                             f"Checks: {', '.join(CHECKS)}")
    parser.add_argument("--presets", nargs="+", metavar="NAME",
                        help=f"the presets of the parity checks (default on a GPU: {' '.join(GPU_PRESETS)}; "
                             f"on a CPU: {' '.join(CPU_PRESETS)}, the interpreter is slow)")
    parser.add_argument("--timing-preset", default=TIMING_PRESET, metavar="NAME",
                        help=f"the preset of the decode timings (default {TIMING_PRESET})")


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    names = select(args.check)
    cuda = torch.cuda.is_available()
    ctx = Context(cuda=cuda, presets=args.presets or (GPU_PRESETS if cuda else CPU_PRESETS),
                  timing_preset=args.timing_preset, new_tokens=32 if cuda else 16, repeats=3, busy=busy_note())
    info = {"versions": versions(), "device": device_info()}
    if not args.json:
        print(_version_line(info["versions"]) + hub_note())
        print(_device_line(info["device"]), flush=True)
    results = []
    # --json: whatever a check prints (a library's notice) goes to stderr, so stdout is one JSON object
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        try:
            for name in names:
                results.append(run_check(name, CHECKS[name], ctx))
                if not args.json:
                    print(format_line(results[-1]), flush=True)
        finally:
            ctx.close()
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    seconds = round(time.perf_counter() - start, 1)
    if args.json:
        print(json.dumps({**info, "checks": [asdict(r) for r in results], "passed": counts[PASS],
                          "failed": counts[FAIL], "skipped": counts[SKIP], "ok": counts[FAIL] == 0,
                          "seconds": seconds}, indent=1))
    else:
        print(f"doctor: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped in {seconds} s")
    return 1 if counts[FAIL] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit doctor")
    add_arguments(parser)
    return run(parser.parse_args(argv))
