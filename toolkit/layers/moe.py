"""Sparse mixture-of-experts FFN (HF `JambaSparseMoeBlock`), torch reference path.

Routing: logits = x @ router.weight^T [T, E]; probs = softmax(logits) in fp32; the top-k probs
and their experts are taken per token; Jamba does NOT renormalise the k weights (they sum to < 1),
`renormalize=True` does (Mixtral-style). The weights are cast to the hidden dtype, then
out = sum_k w_k * expert_k(x), each expert a SwiGLU MLP.

Parameter layout = HF transformers 5.x in memory (and vLLM's fused MoE): router.weight [E, H],
experts.gate_up_proj [E, 2I, H] (rows [0, I) gate, [I, 2I) up), experts.down_proj [E, H, I].
Checkpoints on disk (what `save_pretrained` writes, and the released Jamba checkpoints) hold
per-expert tensors experts.{e}.gate_proj / up_proj / down_proj .weight instead:
`merge_expert_checkpoint_tensors` / `split_expert_state_tensors` convert between the two.
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.distributed import SINGLE, TPGroup
from toolkit.layers.mlp import get_activation
from toolkit.layers.ops import TORCH_OPS
from toolkit.layers.parallel import check_divides, keep_entries

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


# --------------------------------------------------------------------------------------------
# pure math
# --------------------------------------------------------------------------------------------


def topk_routing(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64), best first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


# Steps of at most this many tokens (decode steps, CUDA-graph capture sizes) run every expert on
# every token, weighted by a dense [T, E] routing matrix: static shapes, no host sync. Larger steps
# run each expert on its own tokens only (torch.unique / torch.where: data-dependent shapes, a sync).
DENSE_MAX_TOKENS = 512


def dense_routing(weights: torch.Tensor, ids: torch.Tensor, num_experts: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k weights [T, k] and expert ids [T, k] -> (weights [T, E], 0 off each token's top-k;
    routed bool [T, E]). An expert's output on a token not routed to it is dropped with `routed`,
    not multiplied by 0 (inf * 0 = nan), so the sum equals the sparse one."""
    t = ids.shape[0]
    dense = torch.zeros(t, num_experts, dtype=weights.dtype, device=weights.device).scatter_(1, ids, weights)
    routed = torch.zeros(t, num_experts, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)
    return dense, routed


# --------------------------------------------------------------------------------------------
# checkpoint layout
# --------------------------------------------------------------------------------------------


