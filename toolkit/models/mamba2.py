"""Mamba2 (HF `Mamba2ForCausalLM`): attention-free stack of pre-norm Mamba2 mixer blocks.

HF names: backbone.embeddings, backbone.layers.{i}.norm, backbone.layers.{i}.mixer.*,
backbone.norm_f, lm_head. With `residual_in_fp32` (the default) the residual stream is kept in
fp32 between blocks, as HF does.
"""
from __future__ import annotations

from transformers import PretrainedConfig

from toolkit.layers.mamba2_mixer import Mamba2Mixer
from toolkit.models.base import CausalLM, DecoderBody
from toolkit.models.mamba import MambaForCausalLM, mamba_backbone


def mamba2_mixer(config: PretrainedConfig, layer_idx: int) -> Mamba2Mixer:
    return Mamba2Mixer(
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


class Mamba2ForCausalLM(CausalLM):
    is_attention_free = True
    hf_architecture = "Mamba2ForCausalLM"
    hf_model_type = "mamba2"
    body_name = "backbone"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        return mamba_backbone(config, lambda i: mamba2_mixer(config, i))

    remap_checkpoint_key = staticmethod(MambaForCausalLM.remap_checkpoint_key)
