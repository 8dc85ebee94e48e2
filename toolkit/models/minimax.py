"""MiniMax-Text-01 / MiniMax-M1 (HF `MiniMaxForCausalLM`): lightning attention layers
(toolkit/layers/lightning.py) and softmax attention layers in `config.layer_types`, each followed by a
Mixtral-style MoE (softmax top-k, renormalised).

The decoder layer feeds the *normed* input forward as the residual, with per-kind scales:
    x = norm1(h);  h = x * alpha_attn + attn(x) * beta_attn
    x = norm2(h);  h = x * mlp_alpha + moe(x) * mlp_beta
(alpha / beta: `linear_attn_*_factor` on lightning layers, `full_attn_*_factor` on softmax layers,
`mlp_*_factor`). Softmax attention: GQA with RoPE over the whole head (HF ignores a partial rotary
factor here), q/k/v/o_proj. Layer indices and the layer count set each lightning layer's decays.

On disk (save_pretrained's layout, transformers' "minimax" -> "mixtral" conversion): the MoE under
`block_sparse_moe.` (gate.weight, experts.{e}.w1 / w3 / w2), and in every lightning layer the decay
tables HF keeps as buffers (query_decay, key_decay, diagonal_decay: functions of slope_rate and
HF's prefill `block_size`), which are dropped on load (named once in a log line) and rebuilt on save.
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.errors import NotSupportedYetError, UnsupportedArchitectureError
from toolkit.layers.attention import PagedAttention
from toolkit.layers.lightning import LightningAttention
from toolkit.layers.moe import (
    FusedExperts,
    ShardedExperts,
    TopKRouter,
    merge_w123_expert_tensors,
    split_w123_expert_tensors,
    topk_routing,
)
from toolkit.layers.norms import RMSNorm
from toolkit.models.base import CausalLM, DecoderBody
from toolkit.models.llama import build_rotary

log = logging.getLogger(__name__)

LAYER_TYPES = ("linear_attention", "full_attention")
DECAY_TABLES = ("query_decay", "key_decay", "diagonal_decay")


class MiniMaxMoE(ShardedExperts, nn.Module):
    """x [T, H] -> [T, H]: softmax over the router's logits (fp32), top-k, renormalised; fused SwiGLU
    experts. Names: gate.weight [E, H], experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        e, k = config.num_local_experts, config.num_experts_per_tok
        if not 1 <= k <= e:
            raise ValueError(f"num_experts_per_tok {k} must be in [1, num_local_experts={e}]")
        self.top_k = k
        self.gate = TopKRouter(config.hidden_size, e)
        self.experts = FusedExperts(config.hidden_size, config.intermediate_size, e, config.hidden_act)

    experts_size_name = "the experts' intermediate_size"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_routing(self.gate(x), self.top_k, renormalize=True)
        return self.tp.all_reduce(self.experts(x, weights.to(x.dtype), ids))


class ScaledResidualBlock(nn.Module):
    """MiniMax's layer (see the module doc); names input_layernorm, self_attn, post_attention_layernorm, mlp."""

    def __init__(self, mixer: nn.Module, moe: nn.Module, hidden_size: int, eps: float, layer_type: str,
                 attn_scales: tuple[float, float], mlp_scales: tuple[float, float]) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(hidden_size, eps=eps)
        self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=eps)
        self.mlp = moe
        self.attn_scales, self.mlp_scales = attn_scales, mlp_scales
        self._takes_positions = isinstance(mixer, PagedAttention)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        x = self.input_layernorm(h)
        out = self.self_attn(x, positions, attn_metadata) if self._takes_positions else self.self_attn(x, attn_metadata)
        h = x * self.attn_scales[0] + out * self.attn_scales[1]
        x = self.post_attention_layernorm(h)
        return x * self.mlp_scales[0] + self.mlp(x) * self.mlp_scales[1]


def minimax_layer_types(config: PretrainedConfig) -> list[str]:
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise UnsupportedArchitectureError(f"MiniMax layer types {bad} are not supported; supported: "
                                           f"{list(LAYER_TYPES)}")
    return types


def lightning_decay_tables(slope_rate: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """HF `MiniMaxLightningAttention.decay_factors`: the per-block tables of its blockwise prefill,
    from slope_rate [H, 1, 1] (what save_pretrained writes beside it)."""
    s = slope_rate.to(torch.float32)
    r = torch.arange(block_size, dtype=torch.float32) + 1
    diag = s * (r[:, None] - r[None, :])[None, None]
    return {"query_decay": torch.exp(-s * r[:, None]),
            "key_decay": torch.exp(-s * (block_size - r[:, None])),
            "diagonal_decay": torch.exp(torch.where(diag >= 0, -diag, float("-inf")))}


class MiniMaxForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "MiniMaxForCausalLM"
    hf_model_type = "minimax"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        if getattr(config, "sliding_window", None) is not None:
            raise NotSupportedYetError(f"MiniMax with sliding_window={config.sliding_window}: the paged attention "
                                       "here has no window yet (the released MiniMax-Text-01 / M1 have none)")
        eps, h = config.rms_norm_eps, config.hidden_size
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        types = minimax_layer_types(config)
        blocks = []
        for i, kind in enumerate(types):
            name = f"model.layers.{i}.self_attn"
            if kind == "linear_attention":
                mixer = LightningAttention(layer_name=name, hidden_size=h, num_heads=config.num_attention_heads,
                                           head_dim=head_dim, layer_idx=i, num_layers=len(types),
                                           activation=config.hidden_act)
                scales = (config.linear_attn_alpha_factor, config.linear_attn_beta_factor)
            else:
                mixer = PagedAttention(layer_name=name, hidden_size=h, num_heads=config.num_attention_heads,
                                       num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
                                       head_dim=head_dim, bias=False,
                                       rotary=build_rotary(config, head_dim, use_partial=False))
                scales = (config.full_attn_alpha_factor, config.full_attn_beta_factor)
            blocks.append(ScaledResidualBlock(mixer, MiniMaxMoE(config), h, eps, kind, scales,
                                              (config.mlp_alpha_factor, config.mlp_beta_factor)))
        return DecoderBody(("embed_tokens", nn.Embedding(config.vocab_size, h)), blocks, ("norm", RMSNorm(h, eps=eps)))

    @staticmethod
    def checkpoint_to_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loader hook: `block_sparse_moe.` -> `mlp.`, per-expert w1 / w3 / w2 merged; the lightning
        layers' decay tables dropped (slope_rate, which they derive from, is kept)."""
        out, dropped = {}, 0
        for key, tensor in state.items():
            if re.fullmatch(rf".*\.self_attn\.({'|'.join(DECAY_TABLES)})", key):
                dropped += 1
                continue
            out[key.replace(".block_sparse_moe.", ".mlp.")] = tensor
        if dropped:
            log.info("MiniMax: %d decay tables (%s) skipped: recomputed from slope_rate, not kept", dropped,
                     ", ".join(DECAY_TABLES))
        return merge_w123_expert_tensors(out)

    @staticmethod
    def state_dict_to_checkpoint(state: dict[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
        """save_hf_folder hook: save_pretrained's layout (the loader hook's inverse, the decay tables
        rebuilt for config.block_size)."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in split_w123_expert_tensors(state).items():
            key = key.replace(".mlp.", ".block_sparse_moe.")
            out[key] = tensor
            if key.endswith(".self_attn.slope_rate"):
                prefix = key[: -len("slope_rate")]
                out.update({prefix + n: t for n, t in lightning_decay_tables(tensor, config.block_size).items()})
        return out
