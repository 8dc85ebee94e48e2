"""Test harness of the runner: small engines on the tiny presets, and their parity with HF transformers.

Parity: the toolkit and HF transformers run on the same weights. Reference = HF's `generate`
(greedy) for tokens, and HF's full forward (no cache) over prompt + generated tokens for logits.
Tie rule: if our greedy token differs from HF's at some step and HF's two logits are within
TIE_ATOL (1e-5), both choices are right; the sequences then diverge, so comparison of that request
stops at that step.

Logprobs (when the run asked for them: the parity checks run with logprobs=prompt_logprobs=5):
every logprob the engine returns, for generated and prompt tokens, equals HF's log_softmax of its
fp32 logits at that token within LOGPROB_ATOL (1e-4), the top 5 included; and
`toolkit.inspect.check_logprobs_close` (vLLM's rule) passes with k=5 between HF's greedy tokens and
ours. Conditioning rule for prompt tokens of a chunked prefill: where HF's own prefill in the same
chunks (its cache carrying the state, `hf_chunked_logits`) differs from its full forward by more
than LOGPROB_ATOL, HF disagrees with itself at that token (an ill-conditioned position: the
HF-initialised tiny Qwen3-Next's Gated DeltaNet output norm amplifies 1e-6 differences at one
prompt position of the batch to 3.5e-4), and ours must then equal HF's chunked value within
LOGPROB_ATOL instead.

Device rule (RUNNERSCOPE_TEST_DEVICE=cuda): HF's fp32 forward on the GPU rounds otherwise than on the
CPU, and at an ill-conditioned position by more than the tolerance: on an H200, HF's CUDA logits of
hf-random-tiny-qwen3.5-moe were 2.0e-4 from HF's fp64 forward at one generated token, where HF's CPU
logits were 1.9e-5 from it and ours 4.8e-5 (Triton) / 6.4e-5 (torch). Where HF's logits on the test
device and on the CPU differ by more than LOGIT_ATOL at a position, the reference row there (logits
and logprobs) is HF's CPU row (`hf_reference_logits`); the tolerance stays.
"""
from __future__ import annotations

import copy
import os
import random
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from toolkit import LLM, SamplingParams
from toolkit.inspect import check_logprobs_close
from toolkit.models import DEMO_MODELS, model_folder, save_hf_folder
from toolkit.models import PRESETS as PRESET_CONFIGS
from toolkit.runner.model_states import MambaHybridModelState
from toolkit.runner.spec_decode import ContextProposer

# The device the parity tests run on: CPU by default; RUNNERSCOPE_TEST_DEVICE=cuda on a GPU machine.
DEVICE = os.environ.get("RUNNERSCOPE_TEST_DEVICE", "cpu")
if DEVICE.startswith("cuda"):
    # fp32 parity means real fp32: no TF32 in matmuls or cuDNN convolutions, ours or HF's
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
F32 = dict(device=DEVICE, dtype="float32")


