"""Kimi Delta Attention (KDA) mixer: HF `KimiLinearDeltaAttention` (Kimi Linear) over per-request state.

Notation: T tokens, H heads (q, k and v alike), D head dim (key = value dim), Dc = 3 * H * D.

    q, k, v  = q_proj(x), k_proj(x), v_proj(x)                 [T, H*D] each
    q, k, v  = split(silu(causal_conv1d([q | k | v])))         (one depthwise conv, no bias; conv state:
                                                                 the last K_conv - 1 inputs, Dc wide)
    g        = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)   [T, H, D]: a log decay per key channel
                                                                 (the low-rank "forget gate", fp32)
    beta     = sigmoid(b_proj(x))                               [T, H]
    per token and head (kernels/kda_ref.py):  S = S * exp(g)[None, :];  S += beta (v - S k) k^T;  o = S q
                                                                 (q, k l2-normalised, q / sqrt(D); fp32)
    out      = o_proj(rmsnorm(o) * w * sigmoid(g_b(g_a(x))))   (per head over D, all in fp32)

State per slot: conv_state [K_conv - 1, Dc] (model dtype), ssm_state [H, D, D] fp32 (vLLM's "K-last",
HF keeps the transpose). The layer runs on the Gated DeltaNet metadata builder (MambaSpec
mamba_type "gdn"), as vLLM's KimiDeltaAttention does; the ops are `kda_update` / `kda_prefill`.
HF names: q_proj, k_proj, v_proj, conv1d, forget_gate.{f_a_proj, f_b_proj, dt_bias, A_log}, b_proj,
g_a_proj, g_b_proj, o_norm, o_proj (checkpoints: q/k/v_conv1d and the gate's weights one level up,
toolkit/models/kimi_linear.py converts).
"""
from __future__ import annotations

import torch
from torch import nn

from toolkit.attention.gdn import GDN_CHUNK_SIZE
from toolkit.distributed import SINGLE, TPGroup
from toolkit.kv_cache_spec import MambaSpec
from toolkit.layers.gdn import prefill_chunks
from toolkit.layers.mlp import get_activation
from toolkit.layers.norms import RMSNorm
from toolkit.layers.parallel import check_divides, keep_entries, keep_rows, shard_rows
from toolkit.layers.state_mixer import States, StateShard, StateSlotMixer


