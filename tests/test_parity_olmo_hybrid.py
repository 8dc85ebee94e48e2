"""OLMo Hybrid (`OlmoHybridForCausalLM`: Llama pre-norm Gated DeltaNet layers with per-input
projections and beta in [0, 2], OLMo-3 post-norm attention layers with whole-width q/k norms and no
RoPE) reproduces HF transformers 5.24, for the preset and an HF-initialised checkpoint: the model
(`ModelParitySuite`), config variants (RoPE on, beta in [0, 1], attention first, no GQA, conv 3),
the engine against HF's generate (`RunnerParityChecks`), and the checkpoint layout save_pretrained
writes (split q/k/v convs, `attention_layer_norm` / `feedforward_layer_norm`) both ways.
"""
from __future__ import annotations

import torch

from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.layers.gdn import OlmoGatedDeltaNet
from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.olmo_hybrid import OlmoHybridForCausalLM, PostNormBlock

from model_helpers import ConfigVariantChecks, ModelParitySuite, RunnerParityChecks, saved_both_ways, shapes

ARCH = "tiny-olmo-hybrid"
# the preset's GDN: 4 key heads x 8 = 4 value heads x 16 -> conv_dim 2*32 + 64 = 128
HV, KD, VD, CONV_DIM = 4, 8, 16, 128


def _variant_rope_beta_below_one():
    """RoPE in the attention layer (theta 10000), beta = sigmoid(b) (no negative eigenvalues)."""
    cfg = PRESETS[ARCH]()
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    cfg.linear_allow_neg_eigval = False
    return cfg


def _variant_attention_first_mha_conv3():
    """Attention on layers 0 and 2 (KV heads = heads), key dim = value dim, conv kernel 3, attention biases."""
    cfg = PRESETS[ARCH]()
    cfg.layer_types = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    cfg.num_key_value_heads = 4
    cfg.linear_value_head_dim = 8
    cfg.linear_conv_kernel_dim = 3
    cfg.attention_bias = True
    return cfg


class TestOlmoHybrid(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (ARCH,)
    VARIANTS = {"rope-beta-below-one": _variant_rope_beta_below_one,
                "attention-first-mha-conv3": _variant_attention_first_mha_conv3}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert [b.layer_type for b in ours.model.layers] == ["linear_attention"] * 3 + ["full_attention"]
        assert sorted(ours.state_dict()) == sorted(hf.state_dict())

    def check_variant(self, variant: str, ours) -> None:
        if variant == "rope-beta-below-one":
            assert ours.model.layers[3].self_attn.rotary is not None
            assert ours.model.layers[0].linear_attn.beta_scale == 1.0
        else:
            assert isinstance(ours.model.layers[0], PostNormBlock)
            assert ours.model.layers[1].linear_attn.state_shapes() == ((2, 2 * 32 + 32), (4, 8, 8))


def test_layer_kinds_and_cache_specs():
    assert get_model_class(PRESETS[ARCH]()) is OlmoHybridForCausalLM
    m = load_model(ARCH, dtype=torch.bfloat16, device="cpu").model
    gdn, attn_block = m.model.layers[0].linear_attn, m.model.layers[3]
    assert isinstance(gdn, OlmoGatedDeltaNet) and gdn.beta_scale == 2.0 and gdn.o_norm.eps == 1e-5
    assert isinstance(attn_block, PostNormBlock) and attn_block.self_attn.rotary is None       # NoPE
    assert attn_block.self_attn.q_norm.weight.shape == (4 * 16,)          # whole width, not per head
    specs = m.kv_cache_specs()
    assert specs["model.layers.0.linear_attn"] == MambaSpec(shapes=((3, CONV_DIM), (HV, VD, KD)),
                                                           dtypes=(torch.bfloat16, torch.float32), mamba_type="gdn",
                                                           chunk_size=gdn.chunk_size)
    assert specs["model.layers.3.self_attn"] == AttentionSpec(num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)


def test_checkpoint_layout_matches_save_pretrained(tmp_path):
    """On disk both ways: the conv as q/k/v tensors, the norms under OLMo's checkpoint names. Ours
    splits the conv at the projections' widths (q and k: Hk*K channels, v: Hv*V, as OLMo-core writes
    it); transformers 5.24's save_pretrained splits it in three equal parts (the reverse of its
    `Concatenate`), which loads back the same since both loaders concatenate in q, k, v order."""
    hf, ours, on_disk_hf, on_disk_ours = saved_both_ways(ARCH, tmp_path)
    assert sorted(on_disk_ours) == sorted(on_disk_hf)
    conv = "model.layers.0.linear_attn.{}_conv1d.weight"
    assert [on_disk_ours[conv.format(p)].shape[0] for p in "qkv"] == [4 * 8, 4 * 8, 4 * 16]
    assert [on_disk_hf[conv.format(p)].shape[0] for p in "qkv"] == [43, 43, 42]
    whole = torch.cat([on_disk_hf[conv.format(p)] for p in "qkv"])
    assert torch.equal(whole, hf.state_dict()["model.layers.0.linear_attn.conv1d.weight"])
    loaded = load_model(str(tmp_path / "hf"), dtype=torch.float32, device="cpu").model
    assert torch.equal(loaded.state_dict()["model.layers.0.linear_attn.conv1d.weight"], whole)
    assert "model.layers.0.attention_layer_norm.weight" in on_disk_hf
    assert "model.layers.3.feedforward_layer_norm.weight" in on_disk_hf            # after attention
    assert "model.layers.3.post_feedforward_layernorm.weight" in on_disk_hf
    assert shapes(ours) == shapes(hf)
