"""Qwen3-Next (`Qwen3NextForCausalLM`: Gated DeltaNet and gated full attention layers, MoE with a
shared expert) reproduces HF transformers, for the preset and an HF-initialised checkpoint: the
model (`ModelParitySuite`: fp32 logits within 1e-4 in one shot, in chunked prefill + decode, in
mixed decode/prefill steps, a profile run touching no cache; small GDN chunks inside the model),
config variants (dense layers and plain top-k; no grouped values, full RoPE, sparse MoE steps),
its norms against HF's modules, the engine against HF's generate (`RunnerParityChecks`) and, on a
config with GDN layers only, against HF's uncached forward; the routing facts and cache specs (the
engine's GDN builder), the checkpoint layout (per-expert tensors on disk, `mtp.*` ignored) and bf16
checkpoints.

HF's cached generation works for the preset and its variants in transformers 5.24 (greedy
`generate` agrees with full forwards), so the runner-level references use `generate`
(use_cache=True). It raises on a config without any attention layer, which is therefore compared
with use_cache=False (`test_llm_without_attention_layers_matches_hf_uncached`).
"""
from __future__ import annotations

import torch
from safetensors.torch import save_file
from transformers.models.qwen3_next import modeling_qwen3_next as hf_q3n

from toolkit import LLM
from toolkit.attention.gdn import GDN_CHUNK_SIZE
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.layers.gdn import GatedDeltaNet
from toolkit.layers.moe import merge_expert_checkpoint_tensors
from toolkit.layers.norms import RMSNormThenGate
from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.qwen3_next import OffsetRMSNorm, Qwen3NextForCausalLM
from toolkit.runner.model_states import MambaHybridModelState

from harness import F32, check_no_attention_llm_matches_hf_uncached
from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    assert_close,
    random_prompt,
    run_steps,
    save_bf16_checkpoint,
    saved_both_ways,
    shapes,
)

ARCH = "tiny-qwen3-next"
GDN_LAYERS = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
# tiny-qwen3-next's GDN: 2 key heads x 8, 4 value heads x 16, conv 4 -> conv_dim 2*2*8 + 4*16 = 96
HV, KD, VD, CONV_DIM = 4, 8, 16, 96


def _variant_dense_layers_plain_topk():
    """Dense MLPs on layers 0 and 3, top-3 without renormalisation, attention biases."""
    cfg = PRESETS[ARCH]()
    cfg.mlp_only_layers = [0, 3]
    cfg.norm_topk_prob = False
    cfg.num_experts_per_tok = 3
    cfg.attention_bias = True
    return cfg


def _variant_no_gva_full_rope():
    """Hv == Hk (no grouped values), key dim > value dim, full RoPE, attention first, MoE only on
    every 2nd layer (decoder_sparse_step 2), conv kernel 3."""
    cfg = PRESETS[ARCH]()
    cfg.layer_types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    cfg.linear_num_value_heads = 2
    cfg.linear_key_head_dim = 16
    cfg.linear_value_head_dim = 8
    cfg.linear_conv_kernel_dim = 3
    cfg.decoder_sparse_step = 2
    cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": 1.0}
    return cfg


