"""Mamba2 (HF `Mamba2ForCausalLM`): attention-free stack of pre-norm Mamba2 mixer blocks.

HF names: backbone.embeddings, backbone.layers.{i}.norm, backbone.layers.{i}.mixer.*,
backbone.norm_f, lm_head. With `residual_in_fp32` (the default) the residual stream is kept in
fp32 between blocks, as HF does.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.mamba2_mixer import Mamba2Mixer
from toolkit.layers.norms import RMSNorm
from toolkit.models.base import CausalLM


class Mamba2Block(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", True))
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(
            layer_name=f"backbone.layers.{layer_idx}.mixer",
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            state_size=config.state_size,
            n_groups=config.n_groups,
            conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size,
            use_bias=config.use_bias,
            use_conv_bias=config.use_conv_bias,
            norm_eps=config.layer_norm_epsilon,
            time_step_limit=config.time_step_limit,
            activation=config.hidden_act,
            intermediate_size=int(config.expand * config.hidden_size),
        )

    def forward(self, h: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        residual = h.to(torch.float32) if self.residual_in_fp32 else h
        out = self.mixer(self.norm(h.to(self.norm.weight.dtype)), attn_metadata)
        return residual + out


class Mamba2Backbone(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(config, i) for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class Mamba2ForCausalLM(CausalLM):
    is_attention_free = True
    hf_architecture = "Mamba2ForCausalLM"
    hf_model_type = "mamba2"

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.backbone = Mamba2Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.backbone.embeddings

    @staticmethod
    def remap_checkpoint_key(name: str) -> str:
        """Older Mamba2 checkpoints call the embedding `backbone.embedding` (HF's load hook renames it)."""
        if name.startswith("backbone.embedding."):
            return "backbone.embeddings." + name[len("backbone.embedding."):]
        return name

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: dict[str, object] | None
    ) -> torch.Tensor:
        """positions are unused (no positional encoding); hidden is fp32 if residual_in_fp32."""
        h = self.backbone.embeddings(input_ids)
        for layer in self.backbone.layers:
            h = layer(h, attn_metadata)
        return self.backbone.norm_f(h)
