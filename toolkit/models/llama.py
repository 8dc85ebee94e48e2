"""Llama (HF `LlamaForCausalLM`): GQA attention with RoPE, RMSNorm, SwiGLU MLP."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.attention import PagedAttention
from toolkit.layers.mlp import SwiGLUMLP
from toolkit.layers.norms import RMSNorm
from toolkit.layers.rotary import RotaryEmbedding
from toolkit.models.base import CausalLM


def attention_head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def build_rotary(config: PretrainedConfig, head_dim: int, use_partial: bool) -> RotaryEmbedding:
    """RoPE from config.rope_parameters. HF Llama's default rope ignores partial_rotary_factor,
    Bamba's honours it (`use_partial`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", 1.0) or 1.0) if use_partial else 1.0
    return RotaryEmbedding(head_dim, theta, partial, rope_parameters=params, config=config)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        head_dim = attention_head_dim(config)
        self.self_attn = PagedAttention(
            layer_name=f"model.layers.{layer_idx}.self_attn",
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            bias=bool(getattr(config, "attention_bias", False)),
            rotary=build_rotary(config, head_dim, use_partial=False),
        )
        self.mlp = SwiGLUMLP(
            config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), config.hidden_act
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, attn_metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    hf_architecture = "LlamaForCausalLM"
    hf_model_type = "llama"

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: dict[str, object] | None
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, positions, attn_metadata)
        return self.model.norm(h)
