"""Mamba1 (selective scan) mixer over per-request recurrent state: HF `MambaMixer`,
`FalconMambaMixer` and `JambaMambaMixer` (torch paths) in one class.

Notation: T tokens, Di = intermediate_size (d_inner), N = d_state, R = time_step_rank, K conv
kernel, S sequences.

    x, z      = in_proj(hidden).split([Di, Di])
    x         = act(causal_conv1d(x))                       (conv state: last K-1 inputs)
    ts, B, C  = x_proj(x).split([R, N, N])
    [ts, B, C = rms(ts), rms(B), rms(C)]                    FalconMamba: no weight; Jamba: weighted
    dt        = softplus(ts @ dt_proj.weight^T + dt_proj.bias)          fp32
    h_t       = exp(dt_t * A) * h_{t-1} + (dt_t * B_t) * x_t            A = -exp(A_log)  [Di, N]
    y_t       = h_t . C_t + D * x_t
    out       = out_proj(y * silu(z))

The module wires the math; the math itself is the op set it calls (`self.ops`), whose torch
references sit beside their kernels in toolkit/kernels/:
  - conv with state           causal_conv1d_ref.py (shared with Mamba2, ShortConv and GDN)
  - `selective_scan_varlen`   per-token recurrence over S concatenated sequences (selective_scan_ref.py)
  - `selective_state_update`  one-token update (selective_scan_ref.py)
All SSM math is fp32. (HF's torch path adds dt_proj.bias and applies softplus in the model dtype;
in fp32 the two agree, in bf16 ours is the more precise, as vLLM's kernels are.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.distributed import SINGLE, TPGroup
from toolkit.kv_cache_spec import MambaSpec
from toolkit.layers.mlp import get_activation
from toolkit.layers.norms import RMSNorm
from toolkit.layers.parallel import check_divides, keep_entries, keep_rows, shard_columns, shard_rows
from toolkit.layers.state_mixer import States, StateShard, StateSlotMixer

BCDT_NORMS = (None, "weightless", "weighted")


# --------------------------------------------------------------------------------------------
# pure math
# --------------------------------------------------------------------------------------------


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF `FalconMambaWeightlessRMSNorm`: x / rms(x) over the last dim, computed in fp32, x.dtype out."""
    xf = x.to(torch.float32)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# --------------------------------------------------------------------------------------------
# module
# --------------------------------------------------------------------------------------------