def kernel_test_device(device: str = DEVICE, cuda: bool | None = None, interpret: str | None = None) -> str:
    """The device the kernel tests (tests/test_kernel_*.py) build their tensors on: the test device,
    except that where the kernels compile (a CUDA host without TRITON_INTERPRET=1, see conftest) it is
    CUDA even when RUNNERSCOPE_TEST_DEVICE is unset: compiled Triton kernels take CUDA tensors only.
    On a CPU-only host: the CPU, with the kernels under the interpreter."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    interpret = os.environ.get("TRITON_INTERPRET") if interpret is None else interpret
    return "cuda" if cuda and interpret != "1" and not device.startswith("cuda") else device


KERNEL_DEVICE = kernel_test_device()
LOGIT_ATOL = 1e-4
TIE_ATOL = 1e-5
LOGPROB_ATOL = 1e-4
NUM_LOGPROBS = 5            # logprobs and prompt_logprobs of the parity runs; check_logprobs_close's k
LOGPROB_DIFFS: list[float] = []   # the largest |logprob - HF's| of each request compared (for reports)
CONDITIONED: list[str] = []       # prompt tokens compared with HF's chunked prefill (the conditioning rule)
# The tiny preset of every architecture family (toolkit/models/<family>.py).
TINY_PRESETS = ["tiny-llama", "tiny-mamba2", "tiny-bamba", "tiny-mamba", "tiny-falcon-mamba", "tiny-jamba",
                "tiny-lfm2", "tiny-nemotron-h", "tiny-granite-hybrid", "tiny-zamba2", "tiny-falcon-h1",
                "tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-olmo-hybrid",
                "tiny-kimi-linear", "tiny-lfm2-moe", "tiny-minimax", "tiny-lfm3", "tiny-xlstm"]
# The seven that the slower engine-wide checks run on (outputs independent of scheduling, the
# property programs, ...): every sequence mixer but Gated DeltaNet (attention; Mamba1, FalconMamba's
# normed Mamba1; Mamba2; LFM2's short conv) and the Bamba and Jamba hybrids. The others are larger
# hybrids of the same mixers (and Gated DeltaNet: Qwen3-Next's, Qwen3.5's), checked per family.
ENGINE_PRESETS = TINY_PRESETS[:7]
# Hybrid configs with no attention layer at all (HF's cached generate crashes on them).
NO_ATTENTION = {"tiny-jamba": dict(attn_layer_period=8, attn_layer_offset=5),
                "tiny-lfm2": dict(layer_types=["conv"] * 4, full_attn_idxs=[]),
                "tiny-qwen3-next": dict(layer_types=["linear_attention"] * 4)}

# The runner-level parity workload (model_helpers.RunnerParityChecks, test_backend_triton): a single
# request, and a batch that the limits force to be chunked, mixed and queued.
MAX_TOKENS = 6
BATCH_PROMPT_LENS = [1, 60, 17, 33, 5]     # 5 requests, 1..60 tokens
BATCH_LIMITS = dict(max_num_seqs=3, max_num_batched_tokens=24)


def checkpoint_prefixes(tokens: list[int], slots: list[int], starts: list[int]) -> list[tuple[int, int, int, slice]]:
    """Internal checkpoints (token index, slot) of sequences starting at `starts` (S + 1 offsets):
    for each one with a slot, (token, slot, its sequence, the rows of that sequence up to the token),
    which a kernel test runs again as a prefix to check the state saved there."""
    out = []
    for tok, slot in zip(tokens, slots):
        if slot >= 0:
            s = max(i for i in range(len(starts) - 1) if starts[i] <= tok)
            out.append((tok, slot, s, slice(starts[s], tok + 1)))
    return out


def prompts_of(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)   # one [V] per token
    records: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)         # request id -> RequestOutput


def run_by_hand(llm: LLM, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None,
                prompt_logprobs: int | None = None) -> RunResult:
    """Step the engine by hand (greedy, no EOS), collecting each request's kept tokens, their
    logits and its RequestOutput (with logprobs and prompt logprobs when asked)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs)
    ids = [llm.add_request({"prompt_token_ids": p}, params) for p in prompts]
    res = RunResult({i: [] for i in ids}, {i: [] for i in ids})
    while llm.has_unfinished_requests():
        rec = llm.step()
        res.records.append(rec)
        for rid, tok in rec.kept_token_ids.items():
            res.tokens[rid].append(tok)
            res.logits[rid].append(rec.logits_of(rid))
        res.outputs.update({o.request_id: o for o in rec.outputs})
    return res


def load_hf(folder) -> torch.nn.Module:
    """HF model (fp32, eval) whose `generate` ignores EOS, as every request compared with it does
    (run_by_hand: ignore_eos=True). With an EOS id set, hf_greedy's min_new_tokens masks the EOS
    logit, so where EOS is the greedy token (it is for hf-random-tiny-nemotron-h's 5-token prompt,
    step 1) HF would pick the runner-up, and a plain `generate` would stop there."""
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(DEVICE).eval()
    hf.generation_config.eos_token_id = None
    return hf


