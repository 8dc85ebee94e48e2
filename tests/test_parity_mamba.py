"""Mamba and FalconMamba (`MambaForCausalLM`, `FalconMambaForCausalLM`: attention-free Mamba1)
reproduce HF transformers, for the presets and HF-initialised checkpoints: the model
(`ModelParitySuite`: fp32 logits within 1e-4 in one shot, in chunked prefill + decode, in mixed
decode/prefill steps, a profile run that computes the real thing and touches no cache), config
variants (biases on/off, residual in the model dtype, tying flipped, a mixer eps that matters), the
engine against HF's generate (`RunnerParityChecks`); the routing facts and cache specs, and bf16
checkpoints (a tied Mamba stores no lm_head)."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from toolkit.kv_cache_spec import MambaSpec
from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.falcon_mamba import FalconMambaForCausalLM
from toolkit.models.mamba import MambaForCausalLM

from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    check_bf16_load_runs,
    save_bf16_checkpoint,
)

ARCHS = ("tiny-mamba", "tiny-falcon-mamba")


def _variant(arch: str):
    cfg = PRESETS[arch]()
    if arch == "tiny-mamba":
        cfg.use_bias = True
        cfg.use_conv_bias = False
        cfg.residual_in_fp32 = False
        cfg.tie_word_embeddings = False
    else:
        cfg.use_bias = True
        cfg.mixer_rms_eps = 1e-2                # eps large enough to matter
        cfg.tie_word_embeddings = True
    return cfg


class TestMambaFalconMamba(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = ARCHS
    # HF references always come from full forwards with use_cache=False
    VARIANTS = {arch: partial(_variant, arch) for arch in ARCHS}
    VARIANT_PROMPT_SEED = 7


def test_routing_facts_and_cache_specs():
    assert MambaForCausalLM.is_attention_free and not MambaForCausalLM.is_hybrid
    assert FalconMambaForCausalLM.is_attention_free and not FalconMambaForCausalLM.is_hybrid
    for arch, cls in zip(ARCHS, (MambaForCausalLM, FalconMambaForCausalLM)):
        assert get_model_class(PRESETS[arch]()) is cls
    m = load_model("tiny-mamba", dtype=torch.bfloat16, device="cpu").model
    assert m.is_tied
    specs = m.kv_cache_specs()
    assert list(specs) == [f"backbone.layers.{i}.mixer" for i in range(4)]
    s = specs["backbone.layers.0.mixer"]
    assert s == MambaSpec(shapes=((3, 128), (128, 16)), dtypes=(torch.bfloat16, torch.float32), mamba_type="mamba1")


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_checkpoint_loads_exactly_and_runs(arch, tmp_path):
    """bf16 HF checkpoints load exactly (as fp32) and run in bf16; a tied Mamba stores no lm_head."""
    _, stored = save_bf16_checkpoint(arch, tmp_path)
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert ("lm_head.weight" in stored) == (not PRESETS[arch]().tie_word_embeddings)
    m = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    assert m.is_tied == bool(PRESETS[arch]().tie_word_embeddings)
    for k, v in m.state_dict().items():
        if k == "lm_head.weight" and m.is_tied:
            continue
        assert v.dtype == torch.float32 and torch.equal(v, stored[k].float()), k
    check_bf16_load_runs(tmp_path)
