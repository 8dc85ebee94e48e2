"""MiniMax's lightning attention (HF `MiniMaxLightningAttention`, vLLM `MiniMaxText01LinearAttention`):
linear attention with a fixed decay per head, over per-request state slots.

Per head h, with q, k, v = silu(qkv_proj(x)) split per head ([q_h | k_h | v_h] of D each):
    S_t = exp(-s_h) S_{t-1} + k_t^T v_t          S [D_k, D_v]
    o_t = q_t S_t
then RMSNorm over all H*D channels, times sigmoid(output_gate(x)), then out_proj. The decay s_h is a
fixed slope, (2^(-8/H))^(h+1) * (1 - l/(L-1+1e-5) + 1e-5) for layer l of L (`lightning_slopes`,
HF's `get_slope_rate`; vLLM's ALiBi-style `_build_slope_tensor` agrees only for a power-of-two H).

This is Mamba2's SSD recurrence exactly, with dt = 1, A = -s_h, B = k, C = q, x = v, D = 0, one
group per head, no conv and no gate inside: the layer runs on the SSD ops (`mamba2_update` for
decode and verify rows, `ssd_scan` for prefill chunks, which also leaves the states at chunk ends
for prefix caching; chunk_size 16 by default, so that cache mode "all" finds a chunk end on every
boundary of the default 16-token blocks: HF's `block_size` only tiles its own prefill).
State per slot: ssm_state [H, D_v, D_k] fp32 (the SSD layout, S transposed; HF's `linear_cache` holds
S as [H, D_k, D_v] in the model dtype).

HF's checkpoint holds the decays as buffers: `slope_rate` [H, 1, 1] is kept (loaded as stored,
float32), the per-block tables derived from it (`query_decay`, `key_decay`, `diagonal_decay`,
which depend on HF's prefill block_size only) are skipped on load and rebuilt on save
(toolkit/models/minimax.py).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from toolkit.attention.mamba2 import compute_chunk_metadata
from toolkit.distributed import SINGLE, TPGroup
from toolkit.kv_cache_spec import MambaSpec
from toolkit.layers.norms import RMSNorm
from toolkit.layers.parallel import keep_entries, keep_rows, shard_rows
from toolkit.layers.state_mixer import States, StateShard, StateSlotMixer


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """fp32 [H]: HF MiniMax's decay per head for layer `layer_idx` of `num_layers`."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** (torch.arange(num_heads) + 1)) * factor


