"""Argument checks the kernel launchers share: each raises ValueError naming the argument, what it
must be and what it is. They read shapes, dtypes and strides only, never tensor data (that would
synchronise host and device). Also the row tiling of the row-wise kernels (`rows_per_program`, `tile_warps`),
and the verify-row arguments of the recurrent update ops (`check_verify_rows`)."""
from __future__ import annotations

import torch

from .state_slots_ref import Checkpoints

INT_DTYPES = (torch.int32, torch.int64)


def check_index(name: str, t: torch.Tensor, n: int | None, what: str, dtypes=INT_DTYPES) -> None:
    """t must be a 1-D tensor of one of `dtypes`, of length n (any length when n is None)."""
    if t.dim() != 1 or (n is not None and t.shape[0] != n) or t.dtype not in dtypes:
        want = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must be {want} [{what}], got {t.dtype} {tuple(t.shape)}")


def check_chunk_layout(chunk_size: int, cu_chunk_seqlens: torch.Tensor, seq_idx: torch.Tensor,
                       last_chunk_indices: torch.Tensor, state_indices: torch.Tensor,
                       has_initial_state: torch.Tensor) -> tuple[int, int]:
    """The varlen chunk layout of a chunked prefill (Mamba2 SSD, GDN) and its per-sequence state
    arguments -> (NC chunks, R sequences)."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive python int, got {chunk_size!r}")
    if cu_chunk_seqlens.dim() != 1 or cu_chunk_seqlens.shape[0] < 1:
        raise ValueError(f"cu_chunk_seqlens must be int32/int64 [NC+1], got {tuple(cu_chunk_seqlens.shape)}")
    nc = cu_chunk_seqlens.shape[0] - 1
    check_index("cu_chunk_seqlens", cu_chunk_seqlens, nc + 1, "NC+1")
    check_index("seq_idx", seq_idx, nc, f"NC={nc}")
    check_index("last_chunk_indices", last_chunk_indices, None, "R")
    rows = last_chunk_indices.shape[0]
    check_index("state_indices", state_indices, rows, f"R={rows}")
    check_index("has_initial_state", has_initial_state, rows, f"R={rows}", (torch.bool, *INT_DTYPES))
    return nc, rows


def check_checkpoints(checkpoints: Checkpoints | None, device: torch.device) -> int:
    """A prefill op's `checkpoints` (None, or state_slots_ref.Checkpoints: token_index int64 [M],
    slots int32/int64 [M], both on `device`) -> M (0 when None)."""
    if checkpoints is None:
        return 0
    if not isinstance(checkpoints, Checkpoints):
        raise ValueError(f"checkpoints must be a state_slots_ref.Checkpoints (token_index, slots) or None, "
                         f"got {type(checkpoints).__name__}")
    token_index, slots = checkpoints
    check_index("checkpoints.token_index", token_index, None, "M", (torch.int64,))
    m = token_index.shape[0]
    check_index("checkpoints.slots", slots, m, f"M={m}")
    for name, v in (("checkpoints.token_index", token_index), ("checkpoints.slots", slots)):
        if v.device != device:
            raise ValueError(f"{name} is on {v.device}, x on {device}: all inputs must share a device")
    return m


def check_devices(device: torch.device, **tensors: torch.Tensor) -> None:
    """Every tensor on `device` (v's, in the recurrent launchers), or an error naming the first that is not."""
    for name, x in tensors.items():
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, v on {device}: all inputs must share a device")


def token_save_slots(checkpoints: Checkpoints | None, num_tokens: int, placeholder: torch.Tensor) -> torch.Tensor:
    """What a prefill kernel with checkpoints (HAS_CKPT) reads per token: the slot to store its state
    in after that token, int32 [T], -1 = none, scattered on the device (no host sync). Without
    checkpoints, `placeholder` (a pointer the kernel never reads)."""
    if checkpoints is None or checkpoints.token_index.numel() == 0:
        return placeholder
    save = torch.full((num_tokens,), -1, dtype=torch.int32, device=placeholder.device)
    return save.scatter_(0, checkpoints.token_index, checkpoints.slots.to(torch.int32))


def rows_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """t [..., D] -> a [rows, D] view, unit stride along D (any row stride), for the row-wise kernels."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, strides {t.stride()}")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} {tuple(t.shape)} with strides {t.stride()}: its leading dimensions do not "
                         "flatten to rows without a copy") from None


# Elements per program of the row-wise kernels (norms, activation, rotary, dt, KV write): a program
# takes as many rows as fit, so narrow rows (a tiny model's 16- to 128-wide heads and norms, a decode
# batch) are not one program each. On a GPU a 2048-element tile is 16 per thread at 4 warps; under the
# Triton interpreter, where every program costs a Python call per op, it divides the programs run.
ROW_TILE_ELEMENTS = 2048


def rows_per_program(block_width: int) -> int:
    """BLOCK_M of a row-wise kernel whose row tile is `block_width` wide (a power of 2): a power of 2,
    at least 1. It depends on the width only, never on the row count, so a kernel has one
    specialization per width (what a CUDA graph and the compile check see)."""
    return max(1, ROW_TILE_ELEMENTS // block_width)


def tile_warps(tile_elements: int) -> int:
    """num_warps of a row-wise kernel for a tile of this many elements: one warp per 256 (8 elements
    a thread), 1 to 16."""
    return min(16, max(1, tile_elements // 256))


def check_verify_rows(state_indices: torch.Tensor, query_start_loc: torch.Tensor | None,
                      num_accepted_tokens: torch.Tensor | None, device: torch.device) -> tuple[int, int] | None:
    """The verify-row arguments of a recurrent update op (speculative decoding; semantics in
    state_slots_ref.step_rows_at_columns): None when neither query_start_loc nor num_accepted_tokens
    is given (plain decode: the launcher checks state_indices [B] itself), else (R rows, J state
    columns) after checking state_indices int32/int64 [R, J] (J >= 1), query_start_loc
    int32/int64 [R+1] and num_accepted_tokens int32/int64 [R], contiguous, all on `device`."""
    if query_start_loc is None and num_accepted_tokens is None:
        return None
    if query_start_loc is None or num_accepted_tokens is None:
        given, missing = (("query_start_loc", "num_accepted_tokens") if num_accepted_tokens is None
                          else ("num_accepted_tokens", "query_start_loc"))
        raise ValueError(f"{given} was given without {missing}: the verify rows need both (or neither, "
                         "for a plain decode)")
    if state_indices.dim() != 2 or state_indices.shape[1] < 1 or state_indices.dtype not in INT_DTYPES:
        raise ValueError(f"state_indices must be int32/int64 [R, J=1+k] with query_start_loc (verify rows), "
                         f"got {state_indices.dtype} {tuple(state_indices.shape)}")
    rows, cols = state_indices.shape
    check_index("query_start_loc", query_start_loc, rows + 1, f"R+1={rows + 1}")
    check_index("num_accepted_tokens", num_accepted_tokens, rows, f"R={rows}")
    for name, v in (("state_indices", state_indices), ("query_start_loc", query_start_loc),
                    ("num_accepted_tokens", num_accepted_tokens)):
        if v.device != device:
            raise ValueError(f"{name} is on {v.device}, the inputs on {device}: all must be on one device")
    for name, v in (("query_start_loc", query_start_loc), ("num_accepted_tokens", num_accepted_tokens)):
        if v.shape[0] > 1 and v.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, strides {tuple(v.stride())}")
    return rows, cols


def verify_launch_args(state_indices: torch.Tensor, query_start_loc: torch.Tensor | None,
                       num_accepted_tokens: torch.Tensor | None, verify: tuple[int, int] | None) -> tuple:
    """The verify arguments of a recurrent update kernel (query_start_loc, num_accepted_tokens, J,
    the state indices' row and column strides), from `check_verify_rows`'s result; for a plain launch
    placeholders the kernel never reads."""
    if verify is None:
        return state_indices, state_indices, 1, 1, 1
    return (query_start_loc, num_accepted_tokens, verify[1], *state_indices.stride())
