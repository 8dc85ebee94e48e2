"""Mamba (HF `MambaForCausalLM`): attention-free stack of pre-norm Mamba1 (selective-scan) blocks.

HF names: backbone.embeddings, backbone.layers.{i}.norm, backbone.layers.{i}.mixer.*,
backbone.norm_f, lm_head. `tie_word_embeddings` defaults to True in MambaConfig (the
state-spaces checkpoints store no lm_head). With `residual_in_fp32` (the default) the residual
stream is kept in fp32 between blocks, as HF does.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.mamba1_mixer import Mamba1Mixer
from toolkit.layers.norms import RMSNorm
from toolkit.models.base import CausalLM


class MambaBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, bcdt_norm: str | None) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", True))
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = Mamba1Mixer(
            layer_name=f"backbone.layers.{layer_idx}.mixer",
            hidden_size=config.hidden_size,
            intermediate_size=int(config.intermediate_size),
            state_size=config.state_size,
            conv_kernel=config.conv_kernel,
            time_step_rank=int(config.time_step_rank),
            use_bias=config.use_bias,
            use_conv_bias=config.use_conv_bias,
            activation=config.hidden_act,
            bcdt_norm=bcdt_norm,
            bcdt_norm_eps=float(getattr(config, "mixer_rms_eps", 1e-6)),
        )

    def forward(self, h: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        residual = h.to(torch.float32) if self.residual_in_fp32 else h
        out = self.mixer(self.norm(h.to(self.norm.weight.dtype)), attn_metadata)
        return residual + out


class MambaBackbone(nn.Module):
    def __init__(self, config: PretrainedConfig, bcdt_norm: str | None) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(config, i, bcdt_norm) for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class MambaForCausalLM(CausalLM):
    is_attention_free = True
    hf_architecture = "MambaForCausalLM"
    hf_model_type = "mamba"
    # norm on the mixer's dt / B / C (see Mamba1Mixer): None for Mamba
    bcdt_norm: ClassVar[str | None] = None

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.backbone = MambaBackbone(config, self.bcdt_norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.backbone.embeddings

    @staticmethod
    def remap_checkpoint_key(name: str) -> str:
        """Original state-spaces checkpoints call the embedding `backbone.embedding` (HF's load hook renames it)."""
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
