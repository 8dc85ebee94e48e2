"""The engine runs whose Triton launches test_compile_for_gpus.py compiles for GPUs (sm_80, sm_90).

RECORDED collects, for this test process, every kernel specialization (toolkit/inspect/kernel_specs.py)
launched by
- the backend-parity runs of test_backend_triton.py (`parity_run`, `sampled_run`, `checkpoint_run`):
  every tiny preset and demo-hybrid, fp32, a single request and the chunked, mixed, queued batch,
  greedy and seeded sampled rows; the prefill kernels saving internal checkpoints (cache mode
  "all"). They record as they run, so recording them costs nothing;
- the cases those runs do not launch (`EXTRA_WORKLOADS`, triton only, no comparison):
  fp16 and bf16 on every tiny preset and both demo models, each engine with padded decode
  (cudagraph_mode="padded_eager": the decode batch of 3 runs padded to 4, as a CUDA graph would),
  chunked prefill, mixed steps and a sampled row; the shape-true presets (real dimensions) in bf16,
  cut to one layer of each kind (`trimmed_preset`: every layer of a kind launches the same
  specializations); the Gumbel debug kernel (`gumbel_debug`, launched by no engine); and the recurrent
  update kernels' verify form in bf16 (`verify_rows`: speculative decoding's rows, one launch each).
Each workload records under a label (WORKLOADS: label -> run); test_compile_for_gpus.py runs, one
test each, those not recorded yet in this process (all of them when it runs alone).

The workloads come in four groups (WORKLOAD_GROUPS: the parity runs, the bf16 engines with the Gumbel
debug kernel, the fp16 engines, the shape-true presets). Each launch is recorded in RECORDED (all of
them: benchmarks/kernel_compile.py) and in its group's own KernelSpecs (GROUP_RECORDED), which one
compile test per group compiles. Each group is one pytest-xdist group (test_compile_for_gpus.py), so
that under `make test` the four run on whichever workers are free instead of serially on one.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from toolkit import LLM, SamplingParams
from toolkit.inspect.kernel_specs import KernelSpecs
from toolkit.models import DEMO_MODELS, PRESETS

from harness import BATCH_LIMITS, BATCH_PROMPT_LENS, DEVICE, F32, MAX_TOKENS, TINY_PRESETS, prompts_of, run_by_hand

RECORDED = KernelSpecs()


@contextlib.contextmanager
def recording(label: str):
    """Record the launches inside under `label` in RECORDED and in its group's GROUP_RECORDED."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(RECORDED.recording(label))
        if label in GROUP_OF:
            stack.enter_context(GROUP_RECORDED[GROUP_OF[label]].recording(label))
        yield


def _recorded(backend: str, label: str):
    return recording(label) if backend == "triton" else contextlib.nullcontext()


# ---- the backend-parity runs (test_backend_triton.py) ---------------------------------------------

def _parity_label(model: str, lengths: list[int], seed: int, limits: dict) -> str:
    return ":".join(["parity", model, "+".join(map(str, lengths)), f"seed{seed}",
                     *(f"{k}={v}" for k, v in sorted(limits.items()))])


def parity_run(model: str, backend: str, lengths: list[int], seed: int, **limits):
    """`model` on `backend` (fp32): greedy requests of these prompt lengths, stepped by hand (a
    triton run records its kernel specializations)."""
    with _recorded(backend, _parity_label(model, lengths, seed, limits)):
        with LLM(model, **F32, backend=backend, **limits) as llm:
            assert llm.backend == backend
            res = run_by_hand(llm, prompts_of(lengths, llm.vocab_size, seed=seed), MAX_TOKENS)
            assert {r.backend for r in res.records} == {backend}
            return res


