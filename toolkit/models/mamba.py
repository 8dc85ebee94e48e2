"""Mamba (HF `MambaForCausalLM`): attention-free stack of pre-norm Mamba1 (selective-scan) blocks.

HF names: backbone.embeddings, backbone.layers.{i}.norm, backbone.layers.{i}.mixer.*,
backbone.norm_f, lm_head. `tie_word_embeddings` defaults to True in MambaConfig (the
state-spaces checkpoints store no lm_head). With `residual_in_fp32` (the default) the residual
stream is kept in fp32 between blocks, as HF does.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.mamba1_mixer import Mamba1Mixer
from toolkit.layers.norms import RMSNorm
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock


def mamba1_mixer(config: PretrainedConfig, layer_idx: int, bcdt_norm: str | None) -> Mamba1Mixer:
    return Mamba1Mixer(
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


def mamba_backbone(config: PretrainedConfig, mixer_of_layer: Callable[[int], nn.Module]) -> DecoderBody:
    """HF Mamba / Mamba2 layout: backbone.embeddings -> blocks (norm, mixer; residual in fp32 by
    default) -> backbone.norm_f."""
    eps = config.layer_norm_epsilon
    fp32_residual = bool(getattr(config, "residual_in_fp32", True))
    blocks = [PreNormBlock(("norm", RMSNorm(config.hidden_size, eps=eps)), ("mixer", mixer_of_layer(i)),
                           layer_type="mamba", residual_in_fp32=fp32_residual)
              for i in range(config.num_hidden_layers)]
    return DecoderBody(("embeddings", nn.Embedding(config.vocab_size, config.hidden_size)), blocks,
                       ("norm_f", RMSNorm(config.hidden_size, eps=eps)))


class MambaForCausalLM(CausalLM):
    is_attention_free = True
    hf_architecture = "MambaForCausalLM"
    hf_model_type = "mamba"
    body_name = "backbone"
    # norm on the mixer's dt / B / C (see Mamba1Mixer): None for Mamba
    bcdt_norm: ClassVar[str | None] = None

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        return mamba_backbone(config, lambda i: mamba1_mixer(config, i, self.bcdt_norm))

    @staticmethod
    def remap_checkpoint_key(name: str) -> str:
        """Original state-spaces (and older Mamba2) checkpoints call the embedding
        `backbone.embedding` (HF's load hook renames it)."""
        if name.startswith("backbone.embedding."):
            return "backbone.embeddings." + name[len("backbone.embedding."):]
        return name
