"""NemotronH (HF `NemotronHForCausalLM`): a stack of single-mixer blocks, each one of Mamba2
("M"), GQA attention without positional encoding ("*"), a relu2 MLP ("-") or a sigmoid-routed MoE
with a shared expert ("E").

Layer i's kind is config.layers_block_type[i] ("linear_attention", "full_attention", "mlp",
"moe"); `NemotronHConfig` derives it from the legacy `hybrid_override_pattern` string. Every
block is  h = h + mixer(norm(h))  (one RMSNorm per block, no separate FFN sub-layer; HF ignores
config.residual_in_fp32). Differences from the Bamba-style blocks:
  - NemotronHRMSNorm multiplies by its weight in fp32 and casts the product (Llama casts first);
  - the Mamba2 mixer is HF's Bamba/Mamba2 mixer (grouped gated RMSNorm, gate before norm, groups
    of mamba_num_heads * mamba_head_dim // n_groups channels) with in_proj / out_proj biases from
    config.use_bias (not mamba_proj_bias) and dt clamped to [time_step_min, inf): HF builds
    `time_step_limit = (config.time_step_min, inf)` and ignores config.time_step_limit;
  - attention has no RoPE and never a bias (HF hard-codes bias=False whatever attention_bias says);
  - MLP: down_proj(relu2(up_proj(x))) (no gate), biases from mlp_bias;
  - MoE (DeepSeek-V3 routing): scores = sigmoid(x @ gate.weight^T) in fp32; experts are chosen on
    scores + gate.e_score_correction_bias (a checkpoint buffer) within the topk_group best of
    n_group groups (a group's score: the sum of its two best); the weights are the chosen raw
    scores, divided by their sum (+1e-20) if norm_topk_prob, times routed_scaling_factor. Experts
    are relu2 MLPs (up_proj [E, I, D], down_proj [E, D, I], D = moe_latent_size or hidden_size),
    accumulated in fp32; with moe_latent_size the experts run between fc1_latent_proj and
    fc2_latent_proj. out = experts + shared_experts(x) (a relu2 MLP).
  - lm_head is never tied: HF's NemotronHForCausalLM has no tied weights even when
    tie_word_embeddings is true.

Names (HF in-memory state_dict): model.embeddings, model.layers.{i}.norm, model.layers.{i}.mixer.*,
model.norm_f, lm_head. Checkpoints on disk (save_pretrained, NVIDIA's releases) say `backbone.`
instead of `model.` and hold per-expert tensors mixer.experts.{e}.{up,down}_proj.weight; the
loader / save_hf_folder convert through the hooks below (HF's conversion_mapping for nemotron_h).
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from toolkit.distributed import SINGLE, TPGroup
from toolkit.errors import UnsupportedArchitectureError
from toolkit.layers.attention import PagedAttention
from toolkit.layers.mamba2_mixer import Mamba2Mixer
from toolkit.layers.mlp import get_activation
from toolkit.layers.moe import DENSE_MAX_TOKENS, dense_routing, shard_experts
from toolkit.layers.norms import RMSNorm
from toolkit.layers.parallel import check_divides, shard_columns, shard_rows
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock

# HF layers_block_type -> our block kind (legacy names as HF's remap_legacy_layer_types)
LAYER_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
               "attention": "attention", "mlp": "mlp", "moe": "moe"}

_EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.mixer\.experts)\.(?P<e>\d+)\.(?P<proj>up_proj|down_proj)\.weight$")


def relu2(x: torch.Tensor) -> torch.Tensor:
    """HF ACT2FN["relu2"] (ReLUSquaredActivation): relu(x) ** 2."""
    return torch.square(F.relu(x))


def nemotron_h_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return relu2 if name == "relu2" else get_activation(name)


def nemotron_h_layer_types(config: PretrainedConfig) -> list[str]:
    """Per layer "mamba", "attention", "mlp" or "moe" (from config.layers_block_type)."""
    types = list(config.layers_block_type)
    bad = sorted({t for t in types if t not in LAYER_KINDS})
    if bad:
        raise UnsupportedArchitectureError(
            f"NemotronH layer types {bad} are not supported; supported: {sorted(LAYER_KINDS)}")
    return [LAYER_KINDS[t] for t in types]


class NemotronHRMSNorm(RMSNorm):
    """HF `NemotronHRMSNorm`: normalise in fp32, multiply by the weight in fp32, then cast to the
    input dtype (identical to RMSNorm in fp32; differs in bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * xf).to(in_dtype)


