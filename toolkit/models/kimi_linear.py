"""Kimi Linear (HF `KimiLinearForCausalLM`, moonshotai/Kimi-Linear-48B-A3B): Kimi Delta Attention
layers and multi-head latent attention layers, each followed by a dense SwiGLU MLP or a DeepSeek-V3
MoE.

Layer i's mixer (HF calls both `self_attn`) is KDA (toolkit/layers/kda.py) if config.layer_types[i] ==
"linear_attention", else MLA without RoPE (toolkit/layers/mla.py: the cache holds the latent). Layer
i's FFN is the MoE if config.mlp_layer_types[i] == "sparse" (from first_k_dense_replace: the first
layers dense), else a SwiGLU MLP of intermediate_size. Blocks are Llama pre-norm (RMSNorm, weight
applied after the cast back, as HF's `KimiLinearRMSNorm`).

MoE (HF `KimiLinearMoE`): DeepSeek-V3 routing (sigmoid scores, `e_score_correction_bias` for the
choice only, n_group groups of which topk_group are kept, weights renormalised if norm_topk_prob,
times routed_scaling_factor; NemotronH's router), fused SwiGLU experts, plus shared_experts (a SwiGLU
MLP of moe_intermediate_size * n_shared_experts), summed.

On disk (save_pretrained's layout, transformers' "kimi_linear" conversion mapping): every FFN under
`block_sparse_moe.` (not `mlp.`), experts per expert as w1 (gate), w3 (up), w2 (down); the KDA conv
as q/k/v_conv1d; the forget gate's f_a_proj, f_b_proj, dt_bias and A_log directly under self_attn.
"""
from __future__ import annotations

import re

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.kda import KimiDeltaAttention
from toolkit.layers.mla import LatentPagedAttention
from toolkit.layers.mlp import SwiGLUMLP
from toolkit.layers.moe import FusedExperts, ShardedExperts, merge_w123_expert_tensors, split_w123_expert_tensors
from toolkit.layers.norms import RMSNorm
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock
from toolkit.models.nemotron_h import NemotronHTopkRouter
from toolkit.models.qwen3_next import qwen3_next_layer_types

CONV_PARTS = ("q_conv1d", "k_conv1d", "v_conv1d")


class DeepseekMoE(ShardedExperts, nn.Module):
    """x [T, H] -> experts(DeepSeek-V3 routing) + shared_experts(x). Names: gate.weight,
    gate.e_score_correction_bias, experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I],
    shared_experts.{gate,up,down}_proj."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.moe_intermediate_size
        self.gate = NemotronHTopkRouter(h, config.num_local_experts, config.num_experts_per_tok, config.n_group,
                                        config.topk_group, bool(config.norm_topk_prob), config.routed_scaling_factor)
        self.experts = FusedExperts(h, i, config.num_local_experts, config.hidden_act)
        self.shared_experts = SwiGLUMLP(h, i * config.n_shared_experts, False, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.tp.all_reduce(self.experts(x, weights.to(x.dtype), ids)) + self.shared_experts(x)


def kimi_mixer(config: PretrainedConfig, layer_idx: int, kind: str) -> nn.Module:
    name = f"model.layers.{layer_idx}.self_attn"
    if kind == "linear_attention":
        return KimiDeltaAttention(layer_name=name, hidden_size=config.hidden_size, num_heads=config.linear_num_heads,
                                  head_dim=config.linear_head_dim, conv_kernel=config.linear_conv_kernel_dim,
                                  norm_eps=config.rms_norm_eps, activation=config.hidden_act)
    return LatentPagedAttention(layer_name=name, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                                q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                                qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                                v_head_dim=config.v_head_dim, bias=bool(config.attention_bias))


class KimiLinearForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "KimiLinearForCausalLM"
    hf_model_type = "kimi_linear"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        eps, h = config.rms_norm_eps, config.hidden_size
        blocks = []
        for i, kind in enumerate(qwen3_next_layer_types(config, "Kimi Linear")):
            ffn = (DeepseekMoE(config) if config.mlp_layer_types[i] == "sparse"
                   else SwiGLUMLP(h, config.intermediate_size, False, config.hidden_act))
            blocks.append(PreNormBlock(("input_layernorm", RMSNorm(h, eps=eps)),
                                       ("self_attn", kimi_mixer(config, i, kind)),
                                       ("post_attention_layernorm", RMSNorm(h, eps=eps)), ("mlp", ffn),
                                       layer_type=kind))
        return DecoderBody(("embed_tokens", nn.Embedding(config.vocab_size, h)), blocks, ("norm", RMSNorm(h, eps=eps)))

    @staticmethod
    def checkpoint_to_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loader hook: `block_sparse_moe.` -> `mlp.`; per-expert w1 / w3 / w2 -> fused gate_up_proj
        ([w1; w3] per expert, stacked) and down_proj; q/k/v convs concatenated; the forget gate's
        tensors moved under self_attn.forget_gate."""
        out: dict[str, torch.Tensor] = {}
        convs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in state.items():
            key = key.replace(".block_sparse_moe.", ".mlp.")
            m = re.fullmatch(r"(.*\.self_attn)\.(q_conv1d|k_conv1d|v_conv1d)\.weight", key)
            if m:
                convs.setdefault(m.group(1), {})[m.group(2)] = tensor
                continue
            m = re.fullmatch(r"(.*\.self_attn)\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)", key)
            if m:
                key = f"{m.group(1)}.forget_gate.{m.group(2)}"
            out[key] = tensor
        for prefix, parts in convs.items():
            if set(parts) == set(CONV_PARTS):
                out[f"{prefix}.conv1d.weight"] = torch.cat([parts[p] for p in CONV_PARTS], dim=0)
            else:                        # left under their names: the loader names what is missing
                out.update({f"{prefix}.{p}.weight": t for p, t in parts.items()})
        return merge_w123_expert_tensors(out)

    @staticmethod
    def state_dict_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """save_hf_folder hook: the layout save_pretrained writes (the inverse of the loader hook)."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in split_w123_expert_tensors(state).items():
            disk = key.replace(".mlp.", ".block_sparse_moe.")
            m = re.fullmatch(r"(.*\.self_attn)\.conv1d\.weight", disk)
            if m and f"{key.rsplit('.conv1d', 1)[0]}.q_proj.weight" in state:
                for part, piece in zip(CONV_PARTS, tensor.chunk(3, dim=0)):
                    out[f"{m.group(1)}.{part}.weight"] = piece.contiguous()
                continue
            out[disk.replace(".forget_gate.", ".")] = tensor
        return out
