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

State per request slot (vLLM's layout: `gated_delta_net_state_shape` in vLLM's mamba_utils):
    conv_state [K_conv-1, Dc] in the model dtype ("SD": the K_conv-1 conv inputs before the next token)
    ssm_state  [Hv, V, K] fp32: S above, vLLM's `(num_v_heads, head_v_dim, head_k_dim)` ("K-last").
HF keeps the transpose, [batch, Hv, K, V], so ours == hf[0].transpose(-1, -2).

The pure math lives in plain functions (no module state, no in-place writes), the references any
GDN kernel is tested against:
  - `gdn_gating`            a, b -> g (fp32 log decay), beta
  - `gdn_prepare_qk`        GVA head repeat, l2norm and 1/sqrt(K) scaling of q and k
  - `gdn_step`              one-token update (the recurrent form)
  - `gdn_recurrent_varlen`  the recurrence one token at a time over varlen sequences (the reference)
  - `gdn_chunk_varlen`      chunked prefill (UT transform per chunk, HF `torch_chunk_gated_delta_rule`)
                            over a varlen chunk layout with initial states
and in place at state indices (the mixer calls them through `self.ops`: `gdn_update` /
`gdn_prefill`, with the Triton kernels of toolkit.kernels.gated_delta_rule as the other set):
  - `gdn_update_at_slots`   decode rows
  - `gdn_prefill_at_slots`  prefill rows
All delta-rule math is fp32.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from toolkit.attention.gdn import GDN_CHUNK_SIZE, compute_gdn_chunk_metadata
from toolkit.layers.causal_conv1d import initial_states_at, write_states_at
from toolkit.layers.mlp import get_activation
from toolkit.layers.norms import RMSNormThenGate
from toolkit.layers.state_mixer import States, StateSlotMixer
from toolkit.runner.kv_cache_spec import MambaSpec

L2NORM_EPS = 1e-6


