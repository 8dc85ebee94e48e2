"""Jamba (HF `JambaForCausalLM`): hybrid of Mamba1 mixers (with weighted dt/B/C RMS norms) and
GQA attention WITHOUT positional encoding (no RoPE), each followed by a dense SwiGLU MLP or a
sparse top-k MoE.

Layer i is attention iff i % attn_layer_period == attn_layer_offset (config.layers_block_type),
and MoE iff i % expert_layer_period == expert_layer_offset (config.layers_num_experts).
HF names: model.embed_tokens, model.layers.{i}.input_layernorm, model.layers.{i}.mamba.* |
model.layers.{i}.self_attn.*, model.layers.{i}.pre_ff_layernorm, model.layers.{i}.feed_forward.*
(gate_proj/up_proj/down_proj, or router.weight + experts.gate_up_proj / experts.down_proj),
model.final_layernorm, lm_head. The MoE experts are fused 3D tensors, as in transformers 5.x's
state_dict(); checkpoints on disk hold them per expert (experts.{e}.gate_proj.weight, ...), and
the loader / save_hf_folder convert through the two hooks below.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.attention import PagedAttention
from toolkit.layers.mamba1_mixer import Mamba1Mixer
from toolkit.layers.mlp import SwiGLUMLP
from toolkit.layers.moe import SparseMoeBlock, merge_expert_checkpoint_tensors, split_expert_state_tensors
from toolkit.layers.norms import RMSNorm
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock
from toolkit.models.llama import attention_head_dim


def jamba_layer_types(config: PretrainedConfig) -> list[str]:
    """Per layer "attention" or "mamba" (HF JambaConfig.layers_block_type)."""
    return list(config.layers_block_type)


def jamba_layer_num_experts(config: PretrainedConfig) -> list[int]:
    """Experts per layer; 1 = dense MLP (HF JambaConfig.layers_num_experts)."""
    return list(config.layers_num_experts)


def jamba_mixer(config: PretrainedConfig, layer_idx: int, layer_type: str) -> tuple[str, nn.Module]:
    if layer_type == "mamba":
        return "mamba", Mamba1Mixer(
            layer_name=f"model.layers.{layer_idx}.mamba",
            hidden_size=config.hidden_size,
            intermediate_size=int(config.mamba_expand * config.hidden_size),
            state_size=config.mamba_d_state,
            conv_kernel=config.mamba_d_conv,
            time_step_rank=int(config.mamba_dt_rank),
            use_bias=config.mamba_proj_bias,
            use_conv_bias=config.mamba_conv_bias,
            activation=config.hidden_act,
            bcdt_norm="weighted",
            bcdt_norm_eps=config.rms_norm_eps,
        )
    if layer_type == "attention":
        return "self_attn", PagedAttention(
            layer_name=f"model.layers.{layer_idx}.self_attn",
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=attention_head_dim(config),
            bias=False,
            rotary=None,
        )
    raise ValueError(f"unknown Jamba layer type {layer_type!r}")


def jamba_ffn(config: PretrainedConfig, num_experts: int) -> nn.Module:
    if num_experts > 1:
        return SparseMoeBlock(config.hidden_size, config.intermediate_size, num_experts,
                              config.num_experts_per_tok, config.hidden_act, renormalize=False)
    return SwiGLUMLP(config.hidden_size, config.intermediate_size, False, config.hidden_act)


class JambaForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "JambaForCausalLM"
    hf_model_type = "jamba"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        eps = config.rms_norm_eps
        blocks = [PreNormBlock(("input_layernorm", RMSNorm(config.hidden_size, eps=eps)),
                               jamba_mixer(config, i, kind),
                               ("pre_ff_layernorm", RMSNorm(config.hidden_size, eps=eps)),
                               ("feed_forward", jamba_ffn(config, experts)), layer_type=kind)
                  for i, (kind, experts) in enumerate(zip(jamba_layer_types(config),
                                                          jamba_layer_num_experts(config)))]
        return DecoderBody(("embed_tokens", nn.Embedding(config.vocab_size, config.hidden_size)), blocks,
                           ("final_layernorm", RMSNorm(config.hidden_size, eps=eps)))

    @staticmethod
    def checkpoint_to_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loader hook: per-expert checkpoint tensors -> fused experts (HF's WeightConverter for jamba)."""
        return merge_expert_checkpoint_tensors(state)

    @staticmethod
    def state_dict_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """save_hf_folder hook: fused experts -> per-expert tensors, the layout save_pretrained writes."""
        return split_expert_state_tensors(state)
