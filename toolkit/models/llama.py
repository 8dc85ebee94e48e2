"""Llama (HF `LlamaForCausalLM`): GQA attention with RoPE, RMSNorm, SwiGLU MLP."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.attention import PagedAttention
from toolkit.layers.mlp import SwiGLUMLP
from toolkit.layers.norms import RMSNorm
from toolkit.layers.rotary import RotaryEmbedding
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock


def attention_head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def build_rotary(config: PretrainedConfig, head_dim: int, use_partial: bool) -> RotaryEmbedding:
    """RoPE from config.rope_parameters. HF Llama's default rope ignores partial_rotary_factor,
    Bamba's honours it (`use_partial`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", 1.0) or 1.0) if use_partial else 1.0
    return RotaryEmbedding(head_dim, theta, partial, rope_parameters=params, config=config)


def llama_attention(config: PretrainedConfig, layer_idx: int, use_partial_rope: bool = False) -> PagedAttention:
    """GQA attention with RoPE as in HF Llama (Bamba passes use_partial_rope=True)."""
    head_dim = attention_head_dim(config)
    return PagedAttention(
        layer_name=f"model.layers.{layer_idx}.self_attn",
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        bias=bool(getattr(config, "attention_bias", False)),
        rotary=build_rotary(config, head_dim, use_partial=use_partial_rope),
    )


def swiglu_mlp(config: PretrainedConfig) -> SwiGLUMLP:
    return SwiGLUMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                     config.hidden_act)


class LlamaForCausalLM(CausalLM):
    """HF names: model.embed_tokens, model.layers.{i}.{input_layernorm, self_attn.*,
    post_attention_layernorm, mlp.*}, model.norm, lm_head."""
    hf_architecture = "LlamaForCausalLM"
    hf_model_type = "llama"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        eps = config.rms_norm_eps
        blocks = [PreNormBlock(("input_layernorm", RMSNorm(config.hidden_size, eps=eps)),
                               ("self_attn", llama_attention(config, i)),
                               ("post_attention_layernorm", RMSNorm(config.hidden_size, eps=eps)),
                               ("mlp", swiglu_mlp(config)), layer_type="attention")
                  for i in range(config.num_hidden_layers)]
        return DecoderBody(("embed_tokens", nn.Embedding(config.vocab_size, config.hidden_size)), blocks,
                           ("norm", RMSNorm(config.hidden_size, eps=eps)))