# --------------------------------------------------------------------------------------------
# pure math
# --------------------------------------------------------------------------------------------


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv]; A_log, dt_bias [Hv] -> (g fp32 [T, Hv] = -exp(A_log) * softplus(a + dt_bias),
    beta [T, Hv] = sigmoid(b) in b.dtype), as HF computes them."""
    g = -torch.exp(A_log.to(torch.float32)) * F.softplus(a.to(torch.float32) + dt_bias.to(torch.float32))
    return g, torch.sigmoid(b)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (HF / FLA `l2norm`)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, K] -> fp32 [T, Hv, K]: each key head repeated for its Hv // Hk value heads,
    l2-normalised (if use_qk_l2norm), and q scaled by K ** -0.5."""
    hk = k.shape[-2]
    if num_v_heads % hk != 0:
        raise ValueError(f"num_v_heads {num_v_heads} is not a multiple of num_k_heads {hk}")
    qf, kf = q.to(torch.float32), k.to(torch.float32)
    if num_v_heads != hk:
        qf = qf.repeat_interleave(num_v_heads // hk, dim=-2)
        kf = kf.repeat_interleave(num_v_heads // hk, dim=-2)
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    return qf * (qf.shape[-1] ** -0.5), kf


def gdn_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token gated delta rule update on prepared inputs (see `gdn_prepare_qk`).

    state [B, Hv, V, K]; q, k [B, Hv, K] (prepared, fp32); v [B, Hv, V]; g [B, Hv] (log decay, <= 0);
    beta [B, Hv].
        S = exp(g) S;  S = S + beta (v - S k) k^T;  y = S q
    Returns (y [B, Hv, V] fp32, new_state [B, Hv, V, K] fp32).
    """
    f32 = torch.float32
    s = state.to(f32) * torch.exp(g.to(f32))[..., None, None]
    kv_mem = torch.einsum("bhvk,bhk->bhv", s, k)
    delta = (v.to(f32) - kv_mem) * beta.to(f32)[..., None]
    s = s + delta[..., :, None] * k[..., None, :]
    return torch.einsum("bhvk,bhk->bhv", s, q), s


def gdn_recurrent_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, initial_states: torch.Tensor | None = None, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the gated delta rule one token at a time (HF `torch_recurrent_gated_delta_rule`).

    q, k [T, Hk, K]; v [T, Hv, V]; g [T, Hv] (log decay); beta [T, Hv]; cu_seqlens int [S+1];
    initial_states [S, Hv, V, K] | None (zeros).
    Returns (y [T, Hv, V] fp32, final_states [S, Hv, V, K] fp32).
    """
    t, hv, vd = v.shape
    qp, kp = gdn_prepare_qk(q, k, hv, use_qk_l2norm)
    cu = [int(x) for x in cu_seqlens.tolist()]
    s = len(cu) - 1
    y = torch.zeros(t, hv, vd, device=v.device, dtype=torch.float32)
    finals = torch.zeros(s, hv, vd, kp.shape[-1], device=v.device, dtype=torch.float32)
    for i in range(s):
        st = (initial_states[i : i + 1].to(torch.float32) if initial_states is not None
              else finals[i : i + 1].clone())
        for j in range(cu[i], cu[i + 1]):
            yj, st = gdn_step(st, qp[j : j + 1], kp[j : j + 1], v[j : j + 1], g[j : j + 1], beta[j : j + 1])
            y[j] = yj[0]
        finals[i] = st[0]
    return y, finals


def gdn_chunk_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor, last_chunk_indices: torch.Tensor,
    chunk_size: int, initial_states: torch.Tensor | None = None, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over a varlen chunk layout (the math of HF
    `torch_chunk_gated_delta_rule`, chunk by chunk over several sequences).

    q, k [T, Hk, K]; v [T, Hv, V]; g [T, Hv] (log decay); beta [T, Hv];
    cu_chunk_seqlens int [C+1]: chunk c covers tokens [cu[c], cu[c+1]) (0 < length <= chunk_size,
        cu[0] == 0, cu[-1] == T, chunks in token order, never crossing a sequence);
    seq_idx int [C]: sequence of each chunk (a sequence's chunks are consecutive);
    last_chunk_indices int [S]: last chunk of each sequence;
    initial_states [S, Hv, V, K] | None: state before each sequence's first token (None = zeros).

    Per chunk (positions i, j < L, cumulative log decay G_i = sum_{l <= i} g_l, state M = S^T [K, V]):
    the UT transform solves (I + tril(diag(beta) K K^T * exp(G_i - G_j), -1)) [U | W] =
    [diag(beta) V | diag(beta exp(G)) K]; with the chunk's start state M0,
        v_new = U - W M0,   y = exp(G) Q M0 + (Q K^T * exp(G_i - G_j), j <= i) v_new,
        M1 = exp(G_last) M0 + (K * exp(G_last - G))^T v_new.
    Chunks shorter than chunk_size are zero-padded (beta = 0, g = 0), which is exact.
    Returns (y [T, Hv, V] fp32, final_states [S, Hv, V, K] fp32).
    """
    t, hv, vd = v.shape
    f32 = torch.float32
    dev = v.device
    qp, kp = gdn_prepare_qk(q, k, hv, use_qk_l2norm)                        # [T, Hv, K]
    kd = kp.shape[-1]
    cu = cu_chunk_seqlens.to(device=dev, dtype=torch.int64)
    nc = cu.numel() - 1
    num_seqs = last_chunk_indices.numel()
    L = int(chunk_size)
    if nc == 0:
        return torch.zeros(t, hv, vd, device=dev, dtype=f32), torch.zeros(num_seqs, hv, vd, kd, device=dev, dtype=f32)

    lens = cu[1:] - cu[:-1]
    ar = torch.arange(L, device=dev)
    valid = ar[None, :] < lens[:, None]                                       # [C, L]
    idx = torch.where(valid, cu[:-1, None] + ar[None, :], torch.zeros_like(ar)[None, :])
    vf = valid.to(f32)

    def chunked(x: torch.Tensor) -> torch.Tensor:
        """[T, Hv, ...] -> [C, Hv, L, ...], zero on padding."""
        xc = x.to(f32)[idx] * vf.view(*vf.shape, *(1,) * (x.dim() - 1))
        return xc.transpose(1, 2)

    qc, kc, vc = chunked(qp), chunked(kp), chunked(v)                         # [C, Hv, L, K|V]
    bc, gc = chunked(beta), chunked(g)                                        # [C, Hv, L]
    k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
    cum = torch.cumsum(gc, dim=-1)                                            # [C, Hv, L]
    upper = torch.ones(L, L, dtype=torch.bool, device=dev).triu(1)
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")))

    # intra-chunk: the UT transform (a unit lower-triangular solve) and the masked q.k "attention"
    ut = (k_beta @ kc.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)        # [C, Hv, L, V]
    w = torch.linalg.solve_triangular(ut, k_beta * torch.exp(cum)[..., None], upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay                                # [C, Hv, L, L]
    q_dec = qc * torch.exp(cum)[..., None]
    k_dec = kc * torch.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = torch.exp(cum[..., -1])[..., None, None]                    # [C, Hv, 1, 1]

    # state passing across the chunks of each sequence (state as M = S^T [Hv, K, V] here)
    seq_list = [int(x) for x in seq_idx.tolist()]
    out = torch.empty(nc, hv, L, vd, device=dev, dtype=f32)
    after = torch.empty(nc, hv, kd, vd, device=dev, dtype=f32)
    m = None
    for c in range(nc):
        if c == 0 or seq_list[c] != seq_list[c - 1]:
            m = (initial_states[seq_list[c]].to(f32).transpose(-1, -2) if initial_states is not None
                 else torch.zeros(hv, kd, vd, device=dev, dtype=f32))
        v_new = u[c] - w[c] @ m
        out[c] = q_dec[c] @ m + attn[c] @ v_new
        m = m * chunk_decay[c] + k_dec[c].transpose(-1, -2) @ v_new
        after[c] = m

    y = out.transpose(1, 2)[valid]                                            # [T, Hv, V], token order
    if y.shape[0] != t:
        raise ValueError(f"gdn_chunk_varlen: chunk layout covers {y.shape[0]} of {t} tokens "
                         f"(chunks must tile [0, T) and be at most chunk_size={L} long)")
    finals = after[last_chunk_indices.to(device=dev, dtype=torch.int64)].transpose(-1, -2)
    return y, finals.contiguous()


def gdn_update_at_slots(ssm_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        g: torch.Tensor, beta: torch.Tensor, state_indices: torch.Tensor,
                        use_qk_l2norm: bool = True) -> torch.Tensor:
    """`gdn_step` in place at state indices (one token per row): ssm_state [S, Hv, V, K], q, k
    [B, Hk, K] (raw: prepared here), v [B, Hv, V], g, beta [B, Hv]; row i reads and writes slot
    state_indices[i] (-1: padded row, y = 0, nothing touched). Returns y fp32 [B, Hv, V]."""
    qp, kp = gdn_prepare_qk(q, k, v.shape[-2], use_qk_l2norm)
    y, new = gdn_step(initial_states_at(ssm_state, state_indices, None), qp, kp, v, g, beta)
    write_states_at(ssm_state, state_indices, new)
    return torch.where((state_indices >= 0).view(-1, 1, 1), y, torch.zeros((), dtype=y.dtype, device=y.device))


def gdn_prefill_at_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor,
                         last_chunk_indices: torch.Tensor, chunk_size: int, ssm_state: torch.Tensor,
                         state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                         use_qk_l2norm: bool = True) -> torch.Tensor:
    """`gdn_chunk_varlen` in place at state indices: sequence i starts from
    ssm_state[state_indices[i]] if has_initial_state[i] else zeros; its final state is written
    back there. Returns y fp32 [T, Hv, V]."""
    init = initial_states_at(ssm_state, state_indices, has_initial_state)
    y, final = gdn_chunk_varlen(q, k, v, g, beta, cu_chunk_seqlens, seq_idx, last_chunk_indices, chunk_size,
                                init, use_qk_l2norm)
    write_states_at(ssm_state, state_indices, final)
    return y


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
        self.activation = activation
        get_activation(activation)  # validate early

        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=False)     # weight [Dc, 1, K] as in HF
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = RMSNormThenGate(head_v_dim, eps=norm_eps, cast_normed=True)   # HF Qwen3NextRMSNormGated
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    # -- cache plumbing (bind_kv_cache / unbind_kv_cache: StateSlotMixer) --------------------
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """conv_state [K_conv-1, Dc], ssm_state [Hv, V, K] per slot."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_v_heads, self.head_v_dim, self.head_k_dim)

    def get_kv_cache_spec(self) -> MambaSpec:
        return MambaSpec(
            shapes=self.state_shapes(),
            dtypes=(self.in_proj_qkvz.weight.dtype, torch.float32),
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
        weight = self.conv1d.weight[:, 0, :]

        def decode(tok: slice, states: States, idx: torch.Tensor) -> torch.Tensor:
            conv_state, ssm_state = states
            xc = self.ops.conv_update(mixed[tok], conv_state, idx, weight, None, self.activation)
            q, k, v = self._split_qkv(xc)
            return self.ops.gdn_update(ssm_state, q, k, v, g[tok], beta[tok], idx)

        def prefill(tok: slice, states: States, idx: torch.Tensor, has_init: torch.Tensor,
                    cu_seqlens: torch.Tensor, md) -> torch.Tensor:
            conv_state, ssm_state = states
            xc = self.ops.conv_prefill(mixed[tok], conv_state, idx, has_init, cu_seqlens, weight, None,
                                       self.activation)
            q, k, v = self._split_qkv(xc)
            if md is None:  # profile run: one sequence
                cu, sidx, last = (torch.from_numpy(x).to(hidden.device) for x in
                                  compute_gdn_chunk_metadata(np.array([q.shape[0]]), self.chunk_size))
                chunks = (cu, sidx, last, self.chunk_size)
            else:
                chunks = (md.cu_chunk_seqlen_p, md.seq_idx_p, md.last_chunk_indices_p, int(md.chunk_size))
            return self.ops.gdn_prefill(q, k, v, g[tok], beta[tok], *chunks, ssm_state, idx, has_init)

        y = self.run_state_slots(attn_metadata, (t, self.num_v_heads, self.head_v_dim), torch.float32,
                                 decode, prefill)
        out = self.norm(y.to(dtype), z)                        # per value head, over V
        return self.out_proj(out.reshape(t, self.value_dim))

    def extra_repr(self) -> str:
        return (f"layer_name={self.layer_name!r}, heads k/v={self.num_k_heads}/{self.num_v_heads}, "
                f"head dims k/v={self.head_k_dim}/{self.head_v_dim}, chunk_size={self.chunk_size}")
