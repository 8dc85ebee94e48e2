"""xLSTM's mLSTM layer (HF transformers `xLSTMLayer`, weight_mode "single"), over per-request state slots.

Per token x [hidden], with H heads, K = qk_dim / H, V = v_dim / H:
    q, k = q(x), k(x) [H, K];  v = v(x) [H, V]
    i = cap(igate_preact(x)), f = cap(fgate_preact(x)) [H]      cap(z) = c * tanh(z / c), c = gate_soft_cap
    h = mLSTM(q, k, v, i, f) [H, V]      the stabilised matrix-memory recurrence (kernels/mlstm_ref.py)
    y = out_proj(sigmoid(ogate_preact(x)) * multihead_norm(h))
where multihead_norm is HF's `xLSTMMultiHeadLayerNorm`: a LayerNorm over each head's V channels (in
fp32 when norm_reduction_force_float32), then one weight (and bias, with use_bias) over all H*V.
The projection widths are HF's layer's: qk_dim = int(hidden * qk_dim_factor), v_dim = int(hidden *
v_dim_factor) (HF's xLSTMCache rounds them up to multiples of 64, so HF's own cached generate works
only where they already are).

State per slot (`state_names`, all fp32, the references' layout: kernels/mlstm_ref.py):
    C_state [H, K, V]   the matrix memory, HF's xLSTMCache C as it is
    n_state [H, K]      the normaliser, HF's n
    m_state [H]         the stabiliser, HF's m without its trailing 1
Decode and verify rows run `mlstm_update`, prefill rows `mlstm_prefill` (token by token, so cache mode
"all" can save the state after any token): the torch references on the torch backend, the Triton
kernels of kernels/mlstm.py (the prefill the same sequential recurrence) on the Triton one.

HF's weight_mode "fused" (qkv_opreact, ifgate_preact) is refused: HF's own init fails with it.
"""
from __future__ import annotations

import torch
from torch import nn

