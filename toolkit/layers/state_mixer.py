"""What the recurrent-state mixers (Mamba1Mixer, Mamba2Mixer, ShortConv, GatedDeltaNet) share: binding their
per-request state tensors, and dispatching a step's tokens to decode / prefill over state slots.

Notation: T tokens in the step, S state slots, nd decode tokens (= decode rows, one token each),
npf prefill tokens in P prefill rows. Each mixer keeps k state tensors (its `state_names`, in
cache order, e.g. ("conv_state", "ssm_state")); tensor i is [S, *state_shapes()[i]], one slice
per request slot (vLLM "SD" layout).

Token order (BaseMambaAttentionMetadata contract): [decode tokens | prefill tokens | padding].
A subclass's forward computes its per-token inputs and calls
`run_state_slots(attn_metadata, out_shape, out_dtype, decode, prefill)` ([T, ...] output) with two closures
holding only its own math, written with the ops of `self.ops` (toolkit/layers/ops.py), which
read and write the state caches in place at state indices:

    decode(tokens, states, state_indices, **verify) -> y
        tokens      slice(0, nd) of the step's tokens
        states      the k bound cache tensors [S, *state_shape_i]; row r's state is
                    states[i][state_indices[r]], updated in place
        verify      {} for plain decode rows (one token each, state_indices [nd]); for speculative
                    decoding's verify rows (1 + k tokens at most each, state_indices [D, 1 + k], a
                    row's state columns) the keywords query_start_loc [D+1] and
                    num_accepted_tokens [D], to pass on to the update ops as they are: each op runs
                    every row's tokens in one call (kernels/state_slots_ref.step_rows_at_columns)
        y           [nd, ...] output rows

    prefill(tokens, states, state_indices, has_initial_state, cu_seqlens, md) -> y
        tokens      slice(nd, nd + npf), or slice(0, T) in a profile run
        states      as for decode; sequence r starts from its slot's state if
                    has_initial_state[r] (else zeros) and leaves its final state there
        cu_seqlens  int32 [P+1] sequence boundaries within `tokens` (md.query_start_loc_p)
        md          the layer's metadata (e.g. Mamba2's chunk fields), None in a profile run
        y           [len(tokens), ...]

A profile run (attn_metadata None) runs prefill over the whole batch as one sequence on scratch
zero states, so the caches are never touched.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from toolkit.kernels.state_slots_ref import Checkpoints
from toolkit.layers.ops import TORCH_OPS

States = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class StateShard:
    """Where one state tensor of a tensor-parallel rank sits in the full (unsharded) state: along
    `dim` of the per-slot shape, entry i of the rank's tensor is entry `index[i]` of the full one
    (`full` entries). Sections that every rank holds (a Mamba2 mixer's one group) appear in every
    rank's index; inspection gathers the ranks' shards by it (inspect/ranks.py)."""
    dim: int
    index: torch.Tensor          # int64 [local entries]
    full: int
DecodeFn = Callable[..., torch.Tensor]      # (tokens, states, state_indices, **verify)
PrefillFn = Callable[[slice, States, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


class StateSlotMixer(nn.Module, ABC):
    """Base class of a layer holding per-request recurrent state in bound cache tensors.

    Subclasses set `state_names` and implement `state_shapes()` (per-slot shape of each state
    tensor, the same shapes their MambaSpec reports); the state tensors are the attributes named
    in `state_names` (None while unbound).
    """

    state_names: tuple[str, ...] = ()
    # tensor parallelism: where each state tensor of this rank sits in the full state (set by the
    # subclass's shard_); None while unsharded
    state_shards: tuple[StateShard, ...] | None = None

    def __init__(self, layer_name: str) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.ops = TORCH_OPS                        # set_ops() swaps in the Triton kernels
        self._neg_exp_A: tuple[tuple, torch.Tensor] | None = None
        self.unbind_kv_cache()

    @abstractmethod
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-slot shape of each state tensor, in `state_names` order."""

    def prefill_checkpoint_alignment(self) -> int | None:
        """Positions a prefill can save its state at from inside a chunk (`Checkpoints`): a
        multiple of this many tokens (1: any token), or None when its prefill op cannot (vLLM
        `get_prefill_checkpoint_alignment`). Cache mode "all" needs it to divide the block size."""
        return None

    @staticmethod
    def checkpoints(md) -> Checkpoints | None:
        """The internal checkpoints the layer's metadata asks its prefill to save (cache mode "all")."""
        if md is None or getattr(md, "checkpoint_token_index_p", None) is None:
            return None
        return Checkpoints(md.checkpoint_token_index_p, md.checkpoint_slots_p)

    def state_dtypes(self) -> tuple[torch.dtype, ...]:
        """Cache dtype of each state tensor, in `state_names` order."""
        return tuple(self.get_kv_cache_spec().dtypes)

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
        out_shape: tuple[int, ...],
        out_dtype: torch.dtype,
        decode: DecodeFn,
        prefill: PrefillFn,
    ) -> torch.Tensor:
        """Run one step's tokens through `decode` / `prefill` (see the module docstring) and return
        their outputs as one [T, ...] tensor of `out_shape` and `out_dtype`.

        Decode rows' outputs come first, then prefill rows', padding rows are zero. A step whose
        tokens are all decode tokens (every CUDA-graph step) or all prefill tokens returns that
        closure's output as it is: no zero buffer, no copy. attn_metadata None (profile run):
        prefill's output for the whole batch as one sequence from a zero state, with no state
        reads or writes.
        """
        t = out_shape[0]
        if attn_metadata is None:
            device = next(self.parameters()).device
            scratch = tuple(torch.zeros(1, *shape, dtype=dtype, device=device)
                            for shape, dtype in zip(self.state_shapes(), self.state_dtypes()))
            one_slot = torch.zeros(1, dtype=torch.int32, device=device)
            cu = torch.tensor([0, t], device=device, dtype=torch.int32)
            return self._checked(prefill(slice(0, t), scratch, one_slot, one_slot.bool(), cu, None),
                                 out_shape, out_dtype, "prefill")
        md = attn_metadata[self.layer_name]
        states = self._bound_states()
        nd = int(md.num_decode_tokens) if int(md.num_decodes) > 0 else 0
        npf = int(md.num_prefill_tokens) if int(md.num_prefills) > 0 else 0
        spec = nd and getattr(md, "num_accepted_tokens", None) is not None
        if nd and not spec and nd != int(md.num_decodes):
            raise ValueError(f"{self.layer_name}: one token per decode row expected, got "
                             f"{nd} tokens for {md.num_decodes} decodes")

        def run_decode() -> torch.Tensor:
            if spec:        # verify rows: every position of every row in one call of each op
                y = decode(slice(0, nd), states, md.state_indices_tensor_d,
                           query_start_loc=md.query_start_loc_d, num_accepted_tokens=md.num_accepted_tokens)
            else:
                y = decode(slice(0, nd), states, md.state_indices_tensor_d[:nd])
            return self._checked(y, (nd, *out_shape[1:]), out_dtype, "decode")

        def run_prefill() -> torch.Tensor:
            y = prefill(slice(nd, nd + npf), states, md.state_indices_tensor_p, md.has_initial_states_p,
                        md.query_start_loc_p, md)
            return self._checked(y, (npf, *out_shape[1:]), out_dtype, "prefill")

        if nd == t:
            return run_decode()
        if npf == t:
            return run_prefill()
        out = torch.zeros(out_shape, dtype=out_dtype, device=states[0].device)
        if nd:
            out[:nd] = run_decode()
        if npf:
            out[nd : nd + npf] = run_prefill()
        return out

    def neg_exp_A(self) -> torch.Tensor:
        """A = -exp(A_log) in fp32, cached while the parameter `A_log` is unchanged (same tensor,
        same version: a weight load bumps it). vLLM computes A once at load time; recomputing it
        would cost a decode step two kernels per layer, and a CUDA graph reads the cached tensor.
        Parameters made under torch.inference_mode have no version counter, so an in-place edit
        could not be seen: A is then recomputed on every call."""
        if self.A_log.is_inference():
            return -torch.exp(self.A_log.to(torch.float32))
        key = (id(self.A_log), self.A_log._version, self.A_log.device)
        if self._neg_exp_A is None or self._neg_exp_A[0] != key:
            self._neg_exp_A = (key, -torch.exp(self.A_log.detach().to(torch.float32)))
        return self._neg_exp_A[1]

    def _checked(self, y: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
        if tuple(y.shape) != tuple(shape) or y.dtype != dtype:
            raise RuntimeError(f"{self.layer_name}: {what} returned {y.dtype} {tuple(y.shape)}, "
                               f"expected {dtype} {tuple(shape)}")
        return y
