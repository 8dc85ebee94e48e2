"""LFM2 gated short convolution (HF `Lfm2ShortConv` torch path) over per-request conv state.

    [B | C | x] = in_proj(hidden)            (each [T, D], D = hidden_size, in that order)
    u = B * x
    v = depthwise causal conv of u (kernel L = conv_L_cache, optional bias, NO activation)
    out = out_proj(C * v)

The only state is the conv state, vLLM "SD" layout [L-1, D] per request slot (the L-1 values of
`u` preceding the next token, oldest first; HF keeps L of them, the oldest of which the next
step never reads). The conv math is `causal_conv1d_varlen` / `causal_conv1d_step` with
activation=None.
"""
from __future__ import annotations

import torch
from torch import nn

from toolkit.layers.causal_conv1d import causal_conv1d_step, causal_conv1d_varlen
from toolkit.runner.kv_cache_spec import MambaSpec


class ShortConv(nn.Module):
    """HF parameter names: in_proj [3D, D], conv (depthwise Conv1d, weight [D, 1, L]), out_proj [D, D].

    `bias` (HF `conv_bias`) applies to all three, as in HF.
    """

    def __init__(self, *, layer_name: str, hidden_size: int, conv_kernel: int, bias: bool = False) -> None:
        super().__init__()
        if conv_kernel < 2:
            raise ValueError(f"conv_L_cache must be >= 2, got {conv_kernel}")
        self.layer_name = layer_name
        self.hidden_size = hidden_size
        self.conv_kernel = conv_kernel
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = nn.Conv1d(
            hidden_size, hidden_size, kernel_size=conv_kernel, groups=hidden_size,
            padding=conv_kernel - 1, bias=bias,
        )
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.conv_state: torch.Tensor | None = None

    # -- cache plumbing -------------------------------------------------------------------
    def get_kv_cache_spec(self) -> MambaSpec:
        return MambaSpec(
            shapes=((self.conv_kernel - 1, self.hidden_size),),
            dtypes=(self.in_proj.weight.dtype,),
            mamba_type="short_conv",
        )

    def bind_kv_cache(self, caches: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
        """caches = (conv_state [S, L-1, D],)."""
        if len(caches) != 1:
            raise ValueError(f"{self.layer_name}: expected one state tensor (conv_state), got {len(caches)}")
        (conv_state,) = caches
        want = (self.conv_kernel - 1, self.hidden_size)
        if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != want:
            raise ValueError(
                f"{self.layer_name}: expected conv_state [S, {want[0]}, {want[1]}], got {tuple(conv_state.shape)}"
            )
        self.conv_state = conv_state

    def unbind_kv_cache(self) -> None:
        self.conv_state = None

    # -- forward --------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, attn_metadata: dict[str, object] | None) -> torch.Tensor:
        """hidden [T, D] -> [T, D].

        Tokens are [decode tokens | prefill tokens | padding] (ShortConvAttentionMetadata contract);
        padding rows get out_proj(0). attn_metadata None (profile run): the whole batch is one
        sequence from a zero state; no state reads or writes.
        """
        t = hidden.shape[0]
        d = self.hidden_size
        B, C, x = self.in_proj(hidden).split(d, dim=-1)
        u = B * x
        weight = self.conv.weight[:, 0, :]
        bias = self.conv.bias
        v = torch.zeros_like(u)

        if attn_metadata is None:
            cu = torch.tensor([0, t], device=hidden.device, dtype=torch.int32)
            v, _ = causal_conv1d_varlen(u, weight, bias, cu, None, activation=None)
        else:
            md = attn_metadata[self.layer_name]
            if self.conv_state is None:
                raise RuntimeError(f"{self.layer_name}: no state cache bound (call bind_kv_cache first)")
            nd = int(md.num_decode_tokens)
            npf = int(md.num_prefill_tokens)
            if int(md.num_decodes) > 0 and nd > 0:
                if nd != int(md.num_decodes):
                    raise ValueError(f"{self.layer_name}: one token per decode row expected, got "
                                     f"{nd} tokens for {md.num_decodes} decodes")
                idx = md.state_indices_tensor_d[:nd].to(torch.int64)
                v_d, new_state = causal_conv1d_step(u[:nd], self.conv_state[idx], weight, bias, activation=None)
                self.conv_state[idx] = new_state.to(self.conv_state.dtype)
                v[:nd] = v_d
            if int(md.num_prefills) > 0 and npf > 0:
                idx = md.state_indices_tensor_p.to(torch.int64)
                has = md.has_initial_states_p.to(device=hidden.device, dtype=torch.bool)
                init = torch.where(
                    has[:, None, None], self.conv_state[idx],
                    torch.zeros((), dtype=self.conv_state.dtype, device=hidden.device),
                )
                v_p, final = causal_conv1d_varlen(
                    u[nd : nd + npf], weight, bias, md.query_start_loc_p, init, activation=None
                )
                self.conv_state[idx] = final.to(self.conv_state.dtype)
                v[nd : nd + npf] = v_p

        return self.out_proj(C * v)