class NemotronHMLP(nn.Module):
    """x [T, H] -> down_proj(act(up_proj(x))); HF names up_proj / down_proj. Also the MoE's shared
    expert. Called as a block mixer, so it accepts (and ignores) the step's attn_metadata."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = nemotron_h_activation(act)

    tp: TPGroup = SINGLE

    def check_shardable(self, tp_size: int) -> None:
        check_divides("the MLP's intermediate size", self.down_proj.in_features, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        """up column-parallel, down row-parallel (all-reduced); relu2 is elementwise, so shard-safe."""
        size = self.down_proj.in_features // tp.world_size
        shard_columns(self.up_proj, tp.rank * size, size)
        shard_rows(self.down_proj, tp.rank * size, size, tp)
        self.tp = tp

    def forward(self, x: torch.Tensor, attn_metadata: dict[str, object] | None = None) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act_fn(self.up_proj(x))))


def sigmoid_group_topk_routing(
    router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
    norm_topk_prob: bool, routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF `NemotronHTopkRouter` (DeepSeek-V3) routing: router_logits fp32 [T, E] ->
    (weights fp32 [T, k], expert ids [T, k])."""
    t, e = router_logits.shape
    scores = router_logits.sigmoid()
    choice = scores + correction_bias.to(torch.float32)
    group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)       # [T, G]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class NemotronHTopkRouter(nn.Module):
    """Holds `weight` [E, H] and the buffer `e_score_correction_bias` [E] (both in checkpoints)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float) -> None:
        super().__init__()
        if num_experts % n_group != 0 or num_experts // n_group < 2:
            raise ValueError(f"{num_experts} experts cannot form {n_group} groups of at least 2")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights fp32 [T, k], ids [T, k])."""
        logits = F.linear(x.to(torch.float32), self.weight.to(torch.float32))
        return sigmoid_group_topk_routing(logits, self.e_score_correction_bias, self.top_k, self.n_group,
                                          self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)


