"""BlockTables' incremental staging: a batch with the same rows as the last gather restages only
the rows written since. Pinned against the whole gather on random programs of appends, aligned
row tails, cleared rows, batch changes, padded batches and dummy batches."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from toolkit.kv_cache_manager import RowTail
from toolkit.runner.block_table import BlockTables, staging_regions
from toolkit.runner.staging import Staging

ROWS, WIDTHS, BLOCK_SIZES = 6, [10, 12], [4, 4]     # group 0: attention (appends), group 1: aligned Mamba


def make_tables(incremental: bool) -> BlockTables:
    int32, int64 = staging_regions(WIDTHS, ROWS, 64)
    staging = Staging(int32, int64, torch.device("cpu"))
    return BlockTables(BLOCK_SIZES, WIDTHS, ROWS, staging, aligned=[False, True], incremental=incremental)


def staged(bt: BlockTables, idx: np.ndarray, padded: int | None) -> list[np.ndarray]:
    return [t.numpy().copy() for t in bt.gather_block_tables(idx, padded)]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_gather_equals_whole_gather(seed):
    rng = random.Random(seed)
    whole, incremental = make_tables(False), make_tables(True)
    live: dict[int, int] = {}                     # row -> blocks held in group 0
    batch: list[int] = []
    restaged = 0
    for step in range(120):
        op = rng.random()
        if op < 0.15 and len(live) < ROWS:        # a new request's whole rows
            row = next(r for r in range(ROWS) if r not in live)
            n = rng.randint(1, 4)
            ids = ([rng.randint(1, 99) for _ in range(n)], [0] * (n - 1) + [rng.randint(1, 99)])
            for bt in (whole, incremental):
                bt.append_block_ids(row, ids, overwrite=True)
            live[row] = n
            batch.append(row)
        elif op < 0.22 and live:                  # a finished request
            row = rng.choice(sorted(live))
            for bt in (whole, incremental):
                bt.clear_row(row)
            del live[row]
            batch = [r for r in batch if r != row]
        elif op < 0.27 and len(batch) > 1:       # the batch's order changes
            rng.shuffle(batch)
        elif op < 0.30:                           # a dummy batch (warmup, capture) in between
            for bt in (whole, incremental):
                bt.null_block_tables(rng.randint(1, ROWS))
        # every live row in the batch may add a block (group 0) and move its aligned tail (group 1)
        for row in list(live):
            if rng.random() < 0.4 and live[row] < WIDTHS[0]:
                new_ids = ([rng.randint(1, 99)], RowTail(max(live[row] - 1, 0), [0, rng.randint(1, 99)]))
                for bt in (whole, incremental):
                    bt.append_block_ids(row, new_ids, overwrite=False)
                live[row] += 1
        if not batch:
            continue
        idx = np.array(batch, dtype=np.int64)
        padded = rng.choice([None, len(batch), min(ROWS, len(batch) + 2)])
        same = incremental._staged_rows is not None
        expected, got = staged(whole, idx, padded), staged(incremental, idx, padded)
        restaged += same and incremental._staged_rows is not None
        for g in range(len(WIDTHS)):
            np.testing.assert_array_equal(got[g], expected[g], err_msg=f"seed {seed}, step {step}, group {g}")
    assert restaged > 20          # the incremental path ran, not only whole gathers


def test_same_rows_restage_only_the_changed_rows():
    bt = make_tables(True)
    for row in range(3):
        bt.append_block_ids(row, ([1 + row], RowTail(0, [10 + row])), overwrite=True)
    idx = np.arange(3, dtype=np.int64)
    bt.gather_block_tables(idx)
    arena = bt.staging.arena
    arena._lo, arena._hi = arena.host_buffer.numel(), 0       # forget what the first gather wrote
    bt.append_block_ids(1, ([7], RowTail(0, [0, 11])), overwrite=False)
    tables = bt.gather_block_tables(idx)
    assert tables[0][1, :2].tolist() == [2, 7] and tables[1][1, :2].tolist() == [0, 11]
    # the span marked for the flush ends at row 1 (the changed row), not at the batch's last row
    start, _, shape = arena.offsets["block_table_1"]
    assert arena._hi == start + 2 * shape[1] * 4
