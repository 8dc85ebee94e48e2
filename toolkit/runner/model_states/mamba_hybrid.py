"""`MambaHybridModelState`: hybrid (attention + Mamba-family) AND attention-free models.

What it adds over the default state (vLLM `model_states/mamba_hybrid.py`):
- state hygiene: a request's fresh state pages are zeroed when it is added (vLLM #35219/#56524),
  except an n > 1 child's that took its parent's slot over (`inherits_state`: the slot holds the
  state of the prompt the parent computed);
- with prefix caching ("align" mode), `preprocess_state`: a row whose last scheduled token lies in a
  new column of its position-indexed row gets its state there before the forward, copied from the
  page that holds it (the last step's running column, or with speculative decoding the spec column
  its accepted count points at; a checkpoint, or a prefix hit's page), or zeroed when it starts from
  scratch; its accepted count is then 1 (MRV2 `preprocess_state`; one batched copy per state tensor,
  no host sync). The scheduler plans these moves (`SchedulerOutput.state_moves`: it alone books
  where each row's state is) and `stage_state` stages them before the step's flush, so they cost no
  copy of their own;
- with prefix caching and speculative decoding, `postprocess_state`'s boundary copy: a verify row
  whose accepted tokens reached a block boundary left the state there in one of its state columns;
  it is copied into that block's column, the checkpoint a later request may hit (MRV2
  `postprocess_mamba`); where each row's state then is goes back to the scheduler
  (`ModelRunnerOutput.state_offsets`);
- `is_prefilling`, which the Mamba builders need to tell decodes from one-token prefill chunks;
- forwarding `seq_lens_cpu_upper_bound` (the field vLLM forgot to forward, #46759);
- speculative decoding: `num_accepted_tokens` per request row (device int32, 1 = the neutral
  value), reset to 1 when a request takes the row (a stale count from the row's last request
  would start it from a wrong column: vLLM #48132) and set after sampling to the tokens each
  row kept (`postprocess_state`), and the two fields the Mamba builders then need.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from toolkit.host import to_device
from toolkit.runner.block_table import BlockTables
from toolkit.runner.input_batch import InputBatch
from toolkit.runner.kv_cache import KVCacheGroup
from toolkit.runner.model_states.default import DefaultModelState
from toolkit.scheduler import NewRequestData, StateMoves


@dataclass
class StateCopies:
    """What `preprocess_state` did this step ("align" mode), one entry per row that entered a new
    block's column: its running state went from page `src` (the state after `from_tokens` tokens: the
    page of the column it left, a spec column with speculative decoding, or a prefix hit's page; 0 =
    none, the new page was zeroed) to page `dst` before the forward (src == dst: already there)."""
    request_ids: list[str]
    from_tokens: np.ndarray      # int64 [R]: tokens the source state covers (0: zeroed)
    src: np.ndarray              # int64 [R]
    dst: np.ndarray              # int64 [R]


@dataclass
class CheckpointCopies:
    """What `postprocess_state`'s boundary copy did this step (prefix caching and speculative
    decoding), one entry per verify row whose accepted tokens reached a block boundary: the state
    after `boundary` tokens, left by position `position` of the row in page `src` (its state column
    `position`), went to page `dst`, the column of the block that boundary ends (src == dst: already
    there)."""
    request_ids: list[str]
    boundary: np.ndarray         # int64 [R]: tokens the checkpoint covers (a block multiple)
    position: np.ndarray         # int64 [R]: the verify position whose state it is (0 = the last sample)
    src: np.ndarray              # int64 [R]
    dst: np.ndarray              # int64 [R]


class MambaHybridModelState(DefaultModelState):
    def __init__(self, model, cfg) -> None:
        super().__init__(model, cfg)
        self.num_speculative_tokens = cfg.num_speculative_tokens
        self.num_accepted_tokens = torch.ones(cfg.max_num_seqs, dtype=torch.int32, device=cfg.device)
        # a batch's counts, gathered by its rows into one persistent buffer (the update ops read them:
        # a CUDA graph captured on a B-row batch reads the address every later B-row step rewrites)
        self._batch_accepted = torch.ones(cfg.max_num_seqs, dtype=torch.int32, device=cfg.device)
        self._block_tables: BlockTables | None = None
        self._planned = None          # what stage_state planned for preprocess_state, this step
        self._staging = None

    def initialize_kv_cache(self, kv_cache_groups: list[KVCacheGroup], caches) -> None:
        self.mamba_groups = [g for g in kv_cache_groups if g.kind == "mamba"]
        self.state_tensors = [t for g in self.mamba_groups for name in g.layer_names
                              for t in caches[name]]

    def add_request(self, req_idx: int, new_req: NewRequestData) -> None:
        self.num_accepted_tokens[req_idx] = 1
        if self.cfg.enable_prefix_caching:
            return      # its running page is set up by preprocess_state (from a prefix hit's page, or zeroed)
        slots = [s for g in self.mamba_groups for s in new_req.block_ids[g.group_id]]
        if 0 in slots:
            raise RuntimeError(f"request {new_req.req_id} was given the null state page 0")
        if slots and not new_req.inherits_state:
            index = to_device(np.array(slots, dtype=np.int64), self.device)
            for t in self.state_tensors:
                t.index_fill_(0, index, 0)

    def _copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Every state tensor: page src[i] -> page dst[i] (self copies skipped); one batched copy."""
        move = src != dst
        if move.any():
            index = to_device(np.stack([src[move], dst[move]]).astype(np.int64), self.device)
            for t in self.state_tensors:
                t.index_copy_(0, index[1], t.index_select(0, index[0]))

    def _set_accepted(self, idx: np.ndarray, values: np.ndarray, idx_device: torch.Tensor | None = None,
                      values_device: torch.Tensor | None = None) -> None:
        """Request rows `idx` keep accepted counts `values` (`values_device`: the same counts already
        on the device, so nothing is copied)."""
        if self.num_speculative_tokens and len(idx):
            index = idx_device if idx_device is not None else to_device(idx.astype(np.int64), self.device)
            if values_device is not None:
                self.num_accepted_tokens[index] = values_device
            elif (values == 1).all():           # no drafts kept (or none run): a fill, no copy
                self.num_accepted_tokens.index_fill_(0, index, 1)
            else:
                self.num_accepted_tokens[index] = to_device(values.astype(np.int32), self.device)

    def staging_regions(self) -> dict[str, tuple[int, ...]]:
        """"align" mode: a step's page copies (source and destination), pages to zero and the rows
        whose accepted count goes back to 1, staged with the step's inputs."""
        if not self.cfg.enable_prefix_caching or not self.mamba_groups:
            return {}
        n = self.cfg.max_num_seqs
        return {"state_copy_pages": (2, n), "state_zero_pages": (n,), "state_reset_rows": (n,)}

    def stage_state(self, input_batch: InputBatch, block_tables: BlockTables, staging, moves: StateMoves,
                    move_rows: np.ndarray) -> None:
        """"align" mode, before the flush: stage the scheduler's `moves` (the rows entering a new
        column: copy their state from page `src`, or zero the new page where src is 0) and their
        request rows `move_rows` (int64 [M]), whose accepted count goes back to 1;
        `preprocess_state` makes the copies after the flush."""
        self._planned = None
        if not self.cfg.enable_prefix_caching or not self.mamba_groups:
            return
        self._block_tables = block_tables
        if not moves.req_ids:
            return
        src, dst = np.array(moves.src, dtype=np.int64), np.array(moves.dst, dtype=np.int64)
        has_src = src != 0
        move = has_src & (src != dst)
        copies = staging.host("state_copy_pages")
        copies[0, :int(move.sum())], copies[1, :int(move.sum())] = src[move], dst[move]
        staging.written("state_copy_pages")
        staging.put("state_zero_pages", dst[~has_src])
        staging.put("state_reset_rows", move_rows)
        self._staging = staging
        record = StateCopies(list(moves.req_ids), np.array(moves.from_tokens, dtype=np.int64), src, dst)
        self._planned = (int(move.sum()), int((~has_src).sum()), len(move_rows), record)

    def preprocess_state(self, input_batch: InputBatch, block_tables: BlockTables) -> StateCopies | None:
        """"align" mode, after the flush: the copies and zeroing `stage_state` planned (one batched
        copy per state tensor, no host sync), and the accepted counts of the rows that moved set
        to 1. Returns what it did."""
        planned, self._planned = self._planned, None
        if planned is None:
            return None
        moves, zeros, resets, copies = planned
        staging = self._staging
        if moves:
            index = staging.device("state_copy_pages")[:, :moves]
            for t in self.state_tensors:
                t.index_copy_(0, index[1], t.index_select(0, index[0]))
        if zeros:
            zero = staging.device("state_zero_pages")[:zeros]
            for t in self.state_tensors:
                t.index_fill_(0, zero, 0)
        if self.num_speculative_tokens:
            self.num_accepted_tokens.index_fill_(0, staging.device("state_reset_rows")[:resets], 1)
        return copies

    def postprocess_state(self, input_batch: InputBatch, sampled: torch.Tensor,
                          num_accepted: np.ndarray | None = None,
                          num_accepted_device: torch.Tensor | None = None
                          ) -> tuple[CheckpointCopies | None, dict[str, int]]:
        """Speculative decoding: each row's request keeps `num_accepted` [B] (1 for rows without
        drafts), where its next step finds its state (column num_accepted - 1);
        `num_accepted_device`: the same counts on the device, when the step made them there. With
        prefix caching, the boundary copy (module docstring). Returns what it copied and, with
        prefix caching, each row's state offset from its running column where it is not 0 (what the
        scheduler plans the row's next move from: ModelRunnerOutput.state_offsets)."""
        if not self.num_speculative_tokens or not input_batch.num_reqs:
            return None, {}
        values = (np.ones(input_batch.num_reqs, dtype=np.int32) if num_accepted is None
                  else num_accepted.astype(np.int32))
        copies, offsets = None, {}
        if self.cfg.enable_prefix_caching and self.mamba_groups and num_accepted is not None:
            copies, rows = self._boundary_copies(input_batch, values)
            if copies is not None:       # a checkpoint in the running column itself: the state is in column 0
                column = copies.boundary // self.mamba_groups[0].block_size - 1
                values[rows[column == self._running_columns(input_batch, rows)]] = 1
            offsets = {input_batch.req_ids[r]: int(values[r]) - 1 for r in np.nonzero(values > 1)[0]}
        # a boundary copy can move a row's state to column 0: the host's counts are then the ones to send
        device_values = num_accepted_device if copies is None and num_accepted is not None else None
        self._set_accepted(input_batch.idx_mapping_np, values, input_batch.idx_mapping, device_values)
        return copies, offsets

    def _running_columns(self, input_batch: InputBatch, rows: np.ndarray) -> np.ndarray:
        """int64 [R]: the running column of batch rows `rows` this step, that of their last scheduled
        token (the column the Mamba builders read, `align_state_columns`)."""
        end = input_batch.num_computed_tokens_np[rows].astype(np.int64) + input_batch.num_scheduled_tokens[rows]
        return -(-end // self.mamba_groups[0].block_size) - 1

    def _boundary_copies(self, input_batch: InputBatch, kept: np.ndarray
                         ) -> tuple[CheckpointCopies | None, np.ndarray]:
        """Verify rows whose kept tokens reached a block boundary: position j = boundary - computed - 1
        left the state after it in state column j (page `running column + j`); it is copied to the
        page of the column of the block the boundary ends (vLLM `postprocess_mamba_fused_kernel`).
        Returns the copies and their batch rows."""
        group = self.mamba_groups[0]
        bs, table = group.block_size, self._block_tables.tables[group.group_id]
        verify = np.nonzero(input_batch.num_drafts_np > 0)[0]
        start = input_batch.num_computed_tokens_np[verify].astype(np.int64)
        boundary = (start + kept[verify]) // bs * bs
        reached = boundary >= start + 1
        if not reached.any():
            return None, verify[:0]
        rows, start, boundary = verify[reached], start[reached], boundary[reached]
        idx = input_batch.idx_mapping_np[rows]
        position = self.boundary_position(boundary, start, input_batch.num_drafts_np[rows])
        src = table[idx, self._running_columns(input_batch, rows) + position].astype(np.int64)
        dst = table[idx, boundary // bs - 1].astype(np.int64)
        if (src == 0).any() or (dst == 0).any():
            raise RuntimeError("prefix caching: a verify row's boundary state or its block's column has no "
                               f"page (rows {rows[(src == 0) | (dst == 0)].tolist()})")
        self._copy_pages(src, dst)
        return CheckpointCopies([input_batch.req_ids[r] for r in rows], boundary, position, src, dst), rows

    @staticmethod
    def boundary_position(boundary: np.ndarray, start: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
        """The verify position after which a row's state covers `boundary` tokens (the row starts
        after `start` computed tokens; position j leaves the state after start + 1 + j): its state
        column. Not the row's last position, `num_drafts`, unless the boundary is there."""
        return boundary - start - 1

    def persistent_buffers(self) -> list[torch.Tensor]:
        return [self._batch_accepted] if self.num_speculative_tokens else []     # the metadata's accepted counts

    def attn_metadata_kwargs(self, input_batch: InputBatch, for_capture: bool) -> dict:
        kwargs = super().attn_metadata_kwargs(input_batch, for_capture)
        kwargs["is_prefilling"] = torch.from_numpy(input_batch.is_prefilling_np)
        if self.num_speculative_tokens:
            rows = input_batch.idx_mapping.shape[0]
            kwargs["num_accepted_tokens"] = torch.index_select(self.num_accepted_tokens, 0, input_batch.idx_mapping,
                                                               out=self._batch_accepted[:rows])
            drafts = np.where(input_batch.is_prefilling_np, -1, input_batch.num_drafts_np)
            kwargs["num_decode_draft_tokens_cpu"] = torch.from_numpy(drafts.astype(np.int32))
        return kwargs
