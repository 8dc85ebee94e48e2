"""Mamba2 (`Mamba2ForCausalLM`: attention-free) reproduces HF transformers, for the preset and an
HF-initialised checkpoint: the model (`ModelParitySuite`: fp32 logits within 1e-4 in one shot, in
chunked prefill + decode, in mixed decode/prefill steps, a profile run that computes the real thing
and touches no cache), a config variant (biases, no conv bias, residual in the model dtype, a dt
clamp that bites), and the engine against HF's generate (`RunnerParityChecks`), the shipped
demo-mamba too."""
from __future__ import annotations

from toolkit.models import PRESETS

from model_helpers import ConfigVariantChecks, ModelParitySuite, RunnerParityChecks


def _variant():
    cfg = PRESETS["tiny-mamba2"]()
    cfg.use_bias = True
    cfg.use_conv_bias = False
    cfg.residual_in_fp32 = False
    cfg.time_step_limit = (0.01, 0.05)      # the clamp actually bites
    return cfg


class TestMamba2(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = ("tiny-mamba2",)
    DEMO_MODELS = ("demo-mamba",)
    PROFILE_PROMPT_SEED = 5
    VARIANTS = {"tiny-mamba2": _variant}
    VARIANT_PROMPT_SEED = 6