SAMPLED = [SamplingParams(max_tokens=8, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
           for t, k, p, s in [(1.0, 0, 1.0, 7), (0.7, 5, 1.0, 8), (1.3, 0, 0.9, 9)]]


def sampled_run(backend: str) -> list[list[int]]:
    """demo-hybrid (fp32): three seeded sampled rows (plain, top-k, top-p); their tokens."""
    with _recorded(backend, "parity:demo-hybrid:sampled"):
        with LLM("demo-hybrid", **F32, backend=backend) as llm:
            prompts = [{"prompt_token_ids": p} for p in prompts_of([5, 9, 3], llm.vocab_size, seed=3)]
            return [o.outputs[0].token_ids for o in llm.generate(prompts, SAMPLED)]


CHECKPOINT_MODELS = ["tiny-bamba", "tiny-mamba", "tiny-lfm2", "tiny-qwen3-next"]   # Mamba2, Mamba1, conv, GDN


def checkpoint_run(model: str, backend: str) -> list[tuple[list[int], int]]:
    """Prefix caching in cache mode "all" (fp32, block 16): a 40-token prompt prefilled in one chunk
    saves the states at 16 and 32 from inside it, then a prompt sharing its first 32 tokens hits
    there. (tokens, cached prompt tokens) per request."""
    shared = list(range(20, 52))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with _recorded(backend, f"checkpoints:{model}"):
        with LLM(model, **F32, backend=backend, block_size=16, max_num_seqs=2, max_num_batched_tokens=48,
                 enable_prefix_caching=True, mamba_cache_mode="all") as llm:
            out = []
            for own in (range(100, 108), range(200, 208)):
                (res,) = llm.generate({"prompt_token_ids": shared + list(own)}, params)
                out.append((list(res.outputs[0].token_ids), res.num_cached_tokens))
            return out


PARITY_WORKLOADS: dict[str, Callable[[], object]] = {
    **{_parity_label(m, [23], 0, {}): (lambda m=m: parity_run(m, "triton", [23], 0))
       for m in TINY_PRESETS + ["demo-hybrid"]},
    **{_parity_label(m, BATCH_PROMPT_LENS, 1, BATCH_LIMITS):
       (lambda m=m: parity_run(m, "triton", BATCH_PROMPT_LENS, 1, **BATCH_LIMITS)) for m in TINY_PRESETS},
    "parity:demo-hybrid:sampled": lambda: sampled_run("triton"),
    **{f"checkpoints:{m}": (lambda m=m: checkpoint_run(m, "triton")) for m in CHECKPOINT_MODELS},
}


# ---- what the parity runs do not launch --------------------------------------------------------------

# Shape-true presets cut to one layer of each kind (same dimensions, the same kernel specialisations).
SHAPE_TRIMS = {
    "mamba-130m-shape": dict(num_hidden_layers=1),
    "mamba2-130m-shape": dict(num_hidden_layers=1),
    "bamba-300m-shape": dict(num_hidden_layers=2, attn_layer_indices=[1]),
    "lfm2-350m-shape": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    # Zoo III, cut further where the kernels cannot tell: MoE experts are torch ops (no kernel launch), so
    # 8 of them stand in for 256 (top-8 kept); the vocabulary is a runtime int to the kernels (specialised
    # on divisibility by 16 only), so 32768 stands in for 248320 / 163840 / 100352 (all multiples of 16);
    # the delta-rule heads are the kernels' grid, not their tiles (those come from the head dims), and
    # the conv's tiles stay capped (its channels >= 256); but a head count shows in the specialisations
    # through 16-byte alignment (a [T, H] tensor's rows start at multiples of H elements) and divisibility
    # by 16, so a stand-in keeps H's factors of 2 up to 16: OLMo's 30 heads -> 6, Kimi's 32 -> 16 (each
    # under the interpreter costs its heads' count in programs; the recorded specialisations were
    # compared equal). Qwen3.5's 16 key heads cannot shrink. MLA runs in torch: Kimi's 32 attention heads
    # -> 2. qwen3.5-9b-shape-4l is left out: its GDN layers are 35B-A3B's (16 key / 32 value heads x 128),
    # its attention 16 heads x 256 over 4 KV heads instead of 2.
    "qwen3.5-35b-a3b-shape-2l": dict(num_experts=8, vocab_size=32768),
    "olmo-hybrid-7b-shape-4l": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                    vocab_size=32768, linear_num_key_heads=6, linear_num_value_heads=6),
    "kimi-linear-48b-a3b-shape-2l": dict(num_experts=8, vocab_size=32768, linear_num_heads=16,
                                         num_attention_heads=2, num_key_value_heads=2),
}


def trimmed_config(preset: str):
    cfg = PRESETS[preset]()
    return type(cfg)(**{**cfg.to_dict(), **SHAPE_TRIMS[preset]})


@contextlib.contextmanager
def trimmed_preset(preset: str):
    """A preset name for `preset` cut to SHAPE_TRIMS[preset], registered while inside."""
    name = f"{preset}-trimmed"
    PRESETS[name] = lambda: trimmed_config(preset)
    try:
        yield name
    finally:
        del PRESETS[name]


