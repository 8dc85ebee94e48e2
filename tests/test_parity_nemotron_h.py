"""NemotronH (`NemotronHForCausalLM`: Mamba2, MLP, MoE and attention blocks) reproduces HF
transformers, for the preset and an HF-initialised checkpoint: the model (`ModelParitySuite`: fp32
logits within 1e-4 in one shot, in chunked prefill + decode, in mixed decode/prefill steps, a
profile run touching no cache), a config variant (attention first, biases, a latent MoE, expert
groups, un-normalised top-k, a larger dt floor), group-limited routing on a non-zero correction
bias, and the engine against HF's generate (`RunnerParityChecks`); the routing facts and cache
specs, untied embeddings and the released configs' hybrid_override_pattern, the checkpoint layout
(`backbone.` and per-expert tensors on disk) and bf16 checkpoints."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, NemotronHConfig

from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.nemotron_h import (
    NemotronHForCausalLM,
    NemotronHTopkRouter,
    merge_nemotron_h_experts,
    split_nemotron_h_experts,
)
from toolkit.runner.model_states import MambaHybridModelState

from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    assert_close,
    check_bf16_load_runs,
    random_prompt,
    rebuilt_config,
    run_steps,
    save_bf16_checkpoint,
    saved_both_ways,
    shapes,
)

ARCH = "tiny-nemotron-h"


def _variant() -> NemotronHConfig:
    """Attention first, biases everywhere they exist (Mamba in/out_proj via use_bias, MLPs, shared
    expert, latent projections), no conv bias, a latent MoE (experts on 24 channels), two expert
    groups with one kept, un-normalised top-k weights, a larger dt floor."""
    cfg = rebuilt_config(ARCH, layers_block_type=["full_attention", "moe", "linear_attention", "mlp",
                                                  "linear_attention", "moe"])
    cfg.use_bias = True
    cfg.mlp_bias = True
    cfg.use_conv_bias = False
    cfg.moe_latent_size = 24
    cfg.n_group, cfg.topk_group = 2, 1
    cfg.norm_topk_prob = False
    cfg.time_step_min = 0.02
    cfg.n_groups = 4
    return cfg


class TestNemotronH(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (ARCH,)
    # HF-initialised with N(0, 0.1) biases; references are full forwards without cache
    VARIANTS = {"nemotron-h": _variant}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert shapes(ours) == shapes(hf)

    def check_variant(self, variant: str, ours) -> None:
        moe = ours.model.layers[1].mixer
        assert moe.fc1_latent_proj.weight.shape == (24, 64) and moe.experts.up_proj.shape == (4, 32, 24)
        assert ours.model.layers[2].mixer.time_step_limit == (0.02, float("inf"))

    def check_llm(self, llm) -> None:
        assert type(llm.model_runner.model_state) is MambaHybridModelState


def test_routing_facts_and_cache_specs():
    assert NemotronHForCausalLM.is_hybrid and not NemotronHForCausalLM.is_attention_free
    assert get_model_class(PRESETS[ARCH]()) is NemotronHForCausalLM
    n = load_model(ARCH, dtype=torch.float32, device="cpu").model
    assert [b.layer_type for b in n.model.layers] == ["mamba", "mlp", "mamba", "moe", "mamba", "attention", "moe"]
    specs = n.kv_cache_specs()
    assert list(specs) == [f"model.layers.{i}.mixer" for i in (0, 2, 4, 5)]
    assert specs["model.layers.0.mixer"] == MambaSpec(shapes=((3, 192), (8, 16, 16)),
                                                      dtypes=(torch.float32, torch.float32),
                                                      mamba_type="mamba2", chunk_size=16)
    assert isinstance(specs["model.layers.5.mixer"], AttentionSpec)
    attn = n.model.layers[5].mixer
    assert attn.rotary is None and attn.scale == 16 ** -0.5 and attn.q_proj.bias is None
    assert n.model.layers[0].mixer.time_step_limit == (0.001, float("inf"))   # time_step_min, not time_step_limit
    assert not n.is_tied
    router = n.model.layers[3].mixer.gate
    assert isinstance(router, NemotronHTopkRouter) and router.e_score_correction_bias.abs().sum() > 0


def test_never_ties_and_reads_the_hybrid_override_pattern(tmp_path):
    """tie_word_embeddings is ignored by HF's NemotronH (no tied weights); a config.json with the
    legacy hybrid_override_pattern (as NVIDIA's releases) loads with the same layer kinds."""
    cfg = rebuilt_config(ARCH, tie_word_embeddings=True)
    torch.manual_seed(2)
    hf = AutoModelForCausalLM.from_config(cfg)
    assert hf.lm_head.weight is not hf.model.embeddings.weight
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["hybrid_override_pattern"] = NemotronHConfig._list_to_pattern(raw.pop("layers_block_type"))
    assert raw["hybrid_override_pattern"] == "M-MEM*E"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    assert not ours.is_tied and torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    assert [b.layer_type for b in ours.model.layers] == ["mamba", "mlp", "mamba", "moe", "mamba", "attention", "moe"]


def test_checkpoint_layout_matches_save_pretrained(tmp_path):
    """In memory: HF 5.x's state_dict names and shapes; on disk: what save_pretrained writes
    (backbone. + per-expert up/down_proj), both ways."""
    hf, ours, on_disk_hf, on_disk_ours = saved_both_ways(ARCH, tmp_path)
    assert {k: v.shape for k, v in on_disk_ours.items()} == {k: v.shape for k, v in on_disk_hf.items()}
    assert "backbone.layers.3.mixer.experts.2.up_proj.weight" in on_disk_ours
    assert "backbone.layers.3.mixer.gate.e_score_correction_bias" in on_disk_ours
    sd = ours.state_dict()
    back = merge_nemotron_h_experts(split_nemotron_h_experts(sd))
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    dropped = "backbone.layers.6.mixer.experts.1.down_proj.weight"
    merged = merge_nemotron_h_experts({k: v for k, v in on_disk_ours.items() if k != dropped})
    assert "backbone.layers.6.mixer.experts.up_proj" not in merged
    assert "backbone.layers.3.mixer.experts.up_proj" in merged
    # our folder loads in HF with the same weights (and HF's in ours: the hf-init pairs)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_group_routing_with_correction_bias(tmp_path):
    """Group-limited selection (2 groups of 2, one kept) on a non-zero e_score_correction_bias
    (HF initialises it to zero), top-1, routed_scaling_factor 2.5, un-normalised."""
    cfg = rebuilt_config(ARCH, n_group=2, topk_group=1, num_experts_per_tok=1, norm_topk_prob=False)
    torch.manual_seed(11)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    assert ours.model.layers[3].mixer.gate.e_score_correction_bias.abs().sum() > 0
    seq = random_prompt(12, 30)
    with torch.no_grad():
        ref = hf(seq[None], use_cache=False).logits[0].float()
    assert_close(run_steps(ours, seq, [13, 16, 1]), ref)


def test_bf16_checkpoint_loads_exactly_and_runs(tmp_path):
    """bf16 HF checkpoints load exactly (as fp32: keys remapped, per-expert tensors fused) and run in bf16."""
    _, stored = save_bf16_checkpoint(ARCH, tmp_path)
    m = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    remap = type(m).remap_checkpoint_key
    want = merge_nemotron_h_experts({remap(k): v for k, v in stored.items()})
    for k, v in m.state_dict().items():
        if k == "lm_head.weight" and m.is_tied:
            continue
        assert v.dtype == torch.float32 and torch.equal(v, want[k].float()), k
    check_bf16_load_runs(tmp_path)