def merge_expert_checkpoint_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> fused ones, for every `<prefix>.experts` whose experts
    0..E-1 all have gate_proj, up_proj and down_proj. Incomplete sets are left as they are (the
    loader then reports them as unexpected, and the fused tensors as missing)."""
    groups: dict[str, dict[tuple[int, str], str]] = defaultdict(dict)
    for k in state:
        m = _PER_EXPERT.match(k)
        if m:
            groups[m["prefix"]][(int(m["e"]), m["proj"])] = k
    out = dict(state)
    for prefix, parts in groups.items():
        n = max(e for e, _ in parts) + 1
        if len(parts) != 3 * n:
            continue
        gate_up = torch.stack(
            [torch.cat([state[parts[(e, "gate_proj")]], state[parts[(e, "up_proj")]]], dim=0) for e in range(n)]
        )
        down = torch.stack([state[parts[(e, "down_proj")]] for e in range(n)])
        for k in parts.values():
            del out[k]
        out[f"{prefix}.gate_up_proj"] = gate_up
        out[f"{prefix}.down_proj"] = down
    return out


def split_expert_state_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `merge_expert_checkpoint_tensors`: fused `<prefix>.experts.gate_up_proj` /
    `.down_proj` -> per-expert `<prefix>.experts.{e}.{gate,up,down}_proj.weight` (contiguous)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if k.endswith(".experts.gate_up_proj") and v.dim() == 3:
            prefix = k[: -len(".gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif k.endswith(".experts.down_proj") and v.dim() == 3:
            prefix = k[: -len(".down_proj")]
            for e in range(v.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


_PER_EXPERT_W123 = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")


def merge_w123_expert_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral-style per-expert checkpoint tensors `<prefix>.experts.{e}.w1 / w3 / w2 .weight` (gate,
    up, down; Kimi Linear, LFM2-MoE, MiniMax) -> `<prefix>.experts.gate_up_proj` [E, 2I, H] ([w1; w3]
    per expert) and `.down_proj` [E, H, I], as transformers' conversion mapping merges them. A set
    with an expert or a projection missing is left as it is (the loader then names what is missing)."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        m = _PER_EXPERT_W123.match(key)
        if m:
            groups[m["prefix"]][int(m["e"])][m["w"]] = tensor
        else:
            out[key] = tensor
    for prefix, by_expert in groups.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))) or any(set(by_expert[e]) != {"w1", "w2", "w3"} for e in ids):
            out.update({f"{prefix}.{e}.{w}.weight": t for e in ids for w, t in by_expert[e].items()})
            continue
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["w1"], by_expert[e]["w3"]]) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["w2"] for e in ids])
    return out


def split_w123_expert_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `merge_w123_expert_tensors` (the layout save_pretrained writes)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        m = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", key)
        if not m or tensor.dim() != 3:
            out[key] = tensor
            continue
        for e, expert in enumerate(tensor):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}.{e}.w2.weight"] = expert.contiguous()
            else:
                gate, up = expert.chunk(2, dim=0)
                out[f"{m.group(1)}.{e}.w1.weight"] = gate.contiguous()
                out[f"{m.group(1)}.{e}.w3.weight"] = up.contiguous()
    return out


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------


class TopKRouter(nn.Module):
    """Holds `weight` [E, H] (HF `JambaTopKRouter`); forward(x [T, H]) -> logits [T, E]."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedExperts(nn.Module):
    """E SwiGLU experts as 3D tensors gate_up_proj [E, 2I, H], down_proj [E, H, I] (HF names)."""

    graph_max_tokens = DENSE_MAX_TOKENS     # larger steps take the sparse path, which a CUDA graph cannot hold

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, hidden_act: str = "silu") -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))
        get_activation(hidden_act)              # validate: only the SiLU family is supported
        self.ops = TORCH_OPS                        # set_ops() swaps in the Triton kernel

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x [N, H] -> [N, H]."""
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.ops.silu_and_mul(gate, up), self.down_proj[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights [T, k] (x.dtype), ids [T, k] -> sum_k weights * expert_ids(x); a loop
        over the experts (all of them for few tokens, see `DENSE_MAX_TOKENS`)."""
        out = torch.zeros_like(x)
        if x.shape[0] <= DENSE_MAX_TOKENS:
            dense, routed = dense_routing(weights, ids, self.num_experts)
            for e in range(self.num_experts):
                y = self.expert(e, x) * dense[:, e, None]
                out += torch.where(routed[:, e, None], y.to(out.dtype), 0)
            return out
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            y = self.expert(e, x[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def shard_experts(experts: nn.Module, tp: TPGroup, gated: bool = True) -> None:
    """Keep this rank's slice of every expert's intermediate size (vLLM's fused MoE in TP mode):
    gate_up_proj [E, 2I, H]'s [gate_r | up_r] rows (`gated`; a non-gated up_proj [E, I, H]: its rows)
    and down_proj [E, H, I]'s columns. The experts' sum is a partial one: the caller all-reduces it."""
    up_name = "gate_up_proj" if gated else "up_proj"
    i = experts.down_proj.shape[-1]
    local = i // tp.world_size
    rows = torch.arange(tp.rank * local, (tp.rank + 1) * local)
    keep = torch.cat([rows, i + rows]) if gated else rows
    keep_entries(experts, up_name, keep, dim=1)
    keep_entries(experts, "down_proj", rows, dim=2)
    if hasattr(experts, "intermediate_size"):
        experts.intermediate_size = local


class ShardedExperts:
    """Tensor parallelism of a MoE block holding fused gated `experts` (vLLM's fused MoE in TP mode):
    every expert on every rank, its intermediate channels split (`shard_experts`); the router, a
    routing bias and a shared expert's gate whole, so every rank routes alike; the block all-reduces
    the experts' partial sum with `self.tp` (a shared expert, an MLP of its own, shards and reduces
    itself). `experts_size_name` is the config field a refusal names."""

    tp: TPGroup = SINGLE
    experts_size_name = "moe_intermediate_size"
    experts: FusedExperts

    def check_shardable(self, tp_size: int) -> None:
        check_divides(self.experts_size_name, self.experts.intermediate_size, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        shard_experts(self.experts, tp)
        self.tp = tp


class SparseMoeBlock(ShardedExperts, nn.Module):
    """x [T, H] -> [T, H]: router (top-k softmax) then the experts. Names: router.weight,
    experts.gate_up_proj, experts.down_proj."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        hidden_act: str = "silu",
        renormalize: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.router = TopKRouter(hidden_size, num_experts)
        self.experts = FusedExperts(hidden_size, intermediate_size, num_experts, hidden_act)

    experts_size_name = "the experts' intermediate_size"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_routing(self.router(x), self.top_k, self.renormalize)
        return self.tp.all_reduce(self.experts(x, weights.to(x.dtype), ids))
