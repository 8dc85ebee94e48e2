"""Block tables and slot mappings, one per KV-cache group (MRV2 `BlockTables`).

The CPU table [R, W_g] is the authority (W_g = blocks per request in group g); each step gathers
the batch's rows, in batch order, into a persistent device buffer `input_block_tables[g]`, staged
with the slot mappings (runner/staging.py: written on the host, sent by the runner's one flush).
With `incremental` (the target runner's tables), a step whose batch holds the same rows in the same
order as the last gather restages only the rows written since (`append_block_ids`, `clear_row`:
about B / block_size rows a decode step), so its host work does not follow B x W_g (W_g grows with
max_model_len); MRV2 gets the same from its device-side table and gather kernel.
Slot mapping: token at position p of a row -> block_table[row, p // block_size] * block_size
+ p % block_size, with PAD_SLOT_ID beyond the real tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from toolkit.kv_cache_manager import RowTail
from toolkit.kv_cache_spec import PAD_SLOT_ID
from toolkit.runner.staging import Staging, StagingBank
from toolkit.tensor_views import HeadViews


def staging_regions(widths: list[int], max_num_reqs: int, max_num_tokens: int) -> tuple[dict, dict]:
    """(int32, int64) staging regions of the block tables (narrowest first, so a step's span stops
    at the batch's rows of the widest) and of the slot mappings."""
    order = sorted(range(len(widths)), key=lambda g: widths[g])
    return ({f"block_table_{g}": (max_num_reqs, widths[g]) for g in order},
            {"slot_mappings": (len(widths), max_num_tokens)})


class BlockTables:
    def __init__(self, block_sizes: list[int], widths: list[int], max_num_reqs: int, staging: Staging | StagingBank,
                 aligned: list[bool] | None = None, incremental: bool = False):
        self.block_sizes = block_sizes
        # per group: a Mamba row of prefix caching's "align" mode, position-indexed (0: no page); the
        # scheduler sends the columns it changed (kv_cache_manager.RowTail)
        self.aligned = aligned or [False] * len(widths)
        self.staging = staging
        self.tables = [np.zeros((max_num_reqs, w), dtype=np.int32) for w in widths]
        self.num_blocks = [np.zeros(max_num_reqs, dtype=np.int32) for _ in widths]
        self.input_block_tables = [staging.device(f"block_table_{g}") for g in range(len(widths))]
        self.slot_mappings = staging.device("slot_mappings")
        self.views = HeadViews()            # a step's views of these, the same objects from step to step
        staging.host("slot_mappings")[:] = PAD_SLOT_ID
        staging.written("slot_mappings")
        # `incremental`: the rows the staged tables hold (batch order, padded rows included as -1),
        # None when they must be gathered whole; and the request rows written in the CPU tables since
        # that gather. A table written other than through append_block_ids / clear_row (the draft
        # model's) must not be incremental.
        self.incremental = incremental
        self._staged_rows: np.ndarray | None = None
        # the request rows append_block_ids / clear_row wrote, while an auditor asks for them
        # (track_writes: the runtime checks' LedgerBook, which empties it); None: nothing is kept
        self.written_rows: set[int] | None = None
        self._changed: set[int] = set()

    @property
    def num_groups(self) -> int:
        return len(self.tables)

    def append_block_ids(self, req_idx: int, block_ids: tuple, overwrite: bool) -> None:
        """A request's new ids per group: a new request's whole rows (`overwrite`), else the ids
        appended to each row, or for an aligned Mamba row a RowTail (the row from its first changed
        column; the columns after the tail are zeroed)."""
        changed = overwrite
        for g, ids in enumerate(block_ids):
            if isinstance(ids, RowTail):
                start, ids = ids.start, ids.ids
            else:
                start = 0 if overwrite or self.aligned[g] else int(self.num_blocks[g][req_idx])
            end = start + len(ids)
            if end > self.tables[g].shape[1]:
                raise RuntimeError(f"group {g}: row {req_idx} would hold {end} blocks, "
                                   f"table width is {self.tables[g].shape[1]}")
            self.tables[g][req_idx, start:end] = ids
            if self.aligned[g]:          # a new row: all past its end; a tail: the columns it held past it
                held = int(self.num_blocks[g][req_idx])
                self.tables[g][req_idx, end:None if overwrite else max(end, held)] = 0
                changed = changed or end < held
            changed = changed or end > start
            self.num_blocks[g][req_idx] = end
        if changed and self.incremental:
            self._changed.add(req_idx)
        if changed and self.written_rows is not None:
            self.written_rows.add(req_idx)

    def state_pages(self, g: int, idx_mapping_np: np.ndarray, seq_lens_np: np.ndarray) -> np.ndarray:
        """int [B]: the state page each row's forward reads and writes (group g, a Mamba group): its
        only column, or in "align" mode the column of its last scheduled token."""
        table = self.tables[g]
        if not self.aligned[g]:
            return table[idx_mapping_np, 0]
        cols = np.maximum(np.asarray(seq_lens_np, dtype=np.int64) - 1, 0) // self.block_sizes[g]
        return table[idx_mapping_np, cols]

    def clear_row(self, req_idx: int) -> None:
        for g in range(self.num_groups):
            self.tables[g][req_idx] = 0
            self.num_blocks[g][req_idx] = 0
        if self.incremental:
            self._changed.add(req_idx)
        if self.written_rows is not None:
            self.written_rows.add(req_idx)

    def track_writes(self) -> None:
        """From now on, note in `written_rows` each request row append_block_ids / clear_row write."""
        if self.written_rows is None:
            self.written_rows = set()

    def gather_block_tables(self, idx_mapping_np: np.ndarray, num_rows: int | None = None
                            ) -> tuple[torch.Tensor, ...]:
        """Rows of the batch, in batch order: tuple over groups of int32 [num_rows, W_g] (device
        views; num_rows defaults to B), staged. Rows past B are padded rows: every entry the null
        block / null state page 0, rewritten whenever the staged rows change, so no stale real id
        survives there."""
        b = len(idx_mapping_np)
        rows = b if num_rows is None else num_rows
        staged = np.full(rows, -1, dtype=np.int64)
        staged[:b] = idx_mapping_np
        if self.incremental and self._staged_rows is not None and np.array_equal(staged, self._staged_rows):
            self._restage_changed(staged[:b])
        else:
            for g, table in enumerate(self.tables):
                host = self.staging.host(f"block_table_{g}")
                np.take(table, idx_mapping_np, axis=0, out=host[:b])
                host[b:rows] = 0
                self.staging.written(f"block_table_{g}", rows)
            self._staged_rows = staged if self.incremental else None
        self._changed.clear()
        return tuple(self.views.head(t, rows) for t in self.input_block_tables)

    def _restage_changed(self, idx_mapping_np: np.ndarray) -> None:
        """The staged tables hold the batch's rows as of the last gather: copy in the rows written
        since (a changed row outside the batch is gathered whole when it joins one, which changes
        the staged rows)."""
        if not self._changed:
            return
        changed = np.fromiter(self._changed, dtype=np.int64, count=len(self._changed))
        positions = np.nonzero(np.isin(idx_mapping_np, changed))[0]
        if not len(positions):
            return
        for g, table in enumerate(self.tables):
            self.staging.host(f"block_table_{g}")[positions] = table[idx_mapping_np[positions]]
            self.staging.written(f"block_table_{g}", int(positions[-1]) + 1)

    def invalidate_staged(self) -> None:
        """The staged tables were written for another batch (a dummy or the capture check's): the
        next gather writes them whole."""
        self._staged_rows = None

    def null_block_tables(self, num_rows: int) -> tuple[torch.Tensor, ...]:
        """Block tables of `num_rows` dummy or padded rows: every entry the null block / null state
        slot 0 (staged)."""
        self.invalidate_staged()
        for g in range(self.num_groups):
            self.staging.host(f"block_table_{g}")[:num_rows] = 0
            self.staging.written(f"block_table_{g}", num_rows)
        return tuple(self.views.head(t, num_rows) for t in self.input_block_tables)

    def distinct_state_slots(self, num_rows: int, groups: dict[int, list[int]]) -> None:
        """The capture check's dummy rows (model_runner._check_graph): in each recurrent state group
        of `groups` (group id -> slots the check may use), row r reads and writes slot ids[r] in every
        column, staged (cycling when there are fewer slots than rows; the null slot when none).
        Rows that shared one slot would race on it in a compiled kernel (a row reads the slot while
        another writes it), so eager and replayed forwards could differ with nothing wrong."""
        self.invalidate_staged()
        for g, ids in groups.items():
            slots = np.asarray(ids or [0], dtype=np.int32)
            self.staging.host(f"block_table_{g}")[:num_rows] = slots[np.arange(num_rows) % len(slots), None]
            self.staging.written(f"block_table_{g}", num_rows)

    def pad_slot_mappings(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """Slot mappings that write nothing (PAD_SLOT_ID), staged: tuple over groups of int64
        [num_tokens] views."""
        host = self.staging.host("slot_mappings")
        host[:, :num_tokens] = PAD_SLOT_ID
        self.staging.written("slot_mappings", elements=(self.num_groups - 1) * host.shape[1] + num_tokens)
        return self._slot_views(num_tokens)

    def _slot_views(self, width: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.views.row_head(self.slot_mappings, g, width) for g in range(self.num_groups))

    def compute_slot_mappings(self, idx_mapping_np: np.ndarray, query_start_loc_np: np.ndarray,
                              num_computed_np: np.ndarray, num_padded: int | None = None
                              ) -> tuple[torch.Tensor, ...]:
        """Tuple over groups of int64 [num_padded or T] views of the persistent slot-mapping buffer
        (one row a group): the slots of the batch's T tokens (row r's tokens sit at positions
        num_computed[r], num_computed[r] + 1, ...), then PAD_SLOT_ID for the padded tokens of a
        padded batch. Computed on the host from the CPU tables (the authority), staged."""
        qsl = query_start_loc_np
        num_tokens = int(qsl[-1])
        token_rows = np.repeat(np.arange(len(qsl) - 1), np.diff(qsl))
        positions = num_computed_np[token_rows].astype(np.int64) + np.arange(num_tokens) - qsl[token_rows]
        width = num_padded or num_tokens
        host = self.staging.host("slot_mappings")
        for g, table in enumerate(self.tables):
            bs = self.block_sizes[g]
            blocks = table[idx_mapping_np[token_rows], positions // bs].astype(np.int64)
            host[g, :num_tokens] = blocks * bs + positions % bs
            host[g, num_tokens:width] = PAD_SLOT_ID
        self.staging.written("slot_mappings", elements=(self.num_groups - 1) * host.shape[1] + width)
        return self._slot_views(width)
