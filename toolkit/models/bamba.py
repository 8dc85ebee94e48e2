"""Bamba (HF `BambaForCausalLM`): hybrid of Mamba2 mixers and GQA attention, SwiGLU FFN everywhere.

Layer i is attention if i in config.attn_layer_indices, else Mamba2. HF names:
model.embed_tokens, model.layers.{i}.input_layernorm, model.layers.{i}.mamba.* |
model.layers.{i}.self_attn.*, model.layers.{i}.pre_ff_layernorm, model.layers.{i}.feed_forward.*,
model.final_layernorm, lm_head. RoPE uses partial_rotary_factor (0.5 for Bamba).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.attention import PagedAttention
from toolkit.layers.mamba2_mixer import Mamba2Mixer
from toolkit.layers.mlp import SwiGLUMLP
from toolkit.layers.norms import RMSNorm
from toolkit.models.base import CausalLM
from toolkit.models.llama import attention_head_dim, build_rotary


def bamba_layer_types(config: PretrainedConfig) -> list[str]:
    attn = set(config.attn_layer_indices or [])
    return ["attention" if i in attn else "mamba" for i in range(config.num_hidden_layers)]


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.feed_forward = SwiGLUMLP(
            config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), config.hidden_act
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if layer_type == "mamba":
            self.mamba = Mamba2Mixer(
                layer_name=f"model.layers.{layer_idx}.mamba",
                hidden_size=config.hidden_size,
                num_heads=config.mamba_n_heads,
                head_dim=config.mamba_d_head,
                state_size=config.mamba_d_state,
                n_groups=config.mamba_n_groups,
                conv_kernel=config.mamba_d_conv,
                chunk_size=config.mamba_chunk_size,
                use_bias=config.mamba_proj_bias,
                use_conv_bias=config.mamba_conv_bias,
                norm_eps=config.rms_norm_eps,
                time_step_limit=config.time_step_limit,
                activation=config.hidden_act,
                intermediate_size=int(config.mamba_expand * config.hidden_size),
            )
        else:
            head_dim = attention_head_dim(config)
            self.self_attn = PagedAttention(
                layer_name=f"model.layers.{layer_idx}.self_attn",
                hidden_size=config.hidden_size,
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
                head_dim=head_dim,
                bias=bool(getattr(config, "attention_bias", False)),
                rotary=build_rotary(config, head_dim, use_partial=True),
            )

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.layer_type == "mamba":
            x = self.mamba(x, attn_metadata)
        else:
            x = self.self_attn(x, positions, attn_metadata)
        h = h + x
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class BambaModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            BambaDecoderLayer(config, i, t) for i, t in enumerate(bamba_layer_types(config))
        )
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class BambaForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "BambaForCausalLM"
    hf_model_type = "bamba"

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.model = BambaModel(config)
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
        return self.model.final_layernorm(h)
