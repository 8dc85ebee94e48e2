"""Decoder self-attention over a paged KV cache. The cache write and the attention are ops
(`self.ops`): torch references in toolkit/kernels/kv_cache_ref.py and paged_attention_ref.py.

Cache layout (see toolkit/attention/paged_attn.py): kv [num_blocks, 2, block_size, num_kv_heads,
head_dim], index 1 = 0 for K, 1 for V. Token slot s lives in block s // block_size at offset
s % block_size.
"""
from __future__ import annotations

import torch
from torch import nn

from toolkit.distributed import SINGLE, TPGroup
from toolkit.kv_cache_spec import AttentionSpec, SlidingWindowSpec
from toolkit.layers.norms import RMSNorm
from toolkit.layers.ops import TORCH_OPS
from toolkit.layers.parallel import shard_columns, shard_rows
from toolkit.layers.rotary import RotaryEmbedding


class PagedAttention(nn.Module):
    """q/k/v/o projections (HF names), optional per-head q/k RMSNorm, GQA, RoPE, paged KV cache.

    Args:
        layer_name: module path of this layer (e.g. "model.layers.1.self_attn"); key into the
            step's attn_metadata dict.
        hidden_size, num_heads, num_kv_heads, head_dim: shapes; q_proj: hidden -> num_heads*head_dim.
        bias: `attention_bias` (all four projections, as HF Llama/Bamba).
        rotary: the RoPE module (None = no positional rotation).
        scale: softmax scale (default head_dim ** -0.5, as HF).
        qk_norm_eps: if set, q and k get a per-head RMSNorm over head_dim (weight [head_dim]) after
            projection and before RoPE (HF LFM2 `q_layernorm`/`k_layernorm`, Qwen3 `q_norm`/`k_norm`).
        qk_norm_names: the checkpoint's names of those two norms.
        o_proj_name: the checkpoint's name of the output projection ("out_proj" in LFM2).
        sliding_window: W, or None: the query at position p attends keys p - W + 1 .. p only (the
            kernel never reads keys before the window; their pages go back to the pool: SlidingWindowSpec).
    """

    def __init__(
        self,
        *,
        layer_name: str,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        rotary: RotaryEmbedding | None = None,
        scale: float | None = None,
        qk_norm_eps: float | None = None,
        qk_norm_names: tuple[str, str] = ("q_norm", "k_norm"),
        o_proj_name: str = "o_proj",
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self._o_proj_name = o_proj_name
        self.add_module(o_proj_name, nn.Linear(num_heads * head_dim, hidden_size, bias=bias))
        self._qk_norm_names: tuple[str, str] | None = None
        if qk_norm_eps is not None:
            self._qk_norm_names = tuple(qk_norm_names)
            self.add_module(qk_norm_names[0], RMSNorm(head_dim, eps=qk_norm_eps))
            self.add_module(qk_norm_names[1], RMSNorm(head_dim, eps=qk_norm_eps))
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.q_rows_per_head = head_dim       # q_proj rows per head (a gated attention has 2 * head_dim)
        self.kv_cache: torch.Tensor | None = None
        self.ops = TORCH_OPS                        # set_ops() swaps in the Triton kernels

    tp: TPGroup = SINGLE             # tensor parallelism: set by shard_

    @property
    def output_proj(self) -> nn.Linear:
        """The output projection, whatever the checkpoint calls it (`o_proj_name`)."""
        return getattr(self, self._o_proj_name)

    def check_shardable(self, tp_size: int) -> None:
        if self.num_heads % tp_size:
            raise ValueError(f"Total number of attention heads ({self.num_heads}) must be divisible by tensor "
                             f"parallel size ({tp_size}).")
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            raise ValueError(f"num_key_value_heads ({self.num_kv_heads}) and tensor parallel size ({tp_size}): one "
                             "must divide the other (each rank holds kv/tp KV heads, or one replicated over tp/kv "
                             "ranks)")

    def shard_(self, tp: TPGroup) -> None:
        """Keep this rank's heads (vLLM `QKVParallelLinear` + `RowParallelLinear`): q heads H/tp;
        KV heads kv/tp, or with fewer KV heads than ranks one each, replicated over tp/kv ranks (rank r
        keeps head r // (tp/kv), which its q heads read); o_proj row-parallel, its output all-reduced."""
        (q_start, q_size), (kv_start, kv_size) = self.head_slices(tp)
        per = self.q_rows_per_head // self.head_dim          # q_proj rows per q feature (2: [q | gate])
        shard_columns(self.q_proj, per * q_start, per * q_size)
        shard_columns(self.k_proj, kv_start, kv_size)
        shard_columns(self.v_proj, kv_start, kv_size)
        shard_rows(self.output_proj, q_start, q_size, tp)
        self.num_heads, self.num_kv_heads, self.tp = q_size // self.head_dim, kv_size // self.head_dim, tp

    def head_slices(self, tp: TPGroup) -> tuple[tuple[int, int], tuple[int, int]]:
        """(first feature, features) of this rank's q heads and of its KV heads (before sharding)."""
        n, r, d = tp.world_size, tp.rank, self.head_dim
        heads = self.num_heads // n
        kv_heads, kv_first = ((self.num_kv_heads // n, r * (self.num_kv_heads // n)) if self.num_kv_heads >= n
                              else (1, r // (n // self.num_kv_heads)))
        return (r * heads * d, heads * d), (kv_first * d, kv_heads * d)

    def get_kv_cache_spec(self) -> AttentionSpec:
        """A sliding-window layer's pages leave the cache once out of every query's window: its own
        spec, so it gets a KV cache group (and pool) of its own."""
        dtype = self.q_proj.weight.dtype
        if self.sliding_window is not None:
            return SlidingWindowSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype,
                                     sliding_window=self.sliding_window)
        return AttentionSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype)

    def bind_kv_cache(self, kv: torch.Tensor) -> None:
        """kv: [num_blocks, 2, block_size, num_kv_heads, head_dim]."""
        if kv.dim() != 5 or kv.shape[1] != 2 or tuple(kv.shape[3:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"{self.layer_name}: KV cache must be [num_blocks, 2, block_size, {self.num_kv_heads}, "
                f"{self.head_dim}], got {tuple(kv.shape)}"
            )
        self.kv_cache = kv

    def unbind_kv_cache(self) -> None:
        self.kv_cache = None

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, attn_metadata: dict[str, object] | None
    ) -> torch.Tensor:
        """hidden [T, hidden_size], positions [T] -> [T, hidden_size].

        attn_metadata None (profile run): projections run, the attention core yields zeros (vLLM's
        profiling behaviour), no cache access; the result is o_proj(0) (zeros unless o_proj has a bias).
        Tokens past md.num_actual_tokens (padding) get a zero attention output.
        """
        t = hidden.shape[0]
        q = self.q_proj(hidden).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        if self._qk_norm_names is not None:
            q = getattr(self, self._qk_norm_names[0])(q)
            k = getattr(self, self._qk_norm_names[1])(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = self.gate_output(self.attend(q, k, v, attn_metadata), hidden)
        return self.tp.all_reduce(self.output_proj(out.reshape(t, self.num_heads * self.head_dim)))

    def gate_output(self, out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The attention output [T, Hq, D] before o_proj; a gated attention scales it here."""
        return out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """The attention core: q [T, Hq, D], k, v [T, Hkv, D] (after norms and RoPE) -> [T, Hq, D].
        Writes this step's K/V into the paged cache, then attends over it (`self.ops`); zeros in a
        profile run (attn_metadata None) and for padding tokens."""
        if attn_metadata is None:
            return torch.zeros_like(q)
        md = attn_metadata[self.layer_name]
        if self.kv_cache is None:
            raise RuntimeError(f"{self.layer_name}: no KV cache bound (call bind_kv_cache first)")
        n = min(int(md.num_actual_tokens), q.shape[0])
        self.ops.write_kv_cache(self.kv_cache, k[:n], v[:n], md.slot_mapping[:n])
        return self.ops.paged_attention(q, self.kv_cache, md, self.scale, sliding_window=self.sliding_window)