# 3 requests, a 16-token budget: the 30-token prompt is chunked, steps 2 and 3 mix prefill and decode,
# step 4 is a decode batch of 3 that padded_eager pads to 4 (the CUDA-graph size), then all finish.
ENGINE_LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=16, cudagraph_mode="padded_eager")
ENGINE_PROMPTS = [(3, 4, 0.0), (30, 2, 0.0), (2, 2, 1.0)]       # (prompt length, max_tokens, temperature)
# the shape-true presets: the same steps' kinds (an 18-token prompt still chunked, mixed, padded) with a
# third less prefill, whose delta-rule and conv programs at real head counts dominate the interpreter's time
SHAPE_PROMPTS = [(3, 4, 0.0), (18, 2, 0.0), (2, 2, 1.0)]


def engine_run(model: str, dtype: str, prompts=ENGINE_PROMPTS) -> None:
    """One triton engine: chunked prefill, mixed steps, a padded decode batch, greedy and sampled rows."""
    with recording(f"engine:{model}:{dtype}"):
        with LLM(model, device=DEVICE, dtype=dtype, backend="triton", **ENGINE_LIMITS) as llm:
            for n, max_tokens, temperature in prompts:
                llm.add_request({"prompt_token_ids": prompts_of([n], llm.vocab_size, seed=n)[0]},
                                SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=5,
                                               ignore_eos=True))
            records = []
            while llm.has_unfinished_requests():
                records.append(llm.step())
            assert any(r.num_prefills and r.num_decodes for r in records), "no mixed step"
            assert any(r.padded_size and r.padded_size > r.num_decodes for r in records), "no padded decode"
            assert {r.backend for r in records} == {"triton"}


def shape_run(preset: str, dtype: str) -> None:
    with trimmed_preset(preset) as name:
        engine_run(name, dtype, SHAPE_PROMPTS)


def gumbel_debug_run() -> None:
    """The Gumbel noise kernel (gumbel_debug: the kernel's hashes and noise, for the kernel tests)."""
    from toolkit.kernels import gumbel
    with recording("gumbel_debug"):
        seeds = torch.tensor([[1, 2], [3, 4]], device=DEVICE)
        positions = torch.tensor([5, 6], device=DEVICE)
        gumbel.gumbel_debug(seeds, positions, 300)


def verify_rows_run() -> None:
    """The recurrent update kernels' verify form (speculative decoding: every row's 1 + k tokens in one
    launch) in bf16, as a bf16 engine launches them: bf16 activations, a bf16 conv state, fp32 SSM
    states; the rows, columns and shapes of tests/test_verify_rows.py."""
    from test_verify_rows import CASES, _case, _rows

    from toolkit.layers.ops import triton_ops
    ops = triton_ops(torch.device(DEVICE))
    with recording("verify_rows"):
        for case, name in CASES.items():
            idx, qsl, accepted, t = _rows(DEVICE, 4)
            state, inputs, call = _case(case, t, DEVICE, torch.Generator().manual_seed(2))
            if case == "conv":
                state = state.to(torch.bfloat16)
            # every per-token input in bf16 but Gated DeltaNet's log decay g (fp32 in the mixer)
            inputs = [x if case == "gdn" and i == 3 else x.to(torch.bfloat16) for i, x in enumerate(inputs)]
            call(getattr(ops, name), state, inputs, idx, query_start_loc=qsl, num_accepted_tokens=accepted)


def sliding_window_run() -> None:
    """Paged attention with a sliding window (LFM3's and other SWA layers' mask; released pages before
    every window), bf16 and fp32, decode rows and prefill chunks, before any model uses it."""
    from test_kernel_paged_attention import MIXED, make_batch, release_out_of_window_pages

    from toolkit.kernels import paged_attention
    with recording("sliding_window"):
        for dtype in (torch.bfloat16, torch.float32):
            q, cache, md = make_batch(MIXED + [(1, 33), (20, 40)], 4, 2, 16, 4, dtype, device=DEVICE)
            release_out_of_window_pages(md, 4, 6)
            paged_attention.paged_attention(q, cache, md, 0.25, sliding_window=6)


