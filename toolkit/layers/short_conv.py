"""LFM2 gated short convolution (HF `Lfm2ShortConv` torch path) over per-request conv state.

    [B | C | x] = in_proj(hidden)            (each [T, D], D = hidden_size, in that order)
    u = B * x
    v = depthwise causal conv of u (kernel L = conv_L_cache, optional bias, NO activation)
    out = out_proj(C * v)

The only state is the conv state, vLLM "SD" layout [L-1, D] per request slot (the L-1 values of
`u` preceding the next token, oldest first; HF keeps L of them, the oldest of which the next
step never reads). The conv math is `causal_conv1d_varlen` / `causal_conv1d_step`
(toolkit/kernels/causal_conv1d_ref.py) with activation=None.
"""
from __future__ import annotations

import torch
from torch import nn

from toolkit.distributed import SINGLE, TPGroup
from toolkit.kv_cache_spec import MambaSpec
from toolkit.layers.parallel import check_divides, keep_rows, shard_rows
from toolkit.layers.state_mixer import States, StateShard, StateSlotMixer


class ShortConv(StateSlotMixer):
    """HF parameter names: in_proj [3D, D], conv (depthwise Conv1d, weight [D, 1, L]), out_proj [D, D].

    `bias` (HF `conv_bias`) applies to all three, as in HF. State per request slot: conv_state
    [L-1, D] (model dtype); slot dispatch and cache binding: see state_mixer.py.
    """

    state_names = ("conv_state",)

    def __init__(self, *, layer_name: str, hidden_size: int, conv_kernel: int, bias: bool = False) -> None:
        super().__init__(layer_name)
        if conv_kernel < 2:
            raise ValueError(f"conv_L_cache must be >= 2, got {conv_kernel}")
        self.hidden_size = hidden_size
        self.conv_kernel = conv_kernel
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = nn.Conv1d(
            hidden_size, hidden_size, kernel_size=conv_kernel, groups=hidden_size,
            padding=conv_kernel - 1, bias=bias,
        )
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    # -- tensor parallelism (vLLM `ShortConv`) ----------------------------------------------------
    tp: TPGroup = SINGLE

    def check_shardable(self, tp_size: int) -> None:
        check_divides(f"{self.layer_name}: hidden_size", self.hidden_size, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        """Keep this rank's channels D/tp: in_proj's [B_r | C_r | x_r] rows, the conv's channels;
        out_proj row-parallel (all-reduced). `hidden_size` becomes the local channel count (the
        residual stream stays whole: out_proj's output)."""
        d = self.hidden_size
        local = d // tp.world_size
        x = torch.arange(tp.rank * local, (tp.rank + 1) * local)
        keep_rows(self.in_proj, torch.cat([x, d + x, 2 * d + x]))
        keep_rows(self.conv, x)
        self.conv.in_channels = self.conv.out_channels = self.conv.groups = local
        shard_rows(self.out_proj, tp.rank * local, local, tp)
        self.state_shards = (StateShard(1, x, d),)
        self.hidden_size, self.tp = local, tp

    # -- cache plumbing (bind_kv_cache / unbind_kv_cache: StateSlotMixer) --------------------
    def prefill_checkpoint_alignment(self) -> int | None:
        return 1                      # a conv window ends at any token

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """conv_state [L-1, D] per slot."""
        return ((self.conv_kernel - 1, self.hidden_size),)

    def get_kv_cache_spec(self) -> MambaSpec:
        return MambaSpec(
            shapes=self.state_shapes(),
            dtypes=(self.in_proj.weight.dtype,),
            mamba_type="short_conv",
        )

    # -- forward --------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """hidden [T, D] -> [T, D].

        Tokens are [decode tokens | prefill tokens | padding] (ShortConvAttentionMetadata contract);
        padding rows get out_proj(0). attn_metadata None (profile run): the whole batch is one
        sequence from a zero state; no state reads or writes.
        """
        d = self.hidden_size
        B, C, x = self.in_proj(hidden).split(d, dim=-1)
        u = B * x
        weight = self.conv.weight[:, 0, :]
        bias = self.conv.bias

        def decode(tok: slice, states: States, idx: torch.Tensor, **verify) -> torch.Tensor:
            return self.ops.conv_update(u[tok], states[0], idx, weight, bias, None, **verify)

        def prefill(tok: slice, states: States, idx: torch.Tensor, has_init: torch.Tensor,
                    cu_seqlens: torch.Tensor, md) -> torch.Tensor:
            return self.ops.conv_prefill(u[tok], states[0], idx, has_init, cu_seqlens, weight, bias, None,
                                         checkpoints=self.checkpoints(md))

        v = self.run_state_slots(attn_metadata, tuple(u.shape), u.dtype, decode, prefill)
        return self.tp.all_reduce(self.out_proj(C * v))
