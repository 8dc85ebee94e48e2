"""Bamba (HF `BambaForCausalLM`): hybrid of Mamba2 mixers and GQA attention, SwiGLU FFN everywhere.

Layer i is attention if i in config.attn_layer_indices, else Mamba2. HF names:
model.embed_tokens, model.layers.{i}.input_layernorm, model.layers.{i}.mamba.* |
model.layers.{i}.self_attn.*, model.layers.{i}.pre_ff_layernorm, model.layers.{i}.feed_forward.*,
model.final_layernorm, lm_head. RoPE uses partial_rotary_factor (0.5 for Bamba).
"""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.mamba2_mixer import Mamba2Mixer
from toolkit.layers.norms import RMSNorm
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock
from toolkit.models.llama import llama_attention, swiglu_mlp


def bamba_layer_types(config: PretrainedConfig) -> list[str]:
    attn = set(config.attn_layer_indices or [])
    return ["attention" if i in attn else "mamba" for i in range(config.num_hidden_layers)]


def bamba_mixer(config: PretrainedConfig, layer_idx: int) -> Mamba2Mixer:
    return Mamba2Mixer(
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


class BambaForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "BambaForCausalLM"
    hf_model_type = "bamba"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        eps = config.rms_norm_eps
        blocks = []
        for i, kind in enumerate(bamba_layer_types(config)):
            mixer = ("mamba", bamba_mixer(config, i)) if kind == "mamba" else \
                ("self_attn", llama_attention(config, i, use_partial_rope=True))
            blocks.append(PreNormBlock(("input_layernorm", RMSNorm(config.hidden_size, eps=eps)), mixer,
                                       ("pre_ff_layernorm", RMSNorm(config.hidden_size, eps=eps)),
                                       ("feed_forward", swiglu_mlp(config)), layer_type=kind))
        return DecoderBody(("embed_tokens", nn.Embedding(config.vocab_size, config.hidden_size)), blocks,
                           ("final_layernorm", RMSNorm(config.hidden_size, eps=eps)))
