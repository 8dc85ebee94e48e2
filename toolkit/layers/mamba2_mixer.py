"""Mamba2 mixer (HF `Mamba2Mixer` / `BambaMixer` torch paths) over per-request recurrent state.

Notation: T tokens, H heads, P head_dim, N d_state, G n_groups (head h reads group h // (H // G)),
K conv kernel, Dc = conv_dim = H*P + 2*G*N, S sequences, C chunks.

The module wires the math; the math itself is the op set it calls (`self.ops`), whose torch
references sit beside their kernels in toolkit/kernels/:
  - `mamba2_dt`                  dt_raw -> softplus(dt_raw + dt_bias), clamped (selective_state_update_ref.py)
  - conv with state              causal_conv1d_ref.py (shared with Mamba1, ShortConv and GDN)
  - `ssd_chunk_scan_varlen`      chunked SSD scan over vLLM's varlen chunk layout (ssd_scan_ref.py)
  - `ssm_step`                   one-token SSM update (selective_state_update_ref.py)
  - `ssm_scan_sequential_ref`    plain per-token recurrence, the chunked scan's reference (ssd_scan_ref.py)
All SSM math is fp32.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from toolkit.attention.mamba2 import compute_chunk_metadata
from toolkit.distributed import SINGLE, TPGroup
from toolkit.kv_cache_spec import MambaSpec
from toolkit.layers.mlp import get_activation
from toolkit.layers.norms import RMSNormGated, RMSNormThenGate
from toolkit.layers.parallel import keep_entries, keep_rows, shard_rows
from toolkit.layers.state_mixer import States, StateShard, StateSlotMixer

# --------------------------------------------------------------------------------------------
# pure math
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# module
# --------------------------------------------------------------------------------------------


class Mamba2Mixer(StateSlotMixer):
    """Mamba2 mixer; parameter names match HF (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj).

    in_proj: hidden -> [gate (H*P) | xBC (Dc) | dt (H)]; xBC = [x (H*P) | B (G*N) | C (G*N)] goes
    through the depthwise causal conv + activation; y = SSM(x, dt, A=-exp(A_log), B, C, D);
    out = out_proj(gated_rmsnorm(y, gate)).

    State per request slot: conv_state [K-1, Dc] (model dtype), ssm_state [H, P, N] (fp32); slot
    dispatch and cache binding: see state_mixer.py.

    Options (defaults: plain Mamba2 / Bamba; Falcon-H1 uses them): out_proj_bias (None: use_bias);
    in_multiplier scales the input of in_proj; proj_multipliers [gate, x, B, C, dt] scale those
    sections of in_proj's output (HF Falcon-H1's `mup_vector`); use_norm=False drops `norm`
    (out = y * silu(gate)); norm_before_gate=True normalises y before gating (RMSNormThenGate).
    """

    state_names = ("conv_state", "ssm_state")

    def __init__(
        self,
        *,
        layer_name: str,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        chunk_size: int,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        norm_eps: float = 1e-5,
        time_step_limit: Sequence[float] | None = (0.0, float("inf")),
        activation: str = "silu",
        intermediate_size: int | None = None,
        out_proj_bias: bool | None = None,
        in_multiplier: float = 1.0,
        proj_multipliers: Sequence[float] | None = None,
        use_norm: bool = True,
        norm_before_gate: bool = False,
    ) -> None:
        super().__init__(layer_name)
        inter = num_heads * head_dim
        if intermediate_size is not None and intermediate_size != inter:
            raise ValueError(f"intermediate_size {intermediate_size} != num_heads*head_dim {inter}")
        if num_heads % n_groups != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of n_groups {n_groups}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.state_size = state_size
        self.n_groups = n_groups
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.intermediate_size = inter
        self.conv_dim = inter + 2 * n_groups * state_size
        self.time_step_limit = tuple(time_step_limit) if time_step_limit is not None else None
        self.activation = activation
        get_activation(activation)  # validate early

        self.in_proj = nn.Linear(hidden_size, inter + self.conv_dim + num_heads, bias=use_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel_size=conv_kernel, groups=self.conv_dim,
            padding=conv_kernel - 1, bias=use_conv_bias,
        )  # weight [Dc, 1, K] as in HF
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        norm_cls = RMSNormThenGate if norm_before_gate else RMSNormGated
        self.norm = norm_cls(inter, group_size=inter // n_groups, eps=norm_eps) if use_norm else None
        self.out_proj = nn.Linear(inter, hidden_size, bias=use_bias if out_proj_bias is None else out_proj_bias)
        # Falcon-H1's muP multipliers (1.0 / None: none applied, the arithmetic of the other models)
        self.in_multiplier = float(in_multiplier)
        if proj_multipliers is not None and len(proj_multipliers) != 5:
            raise ValueError(f"proj_multipliers: 5 values [gate, x, B, C, dt] expected, got {list(proj_multipliers)}")
        self.proj_multipliers = tuple(float(m) for m in proj_multipliers) if proj_multipliers is not None else None
        self._proj_mult_cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    # -- tensor parallelism (vLLM `MambaMixer2`) -------------------------------------------------
    tp: TPGroup = SINGLE
    norm_across_ranks = False        # one group replicated over the ranks: the gated norm's statistic
                                     # is all-reduced (over the full intermediate size)

    def check_shardable(self, tp_size: int) -> None:
        """vLLM's refusals: heads must split; groups must split, or be one group (replicated)."""
        if self.num_heads % tp_size:
            raise ValueError(f"{self.layer_name}: Tensor parallel world size ({tp_size}) must divide num heads "
                             f"({self.num_heads}).")
        if self.n_groups % tp_size and self.n_groups != 1:
            raise ValueError(f"{self.layer_name}: If tensor parallel world size ({tp_size}) does not divide "
                             f"num_groups ({self.n_groups}), then num_groups must equal 1.")
        if self.norm is not None and self.n_groups == 1 and tp_size > 1 and isinstance(self.norm, RMSNormThenGate):
            raise ValueError(f"{self.layer_name}: a norm-before-gate mixer with one group is not sharded yet")

    def shard_(self, tp: TPGroup) -> None:
        """Keep this rank's heads H/tp: in_proj's [gate_r | x_r | B_r | C_r | dt_r] rows, the conv's
        [x_r | B_r | C_r] channels, dt_bias / A_log / D and the norm weight for its heads; B and C by
        groups G/tp, or (G = 1) the one group on every rank; out_proj row-parallel (all-reduced)."""
        n, r = tp.world_size, tp.rank
        heads, groups, p, dn = self.num_heads // n, max(self.n_groups // n, 1), self.head_dim, self.state_size
        inter, full, gn = heads * p, self.intermediate_size, self.n_groups * dn
        x = torch.arange(r * inter, (r + 1) * inter)
        bc = self.group_rows(tp)
        dt = torch.arange(r * heads, (r + 1) * heads)
        keep_rows(self.in_proj, torch.cat([x, full + x, 2 * full + bc, 2 * full + gn + bc, 2 * full + 2 * gn + dt]))
        conv = torch.cat([x, full + bc, full + gn + bc])
        keep_rows(self.conv1d, conv)
        self.conv1d.in_channels = self.conv1d.out_channels = self.conv1d.groups = inter + 2 * groups * dn
        for name in ("dt_bias", "A_log", "D"):
            keep_entries(self, name, dt)
        if self.norm is not None:
            keep_entries(self.norm, "weight", x)
            self.norm_across_ranks = self.n_groups == 1
            self.norm.group_size = inter if self.n_groups == 1 else self.norm.group_size
        shard_rows(self.out_proj, r * inter, inter, tp)
        self.full_intermediate = full
        self.num_heads, self.n_groups, self.intermediate_size = heads, groups, inter
        self.conv_dim = inter + 2 * groups * dn
        self._proj_mult_cache.clear()
        self.state_shards = (StateShard(1, conv, full + 2 * gn), StateShard(0, dt, n * heads))
        self.tp = tp

    def group_rows(self, tp: TPGroup) -> torch.Tensor:
        """This rank's rows of B (and of C) [G/tp * N]: its groups, or the one group on every rank."""
        groups, dn = max(self.n_groups // tp.world_size, 1), self.state_size
        first = tp.rank * groups * dn if self.n_groups > 1 else 0
        return torch.arange(first, first + groups * dn)

    def _norm_over_ranks(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The gated norm of one group split over the ranks (RMSNormGated's math: gate, then the
        statistic over the full intermediate size, its sum of squares all-reduced)."""
        norm = self.norm
        x = y.float() * F.silu(gate.float())
        var = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True)) / self.full_intermediate
        return (norm.weight * (x * torch.rsqrt(var + norm.eps)).to(y.dtype)).to(dtype)

    # -- cache plumbing (bind_kv_cache / unbind_kv_cache: StateSlotMixer) --------------------
    def prefill_checkpoint_alignment(self) -> int | None:
        return self.chunk_size        # its SSD scan saves states at chunk ends

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """conv_state [K-1, Dc], ssm_state [H, P, N] per slot."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_heads, self.head_dim, self.state_size)

    def get_kv_cache_spec(self) -> MambaSpec:
        return MambaSpec(
            shapes=self.state_shapes(),
            dtypes=(self.in_proj.weight.dtype, torch.float32),
            mamba_type="mamba2",
            chunk_size=self.chunk_size,
        )

    # -- forward --------------------------------------------------------------------------
    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xBC [T, Dc] -> x [T, H, P], B [T, G, N], C [T, G, N]."""
        t = xbc.shape[0]
        gn = self.n_groups * self.state_size
        x, B, C = torch.split(xbc, [self.intermediate_size, gn, gn], dim=-1)
        return (
            x.reshape(t, self.num_heads, self.head_dim),
            B.reshape(t, self.n_groups, self.state_size),
            C.reshape(t, self.n_groups, self.state_size),
        )

    def forward(self, hidden: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size].

        Tokens are [decode tokens | prefill tokens | padding] (Mamba2AttentionMetadata contract).
        attn_metadata None (profile run): the whole batch is one sequence from a zero state; no
        state reads or writes.
        """
        t = hidden.shape[0]
        dtype = hidden.dtype
        if self.in_multiplier != 1.0:
            hidden = hidden * self.in_multiplier
        proj = self.in_proj(hidden)
        if self.proj_multipliers is not None:
            proj = proj * self._proj_multiplier_vector(proj.device, proj.dtype)
        gate, xbc, dt_raw = torch.split(proj, [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        weight = self.conv1d.weight[:, 0, :]
        bias = self.conv1d.bias
        A = self.neg_exp_A()

        def decode(tok: slice, states: States, idx: torch.Tensor, **verify) -> torch.Tensor:
            conv_state, ssm_state = states
            xbc_d = self.ops.conv_update(xbc[tok], conv_state, idx, weight, bias, self.activation, **verify)
            x, B, C = self._split_xbc(xbc_d)
            return self.ops.mamba2_update(ssm_state, x, dt_raw[tok], A, B, C, self.D, idx,
                                          self.dt_bias, self.time_step_limit, **verify)

        def prefill(tok: slice, states: States, idx: torch.Tensor, has_init: torch.Tensor,
                    cu_seqlens: torch.Tensor, md) -> torch.Tensor:
            conv_state, ssm_state = states
            checkpoints = self.checkpoints(md)
            xbc_p = self.ops.conv_prefill(xbc[tok], conv_state, idx, has_init, cu_seqlens, weight, bias,
                                          self.activation, checkpoints=checkpoints)
            x, B, C = self._split_xbc(xbc_p)
            if md is None:  # profile run: one sequence
                cu, sidx, last = (torch.from_numpy(a).to(hidden.device) for a in
                                  compute_chunk_metadata(np.array([x.shape[0]]), np.array([0]), self.chunk_size))
                chunks = (cu, sidx, last, self.chunk_size)
            else:
                chunks = (md.cu_chunk_seqlen_p, md.seq_idx_p, md.last_chunk_indices_p, int(md.chunk_size))
            dt = self.ops.mamba2_dt(dt_raw[tok], self.dt_bias, self.time_step_limit)
            return self.ops.ssd_scan(x, dt, A, B, C, self.D, *chunks, ssm_state, idx, has_init,
                                     checkpoints=checkpoints)

        y = self.run_state_slots(attn_metadata, (t, self.num_heads, self.head_dim), torch.float32, decode, prefill)
        y = y.reshape(t, self.intermediate_size)
        if self.norm is None:
            out = (y * F.silu(gate)).to(dtype)
        elif self.norm_across_ranks:
            out = self._norm_over_ranks(y, gate, dtype)
        else:
            out = self.norm(y, gate, out_dtype=dtype)
        return self.tp.all_reduce(self.out_proj(out))

    def _proj_multiplier_vector(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[in_proj out] vector of `proj_multipliers` over the sections [gate | x | B | C | dt]
        (HF Falcon-H1's `mup_vector`), cached per device and dtype."""
        key = (device, dtype)
        vec = self._proj_mult_cache.get(key)
        if vec is None:
            gn = self.n_groups * self.state_size
            sizes = (self.intermediate_size, self.intermediate_size, gn, gn, self.num_heads)
            vec = torch.cat([torch.full((n,), m, dtype=torch.float32) for n, m in zip(sizes, self.proj_multipliers)])
            vec = vec.to(device=device, dtype=dtype)
            self._proj_mult_cache[key] = vec
        return vec
