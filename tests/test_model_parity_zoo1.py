"""Mamba, FalconMamba and Jamba reproduce HF transformers logits (fp32, atol 1e-4), for presets and
HF-initialised checkpoints, in one shot, in chunked prefill + decode, and in mixed decode/prefill
batches; plus config variants (biases, no residual_in_fp32, a Jamba without any attention layer),
the Jamba MoE checkpoint layout and the models' routing facts."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from model_helpers import ConfigVariantChecks, ModelParitySuite, random_prompt, run_steps
from toolkit.layers.moe import merge_expert_checkpoint_tensors, split_expert_state_tensors
from toolkit.models import PRESETS, get_model_class, load_model, save_hf_folder
from toolkit.models.falcon_mamba import FalconMambaForCausalLM
from toolkit.models.jamba import JambaForCausalLM
from toolkit.models.mamba import MambaForCausalLM
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec

ARCHS = ("tiny-mamba", "tiny-falcon-mamba", "tiny-jamba")


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


class TestMambaFalconMambaJamba(ModelParitySuite, ConfigVariantChecks):
    ARCHS = ARCHS
    # biases on/off, residual in model dtype, tie flipped, mixer eps, other layer layouts, top-3,
    # and a Jamba with no attention layer. HF references always come from full forwards with
    # use_cache=False (HF's cached path for an attention-less Jamba is not used here).
    VARIANTS = {**{arch: partial(_variant, arch) for arch in ARCHS}, "jamba-no-attention": _jamba_without_attention}
    VARIANT_PROMPT_SEED = 7

    def check_variant(self, variant: str, ours) -> None:
        if variant == "jamba-no-attention":
            specs = ours.kv_cache_specs()
            assert specs and all(isinstance(s, MambaSpec) for s in specs.values())


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
    seq = random_prompt(8, 22)
    out = run_steps(m16, seq, [10, 10, 1, 1])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
