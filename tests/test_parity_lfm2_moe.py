"""LFM2-MoE (`Lfm2MoeForCausalLM`: LFM2's short convs and attention, a sigmoid-routed MoE with an
expert bias) reproduces HF transformers 5.24, for the preset and an HF-initialised checkpoint: the model
(`ModelParitySuite`), config variants (no expert bias, no renormalisation, every FFN dense), routing
with a non-zero expert bias, the engine against HF's generate (`RunnerParityChecks`), the cache specs
(ShortConv's builder, as vLLM's lfm2_moe), and the checkpoint layout save_pretrained writes (per-expert
w1 / w3 / w2, the bias as a float32 buffer) both ways.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from toolkit import LLM
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.lfm2_moe import Lfm2MoeForCausalLM, Lfm2MoeSparseBlock, sigmoid_biased_topk

from harness import F32
from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    assert_close,
    hf_logits,
    random_prompt,
    run_steps,
    saved_both_ways,
    shapes,
)

ARCH = "tiny-lfm2-moe"


def _variant_unbiased_unnormalised():
    """No expert bias (use_expert_bias False: the plain top-k of the scores), weights not renormalised,
    top-3, conv L_cache 4."""
    cfg = PRESETS[ARCH]()
    cfg.use_expert_bias = False
    cfg.norm_topk_prob = False
    cfg.num_experts_per_tok = 3
    cfg.conv_L_cache = 4
    return cfg


def _variant_dense():
    """Every FFN dense (num_dense_layers = layers), attention on layers 0 and 2."""
    cfg = PRESETS[ARCH]()
    cfg.num_dense_layers = 4
    cfg.layer_types = ["full_attention", "conv", "full_attention", "conv"]
    return cfg


class TestLfm2Moe(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (ARCH,)
    HF_POSITION_IDS = True
    VARIANTS = {"unbiased-unnormalised": _variant_unbiased_unnormalised, "dense": _variant_dense}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert [b.layer_type for b in ours.model.layers] == ["conv", "conv", "full_attention", "conv"]
        assert sorted(ours.state_dict()) == sorted(hf.state_dict())

    def hf_continue(self, hf, prompt: torch.Tensor, steps: int) -> torch.Tensor:
        out = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=steps,
                          min_new_tokens=steps, do_sample=False, pad_token_id=0)
        return out[0]

    def check_variant(self, variant: str, ours) -> None:
        ffns = [type(b.feed_forward).__name__ for b in ours.model.layers]
        if variant == "dense":
            assert ffns == ["Lfm2MLP"] * 4
        else:
            assert ffns == ["Lfm2MLP"] + ["Lfm2MoeSparseBlock"] * 3
            assert ours.model.layers[1].feed_forward.expert_bias is None
            assert ours.model.layers[0].conv.state_shapes() == ((3, 64),)


def test_layer_kinds_and_cache_specs():
    assert get_model_class(PRESETS[ARCH]()) is Lfm2MoeForCausalLM
    m = load_model(ARCH, dtype=torch.bfloat16, device="cpu").model
    assert [type(b.feed_forward).__name__ for b in m.model.layers] == ["Lfm2MLP"] + ["Lfm2MoeSparseBlock"] * 3
    assert m.model.layers[1].feed_forward.expert_bias.dtype == torch.float32     # float32 in a bf16 model, as HF
    assert m.is_tied
    specs = m.kv_cache_specs()
    assert specs["model.layers.0.conv"] == MambaSpec(shapes=((2, 64),), dtypes=(torch.bfloat16,),
                                                     mamba_type="short_conv")
    assert specs["model.layers.2.self_attn"] == AttentionSpec(num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    with LLM(ARCH, **F32, max_num_seqs=2, block_size=16) as llm:
        runner = llm.model_runner
        assert [(g.kind, type(a.builder).__name__) for g, a in zip(runner.kv_cache_groups, runner.attn_groups)] == [
            ("attention", "PagedAttentionMetadataBuilder"), ("mamba", "ShortConvMetadataBuilder")]


def test_router_bias_picks_but_never_weights():
    """The expert bias changes which experts win, and the winners keep their unbiased scores,
    renormalised (+1e-6, as HF) and scaled."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, ids = sigmoid_biased_topk(logits, bias, 2, renormalize=True, scale=1.5)
    assert ids.tolist() == [[3, 0]]
    s = logits.sigmoid()[0]
    want = torch.stack([s[3], s[0]]) / (s[3] + s[0] + 1e-6) * 1.5
    torch.testing.assert_close(w[0], want)
    w, ids = sigmoid_biased_topk(logits, None, 2, renormalize=False, scale=1.0)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w[0], logits.sigmoid()[0, :2])


@torch.no_grad()
def test_routing_with_an_expert_bias_matches_hf(tmp_path):
    """HF initialises expert_bias to zeros, which hides a bias misapplied to the weights (it only
    picks the experts): random biases, then HF's and our logits."""
    torch.manual_seed(11)
    hf = AutoModelForCausalLM.from_config(PRESETS[ARCH]()).eval()
    for name, buf in hf.named_buffers():
        if name.endswith("expert_bias"):
            buf.copy_(torch.randn(buf.shape) * 0.3)
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    block = ours.model.layers[1].feed_forward
    assert isinstance(block, Lfm2MoeSparseBlock) and block.expert_bias.abs().sum() > 0
    seq = random_prompt(12, 19)
    ref = hf_logits(hf, seq, position_ids=True)
    assert_close(run_steps(ours, seq, [19]), ref)
    assert_close(run_steps(ours, seq, [8, 9, 1, 1]), ref)


def test_checkpoint_layout_matches_save_pretrained(tmp_path):
    """On disk both ways: experts per expert (w1 gate, w3 up, w2 down), the expert bias under feed_forward."""
    hf, ours, on_disk_hf, on_disk_ours = saved_both_ways(ARCH, tmp_path)
    assert sorted(on_disk_ours) == sorted(on_disk_hf)
    assert on_disk_hf["model.layers.1.feed_forward.experts.7.w3.weight"].shape == (32, 64)
    assert on_disk_hf["model.layers.3.feed_forward.expert_bias"].dtype == torch.float32
    assert "model.layers.0.feed_forward.w1.weight" in on_disk_hf                  # the dense FFN
    assert shapes(ours) == shapes(hf)
