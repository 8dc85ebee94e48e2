"""Qwen3-Next (HF `Qwen3NextForCausalLM`): hybrid of Gated DeltaNet linear attention and gated
full attention, each followed by a sparse MoE with a gated shared expert (or a dense SwiGLU MLP).

Layer i is GDN if config.layer_types[i] == "linear_attention", full attention if
"full_attention" (`Qwen3NextConfig` derives layer_types from full_attention_interval, default
every 4th layer). Layer i's FFN is the MoE unless i is in config.mlp_only_layers or
(i + 1) % decoder_sparse_step != 0 (or num_experts == 0): then a dense SwiGLU MLP of
intermediate_size.

What differs from Llama-style blocks:
- every RMSNorm (input/post-attention, final, q_norm/k_norm) scales by (1 + weight), weight
  zero-centred (`Qwen3NextRMSNorm`); the GDN output norm is a plain-weight norm-before-gate
  (toolkit/layers/gdn.py);
- full attention: q_proj yields [q | gate] per head (2 * head_dim), q/k get a per-head (1 + w)
  RMSNorm before a partial RoPE (partial_rotary_factor, 0.25 by default), and the attention
  output is multiplied by sigmoid(gate) before o_proj;
- MoE: softmax router (`gate.weight`), top-k, renormalised when norm_topk_prob, fused experts, plus
  sigmoid(shared_expert_gate(x)) * shared_expert(x).

HF names: model.embed_tokens, model.layers.{i}.input_layernorm, model.layers.{i}.linear_attn.* |
model.layers.{i}.self_attn.{q,k,v,o}_proj + q_norm/k_norm, model.layers.{i}.post_attention_layernorm,
model.layers.{i}.mlp.{gate.weight, experts.gate_up_proj, experts.down_proj, shared_expert.*,
shared_expert_gate.weight} | mlp.{gate,up,down}_proj, model.norm, lm_head. On disk the experts are
per-expert tensors (save_pretrained's layout), converted by the two hooks below; a released
checkpoint's multi-token-prediction weights (`mtp.*`, which HF ignores too) are dropped.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.errors import UnsupportedArchitectureError
from toolkit.layers.attention import PagedAttention
from toolkit.layers.gdn import GatedDeltaNet
from toolkit.layers.mlp import SwiGLUMLP
from toolkit.layers.moe import (
    FusedExperts,
    ShardedExperts,
    TopKRouter,
    merge_expert_checkpoint_tensors,
    split_expert_state_tensors,
    topk_routing,
)
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock
from toolkit.models.llama import attention_head_dim, build_rotary

LAYER_TYPES = ("linear_attention", "full_attention")


def qwen3_next_layer_types(config: PretrainedConfig, family: str = "Qwen3-Next") -> list[str]:
    """config.layer_types checked: one per layer, each "linear_attention" or "full_attention" (the
    delta-rule hybrids' vocabulary: Qwen3-Next, Qwen3.5, OLMo Hybrid, Kimi Linear)."""
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad:
        raise UnsupportedArchitectureError(
            f"{family} layer types {bad} are not supported; supported: {list(LAYER_TYPES)}")
    return types


def qwen3_next_is_moe(config: PretrainedConfig, layer_idx: int) -> bool:
    """HF `Qwen3NextDecoderLayer`: MoE unless listed in mlp_only_layers or off the sparse step."""
    return (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class OffsetRMSNorm(nn.Module):
    """HF `Qwen3NextRMSNorm`: rmsnorm(x) * (1 + weight) in fp32, cast to x.dtype; weight [D] is
    zero-centred (zeros at init). Deliberately not an `RMSNorm` subclass: `init_random_weights`
    then draws its weight N(0, initializer_range), i.e. a scale of 1 + N(0, 0.1)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.to(torch.float32))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedPagedAttention(PagedAttention):
    """HF `Qwen3NextAttention` over the paged KV cache: q_proj [H * 2D, hidden] yields per head
    [q (D) | gate (D)]; q_norm / k_norm are per-head (1 + w) RMSNorms applied before RoPE;
    out = o_proj(attention(q, k, v) * sigmoid(gate))."""

    def __init__(self, *, layer_name: str, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, rotary, eps: float) -> None:
        super().__init__(layer_name=layer_name, hidden_size=hidden_size, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, bias=bias, rotary=rotary)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=bias)
        self.q_rows_per_head = 2 * head_dim       # tensor parallelism: a head's rows are [q | gate]
        self.q_norm = OffsetRMSNorm(head_dim, eps=eps)
        self.k_norm = OffsetRMSNorm(head_dim, eps=eps)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """hidden [T, hidden_size], positions [T] -> [T, hidden_size] (profile run and padding:
        as `PagedAttention.forward`)."""
        t = hidden.shape[0]
        q, gate = torch.chunk(self.q_proj(hidden).view(t, self.num_heads, 2 * self.head_dim), 2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = self.attend(q, k, v, attn_metadata)
        out = out.reshape(t, self.num_heads * self.head_dim) * torch.sigmoid(gate.reshape(t, -1))
        return self.tp.all_reduce(self.output_proj(out))


class SharedExpertMoeBlock(ShardedExperts, nn.Module):
    """HF `Qwen3NextSparseMoeBlock`: x [T, H] -> experts(top-k softmax routing) +
    sigmoid(shared_expert_gate(x)) * shared_expert(x). Names: gate.weight [E, H],
    experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I], shared_expert.{gate,up,down}_proj,
    shared_expert_gate.weight [1, H]."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, shared_intermediate_size: int,
                 num_experts: int, top_k: int, renormalize: bool, hidden_act: str = "silu") -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = TopKRouter(hidden_size, num_experts)
        self.experts = FusedExperts(hidden_size, moe_intermediate_size, num_experts, hidden_act)
        self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size, False, hidden_act)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        weights, ids = topk_routing(self.gate(x), self.top_k, self.renormalize)
        return self.tp.all_reduce(self.experts(x, weights.to(x.dtype), ids)) + shared


