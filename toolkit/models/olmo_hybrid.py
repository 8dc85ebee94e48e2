"""OLMo Hybrid (HF `OlmoHybridForCausalLM`, Ai2's fully open Gated DeltaNet hybrid).

Layer i is a GDN layer if config.layer_types[i] == "linear_attention" (default: three of every
four), else a full-attention layer. The two kinds are built differently:
- GDN layers are Llama pre-norm: h = h + linear_attn(input_layernorm(h)); h = h + mlp(post_attention_layernorm(h)).
  The mixer (`OlmoGatedDeltaNet`) has a projection per input (q/k/v/a/b and a g_proj output gate),
  beta = 2 * sigmoid(b) with `linear_allow_neg_eigval` (eigenvalues of the transition in [-1, 1]),
  and a gated output norm of eps 1e-5 whatever rms_norm_eps says.
- attention layers are OLMo-3 post-norm: h = h + post_attention_layernorm(self_attn(h));
  h = h + post_feedforward_layernorm(mlp(h)); q_norm / k_norm normalise over the whole projection
  width (all heads together), not per head. RoPE only where `rope_parameters` has a rope_theta: the
  released checkpoint has none (NoPE).
Norms multiply by their weight in fp32 (OLMo-3's RMSNorm). MLPs are SwiGLU without biases.

On disk (save_pretrained's layout, transformers' "olmo_hybrid" conversion mapping): the conv is
three tensors, `linear_attn.{q,k,v}_conv1d.weight` (concatenated on load, split on save), and the
norms are named `attention_layer_norm` (ours: input_layernorm) and `feedforward_layer_norm`
(post_attention_layernorm; in an attention layer that is the norm after attention).
"""
from __future__ import annotations

import re

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.distributed import SINGLE, TPGroup
from toolkit.layers.attention import PagedAttention
from toolkit.layers.gdn import OlmoGatedDeltaNet
from toolkit.layers.mlp import SwiGLUMLP
from toolkit.layers.parallel import keep_entries
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock
from toolkit.models.llama import build_rotary
from toolkit.models.nemotron_h import NemotronHRMSNorm as FullPrecisionRMSNorm  # OLMo-3's RMSNorm too
from toolkit.models.qwen3_next import qwen3_next_layer_types

O_NORM_EPS = 1e-5          # HF OlmoHybridGatedDeltaNet's o_norm: fixed, not config.rms_norm_eps
# checkpoint name <-> ours (transformers' conversion mapping for "olmo_hybrid")
DISK_NORMS = {"attention_layer_norm": "input_layernorm", "feedforward_layer_norm": "post_attention_layernorm"}
CONV_PARTS = ("q_conv1d", "k_conv1d", "v_conv1d")


class WidthRMSNorm(FullPrecisionRMSNorm):
    """OLMo-3's q_norm / k_norm: one RMS statistic over a token's whole projection (all heads). Under
    tensor parallelism each rank holds some heads, so the sum of squares is all-reduced first and
    divided by the full width (`full_width`); the weight is this rank's slice."""

    tp: TPGroup = SINGLE

    def __init__(self, width: int, eps: float) -> None:
        super().__init__(width, eps=eps)
        self.full_width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.sharded:
            return super().forward(x)
        in_dtype = x.dtype
        xf = x.to(torch.float32)
        variance = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / self.full_width
        return (self.weight.to(torch.float32) * (xf * torch.rsqrt(variance + self.eps))).to(in_dtype)


class OlmoPagedAttention(PagedAttention):
    """HF `OlmoHybridAttention` over the paged KV cache: q_norm [H*D] and k_norm [Hkv*D] over the
    whole projections (before the heads are split and before RoPE, if any)."""

    def __init__(self, *, eps: float, **kw) -> None:
        super().__init__(**kw)
        self.q_norm = WidthRMSNorm(self.num_heads * self.head_dim, eps)
        self.k_norm = WidthRMSNorm(self.num_kv_heads * self.head_dim, eps)

    def check_shardable(self, tp_size: int) -> None:
        super().check_shardable(tp_size)
        if self.num_kv_heads % tp_size:     # a replicated KV head would count twice in k_norm's statistic
            raise ValueError(f"num_key_value_heads ({self.num_kv_heads}) must be divisible by tensor parallel "
                             f"size ({tp_size}): OLMo's k_norm spans every KV head")

    def shard_(self, tp: TPGroup) -> None:
        (q_start, q_size), (kv_start, kv_size) = self.head_slices(tp)
        super().shard_(tp)
        for norm, start, size in ((self.q_norm, q_start, q_size), (self.k_norm, kv_start, kv_size)):
            keep_entries(norm, "weight", torch.arange(start, start + size))
            norm.tp = tp

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        t = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden)).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(self.k_proj(hidden)).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = self.attend(q, k, v, attn_metadata)
        return self.tp.all_reduce(self.output_proj(out.reshape(t, self.num_heads * self.head_dim)))