def no_attention_folder(preset: str, folder) -> str:
    """An HF-initialised (seed 7) checkpoint of `preset` changed by NO_ATTENTION[preset]: no
    attention layer at all. Returns the folder (an LLM model argument)."""
    cfg = PRESET_CONFIGS[preset]()
    cfg = type(cfg)(**{**cfg.to_dict(), **NO_ATTENTION[preset]})
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return str(folder)


def save_model_pair(name: str, tmp_path_factory) -> tuple[str, Path]:
    """(LLM model argument, HF folder with the same weights) for a runner-level parity model:
    a trained demo model: its shipped folder; "hf-random-<preset>": an HF-initialised model
    (seed 1234) saved to a fresh folder, which the LLM loads; a preset: its weights saved for HF."""
    if name in DEMO_MODELS:
        return name, model_folder(name)
    folder = tmp_path_factory.mktemp(name)
    if name.startswith("hf-random-"):
        cfg = PRESET_CONFIGS[name.removeprefix("hf-random-")]()
        torch.manual_seed(1234)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        return str(folder), folder
    with LLM(name, **F32) as llm:
        save_hf_folder(llm, folder)
    return name, folder


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], max_tokens: int, use_cache: bool = True) -> list[int]:
    """HF's greedy tokens. use_cache=False: argmax over a full forward per token, for configs
    whose cached `generate` crashes in transformers 5.x (hybrids without an attention layer)."""
    if not use_cache:
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
        return tokens[len(prompt):]
    ids = torch.tensor([prompt], device=hf.device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] logits of a full forward without cache, on the CPU (where the runner's
    recorded logits are), whichever device the HF model runs on."""
    ids = torch.tensor([tokens], device=hf.device)
    position_ids = torch.arange(len(tokens), device=hf.device)[None]
    return hf(ids, position_ids=position_ids, use_cache=False).logits[0].float().cpu()


_CPU_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # HF model on a GPU -> its CPU copy
DEVICE_RULED: list[str] = []      # positions whose reference is HF's CPU row (the device rule)


def hf_reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    """hf_logits, with the device rule of the module docstring: on a GPU, the rows where HF's logits
    differ from its CPU copy's by more than LOGIT_ATOL are the CPU copy's. On the CPU: hf_logits."""
    full = hf_logits(hf, tokens)
    if hf.device.type == "cpu":
        return full
    if hf not in _CPU_COPIES:
        _CPU_COPIES[hf] = copy.deepcopy(hf).to("cpu")
    full, off = apply_device_rule(full, hf_logits(_CPU_COPIES[hf], tokens))
    if off:
        DEVICE_RULED.append(f"{type(hf).__name__}, {len(tokens)} tokens, positions {off}")
    return full


def apply_device_rule(on_device: torch.Tensor, on_cpu: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(HF's logits [T, V] on the test device with the rows that differ from its CPU logits by more
    than LOGIT_ATOL replaced by the CPU rows, the replaced positions)."""
    off = (on_device - on_cpu).abs().amax(dim=-1) > LOGIT_ATOL
    return torch.where(off[:, None], on_cpu, on_device), off.nonzero()[:, 0].tolist()


