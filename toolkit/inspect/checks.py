"""Runtime checks (`LLM(checks=True)`): the state hygiene a hybrid engine silently relies on.

Each check reads the objects the runner used (metadata, block tables, the scheduler's ledger, the
state cache) and returns `Violation`s; it never changes them. What each one guards against:

- `null_id_not_live`      no running request holds the null KV block 0 or the null state page 0;
- `no_shared_ids`         no two live requests share a KV block or a state page;
- `block_table_matches_ledger`  the runner's block-table rows equal the scheduler's ledger;
- `state_indices_match_ledger`  each row's Mamba state index is its request's slot (vLLM #55600);
- `initial_state_flag`    has_initial_states_p is True exactly for rows with computed tokens (#43090);
- `fresh_slot_is_zero`    a request's slot reads zero before its first prefill (#56524 / #35219);
- `padded_rows_on_null`   dummy / padded rows point at the null slot and block, and write nothing;
- `logits_finite`         no NaN / Inf in the logits;
- `cached_ids_not_written`  prefix caching: no row writes a cached KV block or state page (a checkpoint
                          another request may read; the forward writes only a row's running page and
                          the blocks past its hit);
- `held_ids_not_free`     prefix caching: an id a request holds is not in its pool's free queue (an
                          allocation would evict it under the request);
- `hit_backed_by_every_group`  prefix caching: a hit of H tokens holds, in every group, the blocks or
                          the checkpoint of the prompt's first H tokens (the silent "hits" of #45238);
- `state_copied_before_forward`  prefix caching: a row entering a new block's column holds there the
                          state of the column it left (a checkpoint, or a hit's page), or zeros;
- `checkpoint_at_block_end`  prefix caching: a state page registered as block b's checkpoint holds
                          the state after exactly (b + 1) * block_size tokens;
- `checkpoint_from_accepted_position`  prefix caching + speculative decoding: a block boundary reached
                          inside a verify row is saved from the state column of that position (not
                          from a rejected draft's, nor the last column's) into its block's page;
- `checkpoint_equals_cold_state`  prefix caching, inspect="full": the state a hit's request starts
                          from equals the state a cold prefill of those tokens computes (inspect/cold_state.py).

Some checks read device tensors (a host sync): they run only when checks are on.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np
import torch

from toolkit.errors import InvariantError
from toolkit.inspect.step_record import CacheLedger, Violation
from toolkit.kv_cache_manager import window_blocks, window_start_block
from toolkit.kv_cache_spec import PAD_SLOT_ID


def ledger_of(scheduler, previous: CacheLedger | None = None) -> CacheLedger:
    """The scheduler's holdings now. A request's row equal to its row in `previous` (the last
    record's ledger) is that same list, shared: a trace of long requests holds each row once until
    it changes, not once per record (the rows are read, never written)."""
    kv = scheduler.kv
    before = previous.holdings if previous is not None else {}
    holdings = {}
    for rid, held in kv.block_ids_by_request():
        old = before.get(rid)
        holdings[rid] = [old[g] if old is not None and old[g] == ids else list(ids) for g, ids in enumerate(held)]
    return CacheLedger([g.kind for g in kv.groups], holdings)


def check_ledger(scheduler, runner, where: str) -> list[Violation]:
    """After a step: pools, ledger and the runner's block tables agree. Without prefix caching no
    id is held twice; with it, ids are shared (a prefix hit) and each pool's holders of an id are
    exactly the requests whose rows hold it (the ref count). runner None: the pools and the ledger
    only (at scheduling, before the runner has seen the step).

    The whole audit: every held id, so it grows with the requests' lengths (tests and scripts/soak.py
    run it; after each step the Recorder runs the same checks on what the step changed, inspect/
    ledger_book.py). Each group is first tested whole with set operations (C loops: about 8x faster
    than the per-id walk at 128 rows of 16k tokens), and only a group that fails is walked id by id
    for the messages; a group of a few ids (WALK_BELOW) is walked at once."""
    out: list[Violation] = []
    kv = scheduler.kv
    holdings = dict(kv.block_ids_by_request())        # read only: no copy of the rows
    running = {r.request_id for r in scheduler.running}
    for g in range(len(kv.groups)):
        # a few ids: the walk is the cheaper test (the arrays' fixed cost is about 50 us)
        if sum(len(held[g]) for held in holdings.values()) <= WALK_BELOW or not _group_books_agree(kv, g, holdings):
            out += _group_book_violations(kv, g, holdings, where)
        if runner is not None:
            out += block_tables_match(kv, g, running, holdings, runner, where)
    return out


WALK_BELOW = 2048       # held ids in a group up to which check_ledger walks them without the whole test


def _group_books_agree(kv, g: int, holdings: dict) -> bool:
    """Group g passes every check of `_group_book_violations` (the same conditions, tested whole on
    arrays; a row holding an id twice with prefix caching fails here and passes there)."""
    pool = kv.pool(g)
    rids = list(holdings)
    rows = [holdings[rid][g] for rid in rids]
    if not kv.has_gaps(g) and any(0 in ids for ids in rows):                 # null_id_not_live
        return False
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    ids = np.fromiter(chain.from_iterable(rows), np.int64, int(lengths.sum()))
    owners = np.repeat(np.arange(len(rows)), lengths)[ids != 0]
    ids = ids[ids != 0]
    width = max(len(rids), 1)
    codes = np.sort(ids * width + owners)          # (id, holder) pairs, by id
    if not kv.caching and (codes[1:] // width == codes[:-1] // width).any():     # no_shared_ids
        return False
    if pool._free.keys() & set(ids.tolist()):                              # held_ids_not_free
        return False
    # ref_counts_match_rows: the (id, holder) pairs of the rows and of the pool, as sorted codes
    holders = pool.holders
    index = {rid: k for k, rid in enumerate(rids)}
    counts = np.fromiter(map(len, holders.values()), np.int64, len(holders))
    pool_ids = np.repeat(np.fromiter(holders.keys(), np.int64, len(holders)), counts)
    pool_owners = np.fromiter(map(index.get, chain.from_iterable(holders.values()), repeat(-1)), np.int64,
                              int(counts.sum()))
    if len(pool_ids) != len(ids) or (pool_owners < 0).any():
        return False
    return bool(np.array_equal(codes, np.sort(pool_ids * width + pool_owners)))


def _group_book_violations(kv, g: int, holdings: dict, where: str) -> list[Violation]:
    """Group g walked id by id: the violations, with their messages."""
    out: list[Violation] = []
    group, pool = kv.groups[g], kv.pool(g)
    gaps, caching = kv.has_gaps(g), kv.caching
    seen: dict[int, set[str]] = {}
    for rid, held in holdings.items():
        ids = held[g]
        if 0 in ids and not gaps:
            out.append(null_id_violation(where, rid, g, group.kind, ids))
        for i in ids:
            if i == 0:
                continue
            holders = seen.get(i)
            if holders is None:
                seen[i] = {rid}
                continue
            if not caching:
                out.append(shared_id_violation(where, g, group.kind, i, sorted(holders)[0], rid))
            holders.add(rid)
    for i in sorted(pool._free.keys() & seen.keys()):                    # (pool.is_free, as a set operation)
        out.append(held_free_violation(where, g, group.kind, i, sorted(seen[i])))
    if seen == pool.holders:            # the common case, compared whole (C loops); else id by id below
        return out
    for i in sorted(set(seen) | set(pool.holders)):
        if seen.get(i, set()) != pool.holders.get(i, set()):
            out.append(ref_count_violation(where, g, group.kind, i, seen.get(i, ()), pool.holders.get(i, ())))
    return out


# the ledger's messages, one place for the whole audit (check_ledger) and the step-by-step one
# (inspect/ledger_book.py)
def null_id_violation(where: str, rid: str, g: int, kind: str, ids: list[int]) -> Violation:
    return Violation("null_id_not_live", f"{where}, request {rid!r}, group {g} ({kind})", "block ids",
                     f"holds the null id 0: {ids}")


def shared_id_violation(where: str, g: int, kind: str, i: int, first: str, second: str) -> Violation:
    return Violation("no_shared_ids", f"{where}, group {g} ({kind})", "block ids",
                     f"id {i} is held by both {first!r} and {second!r}")


def held_free_violation(where: str, g: int, kind: str, i: int, holders: list[str]) -> Violation:
    return Violation("held_ids_not_free", f"{where}, group {g} ({kind}), id {i}", "free queue",
                     f"held by {holders} but waiting in the free queue: the next "
                     "allocation may evict it (a checkpoint page evicted while still referenced)")


def ref_count_violation(where: str, g: int, kind: str, i: int, rows, pool) -> Violation:
    return Violation("ref_counts_match_rows", f"{where}, group {g} ({kind}), id {i}", "pool holders",
                     f"rows hold it: {sorted(rows)}; the pool counts {sorted(pool)}")


def check_held_not_free(scheduler, where: str) -> list[Violation]:
    """`check_ledger`'s held_ids_not_free alone (at scheduling: a page a hit adopted must not wait in
    the free queue), with the same messages, at the cost of one set intersection per group."""
    out: list[Violation] = []
    kv = scheduler.kv
    holdings = dict(kv.block_ids_by_request())        # read only: no copy of the rows
    for g, group in enumerate(kv.groups):
        rows = {rid: held[g] for rid, held in holdings.items()}
        bad = kv.pool(g)._free.keys() & {i for i in chain.from_iterable(rows.values()) if i}
        for i in sorted(bad):
            holders = sorted(rid for rid, ids in rows.items() if i in ids)
            out.append(held_free_violation(where, g, group.kind, i, holders))
    return out


def block_tables_match(kv, g: int, running: Iterable[str], holdings: dict, runner, where: str) -> list[Violation]:
    """The runner's block-table row of each running request equals the scheduler's ledger
    (`holdings`: request id -> its ids per group, as check_ledger read them); `running`: the running
    requests to compare (all of them, or those whose rows changed: inspect/ledger_book.py)."""
    out: list[Violation] = []
    index, gaps = runner.req_states.req_id_to_index, kv.has_gaps(g)
    table, num_blocks = runner.block_tables.tables[g], runner.block_tables.num_blocks[g]
    for rid in running:
        idx = index.get(rid)
        if idx is None:
            continue                     # admitted this step by the scheduler, not yet run
        held = holdings.get(rid)
        want = held[g] if held is not None else []
        row = table[idx, :num_blocks[idx]].tolist()
        if not gaps and row == want:             # the common case: no copies
            continue
        want = list(want)
        if gaps:     # released checkpoint or out-of-window columns: the runner may still show their old ids
            behind = min(kv.released_columns(rid, g), len(row), len(want))
            row, want = [0] * behind + row[behind:], [0] * behind + want[behind:]
        if row != want:
            out.append(Violation("block_table_matches_ledger", f"{where}, request {rid!r}, group {g}",
                                 "block table row", f"runner has {row}, scheduler ledger has {want}"))
    return out


def check_spec_columns(groups, scheduled, kept_last_step: dict[str, int], where: str) -> list[Violation]:
    """Speculative decoding, each decode row of the Mamba metadata: `num_accepted_tokens` is the
    count its request kept at its last step (1 for a request new to its row: vLLM #48132), in what
    the model state gathered (`accepted_count_carried`) and in the layer metadata the update ops read
    to pick the column a row starts from, `state_indices_tensor_d[row, num_accepted - 1]`
    (`verify_starts_at_accepted_column`)."""
    out: list[Violation] = []
    for gm in groups:
        md = gm.metadata
        if gm.kind != "mamba" or gm.common.num_accepted_tokens is None:
            continue
        # what the model state gathered, [B]; padded rows (a padded decode batch) are the null id's
        every_row = gm.common.num_accepted_tokens.tolist()[:len(scheduled)]
        carried = set()
        for row, got in enumerate(every_row):
            rid = scheduled[row].request_id
            want = kept_last_step.get(rid, 1)
            if got != want:
                out.append(Violation("accepted_count_carried",
                                     f"{where}, group {gm.group_id} ({gm.builder}), request {rid!r} (row {row})",
                                     "num_accepted_tokens", f"is {got}, but the request kept {want} token(s) "
                                     "at its last step (a request new to its row starts at 1)"))
            else:
                carried.add(row)
        if md.num_decodes == 0:
            continue
        accepted, columns = md.num_accepted_tokens.tolist(), md.state_indices_tensor_d.tolist()
        for row in sorted(r for r in carried if r < md.num_decodes):
            rid = scheduled[row].request_id
            want = kept_last_step.get(rid, 1)
            if accepted[row] == want:
                continue
            cols = columns[row]
            at = [f"column {c}, slot {cols[c]}" if 0 <= c < len(cols) else
                  f"column {c}, outside its {len(cols)} columns" for c in (accepted[row] - 1, want - 1)]
            out.append(Violation("verify_starts_at_accepted_column",
                                 f"{where}, group {gm.group_id} ({gm.builder}), request {rid!r} (row {row})",
                                 "num_accepted_tokens", f"the update ops start the row from {at[0]}, but the "
                                 f"request kept {want} token(s) at its last step: its state is in {at[1]}"))
    return out


def check_metadata(groups, scheduled, ledger: CacheLedger, where: str,
                   aligned_block_sizes: dict[int, int] | None = None,
                   sliding_windows: dict[int, int] | None = None, book=None,
                   request_ids: list[str] | None = None) -> list[Violation]:
    """A real step's metadata against the ledger taken when the step was scheduled.
    `groups`: list[GroupMetadata]; `scheduled`: list[ScheduledRequest] in batch order, or a function
    making it, called only where a row's token counts are read (a window, aligned rows, a prefill, a
    padded batch or a failed row: a plain decode step reads only `request_ids`, the batch's ids);
    `aligned_block_sizes`: group id -> block size of the Mamba groups with position-indexed rows
    (prefix caching, "align"); `sliding_windows`: group id -> W of the sliding-window groups, whose
    rows are compared from the first block the row's queries read (the runner keeps released ids
    before it, never read), and must hold a block in each of those columns. `book`: the ledger's
    LedgerBook (inspect/ledger_book.py), whose arrays of the same rows let an attention group be
    compared whole (array operations: no per-row work); only a group that fails is compared row by
    row for the messages."""
    out: list[Violation] = []
    if callable(scheduled):
        scheduled = RowsWhenRead(scheduled)
    rids = request_ids if request_ids is not None else [s.request_id for s in scheduled]
    holdings = ledger.holdings
    holds_nothing = [[]] * len(ledger.group_kinds)      # a row the ledger does not know (named by the compare)
    for gm in groups:
        table = gm.common.block_table_tensor
        if gm.kind == "mamba":
            out += _state_indices_match(gm, rids, scheduled, holdings, holds_nothing, where,
                                        (aligned_block_sizes or {}).get(gm.group_id))
        else:
            out += _block_table_rows_match(gm, rids, scheduled, holdings, holds_nothing, where,
                                           (sliding_windows or {}).get(gm.group_id), book)
        n = len(rids)
        if table.shape[0] > n:          # a padded decode batch: its padded rows as a dummy batch's
            num_tokens = sum(sc.num_tokens for sc in scheduled)
            padded = GroupView(gm.group_id, gm.builder, table[n:], gm.common.slot_mapping[num_tokens:])
            out += check_dummy_metadata([padded], f"{where}, padded rows {n}..{table.shape[0] - 1}")
    return out


class RowsWhenRead(Sequence):
    """A step's rows (list[ScheduledRequest]) made by `make` when first read (check_metadata)."""

    def __init__(self, make: Callable[[], list]):
        self._make, self._rows = make, None

    def _made(self) -> list:
        if self._rows is None:
            self._rows = self._make()
        return self._rows

    def __len__(self) -> int:
        return len(self._made())

    def __getitem__(self, i):
        return self._made()[i]


