"""Gated DeltaNet (GDN) mixer: HF `Qwen3NextGatedDeltaNet` (torch paths) over per-request state.

Notation: T tokens, Hk key heads (Q/K), Hv value heads (Hv = r * Hk, head h reads key head h // r),
K key head dim, V value head dim, Dc = conv_dim = 2*Hk*K + Hv*V, S sequences, C chunks.

    [q | k | v | z] per key head = in_proj_qkvz(hidden)     (each key head's group holds its q [K],
    [b | a]         per key head = in_proj_ba(hidden)        k [K], r value heads' v and z, r b, r a)
    q, k, v  = split(silu(causal_conv1d([q | k | v])))        (conv state: last K-1 inputs, no bias)
    beta     = sigmoid(b);   g = -exp(A_log) * softplus(a + dt_bias)          (g: log decay, fp32)
    q, k     = l2norm(q), l2norm(k);  q = q / sqrt(K)         (eps 1e-6, FLA's use_qk_l2norm_in_kernel)
    per token, per value head (the gated delta rule):
        S   = exp(g_t) * S
        S   = S + beta_t * (v_t - S k_t) k_t^T                 S [V, K]
        o_t = S q_t
    out      = out_proj(rmsnorm(o) * silu(z))                 (per value head, norm before gate)

Qwen3.5's GDN (`SplitGatedDeltaNet`, below) is the same mixer with one projection per input:
in_proj_qkv gives [q | k | v] flat, in_proj_z, in_proj_b and in_proj_a the rest, nothing to reorder.

State per request slot (vLLM's layout: `gated_delta_net_state_shape` in vLLM's mamba_utils):
    conv_state [K_conv-1, Dc] in the model dtype ("SD": the K_conv-1 conv inputs before the next token)
    ssm_state  [Hv, V, K] fp32: S above, vLLM's `(num_v_heads, head_v_dim, head_k_dim)` ("K-last").
HF keeps the transpose, [batch, Hv, K, V], so ours == hf[0].transpose(-1, -2).

`gdn_gating` (a, b -> g, the fp32 log decay, and beta) is below. The rest of the math is the op
set the mixer calls (`self.ops`), whose torch references sit beside their kernels in
toolkit/kernels/gated_delta_rule_ref.py (and causal_conv1d_ref.py for the conv):
  - `gdn_prepare_qk`        GVA head repeat, l2norm and 1/sqrt(K) scaling of q and k
  - `gdn_step`              one-token update (the recurrent form)
  - `gdn_recurrent_varlen`  the recurrence one token at a time over varlen sequences (the reference)
  - `gdn_chunk_varlen`      chunked prefill (UT transform per chunk, HF `torch_chunk_gated_delta_rule`)
                            over a varlen chunk layout with initial states
and in place at state indices (the ops `gdn_update` / `gdn_prefill`, with the Triton kernels of
toolkit/kernels/gated_delta_rule.py as the other set):
  - `gdn_update_at_slots`   decode rows
  - `gdn_prefill_at_slots`  prefill rows (with `checkpoints`, cache mode "all": also the states after
                            chosen tokens, from `gdn_states_after`, the plain recurrence)
All delta-rule math is fp32.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from toolkit.attention.gdn import GDN_CHUNK_SIZE, compute_gdn_chunk_metadata
from toolkit.distributed import SINGLE, TPGroup
from toolkit.kv_cache_spec import MambaSpec
from toolkit.layers.mlp import get_activation
from toolkit.layers.norms import RMSNormThenGate
from toolkit.layers.parallel import check_divides, keep_entries, keep_rows, shard_rows
from toolkit.layers.state_mixer import States, StateShard, StateSlotMixer

# --------------------------------------------------------------------------------------------
# pure math
# --------------------------------------------------------------------------------------------


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv]; A_log, dt_bias [Hv] -> (g fp32 [T, Hv] = -exp(A_log) * softplus(a + dt_bias),
    beta [T, Hv] = sigmoid(b) in b.dtype), as HF computes them."""
    g = -torch.exp(A_log.to(torch.float32)) * F.softplus(a.to(torch.float32) + dt_bias.to(torch.float32))
    return g, torch.sigmoid(b)