class Mamba1Mixer(StateSlotMixer):
    """Mamba1 mixer; parameter names match HF (in_proj, conv1d, x_proj, dt_proj, A_log, D,
    out_proj [, dt_layernorm, b_layernorm, c_layernorm]).

    bcdt_norm: None (Mamba), "weightless" (FalconMamba: RMS norm without weight on dt-rank input,
    B and C; HF keeps its all-ones weights as non-persistent buffers, so nothing is stored) or
    "weighted" (Jamba: RMSNorm with weight, parameters dt_layernorm [R], b_layernorm [N],
    c_layernorm [N]); eps = bcdt_norm_eps.

    State per request slot: conv_state [K-1, Di] (model dtype), ssm_state [Di, N] (fp32); slot
    dispatch and cache binding: see state_mixer.py.
    """

    state_names = ("conv_state", "ssm_state")

    def __init__(
        self,
        *,
        layer_name: str,
        hidden_size: int,
        intermediate_size: int,
        state_size: int,
        conv_kernel: int,
        time_step_rank: int,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        activation: str = "silu",
        bcdt_norm: str | None = None,
        bcdt_norm_eps: float = 1e-6,
    ) -> None:
        super().__init__(layer_name)
        if bcdt_norm not in BCDT_NORMS:
            raise ValueError(f"bcdt_norm must be one of {BCDT_NORMS}, got {bcdt_norm!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.state_size = state_size
        self.conv_kernel = conv_kernel
        self.time_step_rank = int(time_step_rank)
        self.activation = activation
        self.bcdt_norm = bcdt_norm
        self.bcdt_norm_eps = float(bcdt_norm_eps)
        self._ones_cache: dict[tuple, torch.Tensor] = {}
        get_activation(activation)  # validate early

        di, n, r = intermediate_size, state_size, self.time_step_rank
        self.in_proj = nn.Linear(hidden_size, 2 * di, bias=use_bias)
        self.conv1d = nn.Conv1d(di, di, kernel_size=conv_kernel, groups=di, padding=conv_kernel - 1,
                                bias=use_conv_bias)  # weight [Di, 1, K] as in HF
        self.x_proj = nn.Linear(di, r + 2 * n, bias=False)
        self.dt_proj = nn.Linear(r, di, bias=True)
        self.A_log = nn.Parameter(torch.zeros(di, n))
        self.D = nn.Parameter(torch.ones(di))
        self.out_proj = nn.Linear(di, hidden_size, bias=use_bias)
        if bcdt_norm == "weighted":
            self.dt_layernorm = RMSNorm(r, eps=self.bcdt_norm_eps)
            self.b_layernorm = RMSNorm(n, eps=self.bcdt_norm_eps)
            self.c_layernorm = RMSNorm(n, eps=self.bcdt_norm_eps)

    # -- cache plumbing (bind_kv_cache / unbind_kv_cache: StateSlotMixer) --------------------
    # -- tensor parallelism (vLLM `MambaMixer`) ---------------------------------------------------
    tp: TPGroup = SINGLE

    def check_shardable(self, tp_size: int) -> None:
        check_divides(f"{self.layer_name}: intermediate_size", self.intermediate_size, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        """Keep this rank's channels Di/tp: in_proj's [x_r | z_r] rows, the conv's channels, A_log, D
        and dt_proj's rows (column-parallel); x_proj row-parallel (its [T, R + 2N] output all-reduced
        before the dt / B / C split and norms, which stay whole); out_proj row-parallel."""
        n, r, di = tp.world_size, tp.rank, self.intermediate_size
        local = di // n
        x = torch.arange(r * local, (r + 1) * local)
        keep_rows(self.in_proj, torch.cat([x, di + x]))
        keep_rows(self.conv1d, x)
        self.conv1d.in_channels = self.conv1d.out_channels = self.conv1d.groups = local
        shard_rows(self.x_proj, r * local, local, tp)
        shard_columns(self.dt_proj, r * local, local)
        keep_entries(self, "A_log", x)
        keep_entries(self, "D", x)
        shard_rows(self.out_proj, r * local, local, tp)
        self.state_shards = (StateShard(1, x, di), StateShard(0, x, di))
        self.intermediate_size, self.tp = local, tp

    def prefill_checkpoint_alignment(self) -> int | None:
        return 1                      # its conv and scan run token by token

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """conv_state [K-1, Di], ssm_state [Di, N] per slot."""
        return (self.conv_kernel - 1, self.intermediate_size), (self.intermediate_size, self.state_size)

    def get_kv_cache_spec(self) -> MambaSpec:
        return MambaSpec(
            shapes=self.state_shapes(),
            dtypes=(self.in_proj.weight.dtype, torch.float32),
            mamba_type="mamba1",
        )

    # -- forward --------------------------------------------------------------------------
    def _ssm_params(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output xc [T, Di] -> (dt [T, Di] fp32 softplus'ed, B [T, N], C [T, N])."""
        n, r = self.state_size, self.time_step_rank
        ts, B, C = torch.split(self.tp.all_reduce(self.x_proj(xc)), [r, n, n], dim=-1)
        if self.bcdt_norm == "weightless":     # = the op's RMS norm with a weight of ones (x * 1 is exact)
            ts, B, C = (self.ops.rms_norm(v, self._ones(v), self.bcdt_norm_eps) for v in (ts, B, C))
        elif self.bcdt_norm == "weighted":
            ts = self.dt_layernorm(ts)
            B = self.b_layernorm(B)
            C = self.c_layernorm(C)
        dt_raw = F.linear(ts, self.dt_proj.weight)            # bias added in fp32, as HF's scan does
        # softplus(dt_raw + bias) in fp32: Mamba2's dt preparation without its clamp (one launch)
        return self.ops.mamba2_dt(dt_raw, self.dt_proj.bias, None), B, C

    def _ones(self, like: torch.Tensor) -> torch.Tensor:
        """A weight of ones [like.shape[-1]] in like's dtype and device, cached (the weightless norm)."""
        key = (like.shape[-1], like.dtype, like.device)
        if key not in self._ones_cache:
            self._ones_cache[key] = torch.ones(like.shape[-1], dtype=like.dtype, device=like.device)
        return self._ones_cache[key]

    def forward(self, hidden: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size].

        Tokens are [decode tokens | prefill tokens | padding] (Mamba1AttentionMetadata contract);
        padding rows get a zero SSM output. attn_metadata None (profile run): the whole batch is
        one sequence from a zero state; no state reads or writes.
        """
        t = hidden.shape[0]
        dtype = hidden.dtype
        di = self.intermediate_size
        x, z = torch.split(self.in_proj(hidden), [di, di], dim=-1)
        weight = self.conv1d.weight[:, 0, :]
        bias = self.conv1d.bias
        A = self.neg_exp_A()

        def decode(tok: slice, states: States, idx: torch.Tensor, **verify) -> torch.Tensor:
            conv_state, ssm_state = states
            xc = self.ops.conv_update(x[tok], conv_state, idx, weight, bias, self.activation, **verify)
            dt, B, C = self._ssm_params(xc)
            return self.ops.mamba1_update(ssm_state, xc, dt, A, B, C, self.D, idx, **verify)

        def prefill(tok: slice, states: States, idx: torch.Tensor, has_init: torch.Tensor,
                    cu: torch.Tensor, md) -> torch.Tensor:
            conv_state, ssm_state = states
            checkpoints = self.checkpoints(md)
            xc = self.ops.conv_prefill(x[tok], conv_state, idx, has_init, cu, weight, bias, self.activation,
                                       checkpoints=checkpoints)
            dt, B, C = self._ssm_params(xc)
            return self.ops.mamba1_scan(xc, dt, A, B, C, self.D, cu, ssm_state, idx, has_init,
                                        checkpoints=checkpoints)

        y = self.run_state_slots(attn_metadata, (t, di), torch.float32, decode, prefill)
        # y * silu(z) in fp32, then dtype
        return self.tp.all_reduce(self.out_proj(self.ops.silu_and_mul(z, y, out_dtype=dtype)))

    def extra_repr(self) -> str:
        return f"layer_name={self.layer_name!r}, bcdt_norm={self.bcdt_norm!r}"
