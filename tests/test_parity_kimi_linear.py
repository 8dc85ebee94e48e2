"""Kimi Linear (`KimiLinearForCausalLM`: Kimi Delta Attention layers, multi-head latent attention over a
paged cache of latents, DeepSeek-V3 MoE) reproduces HF transformers 5.24, for the preset and an
HF-initialised checkpoint: the model (`ModelParitySuite`), config variants (q LoRA, attention biases,
every FFN dense), routing with a non-zero correction bias, the engine against HF's generate
(`RunnerParityChecks`), the cache specs (KDA on the Gated DeltaNet builder; MLA caching one latent per
token), and the checkpoint layout save_pretrained writes (block_sparse_moe, per-expert w1/w2/w3, q/k/v
convs, the forget gate's tensors under self_attn) both ways.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from toolkit import LLM
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.layers.kda import KimiDeltaAttention
from toolkit.layers.mla import LatentPagedAttention
from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.kimi_linear import KimiLinearForCausalLM

from harness import F32
from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    assert_close,
    hf_logits,
    random_prompt,
    run_steps,
    saved_both_ways,
    shapes,
)

ARCH = "tiny-kimi-linear"
# the preset's KDA: 4 heads x 16, conv 4 -> conv_dim 3*64 = 192; MLA latent 16 + 8 rope dims
H, D, CONV_DIM, LATENT = 4, 16, 192, 24


def _variant_q_lora_bias():
    """q through a LoRA (q_a_proj, q_a_layernorm, q_b_proj), attention biases, MLA on layer 1 too."""
    cfg = PRESETS[ARCH]()
    cfg.q_lora_rank = 24
    cfg.attention_bias = True
    cfg.layer_types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    return cfg


def _variant_dense_ffns_conv3():
    """Every FFN dense, KDA conv kernel 3, 2 KDA heads x 32, top-3 of 8 experts unused."""
    cfg = PRESETS[ARCH]()
    cfg.mlp_layer_types = ["dense"] * 4
    cfg.linear_conv_kernel_dim = 3
    cfg.linear_num_heads = 2
    cfg.linear_head_dim = 32
    return cfg


class TestKimiLinear(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (ARCH,)
    VARIANTS = {"q-lora-bias": _variant_q_lora_bias, "dense-ffns-conv3": _variant_dense_ffns_conv3}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert [b.layer_type for b in ours.model.layers] == ["linear_attention"] * 3 + ["full_attention"]
        assert sorted(ours.state_dict()) == sorted(hf.state_dict())

    def check_variant(self, variant: str, ours) -> None:
        if variant == "q-lora-bias":
            mla = ours.model.layers[1].self_attn
            assert isinstance(mla, LatentPagedAttention) and hasattr(mla, "q_b_proj")
        else:
            assert {type(b.mlp).__name__ for b in ours.model.layers} == {"SwiGLUMLP"}
            assert ours.model.layers[0].self_attn.state_shapes() == ((2, 3 * 64), (2, 32, 32))


def test_layer_kinds_and_cache_specs():
    assert get_model_class(PRESETS[ARCH]()) is KimiLinearForCausalLM
    m = load_model(ARCH, dtype=torch.bfloat16, device="cpu").model
    assert isinstance(m.model.layers[0].self_attn, KimiDeltaAttention)
    assert isinstance(m.model.layers[3].self_attn, LatentPagedAttention)
    assert [type(b.mlp).__name__ for b in m.model.layers] == ["SwiGLUMLP"] + ["DeepseekMoE"] * 3
    specs = m.kv_cache_specs()
    assert specs["model.layers.0.self_attn"] == MambaSpec(shapes=((3, CONV_DIM), (H, D, D)),
                                                         dtypes=(torch.bfloat16, torch.float32), mamba_type="gdn",
                                                         chunk_size=64)
    latent = specs["model.layers.3.self_attn"]
    assert latent == AttentionSpec(num_kv_heads=1, head_dim=LATENT, dtype=torch.bfloat16, kv_parts=1)
    assert latent.page_size_bytes(16) == 16 * LATENT * 2          # one latent per token, not K and V per head
    with LLM(ARCH, **F32, max_num_seqs=2, block_size=16) as llm:
        runner = llm.model_runner
        assert [(g.kind, type(a.builder).__name__) for g, a in zip(runner.kv_cache_groups, runner.attn_groups)] == [
            ("attention", "PagedAttentionMetadataBuilder"), ("mamba", "GDNMetadataBuilder")]
        cache = runner.kv_caches["model.layers.3.self_attn"]
        assert tuple(cache.shape[1:]) == (1, 16, 1, LATENT)
        assert runner.cudagraph_manager.mode != "full_decode"


@torch.no_grad()
def test_routing_with_a_correction_bias_matches_hf(tmp_path):
    """HF initialises e_score_correction_bias to zeros, which hides a bias misapplied to the weights
    (it only picks the experts): random biases, then HF's and our logits."""
    torch.manual_seed(11)
    hf = AutoModelForCausalLM.from_config(PRESETS[ARCH]()).eval()
    for name, buf in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape) * 0.3)
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    seq = random_prompt(12, 19)
    ref = hf_logits(hf, seq)
    assert_close(run_steps(ours, seq, [19]), ref)
    assert_close(run_steps(ours, seq, [8, 9, 1, 1]), ref)


def test_checkpoint_layout_matches_save_pretrained(tmp_path):
    """On disk both ways: FFNs under block_sparse_moe, experts per expert (w1 gate, w3 up, w2 down), the
    KDA conv as q/k/v tensors, the forget gate's tensors directly under self_attn."""
    hf, ours, on_disk_hf, on_disk_ours = saved_both_ways(ARCH, tmp_path)
    assert sorted(on_disk_ours) == sorted(on_disk_hf)
    assert on_disk_hf["model.layers.1.block_sparse_moe.experts.7.w3.weight"].shape == (32, 64)
    assert on_disk_hf["model.layers.0.self_attn.q_conv1d.weight"].shape == (64, 1, 4)
    assert "model.layers.0.self_attn.A_log" in on_disk_hf
    assert "model.layers.0.block_sparse_moe.up_proj.weight" in on_disk_hf           # the dense FFN too
    assert shapes(ours) == shapes(hf)
