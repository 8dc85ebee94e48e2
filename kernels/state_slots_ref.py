"""Reading and writing per-request state at state indices, in torch: the `state_indices`
contract every state kernel of this folder keeps (a row reads `cache[state_indices[row]]` and
writes its new state back there; PAD_SLOT_ID (-1) marks a padded row, which reads zeros and writes
nothing). The `*_ref.py` references build on these helpers."""
from __future__ import annotations

from typing import NamedTuple

import torch


class Checkpoints(NamedTuple):
    """States a prefill op also saves from inside its sequences (prefix caching's internal
    checkpoints, `LLM(mamba_cache_mode="all")`): after token `token_index[m]` (an index among the
    op's tokens, never the last token of its sequence) the layer's state goes to cache slot
    `slots[m]`, besides the sequence's final state going to its own slot. M = 0 is allowed."""
    token_index: torch.Tensor     # int64 [M], increasing
    slots: torch.Tensor           # int [M]; PAD_SLOT_ID (-1): nothing is written


def sequence_of(cu_seqlens: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """int64 [M]: the sequence holding each token (cu_seqlens int [S+1]), without a host sync."""
    cu = cu_seqlens.to(device=token_index.device, dtype=torch.int64)
    return torch.searchsorted(cu[1:], token_index.to(torch.int64), right=True)


def padded_rows_redirected(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A scatter `dst[index[i]] = src[i]` that skips the rows with index < 0, without a boolean mask
    (its data-dependent shape would sync host and device, and cannot be captured in a CUDA graph).

    Returns (rows, targets, keep), each [N]: write src[rows[i]] (where keep[i]) to dst[targets[i]].
    An index [N, P] is P such scatters, one per column (rows, targets, keep [N, P]).
    A skipped row repeats the write of the first kept row (same target, same value: a harmless
    duplicate); if no row is kept, every row targets entry 0 with keep False, and the caller writes
    that entry's own value back. Entries no kept row targets are left bit-identical."""
    index = index.to(torch.int64)
    kept = index >= 0
    first_kept = kept.to(torch.int32).argmax(0)          # 0 when no row is kept (per column for [B, P])
    arange = torch.arange(index.shape[0], device=index.device).view(-1, *(1,) * (index.dim() - 1))
    rows = torch.where(kept, arange, first_kept)
    return rows, index.gather(0, rows).clamp(min=0), kept.gather(0, rows)


def initial_states_at(cache: torch.Tensor, state_indices: torch.Tensor,
                    has_initial_state: torch.Tensor | None) -> torch.Tensor:
    """cache[state_indices] where the row has an initial state (and is not padded), else 0."""
    idx = state_indices.to(torch.int64)
    has = idx >= 0
    if has_initial_state is not None:
        has = has & has_initial_state.to(device=idx.device, dtype=torch.bool)
    rows = cache[idx.clamp(min=0)]
    return torch.where(has.view(-1, *(1,) * (rows.dim() - 1)), rows, torch.zeros((), dtype=cache.dtype,
                                                                                  device=cache.device))


def write_states_at(cache: torch.Tensor, state_indices: torch.Tensor, new: torch.Tensor) -> None:
    """cache[state_indices[i]] = new[i] (cast to the cache dtype), padded rows skipped."""
    if state_indices.numel() == 0:
        return
    rows, slots, keep = padded_rows_redirected(state_indices)     # no boolean mask: no sync
    keep = keep.view(-1, *(1,) * (new.dim() - 1))
    cache[slots] = torch.where(keep, new[rows].to(cache.dtype), cache[slots])


def step_rows_at_columns(cache: torch.Tensor | tuple[torch.Tensor, ...], state_indices: torch.Tensor,
                         query_start_loc: torch.Tensor, num_accepted_tokens: torch.Tensor, step,
                         inputs: tuple[torch.Tensor, ...], num_tokens: int) -> torch.Tensor:
    """Speculative decoding's verify rows, in torch: what a recurrent update op does when it is given
    `query_start_loc` and `num_accepted_tokens` (vLLM's selective_state_update / fused recurrent
    gated delta rule arguments), one call for every row's 1 + k tokens.

        state_indices        int [B, J] (J = 1 + k): row r's state columns, column j its slot
        query_start_loc      int [B+1]: row r's tokens are query_start_loc[r] : query_start_loc[r+1]
                             (1..J of them: a decode row always has its last sampled token)
        num_accepted_tokens  int [B] (>= 1): the row starts from the state in column num_accepted - 1
        step(state [B, ...], *per_token_inputs) -> (y [B, ...], new_state [B, ...]): the one-token op
        inputs               per-token tensors [T, ...], indexed by token
    A layer with several state tensors (the mLSTM's C, n, m) passes `cache` as a tuple of them, each
    [S, ...]: `step` then takes and returns the states as a tuple in the same order.

    Row r advances from cache[state_indices[r, num_accepted[r] - 1]] through its tokens in order and
    leaves the state after its j-th token in cache[state_indices[r, j]] (rounded to the cache dtype
    after every token, as a one-token update op leaves it: a verify row equals that op run token by
    token). A row whose column 0 is PAD_SLOT_ID (-1) is padding: y = 0, no state read or written.
    Returns y [num_tokens, ...] (0 at tokens no row covers). A loop over at most J positions; no host
    sync (a CUDA graph captures it)."""
    b, j_cols = state_indices.shape
    several = isinstance(cache, tuple)
    caches = cache if several else (cache,)
    dev = caches[0].device
    idx = state_indices.to(device=dev, dtype=torch.int64)
    qsl = query_start_loc.to(device=dev, dtype=torch.int64)
    starts, lens = qsl[:-1], qsl[1:] - qsl[:-1]
    real = idx[:, 0] >= 0
    first = (num_accepted_tokens.to(device=dev, dtype=torch.int64) - 1).clamp(0, j_cols - 1)
    start = torch.where(real, idx.gather(1, first[:, None])[:, 0], -1)
    states = tuple(initial_states_at(c, start, None) for c in caches)
    # positions to run, from shapes alone (no host sync): with every row holding at least one token,
    # none holds more than T - R + 1 (a batch of rows without drafts costs one position, not 1 + k)
    positions = max(1, min(j_cols, num_tokens - b + 1))
    cols = torch.arange(positions, device=dev)
    valid = real[:, None] & (cols[None, :] < lens[:, None])                                   # [B, P]
    token = (starts[:, None] + torch.minimum(cols[None, :], (lens[:, None] - 1).clamp(min=0))).clamp(0, num_tokens - 1)
    by_position = [t[token] for t in inputs]                               # [B, P, ...]: gathered once
    # where each position's states go: column j of the rows that hold a token j (no boolean mask: no
    # sync); one redirect for all positions, then per position a gather-select-put of B states
    rows, slots, keep = padded_rows_redirected(torch.where(valid, idx[:, :positions], -1))
    ys = []
    for j in range(positions):
        # a row's positions past its last token are invalid, and so are all after them: its state may
        # run on through them (nothing of it is written or returned), so no per-position select
        y, new = step(states if several else states[0], *(t[:, j] for t in by_position))
        states = tuple(s.to(c.dtype) for s, c in zip(new if several else (new,), caches))
        ys.append(y)
        for c, s in zip(caches, states):
            keep_j = keep[:, j].view(b, *(1,) * (s.dim() - 1))
            c[slots[:, j]] = torch.where(keep_j, s[rows[:, j]], c[slots[:, j]])
    # one scatter of the outputs: a position that is not a row's token lands in a scratch row past the end
    y_all = torch.stack(ys, 1).flatten(0, 1)
    out = torch.zeros((num_tokens + 1, *y_all.shape[1:]), dtype=y_all.dtype, device=dev)
    out.index_copy_(0, torch.where(valid, token, num_tokens).reshape(-1), y_all)
    return out[:num_tokens]
