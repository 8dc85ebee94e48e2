"""Zamba2 (HF `Zamba2ForCausalLM`): Mamba2 layers, some of which ("hybrid") first run a shared
attention + MLP block whose output is added to the Mamba layer's input.

`config.layers_block_type[i]` is "hybrid", or "mamba" ("linear_attention" after transformers'
legacy remap). Every layer is a Mamba2 layer:
    h = h + mamba(input_layernorm(h + t))         (t = 0 for a plain Mamba layer)
In a hybrid layer, t comes from the shared transformer block over the concatenation of h and the
ORIGINAL token embeddings e (width 2H), with no residual inside the block:
    x = input_layernorm([h, e]);  x = self_attn(x);  x = feed_forward(pre_ff_layernorm(x));  t = linear(x)
Attention: q/k/v from the 2H input, head_dim = 2H / num_attention_heads, softmax scale
(head_dim / 2) ** -0.5, o_proj back to H, RoPE only if `use_mem_rope`. MLP: fused gate_up_proj,
act(gate) * up (config.hidden_act, "gelu" by default), down_proj.

Shared blocks: the j-th hybrid layer (in hybrid-layer order) uses block j % num_mem_blocks. Every
hybrid layer has its own copy of the block's modules (its own names, `model.layers.{i}.shared_transformer.*`,
and, most importantly, its own attention KV cache `model.layers.{i}.shared_transformer.self_attn`);
the copies of one block share their Parameters. As in transformers 5.x, the copies are tied only
when `config.tie_word_embeddings` is set (HF gates every `_tied_weights_keys` entry on it): untied
configs have independent blocks per hybrid layer. Checkpoints of tied configs store each block once,
under its first hybrid layer (what `save_pretrained` writes); the two hooks below convert.
Each block holds per-hybrid-layer LoRA-style adapters: `feed_forward.gate_up_proj_adapter_list.{j}`
(always) and `self_attn.linear_{q,k,v}_adapter_list.{j}` (if `use_shared_attention_adapter`), each
Linear(in, adapter_rank) -> Linear(adapter_rank, out) added to the projection; entries of other
blocks' hybrid layers are parameterless Identity placeholders, as in HF.

Mamba2 mixer (HF `Zamba2MambaMixer`): n_mamba_heads x mamba_headdim, mamba_ngroups, conv bias always
on, in/out_proj bias `add_bias_linear`, gated-norm eps 1e-5, dt clamped below at time_step_min.
HF names: model.embed_tokens, model.layers.{i}.{input_layernorm, mamba.*} (Mamba layers),
model.layers.{i}.{linear, mamba_decoder.{input_layernorm, mamba.*}, shared_transformer.*} (hybrid
layers), model.final_layernorm, lm_head (tied to embed_tokens by default).
"""
from __future__ import annotations

import re

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from toolkit.distributed import SINGLE, TPGroup
from toolkit.errors import UnsupportedArchitectureError
from toolkit.layers.attention import PagedAttention
from toolkit.layers.mamba2_mixer import Mamba2Mixer
from toolkit.layers.norms import RMSNorm
from toolkit.layers.parallel import check_divides, keep_rows, shard_columns, shard_rows
from toolkit.models.base import CausalLM, DecoderBody
from toolkit.models.llama import build_rotary

MAMBA_TYPES = ("mamba", "linear_attention")


def zamba2_layer_types(config: PretrainedConfig) -> list[str]:
    """Per layer "hybrid" or "mamba"."""
    types = list(config.layers_block_type)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layers_block_type has {len(types)} entries for {config.num_hidden_layers} layers")
    bad = sorted({t for t in types if t != "hybrid" and t not in MAMBA_TYPES})
    if bad:
        raise UnsupportedArchitectureError(f"Zamba2 layer types {bad} are not supported; supported: "
                                           f"hybrid, {', '.join(MAMBA_TYPES)}")
    return ["hybrid" if t == "hybrid" else "mamba" for t in types]


def zamba2_hybrid_layers(config: PretrainedConfig) -> list[int]:
    return [i for i, t in enumerate(zamba2_layer_types(config)) if t == "hybrid"]


def zamba2_shared_block_ties(config: PretrainedConfig) -> dict[int, int]:
    """layer index -> layer index whose shared-block Parameters it uses: the j-th hybrid layer with
    j >= num_mem_blocks uses the (j % num_mem_blocks)-th's; empty unless tie_word_embeddings."""
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    hybrid = zamba2_hybrid_layers(config)
    n = int(config.num_mem_blocks)
    return {layer: hybrid[j % n] for j, layer in enumerate(hybrid) if j >= n}