def _state_indices_match(gm, rids: list[str], scheduled, holdings: dict, holds_nothing: list, where: str,
                         bs: int | None) -> list[Violation]:
    """check_metadata of a Mamba group: each row's state indices and initial-state flag."""
    out: list[Violation] = []
    g, md = gm.group_id, gm.metadata
    decode, prefill = md.state_indices_tensor_d, md.state_indices_tensor_p
    spec = gm.common.num_accepted_tokens is not None     # speculative decoding: 1 + k columns held
    one_slot = bs is None and not spec and (decode is None or decode.dim() == 1)
    flat = None
    if one_slot:            # the common case, compared in one list compare: a row's slot, its first id
        flat = ([] if decode is None else decode.tolist()) + ([] if prefill is None else prefill.tolist())
        want = [held[0] if held else None for held in (holdings.get(rid, holds_nothing)[g] for rid in rids)]
    if flat is None or flat != want[:len(flat)]:
        got = [] if decode is None else decode.tolist()     # [D] (a slot per row) or [D, 1 + k] (columns)
        if got and decode.dim() == 1:
            got = [[i] for i in got]
        got += [] if prefill is None else [[i] for i in prefill.tolist()]
        for row, (rid, slots) in enumerate(zip(rids, got)):
            held = holdings.get(rid, holds_nothing)[g]
            width = len(slots) if spec and row < md.num_decodes else 1
            if bs is not None:      # "align": the column of its last scheduled token (and the spec
                sc = scheduled[row]  # columns after it)
                col = max((sc.num_computed_before + sc.num_tokens - 1) // bs, 0)
                want = [held[c] if c < len(held) else 0 for c in range(col, col + width)]
            else:                   # its one slot, or its 1 + k columns (a prefill row: column 0)
                want = list(held[:width])
            if slots != want:
                name = "state_indices_tensor_d" if row < md.num_decodes else "state_indices_tensor_p"
                shown = slots[0] if len(slots) == 1 else slots
                out.append(Violation("state_indices_match_ledger", f"{_label(where, gm)}, request {rid!r} (row {row})",
                                     name, f"state index {shown}, but the request's slot is {want}"))
    if md.has_initial_states_p is not None:
        flags = md.has_initial_states_p.tolist()
        prefills = scheduled[md.num_decodes:md.num_decodes + len(flags)]
        if len(prefills) == len(flags) and flags == [s.num_computed_before > 0 for s in prefills]:
            return out
        for i, flag in enumerate(flags):
            s = scheduled[md.num_decodes + i]
            if flag != (s.num_computed_before > 0):
                out.append(Violation(
                    "initial_state_flag", f"{_label(where, gm)}, request {s.request_id!r} (prefill row {i})",
                    "has_initial_states_p", f"is {flag} but the request had "
                    f"{s.num_computed_before} computed tokens (a fresh request starts from zero)"))
    return out


def _block_table_rows_match(gm, rids: list[str], scheduled, holdings: dict, holds_nothing: list, where: str,
                            window: int | None, book) -> list[Violation]:
    """check_metadata of an attention group: each row's block table against its ledger row."""
    out: list[Violation] = []
    g, table = gm.group_id, gm.common.block_table_tensor
    rows = table.numpy() if table.device.type == "cpu" else table.cpu().numpy()    # one read, not per row
    if (book is not None and sum(len(holdings.get(rid, holds_nothing)[g]) for rid in rids) >= WHOLE_TABLE_FROM
            and _table_agrees(rows, book, g, rids, scheduled, window, getattr(gm.metadata, "block_size", None))):
        return out
    for row, rid in enumerate(rids):
        held = holdings.get(rid, holds_nothing)[g]
        got = rows[row, :len(held)].tolist()
        if window is None:
            if got != held:
                out.append(Violation("block_table_matches_ledger", f"{_label(where, gm)}, request {rid!r} (row {row})",
                                     "block_table_tensor", f"row starts {got}, ledger has {list(held)}"))
            continue
        # a sliding window: from the first block the row's first query reads
        first = window_start_block(scheduled[row].num_computed_before, window, gm.metadata.block_size)
        got, want = [0] * first + got[first:], [0] * first + list(held[first:])
        if 0 in want[first:]:
            out.append(Violation(
                "window_blocks_held", f"{_label(where, gm)}, request {rid!r} (row {row})", "block ids",
                f"the row's queries read keys from block {first} on (sliding window {window}), but "
                f"the ledger holds no block in column {want.index(0, first)}: {want}"))
        if got != want:
            out.append(Violation("block_table_matches_ledger", f"{_label(where, gm)}, request {rid!r} (row {row})",
                                 "block_table_tensor", f"row starts {got}, ledger has {want}"))
    return out


def _label(where: str, gm) -> str:
    return f"{where}, group {gm.group_id} ({gm.builder})"


WHOLE_TABLE_FROM = 1024     # ledger ids in a group's rows from which check_metadata compares its table whole
# (below, the row walk is the cheaper: the array operations' fixed cost is about 40 us inside a step)


def _table_agrees(rows: np.ndarray, book, g: int, rids: list[str], scheduled, window: int | None,
                  block_size: int | None) -> bool:
    """An attention group's metadata block table `rows` [>= B, W] passes every row check of
    check_metadata (the same conditions, on arrays): each row starts with its ledger row (from the
    first block its queries read, with a sliding window, where the ledger holds no 0)."""
    want, lengths = book.rows_of(g, rids)                      # [B, width], [B]
    n, width = want.shape
    if width > rows.shape[1]:
        return False
    cols = np.arange(width)
    read = cols < lengths[:, None]                             # [B, width]: the columns compared
    if window is not None:
        if block_size is None:
            return False
        computed = np.fromiter((s.num_computed_before for s in scheduled), np.int64, n)
        read &= cols >= (np.maximum(computed - window + 1, 0) // block_size)[:, None]
        if (read & (want == 0)).any():                         # window_blocks_held
            return False
    return not (read & (rows[:n, :width] != want)).any()


@dataclass
class GroupView:
    """The padded rows of one group's metadata, shaped as check_dummy_metadata reads a group."""
    group_id: int
    builder: str
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def common(self) -> GroupView:
        return self


def check_dummy_metadata(groups, where: str) -> list[Violation]:
    """Dummy (padded) rows: state indices and block tables on the null id, slot mappings PAD."""
    out: list[Violation] = []
    for gm in groups:
        label = f"{where}, group {gm.group_id} ({gm.builder})"
        table = gm.common.block_table_tensor
        if table.numel() and int(table.abs().max()) != 0:
            rows = sorted({int(r) for r in torch.nonzero(table)[:, 0].tolist()})
            ids = sorted({int(v) for v in table[table != 0].tolist()})
            out.append(Violation("padded_rows_on_null", f"{label}, padded rows {rows}", "block_table_tensor",
                                 f"point at real ids {ids} instead of the null id 0"))
        slots = gm.common.slot_mapping
        if slots.numel() and bool((slots != PAD_SLOT_ID).any()):
            out.append(Violation("padded_rows_on_null", label, "slot_mapping",
                                 "padded tokens would write to slots "
                                 f"{sorted(set(slots[slots != PAD_SLOT_ID].tolist()))[:8]}"))
    return out


def check_fresh_slots(runner, state, where: str,
                      state_names: dict[str, list[str]] | None = None) -> list[Violation]:
    """Before the forward: rows with no computed tokens must find their slot zeroed.
    `state_names`: layer name -> names of its state tensors, for the messages."""
    out: list[Violation] = []
    batch = state.input_batch
    if 0 not in batch.num_computed_tokens_np.tolist():     # most steps have no fresh row (a list test:
        return out                                          # numpy's .all() goes through a Python wrapper)
    fresh = np.nonzero(batch.num_computed_tokens_np == 0)[0]
    for group in runner.kv_cache_groups:
        if group.kind != "mamba":
            continue
        if runner.block_tables.aligned[group.group_id]:    # prefix caching: the running page
            seq_lens = batch.num_computed_tokens_np[fresh] + batch.num_scheduled_tokens[fresh]
            slots = torch.as_tensor(runner.block_tables.state_pages(
                group.group_id, batch.idx_mapping_np[fresh], seq_lens)).to(runner.device)
        else:
            slots = state.block_tables[group.group_id][torch.as_tensor(fresh), 0]
        for name in group.layer_names:
            for i, tensor in enumerate(runner.kv_caches[name]):
                names = (state_names or {}).get(name, [])
                label = names[i] if i < len(names) else f"state tensor {i}"
                worst = tensor.index_select(0, slots.long()).flatten(1).abs().amax(dim=1)
                for row, slot, value in zip(fresh.tolist(), slots.tolist(), worst.tolist()):
                    if value != 0:
                        out.append(Violation(
                            "fresh_slot_is_zero", f"{where}, request {batch.req_ids[row]!r}, layer {name}",
                            f"{label} at slot {slot}",
                            f"max |value| {value:.3g} before the request's first prefill (a reused slot not zeroed)"))
    return out


def check_cached_not_written(scheduler, runner, state, where: str) -> list[Violation]:
    """Before the forward, prefix caching on: the pages and blocks this step writes hold no cached
    content. Read on the host from the runner's tables (no device read)."""
    kv = scheduler.kv
    out: list[Violation] = []
    batch = state.input_batch
    start = batch.num_computed_tokens_np.astype(np.int64)
    end = start + batch.num_scheduled_tokens
    bt = runner.block_tables
    spec = runner.cfg.num_speculative_tokens
    for group in runner.kv_cache_groups:
        g, bs = group.group_id, group.block_size
        pool = kv.pool(g)
        for row, rid in enumerate(batch.req_ids):
            idx = batch.idx_mapping_np[row]
            if group.kind == "mamba":
                written = {int(bt.state_pages(g, idx[None], end[row:row + 1])[0])}
                if spec and bt.aligned[g] and batch.runs_as_decode_np[row]:   # a verify row: its spec columns
                    col = max((int(end[row]) - 1) // bs, 0)
                    written |= {int(i) for i in bt.tables[g][idx, col:col + 1 + spec]}
            else:
                written = {int(i) for i in bt.tables[g][idx, start[row] // bs:-(-end[row] // bs)]}
            for i in sorted(written & pool.hash_of.keys()):
                b = pool.block_index[i]
                out.append(Violation("cached_ids_not_written", f"{where}, request {rid!r}, group {g} ({group.kind})",
                                     "block table", f"writes id {i}, cached as block {b} (tokens "
                                     f"[{b * bs}, {(b + 1) * bs})) that other requests may read"))
    return out


def check_hits_backed(scheduler, sched_out, where: str) -> list[Violation]:
    """After scheduling, prefix caching on: each request admitted with a hit of H tokens holds what
    the hit claims in every group: its first H / bs attention blocks registered under its own block
    hashes (a sliding-window group: those of its window before H), and in each recurrent group the
    checkpoint of block H / bs - 1 (the state after H tokens) in that column. Host only."""
    kv = scheduler.kv
    out: list[Violation] = []
    for new in sched_out.scheduled_new_reqs:
        hit = new.num_cached_tokens
        req = scheduler.requests.get(new.req_id)
        if not hit or req is None:
            continue
        for g, group in enumerate(kv.groups):
            pool, bs, ids = kv.pool(g), group.block_size, kv.block_ids(new.req_id)[g]
            label = f"{where}, request {new.req_id!r}, group {g} ({group.kind})"
            if kv.windowed(g):      # a sliding window: the blocks of the window before the hit's end
                wanted = range(max(hit // bs - window_blocks(group.sliding_window, bs), 0), hit // bs)
            else:
                wanted = range(hit // bs) if group.kind == "attention" else [hit // bs - 1]
            for b in wanted:
                i = ids[b] if b < len(ids) else 0
                if pool.hash_of.get(i) == req.block_hashes[b]:
                    continue
                what = (f"id {i}, cached as block {pool.block_index[i]}" if i in pool.hash_of
                        else f"id {i}, which caches nothing" if i else "no id")
                state = " (the state it starts from is not the state after those tokens)" \
                    if group.kind == "mamba" else ""
                out.append(Violation("hit_backed_by_every_group", label,
                                     f"column {b} (tokens [{b * bs}, {(b + 1) * bs}))",
                                     f"a hit of {hit} tokens was counted, but the column holds {what}{state}"))
                break
    return out


def _column_moves(runner, state, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of an aligned Mamba group g whose last scheduled token lies in a new column: (rows,
    source pages (0: none, the row starts from scratch), destination pages)."""
    batch, bs = state.input_batch, runner.block_tables.block_sizes[g]
    if runner.cfg.num_speculative_tokens:
        # with speculative decoding the source is the column its accepted count pointed at, which the
        # batch alone does not tell: the reported moves (their sources are checked in full mode, by
        # spec_start_state_equals_plain; here, that each copy happened)
        copies = state.state_copies
        if copies is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        rows = np.array([batch.req_ids.index(r) for r in copies.request_ids], dtype=np.int64)
        return rows, copies.src.astype(np.int64), copies.dst.astype(np.int64)
    start = batch.num_computed_tokens_np.astype(np.int64)
    end = start + batch.num_scheduled_tokens
    old, new = -(-start // bs) - 1, -(-end // bs) - 1
    rows = np.nonzero(new != old)[0]
    table, idx = runner.block_tables.tables[g], batch.idx_mapping_np[rows]
    src = np.where(old[rows] >= 0, table[idx, np.maximum(old[rows], 0)], 0)
    return rows, src.astype(np.int64), table[idx, new[rows]].astype(np.int64)


def check_state_copies(runner, state, where: str, state_names: dict[str, list[str]] | None = None
                       ) -> list[Violation]:
    """Before the forward (after `preprocess_state`), prefix caching on: each row that entered a
    new block's column holds in that column's page exactly the state of the column it left (a
    checkpoint or a hit's page), or zeros when it starts from scratch. Derived from the batch and the
    block tables, not from what preprocess_state reports; reads the state cache (a device read)."""
    out: list[Violation] = []
    batch = state.input_batch
    for group in runner.kv_cache_groups:
        if group.kind != "mamba" or not runner.block_tables.aligned[group.group_id]:
            continue
        rows, src, dst = _column_moves(runner, state, group.group_id)
        if not len(rows):
            continue
        has_src = torch.as_tensor(src != 0).to(runner.device)
        src_i, dst_i = (torch.as_tensor(a).to(runner.device) for a in (src, dst))
        for name in group.layer_names:
            for i, tensor in enumerate(runner.kv_caches[name]):
                names = (state_names or {}).get(name, [])
                label = names[i] if i < len(names) else f"state tensor {i}"
                copied = tensor.index_select(0, src_i)
                want = torch.where(has_src.view(-1, *[1] * (tensor.dim() - 1)), copied, torch.zeros_like(copied))
                diff = (tensor.index_select(0, dst_i) - want).flatten(1).abs().amax(dim=1)
                for row, s, d, value in zip(rows.tolist(), src.tolist(), dst.tolist(), diff.tolist()):
                    if value != 0:
                        source = f"page {s} (the state of the column it left)" if s else "zeros (a fresh start)"
                        out.append(Violation(
                            "state_copied_before_forward", f"{where}, request {batch.req_ids[row]!r}, layer {name}",
                            f"{label} at page {d}", f"differs from {source} by max |diff| {value:.3g} before "
                            "the forward: the pre-copy was skipped, the request starts from a stale or zero state"))
    return out


def check_checkpoints_at_block_end(scheduler, runner, state, where: str) -> list[Violation]:
    """After the step, prefix caching on: a row's running page, which holds the state after the
    row's last token of this step, is registered as a checkpoint only as the block that token ends
    (a page cached as block b must hold the state after exactly (b + 1) * bs tokens). Host only."""
    kv, batch = scheduler.kv, state.input_batch
    out: list[Violation] = []
    end = batch.num_computed_tokens_np.astype(np.int64) + batch.num_scheduled_tokens
    for group in runner.kv_cache_groups:
        g, bs = group.group_id, group.block_size
        if group.kind != "mamba" or not runner.block_tables.aligned[g]:
            continue
        pool = kv.pool(g)
        pages = runner.block_tables.state_pages(g, batch.idx_mapping_np, end)
        for row, page in enumerate(pages.tolist()):
            b = pool.block_index.get(page)
            if b is not None and (b + 1) * bs != end[row]:
                out.append(Violation(
                    "checkpoint_at_block_end", f"{where}, request {batch.req_ids[row]!r}, group {g} (mamba)",
                    f"state page {page}", f"registered as the checkpoint of block {b} (the state after "
                    f"{(b + 1) * bs} tokens) but holds the state after {end[row]} tokens: the step's chunk "
                    f"ended at token {end[row]}, not on a block boundary"))
    return out


def check_spec_checkpoints(runner, state, spec_rows: dict, where: str) -> list[Violation]:
    """After sampling, prefix caching + speculative decoding: each verify row whose kept tokens
    reached a block boundary b (computed < b <= computed + kept) had the state after b tokens -- in
    its state column b - computed - 1, i.e. page `running column + that` of its row -- copied into
    the page of block b / bs - 1, the checkpoint registered for it; no other row had a copy.
    Derived from the batch, the step's block tables and the verification (not from what the
    boundary copy reports, which it is compared with). Reads the step's block tables (a device read)."""
    out: list[Violation] = []
    batch = state.input_batch
    reported: dict[str, tuple[int, int, int]] = {}
    copies = state.checkpoint_copies
    if copies is not None:
        reported = {rid: (int(s), int(d), int(j)) for rid, s, d, j in
                    zip(copies.request_ids, copies.src, copies.dst, copies.position)}
    for group in runner.kv_cache_groups:
        g, bs = group.group_id, group.block_size
        if group.kind != "mamba" or not runner.block_tables.aligned[g]:
            continue
        table = state.block_tables[g].cpu().numpy()    # the step's rows (a finished request's row is gone)
        for row, rid in enumerate(batch.req_ids):
            if batch.num_drafts_np[row] == 0 or rid not in spec_rows:
                continue
            start = int(batch.num_computed_tokens_np[row])
            kept = spec_rows[rid].num_accepted
            boundary = (start + kept) // bs * bs
            label = f"{where}, request {rid!r}, group {g} (mamba)"
            got = reported.pop(rid, None)
            if boundary <= start:
                continue
            running = -(-(start + int(batch.num_scheduled_tokens[row])) // bs) - 1
            position = boundary - start - 1
            want = (int(table[row, running + position]), int(table[row, boundary // bs - 1]), position)
            if got != want:
                did = ("no copy" if got is None else
                       f"a copy from page {got[0]} (its state column {got[2]}) to page {got[1]}")
                out.append(Violation(
                    "checkpoint_from_accepted_position", label, f"checkpoint of block {boundary // bs - 1}",
                    f"its kept tokens reached token {boundary}, whose state is in state column {position} "
                    f"(page {want[0]}) and belongs in page {want[1]}, but the boundary copy made {did}: the "
                    "page registered for that block holds another position's state"))
        for rid, (src, dst, j) in reported.items():
            out.append(Violation("checkpoint_from_accepted_position", f"{where}, request {rid!r}, group {g} (mamba)",
                                 "boundary copy", f"copied page {src} (state column {j}) to page {dst}, but its "
                                 "kept tokens reached no block boundary"))
    return out


_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def check_logits(logits: torch.Tensor, req_ids: list[str], where: str,
                 cu_num_logits: np.ndarray | Callable[[], np.ndarray] | None = None) -> list[Violation]:
    """logits [L, V]: one row per sampled position; `cu_num_logits` [B+1] (or a function that makes
    it, called only when a row is bad) maps them to batch rows (speculative decoding: a verify row
    has 1 + d), None for one row per request."""
    # the common case, in one pass: a NaN or an inf anywhere makes the sum NaN or inf (a sum of finite
    # values that overflows takes the per-row test below, which finds nothing)
    if logits.is_cpu and logits.dtype in _NUMPY_FLOATS:     # (numpy: cheaper than torch inside a step)
        with np.errstate(all="ignore"):                     # a NaN, an inf or an overflow is the test
            if math.isfinite(float(np.add.reduce(logits.numpy(), axis=None))):
                return []
    elif math.isfinite(float(logits.sum())):
        return []
    bad = ~torch.isfinite(logits).all(dim=-1)
    if callable(cu_num_logits):
        cu_num_logits = cu_num_logits()
    rows = (np.arange(len(logits)) if cu_num_logits is None
            else np.searchsorted(cu_num_logits, np.arange(len(logits)), side="right") - 1)
    return [Violation("logits_finite", f"{where}, request {req_ids[rows[i]]!r}", "logits",
                      f"{int((~torch.isfinite(logits[i])).sum())} non-finite values")
            for i in torch.nonzero(bad).flatten().tolist()]


def check_shutdown(runner) -> list[Violation]:
    """After `ModelRunner.shutdown()`: the graph manager went first and the runner holds nothing
    (vLLM PR #52374: a graph manager kept after shutdown keeps its captured memory alive).
    Only the runner's own references are checked: a user's variable, or a traceback in a
    notebook, may keep a tensor alive legitimately (`memory_report()` shows what is alive)."""
    out: list[Violation] = []
    log = getattr(runner, "release_log", [])
    if not log or log[0] != "cudagraph_manager":
        out.append(Violation("shutdown_order", "shutdown", "release order",
                             f"{log}: the CUDA-graph manager must be released first"))
    manager = getattr(runner, "cudagraph_manager", None)
    if manager is not None:
        held = getattr(manager, "held_tensors", lambda: [])()
        size = sum(t.numel() * t.element_size() for t in held)
        out.append(Violation("released_on_shutdown", "shutdown", "cudagraph_manager",
                             f"{type(manager).__name__} is still set after shutdown and holds "
                             f"{len(held)} tensor(s), {size / 2**20:.2f} MiB (caches and buffers)"))
    draft = getattr(runner, "draft", None)
    if draft is not None:
        out.append(Violation("released_on_shutdown", "shutdown", "runner.draft",
                             "the draft model's speculator is still set after shutdown"))
    for attr in ("kv_caches", "model", "model_state", "input_buffers", "block_tables", "staging", "req_states"):
        if hasattr(runner, attr):
            out.append(Violation("released_on_shutdown", "shutdown", f"runner.{attr}",
                                 "still set after shutdown"))
    return out


def raise_if_any(violations: list[Violation]) -> None:
    if violations:
        raise InvariantError(violations)