class TestQwen3Next(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (ARCH,)
    VARIANTS = {"dense-layers-plain-topk": _variant_dense_layers_plain_topk,
                "no-gva-full-rope": _variant_no_gva_full_rope}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert [b.layer_type for b in ours.model.layers] == ["linear_attention", "full_attention"] * 2
        assert sorted(ours.state_dict()) == sorted(hf.state_dict())

    def check_variant(self, variant: str, ours) -> None:
        mlps = [type(b.mlp).__name__ for b in ours.model.layers]
        if variant == "dense-layers-plain-topk":
            assert mlps == ["SwiGLUMLP", "SharedExpertMoeBlock", "SharedExpertMoeBlock", "SwiGLUMLP"]
            assert ours.model.layers[1].mlp.top_k == 3 and not ours.model.layers[1].mlp.renormalize
        else:
            assert mlps == ["SwiGLUMLP", "SharedExpertMoeBlock", "SwiGLUMLP", "SharedExpertMoeBlock"]
            gdn = ours.model.layers[1].linear_attn
            assert gdn.state_shapes() == ((2, 2 * 2 * 16 + 2 * 8), (2, 8, 16))
            assert ours.model.layers[0].self_attn.rotary.rotary_dim == 16

    @torch.no_grad()
    def test_small_gdn_chunks_match_hf(self, pair):
        """GDN chunk size 8 (the spec, hence the metadata, follows): prefill rows span several
        chunks inside the model, and chunks start mid-sequence."""
        ours, hf = pair
        mixers = [m for m in ours.modules() if isinstance(m, GatedDeltaNet)]
        assert len(mixers) == 2 and all(m.chunk_size == GDN_CHUNK_SIZE for m in mixers)
        try:
            for m in mixers:
                m.chunk_size = 8
            assert all(s.chunk_size == 8 for s in ours.kv_cache_specs().values() if isinstance(s, MambaSpec))
            seq = self.hf_continue(hf, random_prompt(11), 2)
            assert_close(run_steps(ours, seq, [10, 17, 10, 1, 1]), self.hf_logits(hf, seq))
        finally:
            for m in mixers:
                m.chunk_size = GDN_CHUNK_SIZE


def test_norms_match_hf_modules():
    """The (1 + weight) RMSNorm and the norm-before-gate GDN norm equal HF's modules, in fp32 and
    bf16 (same dtype handling)."""
    torch.manual_seed(0)
    x, z = torch.randn(5, 16), torch.randn(5, 16)
    ours_n, hf_n = OffsetRMSNorm(16, eps=1e-6), hf_q3n.Qwen3NextRMSNorm(16, eps=1e-6)
    ours_g, hf_g = RMSNormThenGate(16, eps=1e-6, cast_normed=True), hf_q3n.Qwen3NextRMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        for a, b in ((ours_n, hf_n), (ours_g, hf_g)):
            a.weight.normal_(0.0, 0.3)
            b.weight.copy_(a.weight)
    for dtype in (torch.float32, torch.bfloat16):
        xs, zs = x.to(dtype), z.to(dtype)
        for a, b in ((ours_n, hf_n), (ours_g, hf_g)):
            a.to(dtype), b.to(dtype)
        assert torch.equal(ours_n(xs), hf_n(xs))
        assert torch.equal(ours_g(xs, zs), hf_g(xs, zs))


def test_routing_facts_and_cache_specs():
    assert Qwen3NextForCausalLM.is_hybrid and not Qwen3NextForCausalLM.is_attention_free
    assert get_model_class(PRESETS[ARCH]()) is Qwen3NextForCausalLM
    m = load_model(ARCH, dtype=torch.bfloat16, device="cpu").model
    assert not m.is_tied
    specs = m.kv_cache_specs()
    assert list(specs) == [GDN_LAYERS[0], "model.layers.1.self_attn", GDN_LAYERS[1], "model.layers.3.self_attn"]
    assert specs[GDN_LAYERS[0]] == MambaSpec(shapes=((3, CONV_DIM), (HV, VD, KD)),
                                             dtypes=(torch.bfloat16, torch.float32), mamba_type="gdn",
                                             chunk_size=GDN_CHUNK_SIZE)
    assert specs["model.layers.1.self_attn"] == AttentionSpec(num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    attn = m.model.layers[1].self_attn
    assert attn.q_proj.weight.shape == (4 * 16 * 2, 64) and attn.rotary.rotary_dim == 4   # gate; RoPE 0.25
    with LLM(ARCH, **F32, max_num_seqs=2) as llm:
        assert type(llm.model_runner.model_state) is MambaHybridModelState
        assert [(g.kind, type(a.builder).__name__) for g, a in
                zip(llm.model_runner.kv_cache_groups, llm.model_runner.attn_groups)] == [
            ("attention", "PagedAttentionMetadataBuilder"), ("mamba", "GDNMetadataBuilder")]


def test_checkpoint_layout_matches_save_pretrained(tmp_path):
    """In memory: HF 5.x's fused experts (our state_dict keys and shapes equal HF's); on disk:
    per-expert tensors both ways; a checkpoint's `mtp.*` tensors are ignored, as HF does."""
    hf, ours, on_disk_hf, on_disk_ours = saved_both_ways(ARCH, tmp_path)
    theirs = shapes(hf)
    assert theirs["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 64)
    assert theirs["model.layers.0.linear_attn.in_proj_qkvz.weight"] == (2 * 2 * 8 + 2 * 4 * 16, 64)
    assert sorted(on_disk_ours) == sorted(on_disk_hf)
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in on_disk_ours
    with_mtp = dict(on_disk_hf, **{"mtp.fc.weight": torch.zeros(64, 128), "mtp.norm.weight": torch.zeros(64)})
    save_file(with_mtp, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(str(tmp_path / "hf"), dtype=torch.float32, device="cpu").model
    want = merge_expert_checkpoint_tensors(on_disk_hf)
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


@torch.no_grad()
def test_bf16_checkpoint_loads_exactly_and_runs(tmp_path):
    """A bf16 HF checkpoint loads exactly and runs in bf16: conv state in bf16, recurrent state
    fp32, finite fp32 logits that pick HF-fp32's greedy token on most positions."""
    hf, stored = save_bf16_checkpoint(ARCH, tmp_path)
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    m16 = load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu").model
    want = merge_expert_checkpoint_tensors(stored)
    assert all(torch.equal(v, want[k]) for k, v in m16.state_dict().items())
    spec = m16.kv_cache_specs()[GDN_LAYERS[0]]
    assert spec.dtypes == (torch.bfloat16, torch.float32)
    seq = random_prompt(8, 22)
    out = run_steps(m16, seq, [10, 10, 1, 1])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    ref = hf.float()(seq[None], use_cache=False).logits[0]
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_llm_without_attention_layers_matches_hf_uncached(tmp_path):
    """GDN layers only (no attention layer, hence no KV blocks): routed to the hybrid state with one
    Mamba group. HF's cached `generate` raises on this config in transformers 5.24 ("`get_seq_length`
    can only be called on Attention layers"), so HF runs with use_cache=False."""
    check_no_attention_llm_matches_hf_uncached(ARCH, tmp_path)
