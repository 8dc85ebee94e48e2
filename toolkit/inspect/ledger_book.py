"""The cache ledger, kept from step to step for the runtime checks: what `ledger_of` and
`check_ledger` (inspect/checks.py) compute from the whole books, here from what changed since the
last step, so that a recorded step's ledger and audit cost what the step changed (rows, blocks
added, freed or shared), never what the requests hold: at 64 rows of 16k tokens the whole audit took
10.7 ms a step (benchmarks/RESULTS.md, "Recording at long contexts").

What changed is found, not trusted:
- each request's rows are compared with the book's copies of them (list compares, in C), so a row
  written anywhere, by any code, is seen; the book's index of who holds each id (from the rows) is
  updated by the difference;
- the pools name each id whose holders or free-queue place their methods changed (`BlockPool.changed`:
  allocate / touch / free / hand_over, the only writers of `holders` and `_free`);
- the runner's block tables name each request row they wrote (`BlockTables.written_rows`).

An id is audited (its holders by the rows against the pool's, not free while held, not shared without
prefix caching) when either side moved it; a running request's block-table row is compared with the
ledger when its ledger row, its runner row or its row index changed. Everything else passed the last
audit and has not changed since, so it passes again. What this cannot see is a write that bypasses the
pools' or the block tables' methods (a test setting `pool.holders[i]` or a table entry by hand): the
whole audit, `check_ledger`, is for that (tests/test_ledger_check.py, scripts/soak.py). A violation
found stays in the next audit until it is mended.
"""
from __future__ import annotations

import numpy as np

from toolkit.inspect.checks import (
    block_tables_match,
    held_free_violation,
    null_id_violation,
    ref_count_violation,
    shared_id_violation,
)
from toolkit.inspect.step_record import CacheLedger, Violation


