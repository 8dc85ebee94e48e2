"""LFM2-MoE (HF `Lfm2MoeForCausalLM`, LiquidAI/LFM2-8B-A1B): LFM2's gated short convs and GQA
attention (toolkit/models/lfm2.py, the same modules and names), with a sparse MoE FFN after the first
`num_dense_layers` layers.

Layer i's FFN (`feed_forward`) is a SwiGLU MLP of intermediate_size (w1 gate, w3 up, w2 down; no
auto-adjusted width, unlike LFM2) if i < num_dense_layers, else `Lfm2MoeSparseBlock`:
    scores = sigmoid(x @ gate.weight^T)              [T, E] (in the model's dtype, as HF)
    ids    = top-k of scores + expert_bias           (the bias picks experts, it never weights them)
    w      = scores[ids], / (sum + 1e-6) if norm_topk_prob, * routed_scaling_factor
    out    = sum_k w_k * expert_{ids_k}(x)           (fused SwiGLU experts, toolkit/layers/moe.py)
`expert_bias` is a float32 buffer in the checkpoint (use_expert_bias; HF initialises it to zeros).

On disk (save_pretrained's layout, transformers' "lfm2_moe" conversion mapping): experts per expert,
`feed_forward.experts.{e}.w1 / w3 / w2 .weight`, merged on load.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.moe import FusedExperts, ShardedExperts, merge_w123_expert_tensors, split_w123_expert_tensors
from toolkit.layers.norms import RMSNorm
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock
from toolkit.models.lfm2 import Lfm2MLP, lfm2_layer_types, lfm2_mixer


def sigmoid_biased_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in logits' dtype, ids [T, k]): LFM2-MoE's router (see the module doc)."""
    scores = logits.sigmoid()
    if bias is None:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        ids = torch.topk(scores + bias, top_k, dim=-1).indices
        weights = torch.gather(scores, 1, ids).type_as(logits)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return weights * scale, ids


class Lfm2MoeSparseBlock(ShardedExperts, nn.Module):
    """x [T, H] -> [T, H]. Names: gate.weight [E, H], expert_bias [E] (fp32 buffer),
    experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h, e, k = config.hidden_size, config.num_experts, config.num_experts_per_tok
        if not 1 <= k <= e:
            raise ValueError(f"num_experts_per_tok {k} must be in [1, num_experts={e}]")
        self.top_k = k
        self.renormalize = bool(config.norm_topk_prob)
        self.scale = float(config.routed_scaling_factor)
        self.gate = nn.Linear(h, e, bias=False)
        if config.use_expert_bias:       # float32 whatever the model's dtype, as HF (CausalLM.keep_fp32_)
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
            self.fp32_tensors = ("expert_bias",)
        else:
            self.expert_bias = None
        self.experts = FusedExperts(h, config.moe_intermediate_size, e, "silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = sigmoid_biased_topk(F.linear(x, self.gate.weight), self.expert_bias, self.top_k,
                                           self.renormalize, self.scale)
        return self.tp.all_reduce(self.experts(x, weights.to(x.dtype), ids))


class Lfm2MoeForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "Lfm2MoeForCausalLM"
    hf_model_type = "lfm2_moe"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        if getattr(config, "layer_types", None) is None:
            raise ValueError("an LFM2-MoE config needs layer_types (Lfm2MoeConfig has no default pattern)")
        eps, h = config.norm_eps, config.hidden_size
        blocks = [PreNormBlock(("operator_norm", RMSNorm(h, eps=eps)),
                               lfm2_mixer(config, i, kind),
                               ("ffn_norm", RMSNorm(h, eps=eps)),
                               ("feed_forward", Lfm2MLP(h, config.intermediate_size) if i < config.num_dense_layers
                                else Lfm2MoeSparseBlock(config)),
                               layer_type=kind)
                  for i, kind in enumerate(lfm2_layer_types(config))]
        return DecoderBody(("embed_tokens", nn.Embedding(config.vocab_size, h)), blocks,
                           ("embedding_norm", RMSNorm(h, eps=eps)))

    @staticmethod
    def checkpoint_to_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loader hook: per-expert w1 / w3 / w2 -> fused gate_up_proj and down_proj."""
        return merge_w123_expert_tensors(state)

    @staticmethod
    def state_dict_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """save_hf_folder hook: the layout save_pretrained writes (the inverse of the loader hook)."""
        return split_w123_expert_tensors(state)