class ForgetGate(nn.Module):
    """HF `KimiLinearForgetGate`: x [T, hidden] -> g fp32 [T, H, D] = -exp(A_log[h]) *
    softplus(f_b(f_a(x)) + dt_bias), softplus as HF writes it (x above 20 passes through)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(t, self.num_heads, self.head_dim)
        softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        return -torch.exp(self.A_log.float()).view(1, self.num_heads, 1) * softplus


class SigmoidGatedRMSNorm(RMSNorm):
    """HF `KimiLinearRMSNormGated`: rmsnorm(x) * weight * sigmoid(gate), all in fp32, cast to x.dtype
    (an RMSNorm subclass, so `init_random_weights` draws its weight as a norm's)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * xf * torch.sigmoid(gate.to(torch.float32))).to(x.dtype)


class KimiDeltaAttention(StateSlotMixer):
    """See the module docstring; slot dispatch and cache binding: state_mixer.py."""

    state_names = ("conv_state", "ssm_state")

    def __init__(self, *, layer_name: str, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int,
                 norm_eps: float, activation: str = "silu", chunk_size: int = GDN_CHUNK_SIZE) -> None:
        super().__init__(layer_name)
        if conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {conv_kernel}")
        get_activation(activation)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.qkv_dim = num_heads * head_dim
        self.conv_dim = 3 * self.qkv_dim
        self.conv_kernel, self.chunk_size, self.activation = conv_kernel, chunk_size, activation
        self.q_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=False)
        self.forget_gate = ForgetGate(hidden_size, num_heads, head_dim)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, self.qkv_dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.qkv_dim, hidden_size, bias=False)

    # -- tensor parallelism (by heads; the low-rank f_a / g_a projections whole on every rank) ------
    tp: TPGroup = SINGLE

    def check_shardable(self, tp_size: int) -> None:
        check_divides(f"{self.layer_name}: linear_attn_config num_heads", self.num_heads, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        n, r = tp.world_size, tp.rank
        h = self.num_heads // n
        rows = torch.arange(r * h * self.head_dim, (r + 1) * h * self.head_dim)
        heads = torch.arange(r * h, (r + 1) * h)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.forget_gate.f_b_proj, self.g_b_proj):
            keep_rows(proj, rows)
        conv = torch.cat([rows, self.qkv_dim + rows, 2 * self.qkv_dim + rows])
        keep_rows(self.conv1d, conv)
        keep_rows(self.b_proj, heads)
        keep_entries(self.forget_gate, "dt_bias", rows)
        keep_entries(self.forget_gate, "A_log", heads, dim=2)
        shard_rows(self.o_proj, r * h * self.head_dim, h * self.head_dim, tp)
        self.state_shards = (StateShard(1, conv, self.conv_dim), StateShard(0, heads, self.num_heads))
        self.num_heads = self.forget_gate.num_heads = h
        self.qkv_dim, self.conv_dim = h * self.head_dim, 3 * h * self.head_dim
        self.conv1d.in_channels = self.conv1d.out_channels = self.conv1d.groups = self.conv_dim
        self.tp = tp

    # -- cache plumbing -------------------------------------------------------------------
    def prefill_checkpoint_alignment(self) -> int | None:
        return 1                      # its conv and prefill ops save the state after any token

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """conv_state [K_conv-1, Dc], ssm_state [H, D, D] per slot."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_heads, self.head_dim, self.head_dim)

    def get_kv_cache_spec(self) -> MambaSpec:
        return MambaSpec(shapes=self.state_shapes(), dtypes=(self.o_proj.weight.dtype, torch.float32),
                         mamba_type="gdn", chunk_size=self.chunk_size)

    # -- forward --------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; tokens [decode | prefill | padding] (the GDN
        builder's contract); attn_metadata None: the profile run (one sequence, no state access)."""
        t, h, d = hidden.shape[0], self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        g = self.forget_gate(hidden)
        beta = torch.sigmoid(self.b_proj(hidden))
        weight = self.conv1d.weight[:, 0, :]

        def split(xc: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(x.reshape(x.shape[0], h, d) for x in torch.split(xc, [self.qkv_dim] * 3, dim=-1))

        def decode(tok: slice, states: States, idx: torch.Tensor, **verify) -> torch.Tensor:
            conv_state, ssm_state = states
            q, k, v = split(self.ops.conv_update(mixed[tok], conv_state, idx, weight, None, self.activation, **verify))
            return self.ops.kda_update(ssm_state, q, k, v, g[tok], beta[tok], idx, **verify)

        def prefill(tok: slice, states: States, idx: torch.Tensor, has_init: torch.Tensor,
                    cu_seqlens: torch.Tensor, md) -> torch.Tensor:
            conv_state, ssm_state = states
            checkpoints = self.checkpoints(md)
            q, k, v = split(self.ops.conv_prefill(mixed[tok], conv_state, idx, has_init, cu_seqlens, weight, None,
                                                  self.activation, checkpoints=checkpoints))
            chunks = prefill_chunks(md, q.shape[0], self.chunk_size, hidden.device)
            return self.ops.kda_prefill(q, k, v, g[tok], beta[tok], *chunks, ssm_state, idx, has_init,
                                        checkpoints=checkpoints)

        y = self.run_state_slots(attn_metadata, (t, h, d), torch.float32, decode, prefill)
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(t, h, d)
        out = self.o_norm(y.to(hidden.dtype), gate)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.qkv_dim)))

    def extra_repr(self) -> str:
        return f"layer_name={self.layer_name!r}, heads={self.num_heads}, head_dim={self.head_dim}"

