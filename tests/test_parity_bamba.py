"""Bamba (`BambaForCausalLM`: Mamba2 and attention layers) reproduces HF transformers, for the
preset and an HF-initialised checkpoint: the model (`ModelParitySuite`: fp32 logits within 1e-4 in
one shot, in chunked prefill + decode, in mixed decode/prefill steps, a profile run touching no
cache), a config variant (biases, no conv bias, two Mamba groups, attention on layers 0 and 2), and
the engine against HF's generate (`RunnerParityChecks`)."""
from __future__ import annotations

from toolkit.models import PRESETS

from model_helpers import ConfigVariantChecks, ModelParitySuite, RunnerParityChecks


def _variant():
    cfg = PRESETS["tiny-bamba"]()
    cfg.attention_bias = True
    cfg.mlp_bias = True
    cfg.mamba_proj_bias = True
    cfg.mamba_conv_bias = False
    cfg.mamba_n_groups = 2
    cfg.attn_layer_indices = [0, 2]
    return cfg


class TestBamba(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = ("tiny-bamba",)
    PROFILE_PROMPT_SEED = 5
    VARIANTS = {"tiny-bamba": _variant}
    VARIANT_PROMPT_SEED = 6