def _activation(name: str) -> nn.Module:
    if name not in ACT2FN:
        raise UnsupportedArchitectureError(f"hidden_act '{name}' is not supported by transformers' ACT2FN")
    return ACT2FN[name]


def _adapter_list(num_hybrid: int, num_mem_blocks: int, block_id: int, d_in: int, rank: int,
                  d_out: int) -> nn.ModuleList:
    """HF's adapter list of one block: entry j is Linear(d_in, rank) -> Linear(rank, d_out) for the
    hybrid layers j of this block (j % num_mem_blocks == block_id), else a parameterless Identity."""
    return nn.ModuleList([
        nn.Sequential(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False))
        if j % num_mem_blocks == block_id else nn.Identity()
        for j in range(num_hybrid)
    ])


class Zamba2Attention(PagedAttention):
    """HF `Zamba2Attention` for the hybrid layer `hybrid_index` (its adapters and its own KV cache)."""

    def __init__(self, config: PretrainedConfig, layer_name: str, hybrid_index: int, block_id: int,
                 num_hybrid: int) -> None:
        head_dim = int(config.attention_head_dim)
        super().__init__(
            layer_name=layer_name,
            hidden_size=int(config.attention_hidden_size),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            bias=False,
            rotary=build_rotary(config, head_dim, use_partial=False) if config.use_mem_rope else None,
            scale=(head_dim / 2) ** -0.5,
        )
        # o_proj maps back to hidden_size, not to the 2H input width
        self.o_proj = nn.Linear(config.num_attention_heads * head_dim, config.hidden_size, bias=False)
        self.hybrid_index = hybrid_index
        self.use_adapters = bool(config.use_shared_attention_adapter)
        if self.use_adapters:
            d = int(config.attention_hidden_size)
            args = (num_hybrid, int(config.num_mem_blocks), block_id, d, int(config.adapter_rank), d)
            self.linear_q_adapter_list = _adapter_list(*args)
            self.linear_k_adapter_list = _adapter_list(*args)
            self.linear_v_adapter_list = _adapter_list(*args)

    def shard_(self, tp: TPGroup) -> None:
        """PagedAttention's heads; each adapter's second projection (rank -> q / k / v) keeps the same
        rows as the projection it adds to (its first, d -> adapter_rank, stays whole on every rank:
        vLLM all-gathers that column-parallel [T, rank] output instead)."""
        (q_start, q_size), (kv_start, kv_size) = self.head_slices(tp)
        super().shard_(tp)
        if self.use_adapters:
            for adapters, start, size in ((self.linear_q_adapter_list, q_start, q_size),
                                          (self.linear_k_adapter_list, kv_start, kv_size),
                                          (self.linear_v_adapter_list, kv_start, kv_size)):
                for adapter in adapters:
                    if isinstance(adapter, nn.Sequential):
                        shard_columns(adapter[1], start, size)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """hidden [T, 2H], positions [T] -> [T, H]; PagedAttention.forward plus the adapters."""
        t = hidden.shape[0]
        q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        if self.use_adapters:
            j = self.hybrid_index
            q = q + self.linear_q_adapter_list[j](hidden)
            k = k + self.linear_k_adapter_list[j](hidden)
            v = v + self.linear_v_adapter_list[j](hidden)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = self.attend(q, k, v, attn_metadata)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.num_heads * self.head_dim)))


