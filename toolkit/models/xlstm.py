"""xLSTM (HF transformers `xLSTMForCausalLM`, model_type "xlstm", NX-AI's xLSTM-7b): an attention-free
stack of mLSTM blocks.

    h = embeddings(ids)
    per block:  h = h + mlstm_layer(norm_mlstm(h));  h = h + ffn(norm_ffn(h))
    logits = cap(lm_head(out_norm(h)))               cap(z) = c * tanh(z / c), c = output_logit_soft_cap
The mLSTM layer is toolkit/layers/mlstm.py. The norms are HF's `xLSTMRMSNorm` (an RMS norm, in fp32
when norm_reduction_force_float32, with a bias when use_bias; the final `out_norm` always in fp32 and
without bias, as HF builds it); the FFN is HF's `xLSTMFeedForward`:
proj_down(silu(proj_up_gate(x)) * proj_up(x)), of width hidden * ffn_proj_factor rounded up to a
multiple of ffn_round_up_to_multiple_of.

Names are HF's own (backbone.embeddings, backbone.blocks.{i}.norm_mlstm / mlstm_layer / norm_ffn /
ffn, backbone.out_norm, lm_head), so a save_pretrained folder loads as it is and ours saves the same.

As HF 5.x builds it (not as its config reads): the lm_head is never tied to the embedding (HF's class
declares no tied weights, whatever tie_word_embeddings says; its checkpoints store lm_head.weight),
out_norm is always there (add_out_norm is not read), and the state-precision and kernel settings
(mode, chunk_size, *_kernel, autocast_kernel_dtype, max_inference_chunksize) change only how HF
computes the same recurrence. Only weight_mode "single" (HF fails at init with "fused").
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.mlstm import MLSTMLayer, MultiHeadLayerNorm, soft_cap
from toolkit.layers.norms import RMSNorm
from toolkit.layers.ops import TORCH_OPS
from toolkit.layers.parallel import ShardedGatedMLP
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock


def round_up(x: float, multiple: int) -> int:
    """HF xLSTM's `round_up_to_next_multiple_of` (float arithmetic, as HF does it)."""
    return int(((x + multiple - 1) // multiple) * multiple)


class XLSTMRMSNorm(RMSNorm):
    """HF `xLSTMRMSNorm`: weight * x / rms(x) (+ bias); the statistic in fp32 when
    `force_float32_reductions`, else in x's dtype. x [..., D] -> [..., D]."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, bias: bool = False,
                 force_float32_reductions: bool = True) -> None:
        super().__init__(hidden_size, eps=eps)
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        self.force_float32_reductions = force_float32_reductions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.force_float32_reductions:
            y = super().forward(x)
        else:
            y = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        return y if self.bias is None else y + self.bias


class XLSTMFeedForward(ShardedGatedMLP, nn.Module):
    """x [T, hidden] -> [T, hidden]: proj_down(silu(proj_up_gate(x)) * proj_up(x)) (HF `xLSTMFeedForward`,
    weight_mode "single"); tensor-parallel over its intermediate channels."""

    tp_projections = ("proj_up_gate", "proj_up", "proj_down")

    def __init__(self, hidden_size: int, up_proj_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.proj_up_gate = nn.Linear(hidden_size, up_proj_dim, bias=bias)
        self.proj_up = nn.Linear(hidden_size, up_proj_dim, bias=bias)
        self.proj_down = nn.Linear(up_proj_dim, hidden_size, bias=bias)
        self.ops = TORCH_OPS                        # set_ops() swaps in the Triton kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.proj_down(self.ops.silu_and_mul(self.proj_up_gate(x), self.proj_up(x))))


class XLSTMBackbone(DecoderBody):
    """DecoderBody under HF xLSTM's names: embeddings, blocks (what DecoderBody calls `layers`), out_norm."""

    def __init__(self, embeddings: nn.Embedding, blocks: list[nn.Module], out_norm: nn.Module) -> None:
        nn.Module.__init__(self)
        self.embed_name, self.final_norm_name = "embeddings", "out_norm"
        self.embeddings = embeddings
        self.blocks = nn.ModuleList(blocks)
        self.out_norm = out_norm

    @property
    def layers(self) -> nn.ModuleList:
        return self.blocks


def check_xlstm_config(config: PretrainedConfig) -> None:
    """A config HF's own model cannot run either (weight_mode "fused" is refused by MLSTMLayer)."""
    if config.embedding_dim != config.hidden_size:
        raise ValueError(f"xLSTM embedding_dim ({config.embedding_dim}) must equal hidden_size "
                         f"({config.hidden_size}): HF's blocks read the embeddings at hidden_size")


class xLSTMForCausalLM(CausalLM):
    is_attention_free = True
    hf_architecture = "xLSTMForCausalLM"
    hf_model_type = "xlstm"
    body_name = "backbone"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        check_xlstm_config(config)
        d, eps, bias = config.hidden_size, config.norm_eps, config.use_bias
        force32 = config.norm_reduction_force_float32
        up = round_up(d * config.ffn_proj_factor, config.ffn_round_up_to_multiple_of)
        blocks = []
        for i in range(config.num_blocks):
            layer = MLSTMLayer(layer_name=f"backbone.blocks.{i}.mlstm_layer", hidden_size=d,
                               num_heads=config.num_heads, qk_dim=int(d * config.qk_dim_factor),
                               v_dim=int(d * config.v_dim_factor), gate_soft_cap=config.gate_soft_cap,
                               eps=config.eps, norm_eps=eps, use_bias=bias, norm_force_float32=force32,
                               weight_mode=config.weight_mode)
            blocks.append(PreNormBlock(("norm_mlstm", XLSTMRMSNorm(d, eps, bias, force32)), ("mlstm_layer", layer),
                                       ("norm_ffn", XLSTMRMSNorm(d, eps, bias, force32)),
                                       ("ffn", XLSTMFeedForward(d, up, bias)), layer_type="mlstm"))
        return XLSTMBackbone(nn.Embedding(config.vocab_size, d), blocks, XLSTMRMSNorm(d, eps))

    def tie_weights(self) -> None:
        """Never tied: HF's xLSTMForCausalLM keeps its own lm_head whatever tie_word_embeddings says."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V], soft-capped at output_logit_soft_cap (in fp32, as HF)."""
        return soft_cap(super().compute_logits(hidden), self.config.output_logit_soft_cap)

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """CausalLM's seeded weights (the gate projections random, where HF zeroes them), plus: the
        multihead norms' weights 1 + N(0, 0.1) like the other norms; input gate biases N(0, 1) and forget
        gate biases from 1 to 3 over the heads plus N(0, 0.1), so the stabiliser m moves and the
        forget gates differ by head."""
        super().init_random_weights(seed)
        g = torch.Generator(device="cpu").manual_seed(int(seed) + 1)

        def put(p: torch.Tensor, value: torch.Tensor) -> None:
            p.copy_(value.to(device=p.device, dtype=p.dtype))
        for mod in self.modules():
            if isinstance(mod, MultiHeadLayerNorm):
                put(mod.weight, 1.0 + 0.1 * torch.randn(mod.weight.shape, generator=g))
            elif isinstance(mod, MLSTMLayer):
                h = mod.igate_preact.bias.shape[0]
                put(mod.igate_preact.bias, torch.randn(h, generator=g))
                put(mod.fgate_preact.bias, torch.linspace(1.0, 3.0, h) + 0.1 * torch.randn(h, generator=g))
