"""Granite 4.0 hybrid (HF `GraniteMoeHybridForCausalLM`): Mamba2 mixers (HF's Bamba mixer) and GQA
attention, each followed by a top-k softmax MoE plus an always-on shared SwiGLU expert, with
Granite's multipliers.

Layer i is Mamba2 if config.layer_types[i] is "mamba" (HF 5.x remaps it to "linear_attention"),
attention otherwise ("attention" / "full_attention"). Each layer:
    h = h + residual_multiplier * mixer(input_layernorm(h))
    x = post_attention_layernorm(h)
    h = h + residual_multiplier * (block_sparse_moe(x) + shared_mlp(x))   # num_local_experts > 0
    h = h + residual_multiplier * shared_mlp(x)                           # num_local_experts == 0
Embeddings are multiplied by embedding_multiplier; attention's softmax scale IS
attention_multiplier (not head_dim ** -0.5); logits = lm_head(h) / logits_scaling. RoPE (full
rotary, rope_parameters) only if position_embedding_type == "rope"; anything else (None, "nope")
means no position embedding at all.
MoE routing (HF `GraniteMoeHybridTopKRouter`): logits = x @ router.weight^T (then fp32); the top-k
logits are softmaxed among themselves (renormalised top-k), cast to the hidden dtype; experts are
SwiGLU with fused gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
shared_mlp: output_linear(act(a) * b) with [a | b] = input_linear(x) ([2S, H], gate half first).

Names (HF in-memory state_dict): model.embed_tokens, model.layers.{i}.input_layernorm,
model.layers.{i}.mamba.* | model.layers.{i}.self_attn.{q,k,v,o}_proj, model.layers.{i}.
post_attention_layernorm, model.layers.{i}.block_sparse_moe.{router.weight, experts.gate_up_proj,
experts.down_proj}, model.layers.{i}.shared_mlp.{input_linear, output_linear}, model.norm, lm_head
(tied to embed_tokens if tie_word_embeddings, as Granite 4.0 ships). On disk (save_pretrained and
IBM's checkpoints) the MoE tensors are block_sparse_moe.input_linear.weight,
block_sparse_moe.output_linear.weight and block_sparse_moe.router.layer.weight (same shapes); the
loader / save_hf_folder rename them through the hooks below (HF's conversion_mapping "granitemoe").
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.distributed import SINGLE, TPGroup
from toolkit.errors import UnsupportedArchitectureError
from toolkit.layers.attention import PagedAttention
from toolkit.layers.mlp import get_activation
from toolkit.layers.moe import FusedExperts, ShardedExperts, TopKRouter
from toolkit.layers.norms import RMSNorm
from toolkit.layers.parallel import check_divides, keep_rows, shard_rows
from toolkit.models.bamba import bamba_mixer
from toolkit.models.base import CausalLM, DecoderBody
from toolkit.models.llama import attention_head_dim, build_rotary

LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
               "full_attention": "attention"}
# on-disk name (save_pretrained / IBM checkpoints) <-> in-memory name
_DISK_TO_MEMORY = {
    "block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
    "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
    "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight",
}


def granite_hybrid_layer_types(config: PretrainedConfig) -> list[str]:
    """Per layer "mamba" or "attention" (from config.layer_types)."""
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    bad = sorted({t for t in types if t not in LAYER_KINDS})
    if bad:
        raise UnsupportedArchitectureError(
            f"GraniteMoeHybrid layer types {bad} are not supported; supported: {sorted(LAYER_KINDS)}")
    return [LAYER_KINDS[t] for t in types]


class ScaledEmbedding(nn.Embedding):
    """nn.Embedding whose output is multiplied by `multiplier` (Granite's embedding_multiplier)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, multiplier: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.multiplier = float(multiplier)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.multiplier


class GraniteSharedMLP(nn.Module):
    """x [T, H] -> output_linear(act(a) * b), [a | b] = input_linear(x); no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = get_activation(hidden_act)

    tp: TPGroup = SINGLE

    def check_shardable(self, tp_size: int) -> None:
        check_divides("shared_intermediate_size", self.output_linear.in_features, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        """input_linear's fused [a | b] sliced section by section ([a_r | b_r]), output_linear
        row-parallel (its own all-reduce, as vLLM's)."""
        i = self.output_linear.in_features
        local = i // tp.world_size
        rows = torch.arange(tp.rank * local, (tp.rank + 1) * local)
        keep_rows(self.input_linear, torch.cat([rows, i + rows]))
        shard_rows(self.output_linear, tp.rank * local, local, tp)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.input_linear(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.output_linear(self.act_fn(a) * b))


class GraniteMoE(ShardedExperts, nn.Module):
    """x [T, H] -> sum over the top-k experts of softmax(top-k router logits) * expert(x).
    Names: router.weight, experts.gate_up_proj, experts.down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 hidden_act: str) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.router = TopKRouter(hidden_size, num_experts)
        self.experts = FusedExperts(hidden_size, intermediate_size, num_experts, hidden_act)

    experts_size_name = "the experts' intermediate_size"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, ids = self.router(x).float().topk(self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        return self.tp.all_reduce(self.experts(x, weights, ids))


class GraniteHybridBlock(nn.Module):
    """One GraniteMoeHybrid decoder layer (see the module docstring), under HF's names."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, kind: str) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = kind
        self.residual_multiplier = float(config.residual_multiplier)
        self.input_layernorm = RMSNorm(h, eps=eps)
        if kind == "mamba":
            self.mixer_name = "mamba"
            self.mamba = bamba_mixer(config, layer_idx)      # same config fields as Bamba
        else:
            self.mixer_name = "self_attn"
            head_dim = attention_head_dim(config)
            rope = getattr(config, "position_embedding_type", None) == "rope"
            self.self_attn = PagedAttention(
                layer_name=f"model.layers.{layer_idx}.self_attn",
                hidden_size=h,
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
                head_dim=head_dim,
                bias=bool(config.attention_bias),
                rotary=build_rotary(config, head_dim, use_partial=False) if rope else None,
                scale=float(config.attention_multiplier),
            )
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        n_experts = int(config.num_local_experts or 0)
        self.block_sparse_moe = GraniteMoE(h, config.intermediate_size, n_experts, config.num_experts_per_tok,
                                           config.hidden_act) if n_experts > 0 else None
        self.shared_mlp = GraniteSharedMLP(h, config.shared_intermediate_size, config.hidden_act)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        x = self.input_layernorm(h)
        x = self.mamba(x, attn_metadata) if self.mixer_name == "mamba" else self.self_attn(x, positions, attn_metadata)
        h = h + x * self.residual_multiplier
        x = self.post_attention_layernorm(h)
        y = self.shared_mlp(x) if self.block_sparse_moe is None else self.block_sparse_moe(x) + self.shared_mlp(x)
        return h + y * self.residual_multiplier


class GraniteMoeHybridForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "GraniteMoeHybridForCausalLM"
    hf_model_type = "granitemoehybrid"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        blocks = [GraniteHybridBlock(config, i, kind) for i, kind in enumerate(granite_hybrid_layer_types(config))]
        embed = ScaledEmbedding(config.vocab_size, config.hidden_size, config.embedding_multiplier)
        return DecoderBody(("embed_tokens", embed), blocks,
                           ("norm", RMSNorm(config.hidden_size, eps=config.rms_norm_eps)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V] = lm_head(hidden) / logits_scaling (divided in the
        model dtype, as HF)."""
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype)) / self.config.logits_scaling
        return self.gather_logits(logits.float())

    @staticmethod
    def remap_checkpoint_key(key: str) -> str:
        """Loader hook: on-disk MoE names -> in-memory ones (HF's WeightRenaming for granitemoe)."""
        for disk, memory in _DISK_TO_MEMORY.items():
            if key.endswith("." + disk):
                return key[: -len(disk)] + memory
        return key

    @staticmethod
    def state_dict_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """save_hf_folder hook: the names save_pretrained writes."""
        out = {}
        for k, v in state.items():
            for disk, memory in _DISK_TO_MEMORY.items():
                if k.endswith("." + memory):
                    k = k[: -len(memory)] + disk
                    break
            out[k] = v
        return out