def qwen3_next_mixer(config: PretrainedConfig, layer_idx: int, layer_type: str,
                     gdn_class: type[GatedDeltaNet] = GatedDeltaNet) -> tuple[str, nn.Module]:
    """Layer i's mixer: a Gated DeltaNet (`gdn_class`: Qwen3.5 passes its split-projection one) or the
    gated attention with partial RoPE."""
    if layer_type == "linear_attention":
        return "linear_attn", gdn_class(
            layer_name=f"model.layers.{layer_idx}.linear_attn",
            hidden_size=config.hidden_size,
            num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads,
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            norm_eps=config.rms_norm_eps,
            activation=config.hidden_act,
        )
    head_dim = attention_head_dim(config)
    return "self_attn", GatedPagedAttention(
        layer_name=f"model.layers.{layer_idx}.self_attn",
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        bias=bool(getattr(config, "attention_bias", False)),
        rotary=build_rotary(config, head_dim, use_partial=True),
        eps=config.rms_norm_eps,
    )


def qwen3_next_ffn(config: PretrainedConfig, layer_idx: int) -> nn.Module:
    if qwen3_next_is_moe(config, layer_idx):
        return SharedExpertMoeBlock(config.hidden_size, config.moe_intermediate_size,
                                    config.shared_expert_intermediate_size, config.num_experts,
                                    config.num_experts_per_tok, bool(config.norm_topk_prob), config.hidden_act)
    return SwiGLUMLP(config.hidden_size, config.intermediate_size, False, config.hidden_act)


class Qwen3NextForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "Qwen3NextForCausalLM"
    hf_model_type = "qwen3_next"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        eps = config.rms_norm_eps
        blocks = [PreNormBlock(("input_layernorm", OffsetRMSNorm(config.hidden_size, eps=eps)),
                               qwen3_next_mixer(config, i, kind),
                               ("post_attention_layernorm", OffsetRMSNorm(config.hidden_size, eps=eps)),
                               ("mlp", qwen3_next_ffn(config, i)), layer_type=kind)
                  for i, kind in enumerate(qwen3_next_layer_types(config))]
        return DecoderBody(("embed_tokens", nn.Embedding(config.vocab_size, config.hidden_size)), blocks,
                           ("norm", OffsetRMSNorm(config.hidden_size, eps=eps)))

    @staticmethod
    def checkpoint_to_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loader hook: drop `mtp.*` (multi-token-prediction weights, unused, as in HF), then
        per-expert checkpoint tensors -> fused experts (HF's qwen2_moe WeightConverter)."""
        return merge_expert_checkpoint_tensors({k: v for k, v in state.items() if not k.startswith("mtp.")})

    @staticmethod
    def state_dict_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """save_hf_folder hook: fused experts -> per-expert tensors, the layout save_pretrained writes."""
        return split_expert_state_tensors(state)
