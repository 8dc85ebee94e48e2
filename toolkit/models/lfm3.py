"""LFM3 (HF `Lfm3ForCausalLM`, LiquidAI/LFM3-1.7B): LFM2's gated short convs (a 7-wide conv by
default) with two kinds of attention layer, in `config.layer_types`:
  - "sliding_attention": the query at position p attends keys p - W + 1 .. p (W = sliding_window),
    RoPE from rope_parameters["sliding_attention"] (default, theta 1e4);
  - "full_attention": causal attention, RoPE from rope_parameters["full_attention"] ("proportional",
    partial 0.5: the first half of the frequency pairs rotate, the rest have frequency 0).
Both: Qwen3-style per-head q/k RMSNorm (q_norm / k_norm over head_dim), and with use_attention_gate the
output of each head scaled by sigmoid(g_proj(x)) [heads] before o_proj. Each layer is a sandwich
(with use_sandwich_norm): h = h + post_operator_norm(op(operator_norm(h))); h = h + post_ffn_norm(
feed_forward(ffn_norm(h))); the FFN a SwiGLU of intermediate_size (w1 gate, w3 up, w2 down).

The sliding-window layers keep every page of their KV cache for now and mask (the kernel never
reads keys before the window); releasing the pages out of every window is still to come.
On disk (save_pretrained's layout, transformers' "lfm3" conversion): g_proj is `self_attn.gate_proj`.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.errors import UnsupportedArchitectureError
from toolkit.layers.attention import PagedAttention
from toolkit.layers.norms import RMSNorm
from toolkit.layers.parallel import shard_columns
from toolkit.layers.rotary import RotaryEmbedding
from toolkit.layers.short_conv import ShortConv
from toolkit.models.base import CausalLM, DecoderBody
from toolkit.models.lfm2 import Lfm2MLP

LAYER_TYPES = ("conv", "full_attention", "sliding_attention")


class HeadGatedAttention(PagedAttention):
    """PagedAttention whose output is scaled per head by sigmoid(g_proj(x)) before o_proj (g_proj
    [Hq, hidden]; LFM3's `use_attention_gate`)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.g_proj = nn.Linear(kw["hidden_size"], kw["num_heads"], bias=False)

    def shard_(self, tp) -> None:
        (q_start, q_size), _ = self.head_slices(tp)
        super().shard_(tp)
        shard_columns(self.g_proj, q_start // self.head_dim, q_size // self.head_dim)

    def gate_output(self, out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return out * torch.sigmoid(self.g_proj(hidden)).unsqueeze(-1)


class SandwichBlock(nn.Module):
    """LFM3's layer (module doc); names operator_norm, conv | self_attn, post_operator_norm, ffn_norm,
    feed_forward, post_ffn_norm (the post norms Identity without use_sandwich_norm)."""

    def __init__(self, mixer_name: str, mixer: nn.Module, ffn: nn.Module, hidden_size: int, eps: float,
                 sandwich: bool, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.operator_norm = RMSNorm(hidden_size, eps=eps)
        self.add_module(mixer_name, mixer)
        self._mixer_name = mixer_name
        self.post_operator_norm = RMSNorm(hidden_size, eps=eps) if sandwich else nn.Identity()
        self.ffn_norm = RMSNorm(hidden_size, eps=eps)
        self.feed_forward = ffn
        self.post_ffn_norm = RMSNorm(hidden_size, eps=eps) if sandwich else nn.Identity()
        self._takes_positions = isinstance(mixer, PagedAttention)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        mixer = getattr(self, self._mixer_name)
        x = self.operator_norm(h)
        x = mixer(x, positions, attn_metadata) if self._takes_positions else mixer(x, attn_metadata)
        h = h + self.post_operator_norm(x)
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


def lfm3_layer_types(config: PretrainedConfig) -> list[str]:
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise UnsupportedArchitectureError(f"LFM3 layer types {bad} are not supported; supported: {list(LAYER_TYPES)}")
    return types


def lfm3_attention(config: PretrainedConfig, layer_idx: int, kind: str) -> PagedAttention:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = dict(config.rope_parameters[kind])
    rotary = RotaryEmbedding(head_dim, float(params.get("rope_theta", 10000.0)), rope_parameters=params,
                             config=config, layer_type=kind)
    cls = HeadGatedAttention if getattr(config, "use_attention_gate", True) else PagedAttention
    return cls(layer_name=f"model.layers.{layer_idx}.self_attn", hidden_size=config.hidden_size,
               num_heads=config.num_attention_heads,
               num_kv_heads=config.num_key_value_heads or config.num_attention_heads, head_dim=head_dim,
               bias=bool(config.attention_bias), rotary=rotary, qk_norm_eps=config.rms_norm_eps,
               sliding_window=config.sliding_window if kind == "sliding_attention" else None)


class Lfm3ForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "Lfm3ForCausalLM"
    hf_model_type = "lfm3"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        eps, h = config.norm_eps, config.hidden_size
        sandwich = bool(getattr(config, "use_sandwich_norm", True))
        blocks = []
        for i, kind in enumerate(lfm3_layer_types(config)):
            if kind == "conv":
                mixer = ("conv", ShortConv(layer_name=f"model.layers.{i}.conv", hidden_size=h,
                                           conv_kernel=config.conv_L_cache, bias=bool(config.conv_bias)))
            else:
                mixer = ("self_attn", lfm3_attention(config, i, kind))
            blocks.append(SandwichBlock(*mixer, Lfm2MLP(h, config.intermediate_size), h, eps, sandwich, kind))
        return DecoderBody(("embed_tokens", nn.Embedding(config.vocab_size, h)), blocks,
                           ("embedding_norm", RMSNorm(h, eps=eps)))

    @staticmethod
    def checkpoint_to_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loader hook: `self_attn.gate_proj` -> `self_attn.g_proj`."""
        return {k.replace(".self_attn.gate_proj.", ".self_attn.g_proj."): v for k, v in state.items()}

    @staticmethod
    def state_dict_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """save_hf_folder hook: the inverse."""
        return {k.replace(".self_attn.g_proj.", ".self_attn.gate_proj."): v for k, v in state.items()}
