"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of latents: HF
`KimiLinearAttention` (Kimi Linear uses it without RoPE).

Notation: T tokens, H heads, C = kv_lora_rank (the latent), R = qk_rope_head_dim, N = qk_nope_head_dim,
Dv = v_head_dim, L = C + R (what the cache holds per token).

    q              = q_proj(x)  (or q_b_proj(rmsnorm(q_a_proj(x))) with q_lora_rank)   [T, H, N + R]
    [c | k_rot]    = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)                     [T, C], [T, R]
    cache          <- [c | k_rot] per token (one vector, shared by every head: `AttentionSpec(kv_parts=1,
                      num_kv_heads=1, head_dim=L)`, a block of B tokens is B * L values per layer)
    k_nope, v      = split(kv_b_proj(c)) per head, for every cached position (expanded each step, as HF does)
    k              = [k_nope | k_rot]                                                 [S, H, N + R]
    out            = o_proj(causal softmax(q k^T * (N + R) ** -0.5) v)

Positions are not rotated (Kimi Linear is NoPE: the rope slice is cached and used as it is, as in HF).
The attention core is torch: per row, the row's latents are gathered through its block-table row,
expanded and attended (kernels/paged_attention_ref.causal_attention_ref); no Triton MLA kernel is
written yet, and the core's host loop over rows cannot be captured in a CUDA graph (`graph_unsafe`:
the runner runs such a model without graphs).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from toolkit.distributed import SINGLE, TPGroup
from toolkit.kernels.paged_attention_ref import causal_attention_ref
from toolkit.kv_cache_spec import AttentionSpec
from toolkit.layers.norms import RMSNorm
from toolkit.layers.parallel import check_divides, keep_rows, shard_rows


class LatentPagedAttention(nn.Module):
    """See the module docstring. HF names: q_proj | q_a_proj, q_a_layernorm, q_b_proj;
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj."""

    graph_unsafe = "multi-head latent attention runs a host loop over the batch's rows (torch only)"

    def __init__(self, *, layer_name: str, hidden_size: int, num_heads: int, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 bias: bool = False, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, qk_rope_head_dim
        self.nope_dim, self.v_dim = qk_nope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scale = self.qk_dim ** -0.5
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.kv_cache: torch.Tensor | None = None

    # -- tensor parallelism: heads split (q and kv_b_proj by head, o_proj row-parallel); the latent,
    # its norm and the cache whole on every rank (one vector per token serves every head) -------
    tp: TPGroup = SINGLE

    def check_shardable(self, tp_size: int) -> None:
        check_divides(f"{self.layer_name}: num_attention_heads", self.num_heads, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        h = self.num_heads // tp.world_size
        first = tp.rank * h

        def head_rows(per_head: int) -> torch.Tensor:
            return torch.arange(first * per_head, (first + h) * per_head)

        keep_rows(self.q_proj if hasattr(self, "q_proj") else self.q_b_proj, head_rows(self.qk_dim))
        keep_rows(self.kv_b_proj, head_rows(self.nope_dim + self.v_dim))
        shard_rows(self.o_proj, first * self.v_dim, h * self.v_dim, tp)
        self.num_heads, self.tp = h, tp

    # -- cache ----------------------------------------------------------------------------
    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def get_kv_cache_spec(self) -> AttentionSpec:
        return AttentionSpec(num_kv_heads=1, head_dim=self.latent_dim, dtype=self.kv_b_proj.weight.dtype, kv_parts=1)

    def bind_kv_cache(self, kv: torch.Tensor) -> None:
        """kv: [num_blocks, 1, block_size, 1, C + R]."""
        if kv.dim() != 5 or kv.shape[1] != 1 or tuple(kv.shape[3:]) != (1, self.latent_dim):
            raise ValueError(f"{self.layer_name}: latent cache must be [num_blocks, 1, block_size, 1, "
                             f"{self.latent_dim}], got {tuple(kv.shape)}")
        self.kv_cache = kv

    def unbind_kv_cache(self) -> None:
        self.kv_cache = None

    # -- forward --------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]. attn_metadata None (profile run): the
        attention core yields zeros and the cache is untouched (as PagedAttention)."""
        t = hidden.shape[0]
        q = self.q_proj(hidden) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(t, self.num_heads, self.qk_dim)
        c, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden), [self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1)                  # [T, C + R]
        out = torch.zeros(t, self.num_heads, self.v_dim, dtype=hidden.dtype, device=hidden.device)
        if attn_metadata is not None:
            self._attend(q, latent, attn_metadata[self.layer_name], out)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.num_heads * self.v_dim)))

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [S, C + R] -> (k [S, H, N + R], v [S, H, Dv]): kv_b_proj per head, k_rot shared."""
        s = latent.shape[0]
        c, k_rot = torch.split(latent, [self.kv_lora_rank, self.rope_dim], dim=-1)
        k_nope, v = torch.split(self.kv_b_proj(c).view(s, self.num_heads, self.nope_dim + self.v_dim),
                                [self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None, :].expand(s, self.num_heads, self.rope_dim)], dim=-1)
        return k, v

    def _attend(self, q: torch.Tensor, latent: torch.Tensor, md, out: torch.Tensor) -> None:
        """Write this step's latents at their slots, then each row's queries attend over its cached
        positions 0 .. seq_len - 1 (queries at the last q_len of them); padding tokens stay 0."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.layer_name}: no KV cache bound (call bind_kv_cache first)")
        n = min(int(md.num_actual_tokens), q.shape[0])
        flat = self.kv_cache.view(-1, self.latent_dim)                              # [blocks * B, C + R]
        slots = md.slot_mapping[:n]
        keep = (slots >= 0)[:, None]
        at = slots.clamp(min=0)
        flat[at] = torch.where(keep, latent[:n].to(flat.dtype), flat[at])           # a -1 slot writes nothing
        block_size = self.kv_cache.shape[2]
        starts = md.query_start_loc_cpu.numpy().tolist()               # host copies: no device sync
        for row, seq_len in enumerate(md.seq_lens_cpu.numpy().tolist()):
            lo, hi = starts[row], starts[row + 1]
            if hi <= lo:
                continue
            blocks = md.block_table[row, :math.ceil(seq_len / block_size)].to(torch.int64)
            cached = self.kv_cache[blocks].reshape(-1, self.latent_dim)[:seq_len]
            k, v = self.expand(cached)
            out[lo:hi] = causal_attention_ref(q[lo:hi], k, v, seq_len - (hi - lo), self.scale)

    def extra_repr(self) -> str:
        return (f"layer_name={self.layer_name!r}, heads={self.num_heads}, latent={self.kv_lora_rank}+{self.rope_dim}, "
                f"qk={self.qk_dim}, v={self.v_dim}")
