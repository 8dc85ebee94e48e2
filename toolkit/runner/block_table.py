"""Block tables and slot mappings, one per KV-cache group (MRV2 `BlockTables`).

The CPU table [R, W_g] is the authority (W_g = blocks per request in group g); each step gathers
the batch's rows, in batch order, into a persistent device buffer `input_block_tables[g]`.
Slot mapping: token at position p of a row -> block_table[row, p // block_size] * block_size
+ p % block_size, with PAD_SLOT_ID beyond the real tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from toolkit.host import copy_to
from toolkit.kv_cache_spec import PAD_SLOT_ID


class BlockTables:
    def __init__(self, block_sizes: list[int], widths: list[int], max_num_reqs: int,
                 max_num_tokens: int, device: torch.device):
        self.block_sizes = block_sizes
        self.tables = [np.zeros((max_num_reqs, w), dtype=np.int32) for w in widths]
        self.num_blocks = [np.zeros(max_num_reqs, dtype=np.int32) for _ in widths]
        self.input_block_tables = [torch.zeros(max_num_reqs, w, dtype=torch.int32, device=device)
                                   for w in widths]
        self.slot_mappings = torch.full((len(widths), max_num_tokens), PAD_SLOT_ID,
                                        dtype=torch.int64, device=device)

    @property
    def num_groups(self) -> int:
        return len(self.tables)

    def append_block_ids(self, req_idx: int, block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        for g, ids in enumerate(block_ids):
            start = 0 if overwrite else int(self.num_blocks[g][req_idx])
            end = start + len(ids)
            if end > self.tables[g].shape[1]:
                raise RuntimeError(f"group {g}: row {req_idx} would hold {end} blocks, "
                                   f"table width is {self.tables[g].shape[1]}")
            self.tables[g][req_idx, start:end] = ids
            self.num_blocks[g][req_idx] = end

    def clear_row(self, req_idx: int) -> None:
        for g in range(self.num_groups):
            self.tables[g][req_idx] = 0
            self.num_blocks[g][req_idx] = 0

    def gather_block_tables(self, idx_mapping_np: np.ndarray, num_rows: int | None = None
                            ) -> tuple[torch.Tensor, ...]:
        """Rows of the batch, in batch order: tuple over groups of int32 [num_rows, W_g] (device
        views; num_rows defaults to B). Rows past B are padded rows: every entry the null block /
        null state slot 0, rewritten every step so no stale real id survives there. One
        host-to-device copy per group."""
        b = len(idx_mapping_np)
        rows = b if num_rows is None else num_rows
        out = []
        for g, table in enumerate(self.tables):
            host = np.zeros((rows, table.shape[1]), dtype=np.int32)
            host[:b] = table[idx_mapping_np]
            dst = self.input_block_tables[g][:rows]
            copy_to(dst, host)
            out.append(dst)
        return tuple(out)

    def compute_slot_mappings(self, idx_mapping_np: np.ndarray, query_start_loc_np: np.ndarray,
                              num_computed_np: np.ndarray, num_padded: int | None = None) -> torch.Tensor:
        """int64 [G, num_padded or T] view of the persistent slot-mapping buffer: the slots of the
        batch's T tokens (row r's tokens sit at positions num_computed[r], num_computed[r] + 1, ...),
        then PAD_SLOT_ID for the padded tokens of a padded batch. Computed on the host from the
        CPU tables (the authority), then one host-to-device copy per group."""
        qsl = query_start_loc_np
        num_tokens = int(qsl[-1])
        token_rows = np.repeat(np.arange(len(qsl) - 1), np.diff(qsl))
        positions = num_computed_np[token_rows].astype(np.int64) + np.arange(num_tokens) - qsl[token_rows]
        width = num_padded or num_tokens
        for g, table in enumerate(self.tables):
            bs = self.block_sizes[g]
            slots = np.full(width, PAD_SLOT_ID, dtype=np.int64)
            slots[:num_tokens] = table[idx_mapping_np[token_rows], positions // bs].astype(np.int64) * bs + positions % bs
            copy_to(self.slot_mappings[g, :width], slots)
        return self.slot_mappings[:, :width]
