"""Qwen3.5 (`Qwen3_5ForCausalLM`, dense) and Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`) reproduce HF
transformers 5.24, for the presets and HF-initialised checkpoints: the model (`ModelParitySuite`:
fp32 logits within 1e-4 in one shot, in chunked prefill + decode, in mixed decode/prefill steps, a
profile run touching no cache), config variants, the engine against HF's generate
(`RunnerParityChecks`), the split GDN projections' layout and the cache specs, and the released
checkpoints' layout: a `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`
folder (vision tower, `model.language_model.` prefix, `mtp.*`) loads text-only and equals HF's
vision-language model on text input.
"""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)

from toolkit import LLM
from toolkit.attention.gdn import GDN_CHUNK_SIZE
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.layers.gdn import SplitGatedDeltaNet
from toolkit.layers.moe import merge_expert_checkpoint_tensors
from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

from harness import F32
from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    assert_close,
    random_prompt,
    run_steps,
    saved_both_ways,
    shapes,
)

DENSE, MOE = "tiny-qwen3.5", "tiny-qwen3.5-moe"
GDN_LAYERS = [f"model.layers.{i}.linear_attn" for i in range(3)]
# the presets' GDN: 2 key heads x 8, 4 value heads x 16, conv 4 -> conv_dim 2*2*8 + 4*16 = 96
HV, KD, VD, CONV_DIM = 4, 8, 16, 96


def _variant_attention_first_no_gva():
    """Attention on layers 0 and 2, Hv == Hk (no grouped values), key dim > value dim, conv kernel 3,
    full RoPE, attention biases (dense)."""
    cfg = PRESETS[DENSE]()
    cfg.layer_types = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    cfg.linear_num_value_heads = 2
    cfg.linear_key_head_dim = 16
    cfg.linear_value_head_dim = 8
    cfg.linear_conv_kernel_dim = 3
    cfg.attention_bias = True
    cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": 1.0, "mrope_section": [4, 2, 2]}
    return cfg


def _variant_moe_top3():
    """MoE top-3 of 4 (renormalised: Qwen3.5-MoE has no norm_topk_prob), GDN 4 value heads x 8."""
    cfg = PRESETS[MOE]()
    cfg.num_experts_per_tok = 3
    cfg.linear_value_head_dim = 8
    return cfg


class TestQwen3_5(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (DENSE, MOE)
    VARIANTS = {"attention-first-no-gva": _variant_attention_first_no_gva, "moe-top3": _variant_moe_top3}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert [b.layer_type for b in ours.model.layers] == ["linear_attention"] * 3 + ["full_attention"]
        assert sorted(ours.state_dict()) == sorted(hf.state_dict())

    def check_variant(self, variant: str, ours) -> None:
        if variant == "attention-first-no-gva":
            gdn = ours.model.layers[1].linear_attn
            assert gdn.state_shapes() == ((2, 2 * 2 * 16 + 2 * 8), (2, 8, 16))
            assert ours.model.layers[0].self_attn.rotary.rotary_dim == 16
        else:
            assert ours.model.layers[0].mlp.top_k == 3 and ours.model.layers[0].mlp.renormalize


def test_routing_facts_and_cache_specs():
    assert get_model_class(PRESETS[DENSE]()) is Qwen3_5ForCausalLM
    assert get_model_class(PRESETS[MOE]()) is Qwen3_5MoeForCausalLM
    m = load_model(DENSE, dtype=torch.bfloat16, device="cpu").model
    assert not m.is_tied and all(isinstance(m.model.layers[i].linear_attn, SplitGatedDeltaNet) for i in range(3))
    specs = m.kv_cache_specs()
    assert list(specs) == [*GDN_LAYERS, "model.layers.3.self_attn"]
    assert specs[GDN_LAYERS[0]] == MambaSpec(shapes=((3, CONV_DIM), (HV, VD, KD)),
                                             dtypes=(torch.bfloat16, torch.float32), mamba_type="gdn",
                                             chunk_size=GDN_CHUNK_SIZE)
    assert specs["model.layers.3.self_attn"] == AttentionSpec(num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    attn = m.model.layers[3].self_attn
    assert attn.q_proj.weight.shape == (4 * 16 * 2, 64) and attn.rotary.rotary_dim == 4   # gate; RoPE 0.25
    mlps = {type(b.mlp).__name__ for b in load_model(MOE, dtype=torch.float32, device="cpu").model.model.layers}
    assert mlps == {"SharedExpertMoeBlock"}                                     # every layer sparse
    with LLM(DENSE, **F32, max_num_seqs=2) as llm:
        assert [(g.kind, type(a.builder).__name__) for g, a in
                zip(llm.model_runner.kv_cache_groups, llm.model_runner.attn_groups)] == [
            ("attention", "PagedAttentionMetadataBuilder"), ("mamba", "GDNMetadataBuilder")]


def test_checkpoint_layout_matches_save_pretrained(tmp_path):
    """The split GDN projections under HF's names and shapes; the MoE's experts per expert on disk
    both ways (fused in memory, as HF 5.x)."""
    hf, ours, on_disk_hf, on_disk_ours = saved_both_ways(MOE, tmp_path)
    theirs = shapes(hf)
    assert theirs["model.layers.0.linear_attn.in_proj_qkv.weight"] == (CONV_DIM, 64)
    assert theirs["model.layers.0.linear_attn.in_proj_z.weight"] == (HV * VD, 64)
    assert theirs["model.layers.0.linear_attn.in_proj_b.weight"] == theirs[
        "model.layers.0.linear_attn.in_proj_a.weight"] == (HV, 64)
    assert sorted(on_disk_ours) == sorted(on_disk_hf)
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in on_disk_ours


VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16)


@pytest.mark.parametrize("preset, config_cls, hf_cls", [
    (DENSE, Qwen3_5Config, Qwen3_5ForConditionalGeneration),
    (MOE, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)], ids=["dense", "moe"])
@torch.no_grad()
def test_released_vision_language_checkpoint_loads_text_only(preset, config_cls, hf_cls, tmp_path, caplog):
    """The layout Qwen/Qwen3.5-* ship: a vision-language model whose text model sits under
    `model.language_model.`, beside `model.visual.*`, plus `mtp.*` tensors HF ignores. It loads as the
    text model, the skipped tensors named in one warning, and reproduces HF's vision-language model on
    text input (fp32 logits within 1e-4, one shot and chunked)."""
    text = {k: v for k, v in PRESETS[preset]().to_dict().items() if k != "architectures"}
    torch.manual_seed(3)
    hf = hf_cls(config_cls(text_config=text, vision_config=VISION)).eval()
    hf.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("model.visual.") for k in stored)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in stored
    stored["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="toolkit.models.qwen3_5"):
        ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    skipped = [r.getMessage() for r in caplog.records if "text-only" in r.getMessage()]
    assert len(skipped) == 1 and "model.visual.*" in skipped[0] and "1 tensors under mtp.*" in skipped[0]
    assert type(ours) is get_model_class(PRESETS[preset]())
    want = {k.replace("model.language_model.", "model."): v for k, v in stored.items()
            if k.startswith(("model.language_model.", "lm_head."))}
    want = merge_expert_checkpoint_tensors(want) if preset == MOE else want
    assert sorted(ours.state_dict()) == sorted(want)
    seq = random_prompt(5, 21)
    ref = hf(input_ids=seq[None], use_cache=False).logits[0].float()
    assert_close(run_steps(ours, seq, [21]), ref)
    assert_close(run_steps(ours, seq, [9, 10, 1, 1]), ref)
