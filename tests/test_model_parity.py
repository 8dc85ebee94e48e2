"""Our models reproduce HF transformers logits (fp32, atol 1e-4), for presets and HF-initialised
checkpoints, in one shot, in chunked prefill + decode, and in mixed decode/prefill batches."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_helpers import SeqChunk, allocate_caches, build_metadata, one_seq_metadata
from toolkit.models import PRESETS, load_model, save_hf_folder


ATOL = 1e-4
ARCHS = ["tiny-llama", "tiny-mamba2", "tiny-bamba"]
PROMPT_LEN = 37
CHUNKS = [10, 17, 10]   # 10 -> the 2nd chunk starts mid chunk_size (16); 27 -> so does the 3rd
DECODE_STEPS = 5


def _assert_close(got: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (got - ref).abs().max().item()
    assert diff <= ATOL, f"max |logit diff| {diff:.3e} > {ATOL}"
    return diff


@pytest.fixture(scope="module", params=[(a, s) for a in ARCHS for s in ("preset", "hf-init")], ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tmp_path_factory):
    """(our model, HF model) with identical weights."""
    arch, source = request.param
    folder = tmp_path_factory.mktemp(f"{arch}-{source}")
    if source == "preset":
        ours = load_model(arch, dtype=torch.float32, device="cpu").model
        save_hf_folder(ours, folder)
        hf = AutoModelForCausalLM.from_pretrained(folder)
    else:
        torch.manual_seed(1234)
        hf = AutoModelForCausalLM.from_config(PRESETS[arch]())
        hf.save_pretrained(folder)
        ours = load_model(str(folder), dtype=torch.float32, device="cpu").model
    hf = hf.to(torch.float32).eval()
    return ours, hf


def _prompt(seed: int, n: int = PROMPT_LEN) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (n,), generator=g)


@torch.no_grad()
def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None], use_cache=False).logits[0].float()


@torch.no_grad()
def _hf_greedy(hf, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    seq = prompt.clone()
    for _ in range(steps):
        nxt = _hf_logits(hf, seq)[-1].argmax()
        seq = torch.cat([seq, nxt[None]])
    return seq


@torch.no_grad()
def test_full_prompt(pair):
    ours, hf = pair
    ids = _prompt(0)
    allocate_caches(ours)
    md = one_seq_metadata(ours, 0, PROMPT_LEN, [3, 1, 5], state_slot=1)
    got = ours.compute_logits(ours(ids, torch.arange(PROMPT_LEN), md))
    assert got.dtype == torch.float32 and got.shape == (PROMPT_LEN, 320)
    _assert_close(got, _hf_logits(hf, ids))


@torch.no_grad()
def test_chunked_prefill_then_decode(pair):
    ours, hf = pair
    seq = _hf_greedy(hf, _prompt(1), DECODE_STEPS)
    ref = _hf_logits(hf, seq)
    allocate_caches(ours)
    blocks = [4, 2, 7]
    done = 0
    outs = []
    steps = CHUNKS + [1] * DECODE_STEPS
    for q in steps:
        md = one_seq_metadata(ours, done, q, blocks, state_slot=2)
        pos = torch.arange(done, done + q)
        outs.append(ours.compute_logits(ours(seq[done : done + q], pos, md)))
        done += q
    assert done == seq.numel()
    _assert_close(torch.cat(outs), ref)


@torch.no_grad()
def test_mixed_decode_prefill_batch(pair):
    """Decode rows and (continuing) prefill rows share a step; each matches its own HF run."""
    ours, hf = pair
    a = _hf_greedy(hf, _prompt(2, 21), 2)     # A: 21-token prompt, then decodes
    b = _prompt(3, 30)                        # B: prefilled in two chunks (20 | 10), 2nd starts mid-chunk
    c = _prompt(4, 5)                         # C: short prompt prefilled while A and B run
    ref_a, ref_b, ref_c = _hf_logits(hf, a), _hf_logits(hf, b), _hf_logits(hf, c)
    allocate_caches(ours, num_slots=5)
    A = dict(blocks=[5, 9], slot=3)
    B = dict(blocks=[1, 6], slot=1)
    C = dict(blocks=[8], slot=4)

    def step(rows, ids, pos):
        md = build_metadata(ours, rows)
        return ours.compute_logits(ours(torch.cat(ids), torch.cat(pos), md))

    # step 1: A's prompt and B's first chunk (two prefills)
    out = step(
        [SeqChunk(0, 21, A["blocks"], A["slot"]), SeqChunk(0, 20, B["blocks"], B["slot"])],
        [a[:21], b[:20]], [torch.arange(21), torch.arange(20)],
    )
    _assert_close(out[:21], ref_a[:21])
    _assert_close(out[21:], ref_b[:20])
    # step 2: A decodes, B continues from 20 (mid-chunk), C starts
    out = step(
        [SeqChunk(21, 1, A["blocks"], A["slot"]), SeqChunk(20, 10, B["blocks"], B["slot"]),
         SeqChunk(0, 5, C["blocks"], C["slot"])],
        [a[21:22], b[20:], c], [torch.arange(21, 22), torch.arange(20, 30), torch.arange(5)],
    )
    _assert_close(out[:1], ref_a[21:22])
    _assert_close(out[1:11], ref_b[20:])
    _assert_close(out[11:], ref_c)
    # step 3: A decodes again alongside nothing else
    out = step([SeqChunk(22, 1, A["blocks"], A["slot"])], [a[22:23]], [torch.arange(22, 23)])
    _assert_close(out, ref_a[22:23])


@torch.no_grad()
def test_profile_run_touches_no_cache(pair):
    ours, hf = pair
    caches = allocate_caches(ours, fill=0.5)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else tuple(t.clone() for t in v)) for k, v in caches.items()}
    ids = _prompt(5, 40)
    hidden = ours(ids, torch.arange(40), None)
    assert hidden.shape == (40, 64) and torch.isfinite(hidden).all()
    for k, v in caches.items():
        now = v if isinstance(v, tuple) else (v,)
        old = before[k] if isinstance(before[k], tuple) else (before[k],)
        assert all(torch.equal(x, y) for x, y in zip(now, old)), k
    if ours.is_attention_free:
        # attention-free models compute the real thing in a profile run (one sequence, zero state)
        _assert_close(ours.compute_logits(hidden), _hf_logits(hf, ids))


def _variant(arch: str):
    cfg = PRESETS[arch]()
    if arch == "tiny-llama":
        cfg.attention_bias = True
        cfg.mlp_bias = True
        cfg.head_dim = 24                       # head_dim != hidden / heads
        cfg.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    elif arch == "tiny-mamba2":
        cfg.use_bias = True
        cfg.use_conv_bias = False
        cfg.residual_in_fp32 = False
        cfg.time_step_limit = (0.01, 0.05)      # the clamp actually bites
    else:
        cfg.attention_bias = True
        cfg.mlp_bias = True
        cfg.mamba_proj_bias = True
        cfg.mamba_conv_bias = False
        cfg.mamba_n_groups = 2
        cfg.attn_layer_indices = [0, 2]
    return cfg


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_config_variants_match_hf(arch, tmp_path):
    """Biases on/off, explicit head_dim, scaled RoPE, dt clamp, n_groups, other layer layouts."""
    torch.manual_seed(99)
    hf = AutoModelForCausalLM.from_config(_variant(arch)).eval()
    with torch.no_grad():  # HF zero-inits biases; make them non-zero so their names matter
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    seq = _hf_greedy(hf, _prompt(6), 2)
    ref = _hf_logits(hf, seq)
    allocate_caches(ours)
    done, outs = 0, []
    for q in [10, 17, 10, 1, 1]:
        md = one_seq_metadata(ours, done, q, [4, 2, 7], state_slot=2)
        outs.append(ours.compute_logits(ours(seq[done : done + q], torch.arange(done, done + q), md)))
        done += q
    _assert_close(torch.cat(outs), ref)
