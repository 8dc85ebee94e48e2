"""Falcon-H1 (HF `FalconH1ForCausalLM`): every layer runs GQA attention (RoPE) and a Mamba2 mixer in
parallel on the same normed input, then a SwiGLU FFN; muP-style multipliers everywhere.

Per layer (HF `FalconH1DecoderLayer`):
    x = input_layernorm(h)
    h = h + (mamba(x) * ssm_out_multiplier + self_attn(x * attention_in_multiplier) * attention_out_multiplier)
    h = h + feed_forward(pre_ff_layernorm(h))
feed_forward: down_proj(up_proj(x) * act(gate_proj(x) * mlp_multipliers[0])) * mlp_multipliers[1].
Embeddings are scaled by embedding_multiplier, logits by lm_head_multiplier.
Attention: k = k_proj(x) * key_multiplier in HF; since k only enters the scores q.k, the multiplier
is folded into the softmax scale here (scale = head_dim ** -0.5 * key_multiplier), so the KV cache
holds k_proj(x) rotated, unscaled.
Mamba2 mixer (HF `FalconH1Mixer`): intermediate size mamba_d_ssm (or mamba_expand * hidden), input
scaled by ssm_in_multiplier, in_proj's output sections [gate | x | B | C | dt] scaled by
ssm_multipliers (HF's `mup_vector`), conv activation hidden_act, in_proj bias mamba_proj_bias,
out_proj bias projectors_bias, dt clamped to time_step_limit; y * silu(gate) without a norm unless
mamba_rms_norm (then the grouped gated RMS norm, normalising before the gate if
mamba_norm_before_gate). See Mamba2Mixer's options.
Each layer so has two cache layers: `model.layers.{i}.self_attn` (KV blocks) and
`model.layers.{i}.mamba` (a state page); they fall in the attention and the Mamba cache group.
HF names: model.embed_tokens, model.layers.{i}.{feed_forward.{gate,up,down}_proj, mamba.*,
self_attn.{q,k,v,o}_proj, input_layernorm, pre_ff_layernorm}, model.final_layernorm, lm_head.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from toolkit.errors import UnsupportedArchitectureError
from toolkit.layers.attention import PagedAttention
from toolkit.layers.mamba2_mixer import Mamba2Mixer
from toolkit.layers.norms import RMSNorm
from toolkit.layers.parallel import ShardedGatedMLP
from toolkit.models.base import CausalLM, DecoderBody
from toolkit.models.llama import attention_head_dim, build_rotary


def falcon_h1_mamba_intermediate(config: PretrainedConfig) -> int:
    d_ssm = getattr(config, "mamba_d_ssm", None)
    return int(d_ssm) if d_ssm is not None else int(config.mamba_expand * config.hidden_size)


def falcon_h1_mixer(config: PretrainedConfig, layer_idx: int) -> Mamba2Mixer:
    return Mamba2Mixer(
        layer_name=f"model.layers.{layer_idx}.mamba",
        hidden_size=config.hidden_size,
        num_heads=config.mamba_n_heads,
        head_dim=int(config.mamba_d_head),
        state_size=config.mamba_d_state,
        n_groups=config.mamba_n_groups,
        conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size,
        use_bias=bool(config.mamba_proj_bias),
        use_conv_bias=bool(config.mamba_conv_bias),
        norm_eps=config.rms_norm_eps,
        time_step_limit=config.time_step_limit,
        activation=config.hidden_act,
        intermediate_size=falcon_h1_mamba_intermediate(config),
        out_proj_bias=bool(config.projectors_bias),
        in_multiplier=float(config.ssm_in_multiplier),
        proj_multipliers=list(config.ssm_multipliers),
        use_norm=bool(config.mamba_rms_norm),
        norm_before_gate=bool(config.mamba_norm_before_gate),
    )


def falcon_h1_attention(config: PretrainedConfig, layer_idx: int) -> PagedAttention:
    head_dim = attention_head_dim(config)
    return PagedAttention(
        layer_name=f"model.layers.{layer_idx}.self_attn",
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        bias=bool(config.attention_bias),
        rotary=build_rotary(config, head_dim, use_partial=False),
        scale=head_dim**-0.5 * float(config.key_multiplier),
    )


class FalconH1MLP(ShardedGatedMLP, nn.Module):
    """HF `FalconH1MLP`: down_proj(up_proj(x) * act(gate_proj(x) * gate_m)) * down_m."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h, inter, bias = config.hidden_size, config.intermediate_size, bool(config.mlp_bias)
        self.gate_proj = nn.Linear(h, inter, bias=bias)
        self.up_proj = nn.Linear(h, inter, bias=bias)
        self.down_proj = nn.Linear(inter, h, bias=bias)
        if config.hidden_act not in ACT2FN:
            raise UnsupportedArchitectureError(f"hidden_act '{config.hidden_act}' is not supported")
        self.act_fn = ACT2FN[config.hidden_act]
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up_proj(x) * self.act_fn(self.gate_proj(x) * self.gate_multiplier)
        return self.tp.all_reduce(self.down_proj(y)) * self.down_multiplier


class FalconH1Layer(nn.Module):
    """HF `FalconH1DecoderLayer` (parts registered in HF's order)."""

    layer_type = "hybrid"

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.feed_forward = FalconH1MLP(config)
        self.mamba = falcon_h1_mixer(config, layer_idx)
        self.self_attn = falcon_h1_attention(config, layer_idx)
        self.attention_in_multiplier = float(config.attention_in_multiplier)
        self.ssm_out_multiplier = float(config.ssm_out_multiplier)
        self.attn_out_multiplier = float(config.attention_out_multiplier)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        x = self.input_layernorm(h)
        m = self.mamba(x, attn_metadata) * self.ssm_out_multiplier
        a = self.self_attn(x * self.attention_in_multiplier, positions, attn_metadata) * self.attn_out_multiplier
        h = h + (m + a)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class FalconH1Body(DecoderBody):
    """DecoderBody with the embeddings scaled by embedding_multiplier."""

    def __init__(self, *args, embedding_multiplier: float = 1.0) -> None:
        super().__init__(*args)
        self.embedding_multiplier = float(embedding_multiplier)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        h = getattr(self, self.embed_name)(input_ids) * self.embedding_multiplier
        for block in self.layers:
            h = block(h, positions, attn_metadata)
        return getattr(self, self.final_norm_name)(h)


class FalconH1ForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "FalconH1ForCausalLM"
    hf_model_type = "falcon_h1"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        blocks = [FalconH1Layer(config, i) for i in range(config.num_hidden_layers)]
        return FalconH1Body(("embed_tokens", nn.Embedding(config.vocab_size, config.hidden_size)), blocks,
                            ("final_layernorm", RMSNorm(config.hidden_size, eps=config.rms_norm_eps)),
                            embedding_multiplier=config.embedding_multiplier)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V] = lm_head(hidden) * lm_head_multiplier."""
        w = self.lm_head.weight
        return self.gather_logits((self.lm_head(hidden.to(w.dtype)) * float(self.config.lm_head_multiplier)).float())