@torch.inference_mode()
def hf_chunked_logits(hf, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """[len(tokens), V] logits of HF's forward over `tokens` in the given chunks, its cache carrying
    the state from one chunk to the next (HF's own chunked prefill). On the CPU, as hf_logits."""
    ids = torch.tensor([tokens], device=hf.device)
    out, past, done = [], None, 0
    for n in chunks:
        step = hf(ids[:, done:done + n], past_key_values=past, use_cache=True,
                  position_ids=torch.arange(done, done + n, device=hf.device)[None])
        past, done = step.past_key_values, done + n
        out.append(step.logits[0].float().cpu())
    return torch.cat(out)


def prefill_chunks(res: RunResult, request_id: str) -> list[int]:
    """The sizes of the prompt chunks the engine ran the request's prefill in."""
    return [s.num_tokens for r in res.records for s in r.scheduled if s.request_id == request_id and s.is_prefill]


def assert_matches_hf(hf, prompt: list[int], ours: list[int], our_logits: list[torch.Tensor],
                      max_tokens: int, use_cache: bool = True, output=None, chunks: list[int] | None = None) -> float:
    """Returns the max |logit difference|; asserts tokens (tie rule) and logits, and with `output`
    (our RequestOutput, run with logprobs and prompt_logprobs) its logprobs (`assert_logprobs_match_hf`;
    `chunks`: the prompt chunks the engine ran, for the conditioning rule)."""
    ref_tokens = hf_greedy(hf, prompt, max_tokens, use_cache)
    full = hf_reference_logits(hf, prompt + ours)
    ref_logits = full[len(prompt) - 1:]
    assert len(ours) == max_tokens
    worst = 0.0
    compared = 0
    for k, (tok, ref_tok) in enumerate(zip(ours, ref_tokens)):
        diff = (our_logits[k] - ref_logits[k]).abs().max().item()
        worst = max(worst, diff)
        compared = k + 1
        assert diff <= LOGIT_ATOL, f"step {k}: logits differ by {diff:.2e}"
        if tok != ref_tok:
            gap = (ref_logits[k][tok] - ref_logits[k][ref_tok]).abs().item()
            assert gap <= TIE_ATOL, f"step {k}: token {tok} vs HF {ref_tok}, logit gap {gap:.2e}"
            break
    if output is not None:
        def chunked() -> torch.Tensor:
            return hf_chunked_logits(hf, prompt, chunks)
        assert_logprobs_match_hf(output, full, len(prompt), ref_tokens, compared,
                                 chunked if chunks and len(chunks) > 1 else None)
    return worst


def assert_logprobs_match_hf(output, hf_full_logits: torch.Tensor, prompt_len: int, ref_tokens: list[int],
                             compared: int, hf_chunked=None) -> float:
    """Our RequestOutput's logprobs against HF's log_softmax of its fp32 logits `hf_full_logits`
    [prompt + our tokens, V]: every entry of the first `compared` generated tokens' dicts and of
    every prompt token's dict within LOGPROB_ATOL, the top NUM_LOGPROBS values equal to HF's top
    values, the chosen greedy token ranked 1; then check_logprobs_close (k=NUM_LOGPROBS) against
    HF's greedy tokens. `hf_chunked`: () -> HF's logits over the prompt in our prefill chunks, for
    the conditioning rule (module docstring). Returns the largest |difference| (also appended to
    LOGPROB_DIFFS)."""
    ref = torch.log_softmax(hf_full_logits.float(), dim=-1).cpu()
    chunked: list[torch.Tensor] = []            # HF's chunked prefill, computed when first needed
    completion = output.outputs[0]
    gen_ref = ref[prompt_len - 1:]
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == prompt_len
    assert output.prompt_logprobs[0] is None
    worst = 0.0

    def reference(entry: dict, row: torch.Tensor, prompt_pos: int | None, where: str) -> torch.Tensor:
        """HF's full-forward row, or (conditioning rule) HF's chunked-prefill row where the full
        forward is off by more than the tolerance and HF's chunked prefill disagrees with it too."""
        off = [tid for tid, lp in entry.items() if abs(lp.logprob - row[tid].item()) > LOGPROB_ATOL]
        if not off or prompt_pos is None or hf_chunked is None:
            return row
        if not chunked:
            chunked.append(torch.log_softmax(hf_chunked().float(), dim=-1).cpu())
        row_chunked = chunked[0][prompt_pos - 1]
        for tid in off:
            self_diff = abs(row_chunked[tid].item() - row[tid].item())
            assert self_diff > LOGPROB_ATOL, (
                f"{where}, token {tid}: logprob {entry[tid].logprob:.6g} vs HF {row[tid]:.6g}, and HF's prefill "
                f"in the same chunks agrees with its full forward there ({self_diff:.1e})")
        CONDITIONED.append(where)
        return row_chunked

    def compare(entry: dict, row: torch.Tensor, chosen: int, where: str, prompt_pos: int | None = None) -> None:
        nonlocal worst
        assert chosen in entry and len(entry) in (NUM_LOGPROBS, NUM_LOGPROBS + 1), f"{where}: {sorted(entry)}"
        row = reference(entry, row, prompt_pos, where)
        for tid, lp in entry.items():
            diff = abs(lp.logprob - row[tid].item())
            worst = max(worst, diff)
            assert diff <= LOGPROB_ATOL, f"{where}, token {tid}: logprob {lp.logprob:.6g} vs HF {row[tid]:.6g}"
        # the top k: every entry but the chosen token when it is outside them (then the dict has k + 1)
        top = sorted((lp.logprob for tid, lp in entry.items()
                      if not (tid == chosen and len(entry) == NUM_LOGPROBS + 1)), reverse=True)
        ref_top = row.topk(NUM_LOGPROBS).values
        assert torch.allclose(torch.tensor(top), ref_top, atol=LOGPROB_ATOL, rtol=0), \
            f"{where}: top-k {top} vs HF {ref_top.tolist()}"
        # the chosen token's rank: HF's, up to tokens within the tolerance of it
        low, high = (int((row >= row[chosen] + d).sum()) for d in (LOGPROB_ATOL, -LOGPROB_ATOL))
        assert low <= entry[chosen].rank <= high, f"{where}: rank {entry[chosen].rank}, HF's in [{low}, {high}]"
    for k in range(compared):
        tok = completion.token_ids[k]
        compare(completion.logprobs[k], gen_ref[k], tok, f"output token {k}")
        assert completion.logprobs[k][tok].rank == 1 or gen_ref[k].max() - gen_ref[k][tok] <= TIE_ATOL
    for p in range(1, prompt_len):
        tok = output.prompt_token_ids[p]
        compare(output.prompt_logprobs[p], ref[p - 1], tok, f"prompt token {p}", prompt_pos=p)
    cumulative = sum(d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids))
    assert abs(completion.cumulative_logprob - cumulative) <= 1e-6 * max(1.0, abs(cumulative))
    # HF's greedy tokens agree with ours as far as they go; where they part, the positions before
    # share their prefix, so HF's logits over our tokens are HF's logits there too
    report = check_logprobs_close([(ref_tokens[:compared], gen_ref[:compared])], [completion], name_0="hf",
                                  name_1="runner", k=NUM_LOGPROBS, atol=LOGPROB_ATOL)
    assert report.ok, str(report)
    LOGPROB_DIFFS.append(worst)
    return worst


