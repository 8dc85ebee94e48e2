"""GraniteMoeHybrid (`GraniteMoeHybridForCausalLM`: Mamba2 and attention layers, MoE with a shared
MLP) reproduces HF transformers, for the preset and an HF-initialised checkpoint: the model
(`ModelParitySuite`: fp32 logits within 1e-4 in one shot, in chunked prefill + decode, in mixed
decode/prefill steps, a profile run touching no cache), config variants (no position embedding as
Granite 4.0-H ships, biases, top-3, untied; the dense variant without experts), and the engine
against HF's generate (`RunnerParityChecks`); the routing facts and cache specs, the checkpoint
layout (block_sparse_moe.input_linear / output_linear on disk, tied lm_head not stored) and bf16
checkpoints."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig

from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.granite_hybrid import GraniteMoeHybridForCausalLM
from toolkit.runner.model_states import MambaHybridModelState

from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    check_bf16_load_runs,
    rebuilt_config,
    save_bf16_checkpoint,
    saved_both_ways,
    shapes,
)

ARCH = "tiny-granite-hybrid"


def _variant_nope() -> GraniteMoeHybridConfig:
    """No position embedding ("nope", as Granite 4.0-H ships), attention first, biases, no conv
    bias, top-3, one Mamba group, untied."""
    return rebuilt_config(ARCH, position_embedding_type="nope",
                          layer_types=["attention", "mamba", "attention", "mamba"], attention_bias=True,
                          mamba_proj_bias=True, mamba_conv_bias=False, num_experts_per_tok=3, mamba_n_groups=1,
                          tie_word_embeddings=False)


def _variant_dense() -> GraniteMoeHybridConfig:
    """num_local_experts == 0: the shared MLP alone (HF's dense variant)."""
    return rebuilt_config(ARCH, num_local_experts=0)


class TestGraniteHybrid(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (ARCH,)
    # HF-initialised with N(0, 0.1) biases; references are full forwards without cache
    VARIANTS = {"granite-nope": _variant_nope, "granite-dense": _variant_dense}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert shapes(ours) == shapes(hf)

    def check_variant(self, variant: str, ours) -> None:
        if variant == "granite-nope":
            assert ours.model.layers[0].self_attn.rotary is None and not ours.is_tied
        else:
            assert all(b.block_sparse_moe is None for b in ours.model.layers)

    def check_llm(self, llm) -> None:
        assert type(llm.model_runner.model_state) is MambaHybridModelState


def test_routing_facts_and_cache_specs():
    assert GraniteMoeHybridForCausalLM.is_hybrid and not GraniteMoeHybridForCausalLM.is_attention_free
    assert get_model_class(PRESETS[ARCH]()) is GraniteMoeHybridForCausalLM
    g = load_model(ARCH, dtype=torch.float32, device="cpu").model
    assert g.is_tied
    assert list(g.kv_cache_specs()) == ["model.layers.0.mamba", "model.layers.1.self_attn",
                                        "model.layers.2.mamba", "model.layers.3.mamba"]
    ga = g.model.layers[1].self_attn
    assert ga.scale == 0.2 and ga.rotary is not None


def test_checkpoint_layout_matches_save_pretrained(tmp_path):
    """In memory: HF 5.x's state_dict names and shapes; on disk: what save_pretrained writes
    (block_sparse_moe.input_linear ..., no lm_head: tied), both ways."""
    hf, ours, on_disk_hf, on_disk_ours = saved_both_ways(ARCH, tmp_path)
    assert {k: v.shape for k, v in on_disk_ours.items()} == {k: v.shape for k, v in on_disk_hf.items()}
    assert "model.layers.1.block_sparse_moe.input_linear.weight" in on_disk_ours
    assert "lm_head.weight" not in on_disk_ours                       # tied
    # our folder loads in HF with the same weights (and HF's in ours: the hf-init pairs)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_bf16_checkpoint_loads_exactly_and_runs(tmp_path):
    """bf16 HF checkpoints load exactly (as fp32, keys remapped) and run in bf16."""
    _, stored = save_bf16_checkpoint(ARCH, tmp_path)
    m = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    remap = type(m).remap_checkpoint_key
    want = {remap(k): v for k, v in stored.items()}
    for k, v in m.state_dict().items():
        if k == "lm_head.weight" and m.is_tied:
            continue
        assert v.dtype == torch.float32 and torch.equal(v, want[k].float()), k
    check_bf16_load_runs(tmp_path)