class Zamba2MLP(nn.Module):
    """HF `Zamba2MLP`: down_proj(act(gate) * up), [gate | up] = gate_up_proj(x) + adapter_j(x)."""

    def __init__(self, config: PretrainedConfig, hybrid_index: int, block_id: int, num_hybrid: int) -> None:
        super().__init__()
        h, inter = config.hidden_size, config.intermediate_size
        self.hybrid_index = hybrid_index
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=config.add_bias_linear)
        self.down_proj = nn.Linear(inter, h, bias=config.add_bias_linear)
        self.act_fn = _activation(config.hidden_act)
        self.gate_up_proj_adapter_list = _adapter_list(num_hybrid, int(config.num_mem_blocks), block_id, h,
                                                       int(config.adapter_rank), 2 * inter)

    tp: TPGroup = SINGLE

    def check_shardable(self, tp_size: int) -> None:
        check_divides("intermediate_size", self.down_proj.in_features, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        """gate_up_proj's fused [gate | up] sliced section by section ([gate_r | up_r]), each adapter's
        second projection alike; down_proj row-parallel (all-reduced)."""
        i = self.down_proj.in_features
        local = i // tp.world_size
        rows = torch.arange(tp.rank * local, (tp.rank + 1) * local)
        keep_rows(self.gate_up_proj, torch.cat([rows, i + rows]))
        for adapter in self.gate_up_proj_adapter_list:
            if isinstance(adapter, nn.Sequential):
                keep_rows(adapter[1], torch.cat([rows, i + rows]))
        shard_rows(self.down_proj, tp.rank * local, local, tp)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x) + self.gate_up_proj_adapter_list[self.hybrid_index](x)
        gate, up = torch.chunk(gate_up, 2, dim=-1)
        return self.tp.all_reduce(self.down_proj(self.act_fn(gate) * up))


