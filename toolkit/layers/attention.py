"""Decoder self-attention over a paged KV cache: the module and the torch reference ops.

Cache layout (see toolkit/attention/paged_attn.py): kv [num_blocks, 2, block_size, num_kv_heads,
head_dim], index 1 = 0 for K, 1 for V. Token slot s lives in block s // block_size at offset
s % block_size.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from toolkit.layers.norms import RMSNorm
from toolkit.layers.padded_scatter import padded_rows_redirected
from toolkit.layers.rotary import RotaryEmbedding
from toolkit.runner.kv_cache_spec import AttentionSpec


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter K/V of this step into the paged cache, in place.

    kv_cache [num_blocks, 2, block_size, Hkv, D]; k, v [N, Hkv, D]; slot_mapping int [N]
    (entries == -1 are skipped).
    """
    block_size = kv_cache.shape[2]
    if slot_mapping.numel() == 0:
        return
    src, slots, keep = padded_rows_redirected(slot_mapping)
    blk = torch.div(slots, block_size, rounding_mode="floor")
    off = slots % block_size
    keep = keep[:, None, None]
    kv_cache[blk, 0, off] = torch.where(keep, k[src].to(kv_cache.dtype), kv_cache[blk, 0, off])
    kv_cache[blk, 1, off] = torch.where(keep, v[src].to(kv_cache.dtype), kv_cache[blk, 1, off])


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of positions [0, seq_len) of one request: each [seq_len, Hkv, D].

    block_ids int [>= ceil(seq_len / block_size)]: the request's block-table row.
    """
    block_size = kv_cache.shape[2]
    nb = math.ceil(seq_len / block_size)
    blocks = kv_cache[block_ids[:nb].to(torch.int64)]  # [nb, 2, bs, Hkv, D]
    k = blocks[:, 0].reshape(nb * block_size, *blocks.shape[-2:])[:seq_len]
    v = blocks[:, 1].reshape(nb * block_size, *blocks.shape[-2:])[:seq_len]
    return k, v


def causal_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_start: int, scale: float
) -> torch.Tensor:
    """Causal GQA attention of one request, math in fp32.

    q [Q, Hq, D] sits at positions context_start .. context_start + Q - 1; k, v [L, Hkv, D] hold
    positions 0 .. L-1 (L = context_start + Q). Query head h reads kv head h // (Hq // Hkv)
    (HF `repeat_kv`). Returns [Q, Hq, D] in q.dtype.
    """
    nq, hq, _ = q.shape
    seq_len, hkv, _ = k.shape
    rep = hq // hkv
    qf = q.to(torch.float32).transpose(0, 1)                                   # [Hq, Q, D]
    kf = k.to(torch.float32).repeat_interleave(rep, dim=1).transpose(0, 1)     # [Hq, L, D]
    vf = v.to(torch.float32).repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale                      # [Hq, Q, L]
    q_pos = torch.arange(nq, device=q.device)[:, None] + context_start
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)                                              # [Hq, Q, D]
    return out.transpose(0, 1).to(q.dtype)


def decode_attention_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    max_seq_len: int, scale: float
) -> torch.Tensor:
    """Batched attention of rows with one query token each (the token at position seq_len - 1).

    q [R, Hq, D]; block_table int [R, >= ceil(max_seq_len / block_size)]; seq_lens int [R].
    Math in fp32 (same as `causal_attention_ref`); returns [R, Hq, D] in q.dtype.
    """
    rows, hq, dim = q.shape
    block_size, hkv = kv_cache.shape[2], kv_cache.shape[3]
    nb = math.ceil(max_seq_len / block_size)
    blocks = kv_cache[block_table[:, :nb].to(torch.int64)]              # [R, nb, 2, bs, Hkv, D]
    k = blocks[:, :, 0].reshape(rows, nb * block_size, hkv, dim).to(torch.float32)
    v = blocks[:, :, 1].reshape(rows, nb * block_size, hkv, dim).to(torch.float32)
    qf = q.to(torch.float32).view(rows, hkv, hq // hkv, dim)           # head h reads kv head h // rep
    scores = torch.einsum("bgrd,bsgd->bgrs", qf, k) * scale
    past_end = torch.arange(nb * block_size, device=q.device)[None, :] >= seq_lens[:, None]
    scores = scores.masked_fill(past_end[:, None, None, :], float("-inf"))
    v = v.masked_fill(past_end[:, :, None, None], 0.0)        # unwritten slots may hold anything
    out = torch.einsum("bgrs,bsgd->bgrd", torch.softmax(scores, dim=-1), v)
    return out.reshape(rows, hq, dim).to(q.dtype)


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, md, scale: float) -> torch.Tensor:
    """Causal GQA attention of a mixed batch over the paged cache (this step's K/V already written).

    q [T, Hq, D]; md: PagedAttentionMetadata (query_start_loc [B+1], seq_lens [B], block_table
    [B, M], and their host copies). Row i's queries are tokens query_start_loc[i] .. [i+1] at
    positions seq_len - q_len .. seq_len - 1. Tokens past num_actual_tokens (padding) get 0.
    Returns [T, Hq, D] in q.dtype.
    """
    out = torch.zeros_like(q)
    qsl = md.query_start_loc_cpu.numpy().tolist()      # host copies: no device sync
    seq_lens = md.seq_lens_cpu.numpy().tolist()
    rows = md.single_token_rows
    if len(rows):                   # one-token rows (decodes) in one batched op
        tok = md.query_start_loc[rows].to(torch.int64)
        out[tok] = decode_attention_ref(q[tok], kv_cache, md.block_table[rows], md.seq_lens[rows],
                                        md.single_token_max_seq_len, scale)
    for i in range(int(md.num_reqs)):
        qs, qe = qsl[i], qsl[i + 1]
        q_len = qe - qs
        if q_len <= 1:
            continue
        seq_len = seq_lens[i]
        kc, vc = gather_kv(kv_cache, md.block_table[i], seq_len)
        out[qs:qe] = causal_attention_ref(q[qs:qe], kc, vc, seq_len - q_len, scale)
    return out


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
        self.kv_cache: torch.Tensor | None = None
        from toolkit.layers.ops import TORCH_OPS   # ops imports this module's reference functions
        self.ops = TORCH_OPS                        # set_ops() swaps in the Triton kernels

    @property
    def output_proj(self) -> nn.Linear:
        """The output projection, whatever the checkpoint calls it (`o_proj_name`)."""
        return getattr(self, self._o_proj_name)

    def get_kv_cache_spec(self) -> AttentionSpec:
        return AttentionSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.q_proj.weight.dtype)

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
        out = self.attend(q, k, v, attn_metadata)
        return self.output_proj(out.reshape(t, self.num_heads * self.head_dim))

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
        return self.ops.paged_attention(q, self.kv_cache, md, self.scale)
