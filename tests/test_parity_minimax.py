"""MiniMax (`MiniMaxForCausalLM`: lightning attention layers and softmax attention layers, a normed
residual with per-kind scales, Mixtral-style MoE) reproduces HF transformers 5.24, for the preset and
an HF-initialised checkpoint: the model (`ModelParitySuite`), config variants, the engine against HF's
generate (`RunnerParityChecks`), the cache specs (lightning layers on the linear-attention builder,
their state the SSD layout of HF's linear_cache), the lightning recurrence against HF's own module fed
token by token, and the checkpoint layout save_pretrained writes (block_sparse_moe, per-expert
w1 / w2 / w3, the decay tables) both ways.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from toolkit import LLM
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.layers.lightning import LightningAttention, lightning_slopes
from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.minimax import DECAY_TABLES, MiniMaxForCausalLM, lightning_decay_tables

from harness import F32
from model_helpers import ConfigVariantChecks, ModelParitySuite, RunnerParityChecks, saved_both_ways, shapes

ARCH = "tiny-minimax"


def _variant_two_softmax_layers_8_heads():
    """Softmax attention on layers 0 and 2, 8 heads x 8 (4 KV heads), top-1 of 4 experts, block_size 3."""
    cfg = PRESETS[ARCH]()
    cfg.layer_types = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 8, 4, 8
    cfg.num_experts_per_tok = 1
    cfg.block_size = 3
    return cfg


class TestMiniMax(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (ARCH,)
    VARIANTS = {"two-softmax-8-heads": _variant_two_softmax_layers_8_heads}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert [b.layer_type for b in ours.model.layers] == ["linear_attention"] * 2 + ["full_attention",
                                                                                        "linear_attention"]
        on_ours = set(ours.state_dict())
        # HF's per-block decay tables are not kept (derived from slope_rate); everything else is
        assert on_ours == {k for k in hf.state_dict() if not k.endswith(DECAY_TABLES)}

    def check_variant(self, variant: str, ours) -> None:
        assert ours.model.layers[1].self_attn.state_shapes() == ((8, 8, 8),)


def test_layer_kinds_and_cache_specs():
    assert get_model_class(PRESETS[ARCH]()) is MiniMaxForCausalLM
    m = load_model(ARCH, dtype=torch.bfloat16, device="cpu").model
    lightning = m.model.layers[0].self_attn
    assert isinstance(lightning, LightningAttention) and lightning.slope_rate.dtype == torch.float32
    specs = m.kv_cache_specs()
    assert specs["model.layers.0.self_attn"] == MambaSpec(shapes=((4, 16, 16),), dtypes=(torch.float32,),
                                                         mamba_type="linear_attention", chunk_size=16)
    assert specs["model.layers.2.self_attn"] == AttentionSpec(num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    with LLM(ARCH, **F32, max_num_seqs=2, block_size=16) as llm:
        runner = llm.model_runner
        assert [(g.kind, type(a.builder).__name__) for g, a in zip(runner.kv_cache_groups, runner.attn_groups)] == [
            ("attention", "PagedAttentionMetadataBuilder"), ("mamba", "LinearAttentionMetadataBuilder")]


def test_slopes_are_hfs_and_vllms_for_a_power_of_two():
    """HF's slope for head h of layer l: (2^(-8/H))^(h+1) times the layer factor; vLLM's ALiBi-style
    slopes (2^(-8/H))^(h+1) equal them at the factor's 1 (layer 0) when H is a power of two."""
    hf = AutoModelForCausalLM.from_config(PRESETS[ARCH]())
    for i in (0, 1, 3):
        torch.testing.assert_close(lightning_slopes(4, i, 4), hf.model.layers[i].self_attn.slope_rate.flatten())
    torch.testing.assert_close(lightning_slopes(8, 0, 2), torch.tensor([2.0 ** (-(h + 1)) for h in range(8)]),
                               rtol=2e-5, atol=0)


@torch.no_grad()
def test_lightning_state_is_hfs_linear_cache_transposed():
    """Our layer's state after a prompt is HF's linear_cache [H, D_k, D_v] transposed ([H, D_v, D_k])."""
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(PRESETS[ARCH]()).eval()
    ids = torch.randint(3, 320, (1, 9))
    out = hf(ids, use_cache=True)
    hf_state = out.cache.linear_cache[0][0] if hasattr(out, "cache") else out.past_key_values.linear_cache[0][0]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        with LLM(d, **F32, inspect="full") as llm:
            from toolkit import SamplingParams
            llm.add_request({"prompt_token_ids": ids[0].tolist()}, SamplingParams(max_tokens=1))
            rec = llm.step()
            ours = rec.state("model.layers.0.self_attn").of(rec.request_ids[0], "after")["ssm_state"]
    torch.testing.assert_close(ours, hf_state.transpose(-1, -2), atol=1e-5, rtol=1e-5)


def test_checkpoint_layout_matches_save_pretrained(tmp_path):
    """On disk both ways: the MoE under block_sparse_moe with per-expert w1 / w3 / w2, the decay tables
    (rebuilt on save for block_size, equal to HF's)."""
    hf, ours, on_disk_hf, on_disk_ours = saved_both_ways(ARCH, tmp_path, hf_only=DECAY_TABLES)
    assert sorted(on_disk_ours) == sorted(on_disk_hf)
    assert on_disk_hf["model.layers.1.block_sparse_moe.experts.3.w3.weight"].shape == (32, 64)
    for name in ("query_decay", "key_decay", "diagonal_decay"):
        key = f"model.layers.3.self_attn.{name}"
        torch.testing.assert_close(on_disk_ours[key], on_disk_hf[key])
    tables = lightning_decay_tables(on_disk_hf["model.layers.0.self_attn.slope_rate"], 4)
    torch.testing.assert_close(tables["diagonal_decay"], on_disk_hf["model.layers.0.self_attn.diagonal_decay"])
    assert "model.layers.0.self_attn.slope_rate" in shapes(ours)