class Zamba2SharedTransformer(nn.Module):
    """HF `Zamba2AttentionDecoderLayer` (one hybrid layer's copy of a shared block)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, hybrid_index: int, num_hybrid: int) -> None:
        super().__init__()
        block_id = hybrid_index % int(config.num_mem_blocks)
        self.block_id = block_id
        self.self_attn = Zamba2Attention(config, f"model.layers.{layer_idx}.shared_transformer.self_attn",
                                         hybrid_index, block_id, num_hybrid)
        self.feed_forward = Zamba2MLP(config, hybrid_index, block_id, num_hybrid)
        self.input_layernorm = RMSNorm(int(config.attention_hidden_size), eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, original: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        x = self.input_layernorm(torch.cat([h, original], dim=-1))
        x = self.self_attn(x, positions, attn_metadata)
        return self.feed_forward(self.pre_ff_layernorm(x))


def zamba2_mixer(config: PretrainedConfig, layer_name: str) -> Mamba2Mixer:
    return Mamba2Mixer(
        layer_name=layer_name,
        hidden_size=config.hidden_size,
        num_heads=config.n_mamba_heads,
        head_dim=int(config.mamba_headdim),
        state_size=config.mamba_d_state,
        n_groups=config.mamba_ngroups,
        conv_kernel=config.mamba_d_conv,
        chunk_size=config.chunk_size,
        use_bias=config.add_bias_linear,
        use_conv_bias=True,                               # HF builds conv1d with bias=True always
        norm_eps=1e-5,                                    # HF hard-codes the gated norm's eps
        time_step_limit=(config.time_step_min, float("inf")),
        activation="silu",
        intermediate_size=int(config.mamba_expand * config.hidden_size),
    )


class Zamba2MambaLayer(nn.Module):
    """HF `Zamba2MambaDecoderLayer`: h + mamba(input_layernorm(h + t)), t the shared block's output
    in a hybrid layer (None in a plain Mamba layer)."""

    def __init__(self, config: PretrainedConfig, prefix: str) -> None:
        super().__init__()
        self.layer_type = "mamba"
        self.mamba = zamba2_mixer(config, f"{prefix}.mamba")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, original: torch.Tensor | None, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None, transformer_out: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = h if transformer_out is None else h + transformer_out
        return h + self.mamba(self.input_layernorm(x), attn_metadata)


class Zamba2HybridLayer(nn.Module):
    """HF `Zamba2HybridLayer`: t = linear(shared_transformer(h, e)), then the Mamba layer with t."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, hybrid_index: int, num_hybrid: int) -> None:
        super().__init__()
        self.layer_type = "hybrid"
        self.linear = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.mamba_decoder = Zamba2MambaLayer(config, f"model.layers.{layer_idx}.mamba_decoder")
        self.shared_transformer = Zamba2SharedTransformer(config, layer_idx, hybrid_index, num_hybrid)

    def forward(self, h: torch.Tensor, original: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        t = self.linear(self.shared_transformer(h, original, positions, attn_metadata))
        return self.mamba_decoder(h, None, positions, attn_metadata, transformer_out=t)


class Zamba2Body(DecoderBody):
    """DecoderBody whose layers also get the original token embeddings."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: dict[str, object] | None) -> torch.Tensor:
        h = getattr(self, self.embed_name)(input_ids)
        original = h
        for block in self.layers:
            h = block(h, original, positions, attn_metadata)
        return getattr(self, self.final_norm_name)(h)


def _tie_block(target: nn.Module, source: nn.Module, force: bool) -> None:
    """Make `target`'s parameters `source`'s (same names). Unless `force`, a pair is tied only when
    both hold real, equal values (HF's from_pretrained leaves differing stored copies untied)."""
    for name, p in source.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = target.get_submodule(owner_name) if owner_name else target
        current = getattr(owner, leaf)
        if current is p:
            continue
        if not force and not current.is_meta:
            if p.is_meta or current.shape != p.shape or current.dtype != p.dtype \
                    or current.device != p.device or not torch.equal(current, p):
                continue
        setattr(owner, leaf, p)


_SHARED_KEY = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.(.+)$")
_LINEAR_KEY = re.compile(r"^model\.layers\.(\d+)\.linear\.weight$")


def _shared_blocks(state: dict[str, torch.Tensor]) -> tuple[list[int], dict[int, dict[str, torch.Tensor]]]:
    """(hybrid layer indices, layer -> {suffix: tensor} of its stored shared_transformer tensors)."""
    hybrid = sorted(int(m.group(1)) for k in state if (m := _LINEAR_KEY.match(k)))
    blocks: dict[int, dict[str, torch.Tensor]] = {}
    for k, t in state.items():
        m = _SHARED_KEY.match(k)
        if m:
            blocks.setdefault(int(m.group(1)), {})[m.group(2)] = t
    return hybrid, blocks


class Zamba2ForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "Zamba2ForCausalLM"
    hf_model_type = "zamba2"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        eps = config.rms_norm_eps
        hybrid = zamba2_hybrid_layers(config)
        blocks: list[nn.Module] = []
        for i, kind in enumerate(zamba2_layer_types(config)):
            if kind == "hybrid":
                blocks.append(Zamba2HybridLayer(config, i, hybrid.index(i), len(hybrid)))
            else:
                blocks.append(Zamba2MambaLayer(config, f"model.layers.{i}"))
        for target, source in zamba2_shared_block_ties(config).items():
            _tie_block(blocks[target].shared_transformer, blocks[source].shared_transformer, force=True)
        return Zamba2Body(("embed_tokens", nn.Embedding(config.vocab_size, config.hidden_size)), blocks,
                          ("final_layernorm", RMSNorm(config.hidden_size, eps=eps)))

    def tie_weights(self) -> None:
        """lm_head (CausalLM) and the shared blocks' copies (after loading or moving: only copies
        holding the same values are re-tied, as HF's from_pretrained does)."""
        super().tie_weights()
        layers = self.body.layers
        for target, source in zamba2_shared_block_ties(self.config).items():
            _tie_block(layers[target].shared_transformer, layers[source].shared_transformer, force=False)

    @staticmethod
    def checkpoint_to_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loader hook: a tied checkpoint stores each shared block under its first hybrid layer
        only (the first num_mem_blocks hybrid layers); the j-th hybrid layer without stored
        shared_transformer tensors gets a copy of the (j % num_mem_blocks)-th's."""
        hybrid, blocks = _shared_blocks(state)
        stored = [i for i in hybrid if i in blocks]
        n = len(stored)
        if n == len(hybrid) or n == 0 or stored != hybrid[:n]:
            return state                     # nothing tied, or a layout the loader will report
        out = dict(state)
        for j, layer in enumerate(hybrid):
            if layer not in blocks:
                for suffix, t in blocks[hybrid[j % n]].items():
                    out[f"model.layers.{layer}.shared_transformer.{suffix}"] = t
        return out

    @staticmethod
    def state_dict_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """save_hf_folder hook: for a tied model (lm_head.weight left out, which save_hf_folder does
        exactly when tie_word_embeddings holds), drop the shared-block copies that repeat the block of
        hybrid layer j % num_mem_blocks, as save_pretrained does; num_mem_blocks is the smallest
        period with which every copy equals its block."""
        if "lm_head.weight" in state:
            return state
        hybrid, blocks = _shared_blocks(state)
        if len(hybrid) < 2 or any(i not in blocks for i in hybrid):
            return state

        def same(a: int, b: int) -> bool:
            x, y = blocks[a], blocks[b]
            return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

        for n in range(1, len(hybrid)):
            if all(same(hybrid[j], hybrid[j % n]) for j in range(n, len(hybrid))):
                drop = {f"model.layers.{layer}.shared_transformer." for layer in hybrid[n:]}
                return {k: t for k, t in state.items() if not any(k.startswith(p) for p in drop)}
        return state