def check_single_request_matches_hf(llm: LLM, hf) -> None:
    """One 23-token request on `llm` reproduces HF (tokens with the tie rule, logits)."""
    prompt = prompts_of([23], llm.vocab_size)[0]
    res = run_by_hand(llm, [prompt], MAX_TOKENS, logprobs=NUM_LOGPROBS, prompt_logprobs=NUM_LOGPROBS)
    rid = next(iter(res.tokens))
    assert_matches_hf(hf, prompt, res.tokens[rid], res.logits[rid], MAX_TOKENS, output=res.outputs[rid])


def check_chunked_mixed_queued_batch_matches_hf(llm: LLM, hf) -> None:
    """The BATCH_PROMPT_LENS batch on `llm` (opened with BATCH_LIMITS) is chunked, mixed and queued,
    every request reproduces HF, and all KV blocks and state pages are free afterwards."""
    prompts = prompts_of(BATCH_PROMPT_LENS, llm.vocab_size, seed=1)
    res = run_by_hand(llm, prompts, MAX_TOKENS, logprobs=NUM_LOGPROBS, prompt_logprobs=NUM_LOGPROBS)
    chunked = any(s.is_prefill and s.num_computed_before > 0       # a prompt's 2nd+ chunk
                  for r in res.records for s in r.scheduled)
    mixed = any(r.num_prefills and r.num_decodes for r in res.records)
    queued = any(len(r.scheduled) < len(prompts) for r in res.records[:2])
    assert chunked and mixed and queued, "the batch must exercise chunking, mixing and queueing"
    for rid, prompt in zip(res.tokens, prompts):
        assert_matches_hf(hf, prompt, res.tokens[rid], res.logits[rid], MAX_TOKENS, output=res.outputs[rid],
                          chunks=prefill_chunks(res, rid))
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["state_pages_free"] == stats["state_pages_total"]