def kda_run() -> None:
    """Kimi Delta Attention (the delta-rule kernels with a log decay per key channel, G_PER_K), as a bf16
    mixer would launch them before any model uses them: decode rows, verify rows, a prefill with
    checkpoints; bf16 activations and beta, fp32 g and states."""
    from test_kernel_kda import LENS, _inputs, _layout

    from toolkit.kernels import kda
    from toolkit.kernels.state_slots_ref import Checkpoints
    gen = torch.Generator().manual_seed(0)
    with recording("kda"):
        h, kd, vd = 2, 16, 12
        q, k, v, g, beta = _inputs(gen, torch.bfloat16, sum(LENS), h, kd, vd, DEVICE)
        state = torch.zeros(12, h, vd, kd, device=DEVICE)
        rows = torch.tensor([3, -1, 0, 6], dtype=torch.int32, device=DEVICE)
        kda.kda_update(state, q[:4], k[:4], v[:4], g[:4], beta[:4], rows)
        cols = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32, device=DEVICE)
        qsl, acc = (torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in ([0, 3, 5], [2, 1]))
        kda.kda_update(state, q[:5], k[:5], v[:5], g[:5], beta[:5], cols, query_start_loc=qsl, num_accepted_tokens=acc)
        n = len(LENS)
        idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
        flags = torch.ones(n, dtype=torch.bool, device=DEVICE)
        ckpt = Checkpoints(torch.tensor([0, 3], device=DEVICE), torch.tensor([9, 10], dtype=torch.int32, device=DEVICE))
        for checkpoints in (None, ckpt):
            kda.kda_prefill(q, k, v, g, beta, *_layout(LENS, 16, DEVICE), 16, state, idx, flags,
                            checkpoints=checkpoints)


def mlstm_run() -> None:
    """xLSTM's mLSTM kernels as a bf16 mixer launches them, with shapes of their own (a masked K tail,
    two V blocks): decode rows with a padded one, verify rows, a prefill with and without checkpoints;
    bf16 activations and gates, fp32 states."""
    from test_kernel_mlstm import LENS, _inputs

    from toolkit.kernels import mlstm
    from toolkit.kernels.state_slots_ref import Checkpoints
    gen = torch.Generator().manual_seed(0)
    with recording("mlstm"):
        h, kd, vd = 2, 12, 40
        q, k, v, i, f = _inputs(gen, torch.bfloat16, sum(LENS), h, kd, vd, DEVICE)
        states = (torch.zeros(12, h, kd, vd, device=DEVICE), torch.zeros(12, h, kd, device=DEVICE),
                  torch.zeros(12, h, device=DEVICE))
        rows = torch.tensor([3, -1, 0, 6], dtype=torch.int32, device=DEVICE)
        mlstm.mlstm_update(*states, q[:4], k[:4], v[:4], i[:4], f[:4], rows)
        cols = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32, device=DEVICE)
        qsl, acc = (torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in ([0, 3, 5], [2, 1]))
        mlstm.mlstm_update(*states, q[:5], k[:5], v[:5], i[:5], f[:5], cols, query_start_loc=qsl,
                           num_accepted_tokens=acc)
        n = len(LENS)
        cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
        flags = torch.ones(n, dtype=torch.bool, device=DEVICE)
        ckpt = Checkpoints(torch.tensor([0, 3], device=DEVICE), torch.tensor([9, 10], dtype=torch.int32, device=DEVICE))
        for checkpoints in (None, ckpt):
            mlstm.mlstm_prefill(q, k, v, i, f, cu, *states, idx, flags, checkpoints=checkpoints)