from toolkit.distributed import SINGLE, TPGroup
from toolkit.errors import UnsupportedArchitectureError
from toolkit.kv_cache_spec import MambaSpec
from toolkit.layers.parallel import check_divides, keep_entries, keep_rows, shard_columns, shard_rows
from toolkit.layers.state_mixer import States, StateShard, StateSlotMixer


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (HF xLSTM's `soft_cap`); None: x unchanged."""
    return x if cap is None else cap * torch.tanh(x / cap)


class MultiHeadLayerNorm(nn.Module):
    """HF `xLSTMMultiHeadLayerNorm`: x [T, H, D] -> [T, H*D], LayerNorm over each head's D channels
    (biased variance; computed in fp32 with `force_float32_reductions`, the result cast back to x's
    dtype), then `weight` [H*D] (and `bias` [H*D] when built with one)."""

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-6, bias: bool = False,
                 force_float32_reductions: bool = True) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.eps = num_heads, head_dim, eps
        self.force_float32_reductions = force_float32_reductions
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))
        self.bias = nn.Parameter(torch.zeros(num_heads * head_dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if self.force_float32_reductions else x
        centered = xf - xf.mean(-1, keepdim=True)
        y = (centered * torch.rsqrt(xf.var(-1, keepdim=True, unbiased=False) + self.eps)).to(x.dtype)
        y = y.reshape(*x.shape[:-2], -1) * self.weight
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, eps={self.eps}"


class MLSTMLayer(StateSlotMixer):
    """Names as HF: q, k [qk_dim, hidden], v, ogate_preact [v_dim, hidden], igate_preact, fgate_preact
    [H, hidden] (always with a bias), multihead_norm (weight [v_dim]), out_proj [hidden, v_dim]; biases on
    the others with use_bias."""

    state_names = ("C_state", "n_state", "m_state")

    def __init__(self, *, layer_name: str, hidden_size: int, num_heads: int, qk_dim: int, v_dim: int,
                 gate_soft_cap: float | None, eps: float = 1e-6, norm_eps: float = 1e-6, use_bias: bool = False,
                 norm_force_float32: bool = True, weight_mode: str = "single") -> None:
        super().__init__(layer_name)
        if weight_mode != "single":
            raise UnsupportedArchitectureError(
                f"{layer_name}: xLSTM weight_mode {weight_mode!r} is not supported, only \"single\" (HF transformers' "
                "own xLSTM fails at init with \"fused\": its gate-bias init mixes tensors of H and 2H entries)")
        for what, dim in (("qk_dim", qk_dim), ("v_dim", v_dim)):
            if dim % num_heads:
                raise ValueError(f"{layer_name}: the mLSTM's {what} ({dim}) must be divisible by num_heads "
                                 f"({num_heads})")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.qk_head_dim, self.v_head_dim = qk_dim // num_heads, v_dim // num_heads
        self.gate_soft_cap, self.eps = gate_soft_cap, eps
        self.q = nn.Linear(hidden_size, qk_dim, bias=use_bias)
        self.k = nn.Linear(hidden_size, qk_dim, bias=use_bias)
        self.v = nn.Linear(hidden_size, v_dim, bias=use_bias)
        self.ogate_preact = nn.Linear(hidden_size, v_dim, bias=use_bias)
        self.igate_preact = nn.Linear(hidden_size, num_heads, bias=True)
        self.fgate_preact = nn.Linear(hidden_size, num_heads, bias=True)
        self.multihead_norm = MultiHeadLayerNorm(num_heads, self.v_head_dim, eps=norm_eps, bias=use_bias,
                                                 force_float32_reductions=norm_force_float32)
        self.out_proj = nn.Linear(v_dim, hidden_size, bias=use_bias)

    # -- tensor parallelism (by heads) --------------------------------------------------------
    tp: TPGroup = SINGLE

    def check_shardable(self, tp_size: int) -> None:
        check_divides(f"{self.layer_name}: the mLSTM's num_heads", self.num_heads, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        """This rank's heads: their rows of q, k, v, ogate_preact, igate_preact, fgate_preact, their
        channels of the multihead norm (a statistic per head: no communication); out_proj
        row-parallel (all-reduced); the three states by heads."""
        n, r = tp.world_size, tp.rank
        heads, dk, dv = self.num_heads // n, self.qk_head_dim, self.v_head_dim
        head_ids = torch.arange(r * heads, (r + 1) * heads)
        for proj, d in ((self.q, dk), (self.k, dk), (self.v, dv), (self.ogate_preact, dv)):
            shard_columns(proj, r * heads * d, heads * d)
        keep_rows(self.igate_preact, head_ids)
        keep_rows(self.fgate_preact, head_ids)
        channels = torch.arange(r * heads * dv, (r + 1) * heads * dv)
        keep_entries(self.multihead_norm, "weight", channels)
        if self.multihead_norm.bias is not None:
            keep_entries(self.multihead_norm, "bias", channels)
        shard_rows(self.out_proj, r * heads * dv, heads * dv, tp)
        self.state_shards = tuple(StateShard(0, head_ids, self.num_heads) for _ in self.state_names)
        self.num_heads = self.multihead_norm.num_heads = heads
        self.tp = tp

    # -- cache plumbing -----------------------------------------------------------------------
    def prefill_checkpoint_alignment(self) -> int | None:
        return 1                      # the prefill runs token by token: it saves the state after any token

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """C_state [H, K, V], n_state [H, K], m_state [H] per slot."""
        h, dk, dv = self.num_heads, self.qk_head_dim, self.v_head_dim
        return (h, dk, dv), (h, dk), (h,)

    def get_kv_cache_spec(self) -> MambaSpec:
        return MambaSpec(shapes=self.state_shapes(), dtypes=(torch.float32,) * 3, mamba_type="mlstm")

    # -- forward ------------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; tokens [decode | prefill | padding] (the
        MLSTMAttentionMetadata contract); attn_metadata None: a profile run (no state touched)."""
        t, h, dk, dv = hidden.shape[0], self.num_heads, self.qk_head_dim, self.v_head_dim
        q = self.q(hidden).view(t, h, dk)
        k = self.k(hidden).view(t, h, dk)
        v = self.v(hidden).view(t, h, dv)
        i = soft_cap(self.igate_preact(hidden), self.gate_soft_cap)            # [T, H]
        f = soft_cap(self.fgate_preact(hidden), self.gate_soft_cap)

        def decode(tok: slice, states: States, idx: torch.Tensor, **verify) -> torch.Tensor:
            return self.ops.mlstm_update(*states, q[tok], k[tok], v[tok], i[tok], f[tok], idx, self.eps, **verify)

        def prefill(tok: slice, states: States, idx: torch.Tensor, has_init: torch.Tensor,
                    cu_seqlens: torch.Tensor, md) -> torch.Tensor:
            return self.ops.mlstm_prefill(q[tok], k[tok], v[tok], i[tok], f[tok], cu_seqlens, *states, idx, has_init,
                                          self.eps, checkpoints=self.checkpoints(md))

        y = self.run_state_slots(attn_metadata, (t, h, dv), torch.float32, decode, prefill)
        out = torch.sigmoid(self.ogate_preact(hidden)) * self.multihead_norm(y.to(hidden.dtype))
        return self.tp.all_reduce(self.out_proj(out))

    def extra_repr(self) -> str:
        return (f"layer_name={self.layer_name!r}, heads={self.num_heads}, qk_head_dim={self.qk_head_dim}, "
                f"v_head_dim={self.v_head_dim}, gate_soft_cap={self.gate_soft_cap}")
