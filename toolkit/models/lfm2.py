"""LFM2 (HF `Lfm2ForCausalLM`): hybrid of gated short convolutions and GQA attention, SwiGLU FFN.

Layer i is a short conv if config.layer_types[i] == "conv", attention if "full_attention"
(`Lfm2Config` derives layer_types from `full_attn_idxs` when only that is given). Each layer:
    h = h + op(operator_norm(h));  h = h + feed_forward(ffn_norm(h))
Attention applies a per-head RMSNorm to q and k (q_layernorm / k_layernorm) before RoPE, and its
output projection is `out_proj`. HF names: model.embed_tokens, model.layers.{i}.operator_norm,
model.layers.{i}.conv.{in_proj,conv,out_proj} | model.layers.{i}.self_attn.{q,k,v,out}_proj +
q_layernorm/k_layernorm, model.layers.{i}.ffn_norm, model.layers.{i}.feed_forward.{w1,w3,w2},
model.embedding_norm (the final norm), lm_head (tied to embed_tokens by default).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.errors import UnsupportedArchitectureError
from toolkit.layers.attention import PagedAttention
from toolkit.layers.norms import RMSNorm
from toolkit.layers.ops import TORCH_OPS
from toolkit.layers.parallel import ShardedGatedMLP
from toolkit.layers.short_conv import ShortConv
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock
from toolkit.models.llama import attention_head_dim, build_rotary

LAYER_TYPES = ("conv", "full_attention")


def lfm2_layer_types(config: PretrainedConfig) -> list[str]:
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise UnsupportedArchitectureError(f"LFM2 layer types {bad} are not supported; supported: {list(LAYER_TYPES)}")
    return types


def lfm2_ffn_dim(config: PretrainedConfig) -> int:
    """The FFN width HF actually builds (`Lfm2MLP`): with block_auto_adjust_ff_dim, 2/3 of
    intermediate_size, times block_ffn_dim_multiplier (if not None) rounded up to a multiple of
    block_multiple_of. E.g. LFM2-350M: intermediate_size 6656 -> 4437 -> 4608."""
    dim = int(config.intermediate_size)
    if getattr(config, "block_auto_adjust_ff_dim", False):
        dim = int(2 * dim / 3)
        mult = getattr(config, "block_ffn_dim_multiplier", None)
        if mult is not None:
            dim = int(mult * dim)
            m = int(config.block_multiple_of)
            dim = m * ((dim + m - 1) // m)
    return dim


class Lfm2MLP(ShardedGatedMLP, nn.Module):
    """x [T, D] -> w2(silu(w1(x)) * w3(x)); HF names w1 (gate), w3 (up), w2 (down), no biases."""

    def __init__(self, hidden_size: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_dim, bias=False)
        self.w3 = nn.Linear(hidden_size, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, hidden_size, bias=False)
        self.ops = TORCH_OPS                    # set_ops() swaps in the Triton kernel

    tp_projections = ("w1", "w3", "w2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.w2(self.ops.silu_and_mul(self.w1(x), self.w3(x))))


def lfm2_mixer(config: PretrainedConfig, layer_idx: int, layer_type: str) -> tuple[str, nn.Module]:
    if layer_type == "conv":
        return "conv", ShortConv(
            layer_name=f"model.layers.{layer_idx}.conv",
            hidden_size=config.hidden_size,
            conv_kernel=config.conv_L_cache,
            bias=bool(config.conv_bias),
        )
    head_dim = attention_head_dim(config)
    return "self_attn", PagedAttention(
        layer_name=f"model.layers.{layer_idx}.self_attn",
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        bias=False,
        rotary=build_rotary(config, head_dim, use_partial=False),
        qk_norm_eps=config.norm_eps,
        qk_norm_names=("q_layernorm", "k_layernorm"),
        o_proj_name="out_proj",
    )


class Lfm2ForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "Lfm2ForCausalLM"
    hf_model_type = "lfm2"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        eps = config.norm_eps
        blocks = [PreNormBlock(("operator_norm", RMSNorm(config.hidden_size, eps=eps)),
                               lfm2_mixer(config, i, kind),
                               ("ffn_norm", RMSNorm(config.hidden_size, eps=eps)),
                               ("feed_forward", Lfm2MLP(config.hidden_size, lfm2_ffn_dim(config))),
                               layer_type=kind)
                  for i, kind in enumerate(lfm2_layer_types(config))]
        return DecoderBody(("embed_tokens", nn.Embedding(config.vocab_size, config.hidden_size)), blocks,
                           ("embedding_norm", RMSNorm(config.hidden_size, eps=eps)))