def mlstm_shape_run() -> None:
    """The mLSTM kernels at xLSTM-7b's head shape (xlstm-7b-shape-4l: 8 heads, K = 256, V = 512: a
    [256, 32] tile of C per block of V, 16 blocks a head), bf16 inputs, fp32 states: decode rows with a
    padded one, verify rows, a prefill with and without checkpoints. Kernel-level: an engine run of the shape preset
    would spend its time in the torch projections of 4096-wide blocks, not in these kernels."""
    from toolkit.kernels import mlstm
    from toolkit.kernels.state_slots_ref import Checkpoints
    gen = torch.Generator().manual_seed(0)
    with recording("mlstm:xlstm-7b-shape"):
        h, kd, vd, n = 8, 256, 512, 4
        x = torch.randn(n, h * (2 * kd + vd) + 2 * h, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
        q, k = x[:, :h * kd].view(n, h, kd), x[:, h * kd:2 * h * kd].view(n, h, kd)
        v = x[:, 2 * h * kd:h * (2 * kd + vd)].view(n, h, vd)
        i, f = x[:, h * (2 * kd + vd):].view(n, 2, h).unbind(1)
        states = (torch.zeros(6, h, kd, vd, device=DEVICE), torch.zeros(6, h, kd, device=DEVICE),
                  torch.zeros(6, h, device=DEVICE))
        mlstm.mlstm_update(*states, q[:2], k[:2], v[:2], i[:2], f[:2],
                           torch.tensor([1, -1], dtype=torch.int32, device=DEVICE))
        mlstm.mlstm_update(*states, q[:3], k[:3], v[:3], i[:3], f[:3],
                           torch.tensor([[1, 2, 3]], dtype=torch.int32, device=DEVICE),
                           query_start_loc=torch.tensor([0, 3], dtype=torch.int32, device=DEVICE),
                           num_accepted_tokens=torch.tensor([1], dtype=torch.int32, device=DEVICE))
        ckpt = Checkpoints(torch.tensor([2], device=DEVICE), torch.tensor([5], dtype=torch.int32, device=DEVICE))
        for checkpoints in (None, ckpt):
            mlstm.mlstm_prefill(q, k, v, i, f, torch.tensor([0, 1, 4], dtype=torch.int32, device=DEVICE), *states,
                                torch.tensor([0, 4], dtype=torch.int32, device=DEVICE),
                                torch.ones(2, dtype=torch.bool, device=DEVICE), checkpoints=checkpoints)


# bf16 (a GPU's default dtype) on every model; fp16 on a set that launches every kernel family
# (attention and RoPE, Mamba1 and MoE, Mamba2 and the gated norm, short conv, Gated DeltaNet)
BF16_MODELS = TINY_PRESETS + list(DEMO_MODELS)
FP16_MODELS = ["tiny-bamba", "tiny-jamba", "tiny-lfm2", "tiny-qwen3-next", "tiny-mamba"]
BF16_WORKLOADS: dict[str, Callable[[], object]] = {
    **{f"engine:{m}:bfloat16": (lambda m=m: engine_run(m, "bfloat16")) for m in BF16_MODELS},
    "gumbel_debug": gumbel_debug_run,
    "verify_rows": verify_rows_run,
    "kda": kda_run,
    "mlstm": mlstm_run,
    "sliding_window": sliding_window_run,
}
FP16_WORKLOADS: dict[str, Callable[[], object]] = {
    f"engine:{m}:float16": (lambda m=m: engine_run(m, "float16")) for m in FP16_MODELS}
SHAPE_WORKLOADS: dict[str, Callable[[], object]] = {
    **{f"engine:{p}-trimmed:bfloat16": (lambda p=p: shape_run(p, "bfloat16")) for p in SHAPE_TRIMS},
    "mlstm:xlstm-7b-shape": mlstm_shape_run}
EXTRA_WORKLOADS = {**BF16_WORKLOADS, **FP16_WORKLOADS, **SHAPE_WORKLOADS}
WORKLOADS = {**PARITY_WORKLOADS, **EXTRA_WORKLOADS}

# The groups: the parity runs (test_backend_triton.py records them as it compares); the bf16 engines on
# every tiny preset and demo model, with the Gumbel debug kernel: together they launch every kernel
# (test_compile_for_gpus.py checks it); the fp16 engines; the shape-true presets (the heaviest under the
# interpreter: a group of their own, so that a free worker takes it beside the others).
WORKLOAD_GROUPS: dict[str, dict[str, Callable[[], object]]] = {
    "parity": PARITY_WORKLOADS, "engines-bf16": BF16_WORKLOADS, "engines-fp16": FP16_WORKLOADS,
    "shapes": SHAPE_WORKLOADS}
GROUP_OF = {label: group for group, workloads in WORKLOAD_GROUPS.items() for label in workloads}
GROUP_RECORDED = {group: KernelSpecs() for group in WORKLOAD_GROUPS}


def record_all(group: str | None = None) -> list[str]:
    """Run every workload (of `group`, or of all groups) that has no complete recording yet in this
    process; returns their labels."""
    ran = []
    for label, run in (WORKLOADS if group is None else WORKLOAD_GROUPS[group]).items():
        done = RECORDED if group is None else GROUP_RECORDED[group]
        if label not in done.labels:
            run()
            ran.append(label)
            assert label in done.labels, f"workload {label!r} recorded under another label"
    return ran
