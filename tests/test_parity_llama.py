"""Llama (`LlamaForCausalLM`: attention only) reproduces HF transformers, for the preset and an
HF-initialised checkpoint: the model (`ModelParitySuite`: fp32 logits within 1e-4 in one shot, in
chunked prefill + decode, in mixed decode/prefill steps, a profile run touching no cache), a config
variant (biases, head_dim != hidden / heads, linearly scaled RoPE), and the engine against HF's
generate (`RunnerParityChecks`)."""
from __future__ import annotations

from toolkit.models import PRESETS

from model_helpers import ConfigVariantChecks, ModelParitySuite, RunnerParityChecks


def _variant():
    cfg = PRESETS["tiny-llama"]()
    cfg.attention_bias = True
    cfg.mlp_bias = True
    cfg.head_dim = 24                       # head_dim != hidden / heads
    cfg.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    return cfg


class TestLlama(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = ("tiny-llama",)
    PROFILE_PROMPT_SEED = 5
    VARIANTS = {"tiny-llama": _variant}
    VARIANT_PROMPT_SEED = 6
