"""What the recurrent-state mixers (Mamba1Mixer, Mamba2Mixer, ShortConv) share: binding their
per-request state tensors, and dispatching a step's tokens to decode / prefill over state slots.

Notation: T tokens in the step, S state slots, nd decode tokens (= decode rows, one token each),
npf prefill tokens in P prefill rows. Each mixer keeps k state tensors (its `state_names`, in
cache order, e.g. ("conv_state", "ssm_state")); tensor i is [S, *state_shapes()[i]], one slice
per request slot (vLLM "SD" layout).

Token order (BaseMambaAttentionMetadata contract): [decode tokens | prefill tokens | padding].
A subclass's forward computes its per-token inputs, allocates a zero output buffer `out`
[T, ...], and calls `run_state_slots(attn_metadata, out, decode, prefill)` with two closures
holding only its own math:

    decode(tokens, states) -> (y, new_states)
        tokens      slice(0, nd) of the step's tokens
        states      k tensors [nd, *state_shape_i]: the decode rows' states (gathered copies)
        y           [nd, ...] output rows; new_states: k tensors [nd, *state_shape_i]

    prefill(tokens, init_states, cu_seqlens, md) -> (y, final_states)
        tokens      slice(nd, nd + npf), or slice(0, T) in a profile run
        init_states k tensors [P, *state_shape_i], zero for rows without an initial state, or
                    k Nones in a profile run (= zero state)
        cu_seqlens  int32 [P+1] sequence boundaries within `tokens` (md.query_start_loc_p);
                    [0, T] in a profile run
        md          the layer's metadata (e.g. Mamba2's chunk fields), None in a profile run
        y           [len(tokens), ...]; final_states: k tensors [P, *state_shape_i]

States are gathered in their cache dtype and written back cast to it (the math functions compute
in fp32 themselves).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

States = tuple[torch.Tensor, ...]
InitStates = tuple[torch.Tensor | None, ...]
DecodeFn = Callable[[slice, States], tuple[torch.Tensor, States]]
PrefillFn = Callable[[slice, InitStates, torch.Tensor, Any], tuple[torch.Tensor, States]]

class StateSlotMixer(nn.Module, ABC):
    """Base class of a layer holding per-request recurrent state in bound cache tensors.

    Subclasses set `state_names` and implement `state_shapes()` (per-slot shape of each state
    tensor, the same shapes their MambaSpec reports); the state tensors are the attributes named
    in `state_names` (None while unbound).
    """

    state_names: tuple[str, ...] = ()

    def __init__(self, layer_name: str) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.unbind_kv_cache()

    @abstractmethod
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-slot shape of each state tensor, in `state_names` order."""

    # -- cache plumbing -------------------------------------------------------------------
    def bind_kv_cache(self, caches: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
        """caches: one tensor [S, *shape] per state, in `state_names` order."""
        names, wants = self.state_names, self.state_shapes()
        if len(caches) != len(names):
            raise ValueError(f"{self.layer_name}: expected {len(names)} state tensor(s) "
                             f"({', '.join(names)}), got {len(caches)}")
        if any(tuple(c.shape[1:]) != want for c, want in zip(caches, wants)):
            expected = " and ".join(f"{n} [S, {', '.join(str(d) for d in w)}]" for n, w in zip(names, wants))
            got = " and ".join(str(tuple(c.shape)) for c in caches)
            raise ValueError(f"{self.layer_name}: expected {expected}, got {got}")
        for name, cache in zip(names, caches):
            setattr(self, name, cache)

    def unbind_kv_cache(self) -> None:
        for name in self.state_names:
            setattr(self, name, None)

    def _bound_states(self) -> States:
        states = tuple(getattr(self, name) for name in self.state_names)
        if any(s is None for s in states):
            raise RuntimeError(f"{self.layer_name}: no state cache bound (call bind_kv_cache first)")
        return states

    # -- forward dispatch -----------------------------------------------------------------
    def run_state_slots(
        self,
        attn_metadata: dict[str, object] | None,
        out: torch.Tensor,
        decode: DecodeFn,
        prefill: PrefillFn,
    ) -> torch.Tensor:
        """Run one step's tokens through `decode` / `prefill` (see the module docstring).

        out: zero buffer [T, ...] on the step's device; decode rows' outputs go to out[:nd],
        prefill rows' to out[nd : nd + npf], padding rows stay zero; returns out. attn_metadata
        None (profile run): returns prefill's output for the whole batch as one sequence from a
        zero state, with no state reads or writes.
        """
        t = out.shape[0]
        if attn_metadata is None:
            cu = torch.tensor([0, t], device=out.device, dtype=torch.int32)
            y, _ = prefill(slice(0, t), (None,) * len(self.state_names), cu, None)
            return y
        md = attn_metadata[self.layer_name]
        states = self._bound_states()
        nd = int(md.num_decode_tokens)
        npf = int(md.num_prefill_tokens)
        if int(md.num_decodes) > 0 and nd > 0:
            if nd != int(md.num_decodes):
                raise ValueError(f"{self.layer_name}: one token per decode row expected, got "
                                 f"{nd} tokens for {md.num_decodes} decodes")
            idx = md.state_indices_tensor_d[:nd].to(torch.int64)
            y_d, new_states = decode(slice(0, nd), tuple(s[idx] for s in states))
            _write_states(states, idx, new_states)
            out[:nd] = y_d
        if int(md.num_prefills) > 0 and npf > 0:
            idx = md.state_indices_tensor_p.to(torch.int64)
            has = md.has_initial_states_p.to(device=out.device, dtype=torch.bool)
            init = tuple(
                torch.where(has.view(-1, *(1,) * (s.dim() - 1)), s[idx],
                            torch.zeros((), dtype=s.dtype, device=out.device))
                for s in states
            )
            y_p, final_states = prefill(slice(nd, nd + npf), init, md.query_start_loc_p, md)
            _write_states(states, idx, final_states)
            out[nd : nd + npf] = y_p
        return out


def _write_states(states: States, idx: torch.Tensor, new_states: States) -> None:
    """states[i][idx] = new_states[i] (cast to the cache dtype) for every state tensor."""
    for state, new in zip(states, new_states):
        state[idx] = new.to(state.dtype)