class LedgerBook:
    """The Recorder's ledger (`refresh`, each step) and, with `audit=True`, its runtime audit of the
    scheduler's pools and the runner's block tables (`audit`, `held_not_free`)."""

    def __init__(self, scheduler, runner=None, audit: bool = True):
        self.kv = scheduler.kv
        self.scheduler = scheduler
        self.runner = runner
        self.auditing = audit
        self.kinds = [g.kind for g in self.kv.groups]
        self.gaps = [self.kv.has_gaps(g) for g in range(len(self.kinds))]
        # request -> per group, the book's copy of its row as of the last refresh (shared with the
        # ledgers handed out: never written)
        self.rows: dict[str, list[list[int]]] = {}
        # per group: id -> {request: how many times its row holds it}, from the rows (id 0 left out)
        self.by_id: list[dict[int, dict[str, int]]] = [{} for _ in self.kinds]
        self._moved_ids: list[set[int]] = [set() for _ in self.kinds]   # since the last audit
        self._moved_rows: set[str] = set()
        self._null_rows: set[tuple[str, int]] = set()       # (request, group) rows that gained a 0
        self._runner_rows: dict[str, int] = {}               # running request -> its runner row, last audit
        # the rows again as arrays, for check_metadata's compare of a whole batch at once: per group a
        # table [slots, width] (0 past a row's length) and the lengths [slots]; slot 0 holds nothing
        # (a request the ledger does not know)
        self._slot: dict[str, int] = {}
        self.tables = [np.zeros((8, 8), dtype=np.int32) for _ in self.kinds]
        self.lengths = [np.zeros(8, dtype=np.int64) for _ in self.kinds]
        self._free_slots: list[int] = list(range(len(self.lengths[0]) - 1, 0, -1))    # popped from the end: 1 first
        self.audited = (0, 0)           # the ids and the runner rows the last audit looked at
        if audit:
            for pool in self.kv.pools:
                pool.track_changes()
            if runner is not None:
                runner.block_tables.track_writes()

    # ---- the ledger ------------------------------------------------------------------------------
    def refresh(self) -> CacheLedger:
        """The scheduler's holdings now, as `checks.ledger_of`: a row unchanged since the last refresh
        is the same list (a trace of long requests holds each row once until it changes)."""
        before, rows = self.rows, {}
        for rid, held in self.kv.block_ids_by_request():
            old = before.get(rid)
            if old is None:
                new = [list(ids) for ids in held]
                for g, ids in enumerate(new):
                    self._moved(rid, g, [], ids)
            else:
                new = old
                for g, ids in enumerate(held):
                    if old[g] != ids:           # C compare: the rows a step did not touch cost little
                        if new is old:
                            new = list(old)
                        new[g] = list(ids)
                        self._moved(rid, g, old[g], new[g])
            rows[rid] = new
        if len(rows) != len(before) or rows.keys() != before.keys():
            for rid in before.keys() - rows.keys():        # freed (finished, preempted, aborted)
                for g, ids in enumerate(before[rid]):
                    self._moved(rid, g, ids, [])
                if rid in self._slot:
                    self._free_slots.append(self._slot.pop(rid))
        self.rows = rows
        return CacheLedger(self.kinds, rows)

    def _moved(self, rid: str, g: int, old: list[int], new: list[int]) -> None:
        """Row (rid, g) went from `old` to `new`: the index follows, and what moved is noted."""
        if not self.auditing:
            return
        n = len(old)
        slot = self._slot_of(rid)
        if len(new) >= n and new[:n] == old:        # the common change: ids appended
            removed, added = (), new[n:]
            self._write(g, slot, n, added)
        else:                                       # ids replaced in place (aligned rows, windows), cut
            m = min(n, len(new))
            a, b = np.asarray(old[:m], dtype=np.int64), np.asarray(new[:m], dtype=np.int64)
            at = np.nonzero(a != b)[0]
            removed, added = a[at].tolist() + old[m:], b[at].tolist() + new[m:]
            self._write(g, slot, 0, new)
            self.tables[g][slot, len(new):n] = 0
        self.lengths[g][slot] = len(new)
        index, moved = self.by_id[g], self._moved_ids[g]
        for i in removed:
            if i:
                holders = index[i]
                if holders[rid] > 1:
                    holders[rid] -= 1
                else:
                    del holders[rid]
                    if not holders:
                        del index[i]
                moved.add(i)
        for i in added:
            if i:
                holders = index.setdefault(i, {})
                holders[rid] = holders.get(rid, 0) + 1
                moved.add(i)
            elif not self.gaps[g]:
                self._null_rows.add((rid, g))
        self._moved_rows.add(rid)

    def _slot_of(self, rid: str) -> int:
        slot = self._slot.get(rid)
        if slot is None:
            if not self._free_slots:
                grown = len(self.lengths[0])
                self._free_slots = list(range(2 * grown - 1, max(grown, 1) - 1, -1))
                self.tables = [np.concatenate([t, np.zeros_like(t)]) for t in self.tables]
                self.lengths = [np.concatenate([n, np.zeros_like(n)]) for n in self.lengths]
            slot = self._slot[rid] = self._free_slots.pop()
        return slot

    def _write(self, g: int, slot: int, start: int, ids: list[int]) -> None:
        end = start + len(ids)
        if end > self.tables[g].shape[1]:          # a longer row than any before: the table widens
            t = self.tables[g]
            self.tables[g] = np.zeros((t.shape[0], max(end, 2 * t.shape[1])), dtype=t.dtype)
            self.tables[g][:, :t.shape[1]] = t
        if ids:
            self.tables[g][slot, start:end] = ids

    def rows_of(self, g: int, rids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Group g's ledger rows of these requests as arrays: [len(rids), longest row] (0 past each
        row's end) and the lengths [len(rids)]; a request the ledger does not know holds nothing."""
        slots = [self._slot.get(rid, 0) for rid in rids]
        lengths = self.lengths[g][slots]
        return self.tables[g][slots, :int(lengths.max(initial=0))], lengths

    # ---- the audit -------------------------------------------------------------------------------
    def audit(self, where: str) -> list[Violation]:
        """`checks.check_ledger(scheduler, runner, where)` for what changed since the last audit (call
        `refresh` first): the same checks and messages, in the same order (per group: null ids,
        shared ids, held ids in the free queue, ref counts, block tables)."""
        kv, out = self.kv, []
        pools = kv.pools
        compare = self._runner_rows_to_compare()
        if not (compare or self._moved_rows or self._null_rows or any(self._moved_ids)
                or any(pool.changed for pool in pools)):
            self.audited = (0, 0)       # nothing moved since the last audit (many decode steps)
            return out
        changed = {}
        for pool in pools:                      # a pool may serve several groups: taken once
            changed[id(pool)] = pool.changed
            pool.changed = set()
        bad_ids: list[set[int]] = [set() for _ in self.kinds]     # audited again next time
        bad_rows: set[str] = set()
        num_ids = 0
        for g, kind in enumerate(self.kinds):
            for rid, h in sorted(self._null_rows):
                ids = self.rows[rid][g] if h == g and rid in self.rows else ()
                if 0 in ids:
                    out.append(null_id_violation(where, rid, g, kind, ids))
                    bad_rows.add(rid)
            pool, index = kv.pool(g), self.by_id[g]
            shared, free, counts = [], [], []
            ids = sorted((self._moved_ids[g] | changed[id(pool)]) - {0})
            num_ids += len(ids)
            for i in ids:
                named = len(shared) + len(free) + len(counts)
                rows = index.get(i, {})
                pool_holders = pool.holders.get(i, set())
                if rows and not kv.caching and sum(rows.values()) > 1:
                    names = sorted(rows) * 2        # (one request holding it twice: named twice)
                    shared.append(shared_id_violation(where, g, kind, i, names[0], names[1]))
                if rows and pool.is_free(i):
                    free.append(held_free_violation(where, g, kind, i, sorted(rows)))
                if rows.keys() != pool_holders:
                    counts.append(ref_count_violation(where, g, kind, i, rows, pool_holders))
                if len(shared) + len(free) + len(counts) > named:      # this id was named
                    bad_ids[g].add(i)
            out += shared + free + counts
            if compare:
                differ = block_tables_match(kv, g, compare, self.rows, self.runner, where)
                if differ:
                    bad_rows.update(compare)
                out += differ
        self._null_rows = {(rid, g) for rid, g in self._null_rows if rid in bad_rows}
        self._moved_ids, self._moved_rows = bad_ids, bad_rows
        self.audited = (num_ids, len(compare))
        return out

    def _runner_rows_to_compare(self) -> list[str]:
        """The running requests whose runner block-table row may differ from the ledger now: its ledger
        row changed, the runner wrote its row, or its row is another than at the last audit."""
        if self.runner is None:
            return []
        index = self.runner.req_states.req_id_to_index
        written = self.runner.block_tables.written_rows
        self.runner.block_tables.written_rows = set()
        rows_now, compare = {}, []
        for r in self.scheduler.running:
            rid = r.request_id
            idx = index.get(rid)
            if idx is None:
                continue                    # admitted by the scheduler, not yet run
            rows_now[rid] = idx
            if rid in self._moved_rows or idx in written or self._runner_rows.get(rid) != idx:
                compare.append(rid)
        self._runner_rows = rows_now
        return compare

    def held_not_free(self, where: str) -> list[Violation]:
        """`checks.check_held_not_free(scheduler, where)` for the ids moved since the last audit (call
        `refresh` first; nothing is taken: the audit after the step looks at them again)."""
        out = []
        for g, kind in enumerate(self.kinds):
            pool, index = self.kv.pool(g), self.by_id[g]
            for i in sorted((self._moved_ids[g] | (pool.changed or set())) - {0}):
                rows = index.get(i)
                if rows and pool.is_free(i):
                    out.append(held_free_violation(where, g, kind, i, sorted(rows)))
        return out
