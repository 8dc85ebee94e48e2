"""Jamba (`JambaForCausalLM`: Mamba1 and attention layers, MoE feed-forwards) reproduces HF
transformers, for the preset and an HF-initialised checkpoint: the model (`ModelParitySuite`: fp32
logits within 1e-4 in one shot, in chunked prefill + decode, in mixed decode/prefill steps, a
profile run touching no cache), config variants (biases, other attention / MoE layouts, top-3, and a
Jamba without any attention layer), the engine against HF's generate (`RunnerParityChecks`) and, on
the config without attention layers, against HF's uncached forward; the routing facts and cache
specs, the MoE checkpoint layout (fused experts in memory, per-expert tensors on disk) and bf16
checkpoints."""
from __future__ import annotations

import torch

from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.layers.moe import merge_expert_checkpoint_tensors, split_expert_state_tensors
from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.jamba import JambaForCausalLM

from harness import check_no_attention_llm_matches_hf_uncached
from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    check_bf16_load_runs,
    save_bf16_checkpoint,
    saved_both_ways,
    shapes,
)


def _variant():
    cfg = PRESETS["tiny-jamba"]()
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


class TestJamba(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = ("tiny-jamba",)
    # HF references always come from full forwards with use_cache=False (HF's cached path for an
    # attention-less Jamba is not used here)
    VARIANTS = {"tiny-jamba": _variant, "jamba-no-attention": _jamba_without_attention}
    VARIANT_PROMPT_SEED = 7

    def check_variant(self, variant: str, ours) -> None:
        if variant == "jamba-no-attention":
            specs = ours.kv_cache_specs()
            assert specs and all(isinstance(s, MambaSpec) for s in specs.values())


def test_routing_facts_and_cache_specs():
    assert JambaForCausalLM.is_hybrid and not JambaForCausalLM.is_attention_free
    assert get_model_class(PRESETS["tiny-jamba"]()) is JambaForCausalLM
    j = load_model("tiny-jamba", dtype=torch.float32, device="cpu").model
    specs = j.kv_cache_specs()
    assert list(specs) == ["model.layers.0.mamba", "model.layers.1.self_attn",
                           "model.layers.2.mamba", "model.layers.3.self_attn"]
    assert isinstance(specs["model.layers.1.self_attn"], AttentionSpec)
    assert specs["model.layers.0.mamba"].mamba_type == "mamba1"
    assert j.model.layers[1].self_attn.rotary is None     # Jamba attention has no RoPE


def test_moe_checkpoint_layout(tmp_path):
    """In memory: HF 5.x's fused experts (state_dict keys equal HF's); on disk: per-expert tensors,
    as save_pretrained writes them, both ways."""
    hf, ours, on_disk_hf, on_disk_ours = saved_both_ways("tiny-jamba", tmp_path)
    assert shapes(hf)["model.layers.1.feed_forward.experts.gate_up_proj"] == (4, 256, 64)
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


def test_bf16_checkpoint_loads_exactly_and_runs(tmp_path):
    """bf16 HF checkpoints load exactly (as fp32, per-expert tensors fused) and run in bf16."""
    _, stored = save_bf16_checkpoint("tiny-jamba", tmp_path)
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert ("lm_head.weight" in stored) == (not PRESETS["tiny-jamba"]().tie_word_embeddings)
    m = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    assert m.is_tied == bool(PRESETS["tiny-jamba"]().tie_word_embeddings)
    want = merge_expert_checkpoint_tensors(stored)
    for k, v in m.state_dict().items():
        if k == "lm_head.weight" and m.is_tied:
            continue
        assert v.dtype == torch.float32 and torch.equal(v, want[k].float()), k
    check_bf16_load_runs(tmp_path)


def test_llm_without_attention_layers_matches_hf_uncached(tmp_path):
    check_no_attention_llm_matches_hf_uncached("tiny-jamba", tmp_path)
