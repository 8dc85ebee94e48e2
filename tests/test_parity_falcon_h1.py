"""Falcon-H1 (`FalconH1ForCausalLM`: attention and Mamba2 side by side in every layer) reproduces HF
transformers, for the preset and an HF-initialised checkpoint: the model (`ModelParitySuite`: fp32
logits within 1e-4 in one shot, in chunked prefill + decode, in mixed decode/prefill steps, a
profile run touching no cache), config variants (no Mamba norm with every bias and a dt clamp that
bites; gating before the grouped norm, one group, head_dim != hidden / heads, scaled RoPE), and the
engine against HF's generate (`RunnerParityChecks`); the routing facts and cache layout (an
attention and a Mamba cache in every layer, the multipliers) and bf16 checkpoints.

HF's decode path skips the `time_step_limit` clamp (as Zamba2's skips its dt floor, see
test_parity_zamba2.py), but the default limit (0, inf) never bites.
"""
from __future__ import annotations

import pytest
import torch

from toolkit import LLM
from toolkit.kv_cache_spec import AttentionSpec
from toolkit.layers.mamba2_mixer import Mamba2Mixer, RMSNormThenGate
from toolkit.layers.norms import RMSNormGated
from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.falcon_h1 import FalconH1ForCausalLM
from toolkit.runner.model_states import MambaHybridModelState, init_model_state

from harness import F32
from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    check_bf16_load_runs,
    meta_model_specs_and_groups,
    rebuilt_config,
    save_bf16_checkpoint,
    shapes,
)

ARCH = "tiny-falcon-h1"
VARIANTS = {
    # no Mamba norm (y * silu(gate)), every bias on, no conv bias, the dt clamp bites, d_ssm from expand
    "falcon-h1-no-mamba-norm": lambda: rebuilt_config(
        ARCH, mamba_rms_norm=False, attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
        projectors_bias=True, mamba_conv_bias=False, time_step_limit=(0.01, 0.05), mamba_d_ssm=None),
    # gated norm gating first, one group, head_dim != hidden / heads, scaled RoPE
    "falcon-h1-gate-then-norm": lambda: rebuilt_config(
        ARCH, mamba_norm_before_gate=False, mamba_n_groups=1, head_dim=24,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
}


def _mixers(model) -> list[Mamba2Mixer]:
    return [m for m in model.modules() if isinstance(m, Mamba2Mixer)]


class TestFalconH1(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (ARCH,)
    VARIANTS = VARIANTS
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert shapes(ours) == shapes(hf)

    def check_variant(self, variant: str, ours) -> None:
        if variant == "falcon-h1-no-mamba-norm":
            assert all(m.norm is None and m.out_proj.bias is not None for m in _mixers(ours))
        else:
            assert all(type(m.norm) is RMSNormGated for m in _mixers(ours))
            assert ours.model.layers[0].self_attn.head_dim == 24


def test_routing_facts_and_cache_layout():
    """Every layer holds an attention cache and a Mamba state, in the two groups."""
    assert FalconH1ForCausalLM.is_hybrid and not FalconH1ForCausalLM.is_attention_free
    assert get_model_class(PRESETS[ARCH]()) is FalconH1ForCausalLM
    f, specs, groups, cfg = meta_model_specs_and_groups(ARCH)
    assert type(init_model_state(f, cfg)) is MambaHybridModelState
    assert list(specs) == [f"model.layers.{i}.{p}" for i in range(4) for p in ("mamba", "self_attn")]
    assert [(g.kind, g.layer_names) for g in groups] == [
        ("attention", [f"model.layers.{i}.self_attn" for i in range(4)]),
        ("mamba", [f"model.layers.{i}.mamba" for i in range(4)])]
    assert specs["model.layers.0.self_attn"] == AttentionSpec(num_kv_heads=2, head_dim=16, dtype=torch.float32)
    mixer = f.model.layers[0].mamba
    assert type(mixer.norm) is RMSNormThenGate and mixer.proj_multipliers == (1.1, 0.9, 1.2, 0.8, 1.3)
    assert mixer.in_multiplier == 0.7
    assert f.model.layers[0].self_attn.scale == pytest.approx(16**-0.5 * 0.8)


def test_llm_binds_an_attention_and_a_mamba_cache_group():
    """The runner allocates and binds both groups; the engine routes to MambaHybridModelState."""
    with LLM(ARCH, **F32, max_num_seqs=2) as llm:
        assert type(llm.model_runner.model_state) is MambaHybridModelState
        assert [g.kind for g in llm.model_runner.kv_cache_groups] == ["attention", "mamba"]
        assert set(llm.model_runner.kv_caches) == set(llm.model.kv_cache_specs())


def test_bf16_checkpoint_loads_exactly_and_runs(tmp_path):
    _, stored = save_bf16_checkpoint(ARCH, tmp_path)
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    m32 = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    for k, t in stored.items():
        assert torch.equal(m32.state_dict()[k], t.float()), k
    check_bf16_load_runs(tmp_path)