class NemotronHExperts(nn.Module):
    """E non-gated experts down_proj[e] @ act(up_proj[e] @ x): up_proj [E, I, D], down_proj [E, D, I]."""

    graph_max_tokens = DENSE_MAX_TOKENS     # larger steps take the sparse path, which a CUDA graph cannot hold

    def __init__(self, input_size: int, intermediate_size: int, num_experts: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up_proj = nn.Parameter(torch.zeros(num_experts, intermediate_size, input_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, input_size, intermediate_size))
        self.act_fn = nemotron_h_activation(act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, D], weights fp32 [T, k], ids [T, k] -> [T, D] in x.dtype (summed in fp32)."""
        out = torch.zeros(x.shape, dtype=weights.dtype, device=x.device)
        if x.shape[0] <= DENSE_MAX_TOKENS:           # static shapes, no host sync (layers/moe.py)
            dense, routed = dense_routing(weights, ids, self.num_experts)
            for e in range(self.num_experts):
                y = F.linear(self.act_fn(F.linear(x, self.up_proj[e])), self.down_proj[e])
                out += torch.where(routed[:, e, None], (y * dense[:, e, None]).to(out.dtype), 0)
            return out.to(x.dtype)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            y = F.linear(self.act_fn(F.linear(x[tok], self.up_proj[e])), self.down_proj[e])
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        return out.to(x.dtype)


class NemotronHMoE(nn.Module):
    """x [T, H] -> fc2_latent_proj(experts(fc1_latent_proj(x))) + shared_experts(x). Names: gate.weight,
    gate.e_score_correction_bias, experts.up_proj, experts.down_proj, shared_experts.*,
    fc1_latent_proj / fc2_latent_proj (only with moe_latent_size)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h, latent = config.hidden_size, getattr(config, "moe_latent_size", None)
        self.gate = NemotronHTopkRouter(h, config.n_routed_experts, config.num_experts_per_tok, config.n_group,
                                        config.topk_group, bool(config.norm_topk_prob),
                                        config.routed_scaling_factor)
        self.experts = NemotronHExperts(latent or h, config.moe_intermediate_size, config.n_routed_experts,
                                        config.mlp_hidden_act)
        self.shared_experts = NemotronHMLP(h, config.moe_shared_expert_intermediate_size, bool(config.mlp_bias),
                                           config.mlp_hidden_act)
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(h, latent, bias=bool(config.mlp_bias))
            self.fc2_latent_proj = nn.Linear(latent, h, bias=bool(config.mlp_bias))
        else:
            self.fc1_latent_proj = nn.Identity()
            self.fc2_latent_proj = nn.Identity()

    tp: TPGroup = SINGLE

    def check_shardable(self, tp_size: int) -> None:
        check_divides("moe_intermediate_size", self.experts.down_proj.shape[-1], tp_size)

    def shard_(self, tp: TPGroup) -> None:
        """Every expert on every rank, its intermediate size split (non-gated: up_proj's rows); the
        router and the latent projections whole; the experts' partial sum all-reduced before
        fc2_latent_proj. The shared expert shards itself (an NemotronHMLP)."""
        shard_experts(self.experts, tp, gated=False)
        self.tp = tp

    def forward(self, x: torch.Tensor, attn_metadata: dict[str, object] | None = None) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed = self.fc2_latent_proj(self.tp.all_reduce(self.experts(self.fc1_latent_proj(x), weights, ids)))
        return routed + self.shared_experts(x)


def nemotron_h_mixer(config: PretrainedConfig, layer_idx: int, kind: str) -> nn.Module:
    name = f"model.layers.{layer_idx}.mixer"
    if kind == "mamba":
        return Mamba2Mixer(
            layer_name=name,
            hidden_size=config.hidden_size,
            num_heads=config.mamba_num_heads,
            head_dim=config.mamba_head_dim,
            state_size=config.ssm_state_size,
            n_groups=config.n_groups,
            conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size,
            use_bias=bool(config.use_bias),
            use_conv_bias=bool(config.use_conv_bias),
            norm_eps=config.layer_norm_epsilon,
            time_step_limit=(float(config.time_step_min), float("inf")),
            activation=config.mamba_hidden_act,
        )
    if kind == "attention":
        return PagedAttention(
            layer_name=name,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            bias=False,
            rotary=None,
        )
    if kind == "mlp":
        return NemotronHMLP(config.hidden_size, config.intermediate_size, bool(config.mlp_bias),
                            config.mlp_hidden_act)
    return NemotronHMoE(config)


def merge_nemotron_h_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `<prefix>.mixer.experts.{e}.{up,down}_proj.weight` -> fused `<prefix>.mixer.experts.
    {up,down}_proj` [E, ...], for every prefix whose experts 0..E-1 all have both; incomplete sets
    are left as they are (the loader then reports them)."""
    groups: dict[str, dict[tuple[int, str], str]] = defaultdict(dict)
    for k in state:
        m = _EXPERT_KEY.match(k)
        if m:
            groups[m["prefix"]][(int(m["e"]), m["proj"])] = k
    out = dict(state)
    for prefix, parts in groups.items():
        n = max(e for e, _ in parts) + 1
        if len(parts) != 2 * n:
            continue
        for proj in ("up_proj", "down_proj"):
            out[f"{prefix}.{proj}"] = torch.stack([state[parts[(e, proj)]] for e in range(n)])
        for k in parts.values():
            del out[k]
    return out


def split_nemotron_h_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `merge_nemotron_h_experts`."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        m = re.match(r"^(?P<prefix>.*\.mixer\.experts)\.(?P<proj>up_proj|down_proj)$", k)
        if m and v.dim() == 3:
            for e in range(v.shape[0]):
                out[f"{m['prefix']}.{e}.{m['proj']}.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


class NemotronHForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "NemotronHForCausalLM"
    hf_model_type = "nemotron_h"

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        eps = config.layer_norm_epsilon
        blocks = [PreNormBlock(("norm", NemotronHRMSNorm(config.hidden_size, eps=eps)),
                               ("mixer", nemotron_h_mixer(config, i, kind)), layer_type=kind)
                  for i, kind in enumerate(nemotron_h_layer_types(config))]
        return DecoderBody(("embeddings", nn.Embedding(config.vocab_size, config.hidden_size)), blocks,
                           ("norm_f", NemotronHRMSNorm(config.hidden_size, eps=eps)))

    def tie_weights(self) -> None:
        """Never tied: HF's NemotronHForCausalLM declares no tied weights (tie_word_embeddings is ignored)."""

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """CausalLM's seeded weights, plus e_score_correction_bias ~ N(0, 0.05) (a buffer; zero
        would leave the bias's part in expert selection untested)."""
        super().init_random_weights(seed)
        g = torch.Generator(device="cpu").manual_seed(int(seed) + 1)
        for mod in self.modules():
            if isinstance(mod, NemotronHTopkRouter):
                b = mod.e_score_correction_bias
                b.copy_((0.05 * torch.randn(b.shape, generator=g)).to(device=b.device, dtype=b.dtype))

    @staticmethod
    def remap_checkpoint_key(key: str) -> str:
        """Loader hook: `backbone.` (on disk) -> `model.` (HF's WeightRenaming for nemotron_h)."""
        return "model." + key[len("backbone."):] if key.startswith("backbone.") else key

    @staticmethod
    def checkpoint_to_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loader hook: per-expert checkpoint tensors -> fused experts."""
        return merge_nemotron_h_experts(state)

    @staticmethod
    def state_dict_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """save_hf_folder hook: the layout save_pretrained writes (`backbone.`, per-expert tensors)."""
        return {("backbone." + k[len("model."):] if k.startswith("model.") else k): v
                for k, v in split_nemotron_h_experts(state).items()}