class PostNormBlock(nn.Module):
    """OLMo-3's layer: h = h + post_attention_layernorm(self_attn(h)); h = h + post_feedforward_layernorm(mlp(h))."""

    def __init__(self, attn: OlmoPagedAttention, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.layer_type = "full_attention"
        self.self_attn = attn
        self.post_attention_layernorm = FullPrecisionRMSNorm(hidden_size, eps=eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = FullPrecisionRMSNorm(hidden_size, eps=eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(h, positions, attn_metadata))
        return h + self.post_feedforward_layernorm(self.mlp(h))


def has_rope(config: PretrainedConfig) -> bool:
    """HF builds rotary embeddings only when rope_parameters names a rope_theta (else NoPE)."""
    params = getattr(config, "rope_parameters", None)
    return params is not None and params.get("rope_theta") is not None


class OlmoHybridForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "OlmoHybridForCausalLM"
    hf_model_type = "olmo_hybrid"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        eps, hidden = config.rms_norm_eps, config.hidden_size
        head_dim = hidden // config.num_attention_heads
        blocks: list[nn.Module] = []
        for i, kind in enumerate(qwen3_next_layer_types(config, "OLMo Hybrid")):
            mlp = SwiGLUMLP(hidden, config.intermediate_size, False, config.hidden_act)
            if kind == "full_attention":
                attn = OlmoPagedAttention(
                    layer_name=f"model.layers.{i}.self_attn", hidden_size=hidden,
                    num_heads=config.num_attention_heads,
                    num_kv_heads=config.num_key_value_heads or config.num_attention_heads, head_dim=head_dim,
                    bias=bool(getattr(config, "attention_bias", False)),
                    rotary=build_rotary(config, head_dim, use_partial=False) if has_rope(config) else None, eps=eps)
                blocks.append(PostNormBlock(attn, mlp, hidden, eps))
                continue
            gdn = OlmoGatedDeltaNet(
                layer_name=f"model.layers.{i}.linear_attn", hidden_size=hidden,
                num_k_heads=config.linear_num_key_heads, num_v_heads=config.linear_num_value_heads,
                head_k_dim=config.linear_key_head_dim, head_v_dim=config.linear_value_head_dim,
                conv_kernel=config.linear_conv_kernel_dim, norm_eps=O_NORM_EPS, activation=config.hidden_act,
                beta_scale=2.0 if config.linear_allow_neg_eigval else 1.0)
            blocks.append(PreNormBlock(("input_layernorm", FullPrecisionRMSNorm(hidden, eps=eps)),
                                       ("linear_attn", gdn),
                                       ("post_attention_layernorm", FullPrecisionRMSNorm(hidden, eps=eps)),
                                       ("mlp", mlp), layer_type=kind))
        return DecoderBody(("embed_tokens", nn.Embedding(config.vocab_size, hidden)), blocks,
                           ("norm", FullPrecisionRMSNorm(hidden, eps=eps)))

    @staticmethod
    def checkpoint_to_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loader hook: the on-disk norm names renamed, each GDN layer's q/k/v convs concatenated
        (transformers' `Concatenate(dim=0)`) into linear_attn.conv1d.weight."""
        out: dict[str, torch.Tensor] = {}
        convs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in state.items():
            m = re.fullmatch(r"(.*\.linear_attn)\.(q_conv1d|k_conv1d|v_conv1d)\.weight", key)
            if m:
                convs.setdefault(m.group(1), {})[m.group(2)] = tensor
                continue
            for disk, ours in DISK_NORMS.items():
                key = key.replace(f".{disk}.", f".{ours}.")
            out[key] = tensor
        for prefix, parts in convs.items():
            if set(parts) != set(CONV_PARTS):     # leave them under their names: the loader names what is missing
                out.update({f"{prefix}.{p}.weight": t for p, t in parts.items()})
                continue
            out[f"{prefix}.conv1d.weight"] = torch.cat([parts[p] for p in CONV_PARTS], dim=0)
        return out

    @staticmethod
    def state_dict_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """save_hf_folder hook: the layout save_pretrained writes (norms renamed, convs split by the
        layer's q_proj / v_proj widths)."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            m = re.fullmatch(r"(.*\.linear_attn)\.conv1d\.weight", key)
            if m:
                key_dim, value_dim = state[f"{m.group(1)}.q_proj.weight"].shape[0], \
                    state[f"{m.group(1)}.v_proj.weight"].shape[0]
                for part, piece in zip(CONV_PARTS, torch.split(tensor, [key_dim, key_dim, value_dim], dim=0)):
                    out[f"{m.group(1)}.{part}.weight"] = piece.contiguous()
                continue
            for disk, ours in DISK_NORMS.items():
                key = key.replace(f".{ours}.", f".{disk}.")
            out[key] = tensor
        return out
