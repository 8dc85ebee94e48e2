"""Mamba2 mixer (HF `Mamba2Mixer` / `BambaMixer` torch paths) over per-request recurrent state.

Notation: T tokens, H heads, P head_dim, N d_state, G n_groups (head h reads group h // (H // G)),
K conv kernel, Dc = conv_dim = H*P + 2*G*N, S sequences, C chunks.

The pure math lives in plain functions below (no module state, no in-place writes) so that
kernels can be tested against them:
  - `mamba2_dt`                  dt_raw -> softplus(dt_raw + dt_bias), clamped to time_step_limit
  - conv with state: see causal_conv1d.py (shared with Mamba1 and ShortConv)
  - `ssd_chunk_scan_varlen`      chunked SSD scan over vLLM's varlen chunk layout, initial states
  - `ssm_step`                   one-token SSM update
  - `ssm_scan_sequential_ref`    plain per-token recurrence (the reference for the chunked scan)
All SSM math is fp32.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from toolkit.attention.mamba2 import compute_chunk_metadata
from toolkit.layers.causal_conv1d import initial_states_at, write_states_at
from toolkit.layers.mlp import get_activation
from toolkit.layers.norms import RMSNormGated, RMSNormThenGate
from toolkit.layers.state_mixer import States, StateSlotMixer
from toolkit.runner.kv_cache_spec import MambaSpec


# --------------------------------------------------------------------------------------------
# pure math
# --------------------------------------------------------------------------------------------


def mamba2_dt(
    dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_limit: Sequence[float] | None = None
) -> torch.Tensor:
    """dt_raw [T, H], dt_bias [H] -> fp32 [T, H] = clamp(softplus(dt_raw + dt_bias), *dt_limit)."""
    dt = F.softplus(dt_raw.to(torch.float32) + dt_bias.to(torch.float32))
    if dt_limit is not None:
        lo, hi = float(dt_limit[0]), float(dt_limit[1])
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(min=lo, max=hi)
    return dt


def _heads_from_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H // G)."""
    g = t.shape[-2]
    if num_heads % g != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of n_groups {g}")
    return t.repeat_interleave(num_heads // g, dim=-2)


def ssm_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token SSM update.

    state [B, H, P, N]; x [B, H, P]; dt [B, H] (already softplus'ed, > 0); A [H] (negative);
    B, C [B, G, N]; D [H] | None.
        new = state * exp(dt * A) + (dt * x) outer B ;  y = new . C + D * x
    Returns (y [B, H, P] fp32, new_state [B, H, P, N] fp32).
    """
    h = x.shape[1]
    xf, dtf = x.to(torch.float32), dt.to(torch.float32)
    Bh = _heads_from_groups(B.to(torch.float32), h)
    Ch = _heads_from_groups(C.to(torch.float32), h)
    dA = torch.exp(dtf * A.to(torch.float32)[None, :])                       # [B, H]
    new = state.to(torch.float32) * dA[:, :, None, None] + (dtf[:, :, None] * xf)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        y = y + D.to(torch.float32)[None, :, None] * xf
    return y, new


def ssm_scan_sequential_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the SSM recurrence one token at a time (see `ssm_step`).

    x [T, H, P]; dt [T, H] (processed); A [H]; B, C [T, G, N]; D [H] | None;
    cu_seqlens int [S+1]; initial_states [S, H, P, N] | None (zeros).
    Returns (y [T, H, P] fp32, final_states [S, H, P, N] fp32).
    """
    t, h, p = x.shape
    n = B.shape[-1]
    cu = [int(v) for v in cu_seqlens.tolist()]
    s = len(cu) - 1
    y = torch.zeros(t, h, p, device=x.device, dtype=torch.float32)
    finals = torch.zeros(s, h, p, n, device=x.device, dtype=torch.float32)
    for i in range(s):
        st = (
            initial_states[i : i + 1].to(torch.float32)
            if initial_states is not None
            else torch.zeros(1, h, p, n, device=x.device, dtype=torch.float32)
        )
        for j in range(cu[i], cu[i + 1]):
            yj, st = ssm_step(st, x[j : j + 1], dt[j : j + 1], A, B[j : j + 1], C[j : j + 1], D)
            y[j] = yj[0]
        finals[i] = st[0]
    return y, finals


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L] with out[..., l, s] = sum_{k=s+1..l} a[k] for l >= s, -inf above.

    Built from a cumulative sum of masked copies (not cumsum differences) for stability.
    """
    L = a.shape[-1]
    x = a[..., :, None].expand(*a.shape, L)                                  # x[..., l, s] = a[l]
    strict = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~strict, 0.0)
    seg = torch.cumsum(x, dim=-2)
    incl = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=0)
    return seg.masked_fill(~incl, float("-inf"))


def ssd_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    cu_chunk_seqlens: torch.Tensor,
    seq_idx: torch.Tensor,
    last_chunk_indices: torch.Tensor,
    chunk_size: int,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD (state-space duality) scan over a varlen chunk layout.

    x [T, H, P]; dt [T, H] (processed, fp32); A [H]; B, C [T, G, N]; D [H] | None;
    cu_chunk_seqlens int [C+1]: chunk c covers tokens [cu[c], cu[c+1]) (0 < length <= chunk_size,
        cu[0] == 0, cu[-1] == T, chunks in token order, never crossing a sequence);
    seq_idx int [C]: sequence of each chunk (sequences' chunks are consecutive);
    last_chunk_indices int [S]: last chunk of each sequence;
    initial_states [S, H, P, N] | None: state before each sequence's first token (None = zeros).
    Per chunk: the intra-chunk (diagonal) term is a masked "attention" C_l.B_s * exp(sum dA(s, l])
    * dt_s * x_s; each chunk's start state comes from a recurrence over the chunks of its
    sequence (state_after = exp(sum dA over chunk) * state_before + chunk_state), and adds
    exp(cumsum dA)_l * C_l . state_before. Chunks shorter than chunk_size are zero-padded with dt = 0,
    which makes padding exact (decay 1, no input).
    Returns (y [T, H, P] fp32, final_states [S, H, P, N] fp32).
    """
    t, h, p = x.shape
    n = B.shape[-1]
    dev = x.device
    f32 = torch.float32
    cu = cu_chunk_seqlens.to(device=dev, dtype=torch.int64)
    nc = cu.numel() - 1
    num_seqs = last_chunk_indices.numel()
    L = int(chunk_size)
    if nc == 0:
        return torch.zeros(t, h, p, device=dev, dtype=f32), torch.zeros(num_seqs, h, p, n, device=dev, dtype=f32)

    lens = cu[1:] - cu[:-1]
    ar = torch.arange(L, device=dev)
    valid = ar[None, :] < lens[:, None]                                       # [C, L]
    idx = torch.where(valid, cu[:-1, None] + ar[None, :], torch.zeros_like(ar)[None, :])
    vf = valid.to(f32)
    xc = x.to(f32)[idx] * vf[:, :, None, None]                                # [C, L, H, P]
    dtc = dt.to(f32)[idx] * vf[:, :, None]                                    # [C, L, H]
    Bc = _heads_from_groups(B.to(f32)[idx], h)                                # [C, L, H, N]
    Cc = _heads_from_groups(C.to(f32)[idx], h)

    dA = dtc * A.to(f32)[None, None, :]                                       # [C, L, H]
    cum = torch.cumsum(dA, dim=1)                                             # [C, L, H]
    xdt = xc * dtc[..., None]                                                 # [C, L, H, P]

    # 1. intra-chunk (diagonal blocks)
    decay_ls = torch.exp(_segsum(dA.permute(0, 2, 1)))                        # [C, H, L, L]
    cb = torch.einsum("clhn,cshn->chls", Cc, Bc)
    y = torch.einsum("chls,cshp->clhp", cb * decay_ls, xdt)

    # 2. each chunk's own contribution to its end state (from a zero start)
    decay_to_end = torch.exp(cum[:, -1:, :] - cum)                            # [C, L, H]
    chunk_states = torch.einsum("clhn,clhp->chpn", Bc * decay_to_end[..., None], xdt)  # [C, H, P, N]
    chunk_decay = torch.exp(cum[:, -1, :])                                    # [C, H]

    # 3. state passing across the chunks of each sequence
    seq_list = [int(v) for v in seq_idx.tolist()]
    states_before = torch.empty(nc, h, p, n, device=dev, dtype=f32)
    states_after = torch.empty(nc, h, p, n, device=dev, dtype=f32)
    prev = None
    for c in range(nc):
        if c == 0 or seq_list[c] != seq_list[c - 1]:
            prev = (
                initial_states[seq_list[c]].to(f32)
                if initial_states is not None
                else torch.zeros(h, p, n, device=dev, dtype=f32)
            )
        states_before[c] = prev
        prev = chunk_decay[c][:, None, None] * prev + chunk_states[c]
        states_after[c] = prev

    # 4. contribution of each chunk's start state
    y = y + torch.einsum("clhn,chpn->clhp", Cc, states_before) * torch.exp(cum)[..., None]
    if D is not None:
        y = y + D.to(f32)[None, None, :, None] * xc

    y_tok = y[valid]                                                          # [T, H, P], token order
    if y_tok.shape[0] != t:
        raise ValueError(
            f"ssd_chunk_scan_varlen: chunk layout covers {y_tok.shape[0]} of {t} tokens "
            f"(chunks must tile [0, T) and be at most chunk_size={L} long)"
        )
    finals = states_after[last_chunk_indices.to(device=dev, dtype=torch.int64)]
    return y_tok, finals


def mamba2_update_at_slots(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
                           state_indices: torch.Tensor, dt_bias: torch.Tensor | None = None,
                           dt_limit: Sequence[float] | None = None) -> torch.Tensor:
    """`ssm_step` in place at state indices: ssm_state [S, H, P, N] (row i reads and writes slot
    state_indices[i]; -1: padded row, y = 0, nothing touched). Returns y fp32 [B, H, P].
    With dt_bias, dt is raw: `mamba2_dt(dt, dt_bias, dt_limit)` is applied first (the kernel
    does it in the same launch, as mamba_ssm's `dt_softplus`)."""
    if dt_bias is not None:
        dt = mamba2_dt(dt, dt_bias, dt_limit)
    y, new = ssm_step(initial_states_at(ssm_state, state_indices, None), x, dt, A, B, C, D)
    write_states_at(ssm_state, state_indices, new)
    return torch.where((state_indices >= 0).view(-1, 1, 1), y, torch.zeros((), dtype=y.dtype, device=y.device))


def ssd_scan_at_slots(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor | None, cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor,
                      last_chunk_indices: torch.Tensor, chunk_size: int, ssm_state: torch.Tensor,
                      state_indices: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """`ssd_chunk_scan_varlen` in place at state indices: sequence i starts from
    ssm_state[state_indices[i]] if has_initial_state[i] else zeros; its final state is written
    back there. Returns y fp32 [T, H, P]."""
    init = initial_states_at(ssm_state, state_indices, has_initial_state)
    y, final = ssd_chunk_scan_varlen(x, dt, A, B, C, D, cu_chunk_seqlens, seq_idx, last_chunk_indices,
                                     chunk_size, init)
    write_states_at(ssm_state, state_indices, final)
    return y


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

    # -- cache plumbing (bind_kv_cache / unbind_kv_cache: StateSlotMixer) --------------------
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

        def decode(tok: slice, states: States, idx: torch.Tensor) -> torch.Tensor:
            conv_state, ssm_state = states
            xbc_d = self.ops.conv_update(xbc[tok], conv_state, idx, weight, bias, self.activation)
            x, B, C = self._split_xbc(xbc_d)
            return self.ops.mamba2_update(ssm_state, x, dt_raw[tok], A, B, C, self.D, idx,
                                          self.dt_bias, self.time_step_limit)

        def prefill(tok: slice, states: States, idx: torch.Tensor, has_init: torch.Tensor,
                    cu_seqlens: torch.Tensor, md) -> torch.Tensor:
            conv_state, ssm_state = states
            xbc_p = self.ops.conv_prefill(xbc[tok], conv_state, idx, has_init, cu_seqlens, weight, bias,
                                          self.activation)
            x, B, C = self._split_xbc(xbc_p)
            if md is None:  # profile run: one sequence
                cu, sidx, last = (torch.from_numpy(a).to(hidden.device) for a in
                                  compute_chunk_metadata(np.array([x.shape[0]]), np.array([0]), self.chunk_size))
                chunks = (cu, sidx, last, self.chunk_size)
            else:
                chunks = (md.cu_chunk_seqlen_p, md.seq_idx_p, md.last_chunk_indices_p, int(md.chunk_size))
            dt = self.ops.mamba2_dt(dt_raw[tok], self.dt_bias, self.time_step_limit)
            return self.ops.ssd_scan(x, dt, A, B, C, self.D, *chunks, ssm_state, idx, has_init)

        y = self.run_state_slots(attn_metadata, (t, self.num_heads, self.head_dim), torch.float32, decode, prefill)
        y = y.reshape(t, self.intermediate_size)
        out = (y * F.silu(gate)).to(dtype) if self.norm is None else self.norm(y, gate, out_dtype=dtype)
        return self.out_proj(out)

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