class LightningAttention(StateSlotMixer):
    """Names as HF: qkv_proj [3*H*D, hidden] (per head [q | k | v]), output_gate [H*D, hidden],
    norm (RMSNorm over H*D), out_proj [hidden, H*D], slope_rate buffer [H, 1, 1]."""

    state_names = ("ssm_state",)

    def __init__(self, *, layer_name: str, hidden_size: int, num_heads: int, head_dim: int, layer_idx: int,
                 num_layers: int, chunk_size: int = 16, activation: str = "silu", norm_eps: float = 1e-6) -> None:
        super().__init__(layer_name)
        if activation != "silu":
            raise ValueError(f"{layer_name}: lightning attention with hidden_act {activation!r} is not supported "
                             "(MiniMax uses silu)")
        self.hidden_size, self.num_heads, self.head_dim, self.chunk_size = hidden_size, num_heads, head_dim, chunk_size
        inner = num_heads * head_dim
        self.qkv_proj = nn.Linear(hidden_size, 3 * inner, bias=False)
        self.output_gate = nn.Linear(hidden_size, inner, bias=False)
        self.norm = RMSNorm(inner, eps=norm_eps)
        self.out_proj = nn.Linear(inner, hidden_size, bias=False)
        self.register_buffer("slope_rate", lightning_slopes(num_heads, layer_idx, num_layers)[:, None, None])
        self.fp32_tensors = ("slope_rate",)         # float32 whatever the model's dtype (CausalLM.keep_fp32_)

    # -- tensor parallelism (vLLM shards heads) -----------------------------------------------
    tp: TPGroup = SINGLE
    full_inner: int | None = None       # H*D of the whole layer while sharded: the norm's statistic spans it

    def check_shardable(self, tp_size: int) -> None:
        if self.num_heads % tp_size:
            raise ValueError(f"{self.layer_name}: tensor parallel world size ({tp_size}) must divide the "
                             f"lightning attention's num heads ({self.num_heads})")

    def shard_(self, tp: TPGroup) -> None:
        """This rank's heads: their [q | k | v] rows of qkv_proj, output_gate rows, norm weights and
        slopes; out_proj row-parallel (all-reduced); the norm's mean square all-reduced over H*D."""
        n, r, d = tp.world_size, tp.rank, self.head_dim
        heads = self.num_heads // n
        head_ids = torch.arange(r * heads, (r + 1) * heads)
        channels = (head_ids[:, None] * d + torch.arange(d)[None, :]).reshape(-1)
        keep_rows(self.qkv_proj, (head_ids[:, None] * 3 * d + torch.arange(3 * d)[None, :]).reshape(-1))
        keep_rows(self.output_gate, channels)
        keep_entries(self.norm, "weight", channels)
        keep_entries(self, "slope_rate", head_ids)
        shard_rows(self.out_proj, r * heads * d, heads * d, tp)
        self.full_inner = self.num_heads * d
        self.num_heads = heads
        self.state_shards = (StateShard(0, head_ids, n * heads),)
        self.tp = tp

    # -- cache plumbing ---------------------------------------------------------------------
    def prefill_checkpoint_alignment(self) -> int | None:
        return self.chunk_size        # its SSD scan saves states at chunk ends

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """ssm_state [H, D_v, D_k] per slot."""
        return ((self.num_heads, self.head_dim, self.head_dim),)

    def get_kv_cache_spec(self) -> MambaSpec:
        return MambaSpec(shapes=self.state_shapes(), dtypes=(torch.float32,), mamba_type="linear_attention",
                         chunk_size=self.chunk_size)

    # -- forward ----------------------------------------------------------------------------
    def _norm(self, y: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the layer's H*D channels; sharded, the mean square over every rank's channels."""
        if self.full_inner is None:
            return self.norm(y)
        x = y.float()
        var = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True)) / self.full_inner
        return self.norm.weight * (x * torch.rsqrt(var + self.norm.eps)).to(y.dtype)

    def forward(self, hidden: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; tokens [decode | prefill | padding] (the
        LinearAttentionMetadata contract); attn_metadata None: a profile run (no state touched)."""
        t, h, d = hidden.shape[0], self.num_heads, self.head_dim
        dtype = hidden.dtype
        q, k, v = F.silu(self.qkv_proj(hidden)).view(t, h, 3, d).unbind(2)
        A = -self.slope_rate.view(h).to(torch.float32)
        dt = torch.ones(t, h, dtype=torch.float32, device=hidden.device)

        def decode(tok: slice, states: States, idx: torch.Tensor, **verify) -> torch.Tensor:
            (ssm_state,) = states
            return self.ops.mamba2_update(ssm_state, v[tok], dt[tok], A, k[tok], q[tok], None, idx, **verify)

        def prefill(tok: slice, states: States, idx: torch.Tensor, has_init: torch.Tensor,
                    cu_seqlens: torch.Tensor, md) -> torch.Tensor:
            (ssm_state,) = states
            if md is None:  # profile run: one sequence
                cu, sidx, last = (torch.from_numpy(a).to(hidden.device) for a in
                                  compute_chunk_metadata(np.array([v[tok].shape[0]]), np.array([0]),
                                                         self.chunk_size))
                chunks = (cu, sidx, last, self.chunk_size)
            else:
                chunks = (md.cu_chunk_seqlen_p, md.seq_idx_p, md.last_chunk_indices_p, int(md.chunk_size))
            return self.ops.ssd_scan(v[tok], dt[tok], A, k[tok], q[tok], None, *chunks, ssm_state, idx, has_init,
                                     checkpoints=self.checkpoints(md))

        y = self.run_state_slots(attn_metadata, (t, h, d), torch.float32, decode, prefill)
        out = self._norm(y.reshape(t, h * d).to(dtype)) * torch.sigmoid(self.output_gate(hidden))
        return self.tp.all_reduce(self.out_proj(out))

    def extra_repr(self) -> str:
        return f"layer_name={self.layer_name!r}, heads={self.num_heads}, head_dim={self.head_dim}"