def prefill_chunks(md, num_tokens: int, chunk_size: int, device: torch.device) -> tuple:
    """(cu_chunk_seqlens, seq_idx, last_chunk_indices, chunk_size) of a delta-rule prefill: the
    metadata's, or in the profile run (md None) the chunks of one sequence of num_tokens."""
    if md is not None:
        return md.cu_chunk_seqlen_p, md.seq_idx_p, md.last_chunk_indices_p, int(md.chunk_size)
    cu, sidx, last = (torch.from_numpy(x).to(device)
                      for x in compute_gdn_chunk_metadata(np.array([num_tokens]), chunk_size))
    return cu, sidx, last, chunk_size


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------


class GatedDeltaNet(StateSlotMixer):
    """Qwen3-Next linear attention; parameter names match HF (in_proj_qkvz, in_proj_ba, conv1d,
    dt_bias, A_log, norm, out_proj). See the module docstring for the math and the state layout;
    slot dispatch and cache binding: state_mixer.py."""

    state_names = ("conv_state", "ssm_state")

    def __init__(
        self,
        *,
        layer_name: str,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        norm_eps: float = 1e-6,
        activation: str = "silu",
        chunk_size: int = GDN_CHUNK_SIZE,
        beta_scale: float = 1.0,
    ) -> None:
        super().__init__(layer_name)
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"linear_num_value_heads {num_v_heads} is not a multiple of "
                             f"linear_num_key_heads {num_k_heads}")
        if conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {conv_kernel}")
        self.hidden_size = hidden_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.beta_scale = beta_scale        # OLMo Hybrid's allow_neg_eigval: 2 (beta in [0, 2])
        self.activation = activation
        get_activation(activation)  # validate early

        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=False)     # weight [Dc, 1, K] as in HF
        self.make_projections()
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        # HF Qwen3NextRMSNormGated, and the output projection, under the checkpoint's names
        self.add_module(self.norm_name, RMSNormThenGate(head_v_dim, eps=norm_eps, cast_normed=True))
        self.add_module(self.out_proj_name, nn.Linear(self.value_dim, hidden_size, bias=False))

    norm_name, out_proj_name = "norm", "out_proj"      # OLMo Hybrid: o_norm, o_proj

    @property
    def gated_norm(self) -> RMSNormThenGate:
        return getattr(self, self.norm_name)

    @property
    def output_proj(self) -> nn.Linear:
        return getattr(self, self.out_proj_name)

    def make_projections(self) -> None:
        """HF Qwen3-Next's fused input projections, grouped per key head (see `project`)."""
        self.in_proj_qkvz = nn.Linear(self.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(self.hidden_size, 2 * self.num_v_heads, bias=False)

    # -- tensor parallelism (vLLM `QwenGatedDeltaNetAttention`, interleaved layout) --------------
    tp: TPGroup = SINGLE

    def check_shardable(self, tp_size: int) -> None:
        check_divides(f"{self.layer_name}: linear_num_key_heads", self.num_k_heads, tp_size)
        check_divides(f"{self.layer_name}: linear_num_value_heads", self.num_v_heads, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        """Keep Hk/tp key heads and their Hv/tp value heads: in_proj_qkvz / in_proj_ba are grouped per
        key head on disk ([q_g | k_g | v_g | z_g], [b_g | a_g]), so a contiguous 1/tp of their rows is
        whole groups; the conv's flat [q | k | v] channels sliced section by section; A_log and
        dt_bias per value head; the per-head gated norm whole; out_proj row-parallel (all-reduced)."""
        n, r = tp.world_size, tp.rank
        hk, hv, kd, vd = self.num_k_heads // n, self.num_v_heads // n, self.head_k_dim, self.head_v_dim
        q = torch.arange(r * hk * kd, (r + 1) * hk * kd)
        v = torch.arange(r * hv * vd, (r + 1) * hv * vd)
        conv = torch.cat([q, self.key_dim + q, 2 * self.key_dim + v])
        self.shard_projections(tp, q, v, torch.arange(r * hv, (r + 1) * hv))
        keep_rows(self.conv1d, conv)
        self.state_shards = (StateShard(1, conv, self.conv_dim),
                             StateShard(0, torch.arange(r * hv, (r + 1) * hv), self.num_v_heads))
        keep_entries(self, "dt_bias", torch.arange(r * hv, (r + 1) * hv))
        keep_entries(self, "A_log", torch.arange(r * hv, (r + 1) * hv))
        shard_rows(self.output_proj, r * hv * vd, hv * vd, tp)
        self.num_k_heads, self.num_v_heads = hk, hv
        self.key_dim, self.value_dim = hk * kd, hv * vd
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d.in_channels = self.conv1d.out_channels = self.conv1d.groups = self.conv_dim
        self.tp = tp

    def shard_projections(self, tp: TPGroup, key_rows: torch.Tensor, value_rows: torch.Tensor,
                          value_heads: torch.Tensor) -> None:
        """This rank's rows of the input projections (called before the sizes shrink). The fused ones
        hold whole key-head groups, so a contiguous 1/tp of their rows; the split layouts take the
        rank's key channels (`key_rows`, of q and of k), value channels and value heads."""
        n, r = tp.world_size, tp.rank
        qkvz = self.in_proj_qkvz.out_features // n
        keep_rows(self.in_proj_qkvz, torch.arange(r * qkvz, (r + 1) * qkvz))
        ba = self.in_proj_ba.out_features // n
        keep_rows(self.in_proj_ba, torch.arange(r * ba, (r + 1) * ba))

    # -- cache plumbing (bind_kv_cache / unbind_kv_cache: StateSlotMixer) --------------------
    def prefill_checkpoint_alignment(self) -> int | None:
        return 1                      # its conv and its prefill kernels save the state after any token

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """conv_state [K_conv-1, Dc], ssm_state [Hv, V, K] per slot."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_v_heads, self.head_v_dim, self.head_k_dim)

    def get_kv_cache_spec(self) -> MambaSpec:
        return MambaSpec(
            shapes=self.state_shapes(),
            dtypes=(self.output_proj.weight.dtype, torch.float32),
            mamba_type="gdn",
            chunk_size=self.chunk_size,
        )

    # -- forward --------------------------------------------------------------------------
    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [T, D] -> (mixed_qkv [T, Dc] = [q | k | v] flat (the conv input), z [T, Hv, V],
        b [T, Hv], a [T, Hv]), undoing the per-key-head grouping of HF's fused projections
        (`fix_query_key_value_ordering`)."""
        t = hidden.shape[0]
        hk, kd, vd = self.num_k_heads, self.head_k_dim, self.head_v_dim
        r = self.num_v_heads // hk
        qkvz = self.in_proj_qkvz(hidden).view(t, hk, 2 * kd + 2 * r * vd)
        q, k, v, z = torch.split(qkvz, [kd, kd, r * vd, r * vd], dim=-1)
        b, a = torch.split(self.in_proj_ba(hidden).view(t, hk, 2 * r), [r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, self.key_dim), k.reshape(t, self.key_dim), v.reshape(t, self.value_dim)],
                          dim=-1)
        return (mixed, z.reshape(t, self.num_v_heads, vd), b.reshape(t, self.num_v_heads),
                a.reshape(t, self.num_v_heads))

    def _split_qkv(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv output [T, Dc] -> q, k [T, Hk, K], v [T, Hv, V]."""
        t = xc.shape[0]
        q, k, v = torch.split(xc, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(t, self.num_k_heads, self.head_k_dim), k.reshape(t, self.num_k_heads, self.head_k_dim),
                v.reshape(t, self.num_v_heads, self.head_v_dim))

    def forward(self, hidden: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size].

        Tokens are [decode tokens | prefill tokens | padding] (GDNAttentionMetadata contract);
        padding rows get out_proj(0). attn_metadata None (profile run): the whole batch is one
        sequence from a zero state; no state reads or writes.
        """
        t = hidden.shape[0]
        dtype = hidden.dtype
        mixed, z, b, a = self.project(hidden)
        g, beta = gdn_gating(a, b, self.A_log, self.dt_bias)
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        weight = self.conv1d.weight[:, 0, :]

        def decode(tok: slice, states: States, idx: torch.Tensor, **verify) -> torch.Tensor:
            conv_state, ssm_state = states
            xc = self.ops.conv_update(mixed[tok], conv_state, idx, weight, None, self.activation, **verify)
            q, k, v = self._split_qkv(xc)
            return self.ops.gdn_update(ssm_state, q, k, v, g[tok], beta[tok], idx, **verify)

        def prefill(tok: slice, states: States, idx: torch.Tensor, has_init: torch.Tensor,
                    cu_seqlens: torch.Tensor, md) -> torch.Tensor:
            conv_state, ssm_state = states
            checkpoints = self.checkpoints(md)
            xc = self.ops.conv_prefill(mixed[tok], conv_state, idx, has_init, cu_seqlens, weight, None,
                                       self.activation, checkpoints=checkpoints)
            q, k, v = self._split_qkv(xc)
            chunks = prefill_chunks(md, q.shape[0], self.chunk_size, hidden.device)
            return self.ops.gdn_prefill(q, k, v, g[tok], beta[tok], *chunks, ssm_state, idx, has_init,
                                        checkpoints=checkpoints)

        y = self.run_state_slots(attn_metadata, (t, self.num_v_heads, self.head_v_dim), torch.float32,
                                 decode, prefill)
        out = self.gated_norm(y.to(dtype), z)                  # per value head, over V
        return self.tp.all_reduce(self.output_proj(out.reshape(t, self.value_dim)))

    def extra_repr(self) -> str:
        return (f"layer_name={self.layer_name!r}, heads k/v={self.num_k_heads}/{self.num_v_heads}, "
                f"head dims k/v={self.head_k_dim}/{self.head_v_dim}, chunk_size={self.chunk_size}")


class SplitGatedDeltaNet(GatedDeltaNet):
    """HF `Qwen3_5GatedDeltaNet`: the same mixer with one projection per input instead of Qwen3-Next's
    per-key-head groups: in_proj_qkv [2*Hk*K + Hv*V, D] (the conv input [q | k | v], flat, as the
    conv reads it), in_proj_z [Hv*V, D], in_proj_b and in_proj_a [Hv, D] (no reordering to undo)."""

    def make_projections(self) -> None:
        self.in_proj_qkv = nn.Linear(self.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)

    def shard_projections(self, tp: TPGroup, key_rows: torch.Tensor, value_rows: torch.Tensor,
                          value_heads: torch.Tensor) -> None:
        """in_proj_qkv section by section (the conv's channels), z by value channels, b and a by value heads."""
        keep_rows(self.in_proj_qkv, torch.cat([key_rows, self.key_dim + key_rows, 2 * self.key_dim + value_rows]))
        keep_rows(self.in_proj_z, value_rows)
        keep_rows(self.in_proj_b, value_heads)
        keep_rows(self.in_proj_a, value_heads)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [T, D] -> (mixed_qkv [T, Dc], z [T, Hv, V], b [T, Hv], a [T, Hv])."""
        t = hidden.shape[0]
        return (self.in_proj_qkv(hidden), self.in_proj_z(hidden).view(t, self.num_v_heads, self.head_v_dim),
                self.in_proj_b(hidden), self.in_proj_a(hidden))


class OlmoGatedDeltaNet(GatedDeltaNet):
    """HF `OlmoHybridGatedDeltaNet`: the same mixer with a projection per input, q_proj / k_proj
    [Hk*K, D], v_proj [Hv*V, D] (concatenated as the conv's [q | k | v] input), the output gate from
    g_proj [Hv*V, D], a_proj / b_proj [Hv, D]; beta = beta_scale * sigmoid(b) (2 with
    `linear_allow_neg_eigval`); the gated norm and output projection named o_norm / o_proj."""

    norm_name, out_proj_name = "o_norm", "o_proj"

    def make_projections(self) -> None:
        self.q_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.g_proj = nn.Linear(self.hidden_size, self.value_dim, bias=False)

    def shard_projections(self, tp: TPGroup, key_rows: torch.Tensor, value_rows: torch.Tensor,
                          value_heads: torch.Tensor) -> None:
        """q / k by key channels, v and the gate by value channels, a / b by value heads."""
        for proj, rows in ((self.q_proj, key_rows), (self.k_proj, key_rows), (self.v_proj, value_rows),
                           (self.g_proj, value_rows), (self.a_proj, value_heads), (self.b_proj, value_heads)):
            keep_rows(proj, rows)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [T, D] -> (mixed_qkv [T, Dc], gate [T, Hv, V], b [T, Hv], a [T, Hv])."""
        t = hidden.shape[0]
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        return (mixed, self.g_proj(hidden).view(t, self.num_v_heads, self.head_v_dim), self.b_proj(hidden),
                self.a_proj(hidden))
