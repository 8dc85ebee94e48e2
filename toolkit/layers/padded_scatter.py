"""Scatters that skip padded rows (index PAD_SLOT_ID = -1) without a host-device sync."""
from __future__ import annotations

import torch


def padded_rows_redirected(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A scatter `dst[index[i]] = src[i]` that skips the rows with index < 0, without a boolean mask
    (its data-dependent shape would sync host and device, and cannot be captured in a CUDA graph).

    Returns (rows, targets, keep), each [N]: write src[rows[i]] (where keep[i]) to dst[targets[i]].
    A skipped row repeats the write of the first kept row (same target, same value: a harmless
    duplicate); if no row is kept, every row targets entry 0 with keep False, and the caller writes
    that entry's own value back. Entries no kept row targets are left bit-identical."""
    index = index.to(torch.int64)
    kept = index >= 0
    first_kept = kept.to(torch.int32).argmax()          # 0 when no row is kept
    rows = torch.where(kept, torch.arange(index.numel(), device=index.device), first_kept)
    return rows, index[rows].clamp(min=0), kept[rows]