def check_no_attention_llm_matches_hf_uncached(preset: str, folder) -> None:
    """The engine on no_attention_folder(preset): one cache group (Mamba), the hybrid model state,
    and three requests (1, 23 and 9 tokens) reproduce HF. HF's cached `generate` crashes on a
    config without attention layers, so HF runs with use_cache=False."""
    model = no_attention_folder(preset, folder)
    hf = load_hf(model)
    with LLM(model, **F32, max_num_seqs=2, max_num_batched_tokens=16) as llm:
        assert [g.kind for g in llm.model_runner.kv_cache_groups] == ["mamba"]
        assert type(llm.model_runner.model_state) is MambaHybridModelState
        prompts = prompts_of([1, 23, 9], llm.vocab_size, seed=4)
        res = run_by_hand(llm, prompts, 5)
        for rid, prompt in zip(res.tokens, prompts):
            assert_matches_hf(hf, prompt, res.tokens[rid], res.logits[rid], 5, use_cache=False)


# ---- small engines ----------------------------------------------------------------------------------

def small_llm(preset: str, **kw) -> LLM:
    """An fp32 CPU engine with small limits (4 rows, 64 tokens a step, 128 a request); `kw` overrides."""
    args = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128) | kw
    return LLM(preset, **args)


def token_ids(outs) -> list[list[int]]:
    """The output token ids of each RequestOutput."""
    return [o.outputs[0].token_ids for o in outs]


def run_to_completion(llm: LLM) -> dict:
    """Step until every request is finished: request id -> its RequestOutput."""
    outs = {}
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step().outputs})
    return outs


class ScriptedProposer(ContextProposer):
    """Proposes the reference continuation of the request whose tokens the context starts with,
    with one draft made wrong on every `wrong_every`-th call (at a position that cycles; None:
    never), so that verify rows accept all, some and none of their drafts. A context no reference starts with
    (the run already diverged) gets no drafts, and the token comparison reports the divergence."""

    def __init__(self, references: list[list[int]], k: int, wrong_every: int | None = 3):
        self.references, self.k, self.wrong_every, self.calls = references, k, wrong_every, 0

    def propose(self, context: np.ndarray) -> list[int]:
        ctx = context.tolist()
        for ref in self.references:
            if ref[:len(ctx)] == ctx:
                drafts = list(ref[len(ctx):len(ctx) + self.k])
                self.calls += 1
                if drafts and self.wrong_every and self.calls % self.wrong_every == 1:
                    at = (self.calls // self.wrong_every) % len(drafts)
                    drafts[at] = (drafts[at] + 1) % 200
                return drafts
        return []

    def propose_many(self, contexts: list[np.ndarray], req_ids: list[str] | None = None) -> list[list[int]]:
        return [self.propose(c) for c in contexts]
