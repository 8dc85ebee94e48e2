"""Our models reproduce HF transformers logits (fp32, atol 1e-4), for presets and HF-initialised
checkpoints, in one shot, in chunked prefill + decode, and in mixed decode/prefill batches
(`ModelParitySuite`); plus config variants."""
from __future__ import annotations

from functools import partial

from model_helpers import ConfigVariantChecks, MixedRequest, ModelParitySuite
from toolkit.models import PRESETS


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


class TestLlamaMamba2Bamba(ModelParitySuite, ConfigVariantChecks):
    ARCHS = ("tiny-llama", "tiny-mamba2", "tiny-bamba")
    MIXED_REQUESTS = {
        "A": MixedRequest(2, 21, 2, blocks=[5, 9], slot=3),   # 21-token prompt, then decodes
        "B": MixedRequest(3, 30, 0, blocks=[1, 6], slot=1),   # prefilled in two chunks (20 | 10), 2nd mid-chunk
        "C": MixedRequest(4, 5, 0, blocks=[8], slot=4),       # short prompt prefilled while A and B run
    }
    MIXED_STEPS = [
        [("A", 0, 21), ("B", 0, 20)],                  # two prefills
        [("A", 21, 1), ("B", 20, 10), ("C", 0, 5)],    # A decodes, B continues from 20 (mid-chunk), C starts
        [("A", 22, 1)],                                # A decodes alone
    ]
    PROFILE_PROMPT_SEED = 5
    # biases on/off, explicit head_dim, scaled RoPE, dt clamp, n_groups, other layer layouts
    VARIANTS = {arch: partial(_variant, arch) for arch in ARCHS}
    VARIANT_PROMPT_SEED = 6
