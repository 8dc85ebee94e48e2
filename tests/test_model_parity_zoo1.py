"""Mamba, FalconMamba and Jamba reproduce HF transformers logits (fp32, atol 1e-4), for presets and
HF-initialised checkpoints, in one shot, in chunked prefill + decode, and in mixed decode/prefill
batches; plus config variants (biases, no residual_in_fp32, a Jamba without any attention layer),
the Jamba MoE checkpoint layout and the models' routing facts."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from model_helpers import SeqChunk, allocate_caches, build_metadata, one_seq_metadata
from toolkit.layers.moe import merge_expert_checkpoint_tensors, split_expert_state_tensors
from toolkit.models import PRESETS, get_model_class, load_model, save_hf_folder
from toolkit.models.falcon_mamba import FalconMambaForCausalLM
from toolkit.models.jamba import JambaForCausalLM
from toolkit.models.mamba import MambaForCausalLM
from toolkit.runner.kv_cache_spec import AttentionSpec, MambaSpec


ATOL = 1e-4
ARCHS = ["tiny-mamba", "tiny-falcon-mamba", "tiny-jamba"]
PROMPT_LEN = 37
CHUNKS = [10, 17, 10]
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
    """Greedy tokens from HF full forwards (use_cache=False), no `generate`."""
    seq = prompt.clone()
    for _ in range(steps):
        nxt = _hf_logits(hf, seq)[-1].argmax()
        seq = torch.cat([seq, nxt[None]])
    return seq


@torch.no_grad()
def _chunked_then_decode(ours, seq: torch.Tensor, steps: list[int]) -> torch.Tensor:
    allocate_caches(ours)
    done, outs = 0, []
    for q in steps:
        md = one_seq_metadata(ours, done, q, [4, 2, 7], state_slot=2)
        outs.append(ours.compute_logits(ours(seq[done : done + q], torch.arange(done, done + q), md)))
        done += q
    assert done == seq.numel()
    return torch.cat(outs)


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
    _assert_close(_chunked_then_decode(ours, seq, CHUNKS + [1] * DECODE_STEPS), _hf_logits(hf, seq))


@torch.no_grad()
def test_mixed_decode_prefill_batch(pair):
    """Decode rows and (continuing) prefill rows share a step; each matches its own HF run."""
    ours, hf = pair
    a = _hf_greedy(hf, _prompt(2, 21), 2)     # A: 21-token prompt, then decodes
    b = _prompt(3, 30)                        # B: prefilled in two chunks (20 | 10)
    c = _prompt(4, 5)                         # C: short prompt prefilled while A and B run
    d = _hf_greedy(hf, _prompt(5, 9), 1)      # D: a second decode row in step 2
    ref_a, ref_b, ref_c, ref_d = (_hf_logits(hf, x) for x in (a, b, c, d))
    allocate_caches(ours, num_slots=6)
    A = dict(blocks=[5, 9], slot=3)
    B = dict(blocks=[1, 6], slot=1)
    C = dict(blocks=[8], slot=4)
    D = dict(blocks=[10], slot=5)

    def step(rows, ids, pos):
        md = build_metadata(ours, rows)
        return ours.compute_logits(ours(torch.cat(ids), torch.cat(pos), md))

    # step 1: three prefills (A's prompt, B's first chunk, D's prompt)
    out = step(
        [SeqChunk(0, 21, A["blocks"], A["slot"]), SeqChunk(0, 20, B["blocks"], B["slot"]),
         SeqChunk(0, 9, D["blocks"], D["slot"])],
        [a[:21], b[:20], d[:9]], [torch.arange(21), torch.arange(20), torch.arange(9)],
    )
    _assert_close(out[:21], ref_a[:21])
    _assert_close(out[21:41], ref_b[:20])
    _assert_close(out[41:], ref_d[:9])
    # step 2: A and D decode, B continues from 20, C starts
    out = step(
        [SeqChunk(21, 1, A["blocks"], A["slot"]), SeqChunk(9, 1, D["blocks"], D["slot"]),
         SeqChunk(20, 10, B["blocks"], B["slot"]), SeqChunk(0, 5, C["blocks"], C["slot"])],
        [a[21:22], d[9:10], b[20:], c],
        [torch.arange(21, 22), torch.arange(9, 10), torch.arange(20, 30), torch.arange(5)],
    )
    _assert_close(out[:1], ref_a[21:22])
    _assert_close(out[1:2], ref_d[9:10])
    _assert_close(out[2:12], ref_b[20:])
    _assert_close(out[12:], ref_c)
    # step 3: A decodes alone
    out = step([SeqChunk(22, 1, A["blocks"], A["slot"])], [a[22:23]], [torch.arange(22, 23)])
    _assert_close(out, ref_a[22:23])


@torch.no_grad()
def test_profile_run_touches_no_cache(pair):
    ours, hf = pair
    caches = allocate_caches(ours, fill=0.5)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else tuple(t.clone() for t in v)) for k, v in caches.items()}
    ids = _prompt(6, 40)
    hidden = ours(ids, torch.arange(40), None)
    assert hidden.shape == (40, 64) and torch.isfinite(hidden).all()
    for k, v in caches.items():
        now = v if isinstance(v, tuple) else (v,)
        old = before[k] if isinstance(before[k], tuple) else (before[k],)
        assert all(torch.equal(x, y) for x, y in zip(now, old)), k
    if ours.is_attention_free:
        _assert_close(ours.compute_logits(hidden), _hf_logits(hf, ids))


def _variant(arch: str):
    cfg = PRESETS[arch]()
    if arch == "tiny-mamba":
        cfg.use_bias = True
        cfg.use_conv_bias = False
        cfg.residual_in_fp32 = False
        cfg.tie_word_embeddings = False
    elif arch == "tiny-falcon-mamba":
        cfg.use_bias = True
        cfg.mixer_rms_eps = 1e-2                # eps large enough to matter
        cfg.tie_word_embeddings = True
    else:
        cfg.mamba_proj_bias = True
        cfg.mamba_conv_bias = False
        cfg.attn_layer_period, cfg.attn_layer_offset = 3, 0        # attention at 0 and 3
        cfg.expert_layer_period, cfg.expert_layer_offset = 3, 2    # MoE at 2 only
        cfg.num_experts_per_tok = 3
    return cfg


def _jamba_without_attention():
    """Every layer Mamba: attn_layer_offset 5 < attn_layer_period 8, but only 4 layers."""
    cfg = PRESETS["tiny-jamba"]()
    cfg.attn_layer_period, cfg.attn_layer_offset = 8, 5
    assert cfg.layers_block_type == ["mamba"] * 4
    return cfg


@pytest.mark.parametrize("case", ARCHS + ["jamba-no-attention"])
@torch.no_grad()
def test_config_variants_match_hf(case, tmp_path):
    """Biases on/off, residual in model dtype, tie flipped, mixer eps, other layer layouts, top-3,
    and a Jamba with no attention layer. HF references always come from full forwards with
    use_cache=False (HF's cached path for an attention-less Jamba is not used here)."""
    cfg = _jamba_without_attention() if case == "jamba-no-attention" else _variant(case)
    torch.manual_seed(99)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    for name, p in hf.named_parameters():   # HF zero-inits biases; make them non-zero so their names matter
        if name.endswith(".bias"):
            p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    if case == "jamba-no-attention":
        specs = ours.kv_cache_specs()
        assert specs and all(isinstance(s, MambaSpec) for s in specs.values())
    seq = _hf_greedy(hf, _prompt(7), 2)
    _assert_close(_chunked_then_decode(ours, seq, [10, 17, 10, 1, 1]), _hf_logits(hf, seq))


def test_routing_facts_and_specs():
    assert MambaForCausalLM.is_attention_free and not MambaForCausalLM.is_hybrid
    assert FalconMambaForCausalLM.is_attention_free and not FalconMambaForCausalLM.is_hybrid
    assert JambaForCausalLM.is_hybrid and not JambaForCausalLM.is_attention_free
    for arch, cls in zip(ARCHS, (MambaForCausalLM, FalconMambaForCausalLM, JambaForCausalLM)):
        assert get_model_class(PRESETS[arch]()) is cls
    m = load_model("tiny-mamba", dtype=torch.bfloat16, device="cpu").model
    assert m.is_tied
    specs = m.kv_cache_specs()
    assert list(specs) == [f"backbone.layers.{i}.mixer" for i in range(4)]
    s = specs["backbone.layers.0.mixer"]
    assert s == MambaSpec(shapes=((3, 128), (128, 16)), dtypes=(torch.bfloat16, torch.float32), mamba_type="mamba1")
    j = load_model("tiny-jamba", dtype=torch.float32, device="cpu").model
    specs = j.kv_cache_specs()
    assert list(specs) == ["model.layers.0.mamba", "model.layers.1.self_attn",
                           "model.layers.2.mamba", "model.layers.3.self_attn"]
    assert isinstance(specs["model.layers.1.self_attn"], AttentionSpec)
    assert specs["model.layers.0.mamba"].mamba_type == "mamba1"
    assert j.model.layers[1].self_attn.rotary is None     # Jamba attention has no RoPE


def test_jamba_moe_checkpoint_layout(tmp_path):
    """In memory: HF 5.x's fused experts (state_dict keys equal HF's); on disk: per-expert tensors,
    as save_pretrained writes them, both ways."""
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(PRESETS["tiny-jamba"]())
    ours = load_model("tiny-jamba", dtype=torch.float32, device="cpu").model
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    assert theirs["model.layers.1.feed_forward.experts.gate_up_proj"] == (4, 256, 64)
    hf.save_pretrained(tmp_path / "hf")
    save_hf_folder(ours, tmp_path / "ours")
    on_disk_hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    on_disk_ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert sorted(on_disk_ours) == sorted(on_disk_hf)
    assert "model.layers.3.feed_forward.experts.2.up_proj.weight" in on_disk_ours
    # merge/split are inverse; an incomplete expert set is left alone (the loader reports it)
    sd = ours.state_dict()
    back = merge_expert_checkpoint_tensors(split_expert_state_tensors(sd))
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    partial = dict(on_disk_ours)
    del partial["model.layers.1.feed_forward.experts.3.down_proj.weight"]
    merged = merge_expert_checkpoint_tensors(partial)
    assert "model.layers.1.feed_forward.experts.gate_up_proj" not in merged
    assert "model.layers.3.feed_forward.experts.gate_up_proj" in merged


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_bf16_checkpoint_loads_and_runs(arch, tmp_path):
    """bf16 HF checkpoints load exactly (as fp32) and run in bf16; a tied Mamba stores no lm_head."""
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(PRESETS[arch]()).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert ("lm_head.weight" in stored) == (not PRESETS[arch]().tie_word_embeddings)
    m = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    assert m.is_tied == bool(PRESETS[arch]().tie_word_embeddings)
    want = merge_expert_checkpoint_tensors(stored)
    for k, v in m.state_dict().items():
        if k == "lm_head.weight" and m.is_tied:
            continue
        assert v.dtype == torch.float32 and torch.equal(v, want[k].float()), k
    m16 = load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu").model
    seq = _prompt(8, 22)
    out = _chunked_then_decode(m16, seq, [10, 10, 1, 1])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
