"""`CausalLM`: the interface every model of the toolkit implements.

A model is an `nn.Module` whose parameter names equal the HF checkpoint's, plus:
  - class facts `is_hybrid`, `is_attention_free`, `hf_architecture`, `hf_model_type`;
  - `build_body(config) -> DecoderBody` (embedding -> PreNormBlocks -> final norm, under the
    checkpoint's names); that is all an architecture writes besides its layers;
  - `forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, H]` over the flattened
    step (no batch dimension); `attn_metadata` maps each cache layer's `layer_name` to its
    metadata object, or is None for a profile run (layers then touch no cache);
  - `compute_logits(hidden [N, H]) -> float32 [N, V]`;
  - cache plumbing: `kv_cache_specs()` / `bind_kv_cache(...)`; a cache layer is any submodule with
    `get_kv_cache_spec`, `bind_kv_cache` and a `layer_name` equal to its module path.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.distributed import SINGLE, TPGroup
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.layers.attention import PagedAttention
from toolkit.layers.norms import RMSNorm, RMSNormGated


class PreNormBlock(nn.Module):
    """One layer of every model here: h = h + mixer(norm(h)), then h = h + ffn(ffn_norm(h)) when
    the layer has an FFN (Mamba / Mamba2 blocks have none).

    The parts are registered under the checkpoint's own names (("input_layernorm", RMSNorm(...)),
    ("self_attn", PagedAttention(...)), ...). An attention mixer is called with the positions, a
    recurrent mixer (Mamba1, Mamba2, short conv) without. With `residual_in_fp32` (HF Mamba's
    default) the residual stream is kept in float32.
    """

    def __init__(self, norm: tuple[str, nn.Module], mixer: tuple[str, nn.Module],
                 ffn_norm: tuple[str, nn.Module] | None = None, ffn: tuple[str, nn.Module] | None = None,
                 *, layer_type: str = "", residual_in_fp32: bool = False) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.residual_in_fp32 = residual_in_fp32
        parts = [norm, mixer] + ([ffn_norm, ffn] if ffn is not None else [])
        for name, module in parts:
            self.add_module(name, module)
        self._names = [name for name, _ in parts]
        self._mixer_takes_positions = isinstance(mixer[1], PagedAttention)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        norm, mixer = getattr(self, self._names[0]), getattr(self, self._names[1])
        residual = h.to(torch.float32) if self.residual_in_fp32 else h
        x = norm(h.to(norm.weight.dtype))
        x = mixer(x, positions, attn_metadata) if self._mixer_takes_positions else mixer(x, attn_metadata)
        h = residual + x
        if len(self._names) == 4:
            h = h + getattr(self, self._names[3])(getattr(self, self._names[2])(h))
        return h


class DecoderBody(nn.Module):
    """embedding -> blocks -> final norm, under the checkpoint's names (e.g. `model.embed_tokens`,
    `model.layers`, `model.norm`, or `backbone.embeddings`, `backbone.layers`, `backbone.norm_f`)."""

    def __init__(self, embed: tuple[str, nn.Embedding], blocks: list[nn.Module],
                 final_norm: tuple[str, nn.Module]) -> None:
        super().__init__()
        self.embed_name, self.final_norm_name = embed[0], final_norm[0]
        self.add_module(embed[0], embed[1])
        self.layers = nn.ModuleList(blocks)
        self.add_module(final_norm[0], final_norm[1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        h = getattr(self, self.embed_name)(input_ids)
        for block in self.layers:
            h = block(h, positions, attn_metadata)
        return getattr(self, self.final_norm_name)(h)


class CausalLM(nn.Module, ABC):
    is_hybrid: ClassVar[bool] = False
    is_attention_free: ClassVar[bool] = False
    hf_architecture: ClassVar[str]
    hf_model_type: ClassVar[str]
    hf_aliases: ClassVar[tuple[str, ...]] = ()   # other architectures whose checkpoints load as this one
    body_name: ClassVar[str] = "model"       # "backbone" for Mamba / Mamba2 checkpoints

    lm_head: nn.Linear
    tp: TPGroup = SINGLE             # tensor parallelism (models/tensor_parallel.py shards the model)

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.add_module(self.body_name, self.build_body(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    @abstractmethod
    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        """The model's DecoderBody, with the checkpoint's attribute names."""

    @staticmethod
    def language_config(config: PretrainedConfig) -> PretrainedConfig:
        """The config this class is built from, given a checkpoint folder's (an alias architecture,
        e.g. a vision-language model loaded text-only, returns its text config)."""
        return config

    @property
    def body(self) -> DecoderBody:
        return getattr(self, self.body_name)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: dict[str, object] | None,
    ) -> torch.Tensor:
        """input_ids [T] int32/int64, positions [T] int64 -> final-normed hidden states [T, H]."""
        return self.body(input_ids, positions, attn_metadata)

    def get_input_embeddings(self) -> nn.Embedding:
        return getattr(self.body, self.body.embed_name)

    # -- shared -----------------------------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V]."""
        return self.gather_logits(self.lm_head(hidden.to(self.lm_head.weight.dtype)).float())

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's logits as every rank needs them: unsharded, as they are; tensor-parallel,
        each rank's logits over its slice of the padded vocabulary all-gathered in rank order and
        cut to V (the padding's are 0)."""
        if self.tp.sharded:
            logits = self.tp.all_gather(logits)[:, :self.config.vocab_size]
        return logits

    def tie_weights(self) -> None:
        """If config.tie_word_embeddings: lm_head.weight IS the input embedding's weight tensor."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.get_input_embeddings().weight

    @property
    def is_tied(self) -> bool:
        return self.lm_head.weight is self.get_input_embeddings().weight

    def fp32_tensor_names(self) -> set[str]:
        """Full names of the tensors kept in float32 whatever the model's dtype: a module's
        `fp32_tensors` (its own parameter / buffer names), those HF creates in float32 and never casts
        (LFM2-MoE's expert_bias)."""
        return {f"{mn}.{n}" if mn else n for mn, m in self.named_modules() for n in getattr(m, "fp32_tensors", ())}

    def keep_fp32_(self) -> None:
        """Cast the `fp32_tensor_names` tensors back to float32 (after a model-wide `.to(dtype)`)."""
        for m in self.modules():
            for n in getattr(m, "fp32_tensors", ()):
                t = getattr(m, n)
                if t is not None and t.dtype != torch.float32:
                    t.data = t.data.float()

    def max_graph_tokens(self) -> int | None:
        """The largest step a CUDA graph of this model can hold (None: no limit): a module with a
        `graph_max_tokens` (a MoE layer, whose larger steps sync on the host) caps it."""
        limits = [m.graph_max_tokens for m in self.modules() if getattr(m, "graph_max_tokens", None)]
        return min(limits) if limits else None

    def graph_unsafe_reason(self) -> str | None:
        """Why a CUDA graph cannot hold this model's forward (a module's `graph_unsafe`), or None."""
        return next((f"{name}: {m.graph_unsafe}" for name, m in self.named_modules()
                     if getattr(m, "graph_unsafe", None)), None)

    def cache_layers(self) -> dict[str, nn.Module]:
        """layer_name -> cache-holding layer, in layer (module registration) order."""
        out: dict[str, nn.Module] = {}
        for name, mod in self.named_modules():
            if hasattr(mod, "get_kv_cache_spec") and hasattr(mod, "bind_kv_cache"):
                if getattr(mod, "layer_name", None) != name:
                    raise RuntimeError(f"cache layer at '{name}' has layer_name {getattr(mod, 'layer_name', None)!r}")
                out[name] = mod
        return out

    def kv_cache_specs(self) -> dict[str, AttentionSpec | MambaSpec]:
        """layer_name -> spec (AttentionSpec or MambaSpec), in layer order."""
        return {name: mod.get_kv_cache_spec() for name, mod in self.cache_layers().items()}

    def bind_kv_cache(self, caches: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]) -> None:
        """Give every cache layer its tensor(s); keys must be exactly the cache layers' names."""
        layers = self.cache_layers()
        missing = [n for n in layers if n not in caches]
        extra = [n for n in caches if n not in layers]
        if missing or extra:
            raise ValueError(f"bind_kv_cache: missing layers {missing}, unknown layers {extra}")
        for name, mod in layers.items():
            mod.bind_kv_cache(caches[name])

    def unbind_kv_cache(self) -> None:
        """Drop every layer's reference to its cache tensors (shutdown)."""
        for mod in self.cache_layers().values():
            mod.unbind_kv_cache()

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """Deterministic random weights, identical on every machine (CPU fp32 generator, then copied).

        Parameters are visited in `named_parameters()` order (a tied lm_head is visited once, via
        the embedding):
          - RMSNorm / gated-norm weights: 1 + N(0, 0.1)  (not exactly 1, so norm bugs show)
          - A_log: log(U[1, 16]);  D: 1 + N(0, 0.1);
          - dt_bias (Mamba1: dt_proj.bias): softplus^-1(dt), dt = exp(U[log 1e-3, log 1e-1])
          - conv1d.weight: N(0, 1/sqrt(K));  conv1d.bias: N(0, 0.1)
          - everything else (linear weights/biases, embeddings): N(0, config.initializer_range)
        """
        g = torch.Generator(device="cpu")
        g.manual_seed(int(seed))
        std = float(getattr(self.config, "initializer_range", 0.02))
        norm_params = {
            f"{mn}.weight" for mn, m in self.named_modules() if isinstance(m, (RMSNorm, RMSNormGated))
        }

        def randn(shape: torch.Size) -> torch.Tensor:
            return torch.randn(shape, generator=g, dtype=torch.float32)

        def rand(shape: torch.Size) -> torch.Tensor:
            return torch.rand(shape, generator=g, dtype=torch.float32)

        # in place after the draw (the same float32 ops as `c * randn(...)`, bit for bit): a shape-true
        # preset's embedding is hundreds of MB, and a second tensor of that size costs its page faults
        for name, p in self.named_parameters():
            shape = p.shape
            leaf = name.rsplit(".", 1)[-1]
            if name in norm_params:
                v = randn(shape).mul_(0.1).add_(1.0)
            elif leaf == "A_log":
                v = rand(shape).mul_(15.0).add_(1.0).log_()
            elif leaf == "D":
                v = randn(shape).mul_(0.1).add_(1.0)
            elif leaf == "dt_bias" or name.endswith("dt_proj.bias"):
                lo, hi = math.log(1e-3), math.log(1e-1)
                dt = torch.exp(lo + (hi - lo) * rand(shape))
                v = dt + torch.log(-torch.expm1(-dt))
            elif name.endswith("conv1d.weight"):
                v = randn(shape).div_(math.sqrt(shape[-1]))
            elif name.endswith("conv1d.bias"):
                v = randn(shape).mul_(0.1)
            else:
                v = randn(shape).mul_(std)
            p.copy_(v)           # cast and moved by the copy (one pass, the same rounding as .to)
