"""The draft model inside the step (vLLM's "draft_model" method, MRV2's `StandaloneARSpeculator`).

A smaller model with the target's vocabulary proposes k greedy tokens per decode row, run by the
target's runner right after the step's sampling: no second engine, scheduler, prefix cache or
request ids. For each target request row r (S = the target's max_num_seqs) the draft keeps:

- its KV pages and `num_computed[r]`, the tokens it has consumed, all verified (the target's
  computed tokens and the token the step just sampled);
- k state pages `slots[r]`: one holds the recurrent state over those tokens (the committed slot),
  the other k - 1 take the draft's guesses, each the state after one more guess. Nothing the target
  may reject enters the committed slot, so a recurrent draft needs no rollback; and when the next
  verified tokens begin with m of the guesses, the slot of guess m becomes the committed one and
  the draft continues after them (kept by value: a token equal to a guess leaves the same state).
  (vLLM's draft is attention-only and writes rejected positions' KV that a later round overwrites;
  the guess slots are what let a Mamba draft do the same.)

Per target step, k draft forwards at most, their inputs staged in one flush (a StagingBank each):
  1. catch-up: every row of the step consumes its new verified tokens not yet in its state (a
     prefill chunk's tokens, or a decode row's new sample after the guesses that came true: one
     token, two when every guess and the k-th draft were accepted) as one mixed batch (decodes
     first, as the Mamba builders want); a row whose next target step is a
     decode samples draft 1 from its last token's logits;
  2. k - 1 one-token decode forwards: the state is copied from the
     slot before in the chain to guess j's slot (one index copy per state tensor), which the
     forward then advances by draft j, giving draft j + 1.
The drafts reach the host in one copy after the last forward (vLLM's sync mode fetches them in
`post_step` too); the scheduler puts them in the next step's SchedulerOutput as n-gram drafts.

Pages: a draft with attention layers writes its KV at the target's block ids (its own tensors, as
many blocks as the target's pool: vLLM's draft layers join the target's KV cache groups), and the
scheduler holds k lookahead slots per request for its guesses (`num_lookahead_tokens`; guesses past
max_model_len write the null page, and the scheduler never sends them). A target without attention
layers has no block ids to share: the draft's KV then lies in dense pages per row. A preempted,
finished or new request's row starts over from token 0: the draft has no prefix cache, so a target's
prefix hit is recomputed in its catch-up (at most `max_num_batched_tokens + S` tokens per step),
rewriting the hit blocks' draft KV with the same values.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
from torch import nn

from toolkit.config import RunnerConfig
from toolkit.kv_cache_spec import AttentionSpec
from toolkit.layers.ops import TORCH_OPS, set_ops, triton_ops
from toolkit.runner.attn_utils import init_attn_groups
from toolkit.runner.block_table import BlockTables
from toolkit.runner.block_table import staging_regions as table_regions
from toolkit.runner.input_batch import InputBatch, InputBuffers, host_twin, make_dummy, sort_batch, stage_rows
from toolkit.runner.input_batch import staging_regions as input_regions
from toolkit.runner.kv_cache import allocate_kv_caches, make_kv_cache_groups
from toolkit.runner.model_states import init_model_state
from toolkit.runner.request_states import RequestStates
from toolkit.runner.spec_decode import Proposer
from toolkit.runner.staging import Staging, StagingBank, banked_regions


def draft_runner_config(target: RunnerConfig, k: int, shared_kv_blocks: int | None = None) -> RunnerConfig:
    """The draft's configuration: a row per target row (each forward of a step uses row r for target
    row r) and k state pages per row; the target's token budget plus one token per row (a decode
    row's new sample); k positions past the target's max_model_len (a row's guesses past it go to the
    null page); KV pages: the target's block ids (`shared_kv_blocks`, the target's pool size), else
    dense pages per row; eager, no prefix caching."""
    s = target.max_num_seqs
    width = -(-(target.max_model_len + k) // target.block_size)
    return dataclasses.replace(
        target, max_num_seqs=s, max_num_batched_tokens=target.max_num_batched_tokens + s,
        max_model_len=target.max_model_len + k,
        num_kv_blocks=shared_kv_blocks if shared_kv_blocks is not None else s * width + 1,
        cudagraph_mode="none", enable_prefix_caching=False, num_state_pages=k * s, mamba_cache_mode="none",
        num_speculative_tokens=0)


@dataclasses.dataclass
class DraftStats:
    """Host seconds the draft took (`LLM.stats()`): `seconds` in all, `forward_seconds` in its model
    forwards and greedy picks (what the acceptance compares: the rest is engine work around them)."""
    steps: int = 0                  # target steps the draft ran on
    forwards: int = 0
    tokens: int = 0                 # tokens the draft's forwards consumed
    seconds: float = 0.0
    forward_seconds: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {"draft_steps": self.steps, "draft_forwards": self.forwards, "draft_tokens": self.tokens,
                "draft_seconds": self.seconds, "draft_forward_seconds": self.forward_seconds}


class DraftModelSpeculator(Proposer):
    """See the module docstring. Built by the target's runner, which calls `propose_rows` after
    each step with its own RequestStates (the draft reads each row's token history and computed
    count there) and `forget` when it releases rows."""

    def __init__(self, model: nn.Module, target_cfg: RunnerConfig, k: int,
                 target_kv_table: np.ndarray | None = None, target_kv_blocks: int | None = None):
        """`target_kv_table`: the target's KV block table (its attention group's host table
        [S, W], the runner's authority) and `target_kv_blocks` its pool size: the draft's attention
        layers then use the target's block ids, as vLLM's draft layers join the target's KV cache
        groups, and the scheduler holds k lookahead slots per request for its guesses
        (`num_lookahead_tokens`). None (a target without attention layers): dense pages per row."""
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k}: a draft model proposes at least 1 token")
        self.k = k
        self.num_rows = s = target_cfg.max_num_seqs
        shared = target_kv_table is not None and any(isinstance(spec, AttentionSpec)
                                                      for spec in model.kv_cache_specs().values())
        self.target_kv_table = target_kv_table if shared else None
        self.num_lookahead_tokens = k if shared else 0
        self.cfg = cfg = draft_runner_config(target_cfg, k, target_kv_blocks if shared else None)
        self.device = cfg.device
        self.model = model
        set_ops(model, TORCH_OPS if cfg.backend == "torch" else triton_ops(cfg.device))
        self.model_state = init_model_state(model, cfg)
        self.kv_cache_groups = make_kv_cache_groups(model.kv_cache_specs(), cfg, release_windows=False)
        self.kv_caches = allocate_kv_caches(self.kv_cache_groups, cfg.device)
        model.bind_kv_cache(self.kv_caches)
        self.model_state.initialize_kv_cache(self.kv_cache_groups, self.kv_caches)
        self.attn_groups = init_attn_groups(self.kv_cache_groups)
        self.state_tensors = [t for g in self.kv_cache_groups if g.kind == "mamba"
                              for name in g.layer_names for t in self.kv_caches[name]]
        # one staging, k banks: bank 0 the catch-up forward's inputs, bank j the j-th guess forward's,
        # all written before the first forward and sent by one flush (one copy)
        widths = [g.width for g in self.kv_cache_groups]
        int32, int64 = {}, {}
        for j in range(k):
            rows, tokens = (s, cfg.max_num_batched_tokens) if j == 0 else (s, s)
            inputs32, inputs64 = input_regions(rows, tokens)
            tables32, tables64 = table_regions(widths, rows, tokens)
            int32 |= banked_regions({**inputs32, **tables32}, f"#{j}")
            int64 |= banked_regions({**inputs64, **tables64}, f"#{j}")
        int32["token_ids"] = (cfg.max_num_batched_tokens,)          # the catch-up's tokens (host history)
        int64["guess_copies"] = (max(k - 1, 1), 2, s)                  # per guess: state pages from -> to
        int64["fresh_rows"] = (s,)                                    # state pages to zero (rows starting over)
        self.staging = Staging(int32, int64, cfg.device)
        self.banks = [StagingBank(self.staging, f"#{j}") for j in range(k)]
        self.block_tables = [BlockTables([g.block_size for g in self.kv_cache_groups], widths, s, bank)
                             for bank in self.banks]
        # every bank's rows are the target's rows r: the banks share the KV table (the target's block
        # ids copied in each step, or dense pages) and each has its own state column (the slot its
        # forward runs in). Target row r owns the k state pages slots[r]; one holds its committed
        # state (`committed[r]`, an index into them), the others take its guesses.
        self.kv_table: np.ndarray | None = None
        self.bank_state_tables: list[list[np.ndarray]] = [[] for _ in range(k)]
        for g, group in enumerate(self.kv_cache_groups):
            if group.kind == "attention":
                self.kv_table = self.block_tables[0].tables[g]
                if not shared:
                    self.kv_table[:] = 1 + np.arange(s)[:, None] * group.width + np.arange(group.width)
                for bt in self.block_tables[1:]:
                    bt.tables[g] = self.kv_table
            else:
                for j, bt in enumerate(self.block_tables):
                    self.bank_state_tables[j].append(bt.tables[g])
        self.slots = 1 + np.arange(k * s, dtype=np.int64).reshape(s, k)
        self.committed = np.zeros(s, dtype=np.int64)
        # the drafts each row proposed last, and the slot that holds the state after each guess
        self.last_drafts: list[list[int] | None] = [None] * s
        self.guess_slots = np.zeros((s, max(k - 1, 1)), dtype=np.int64)
        self.input_buffers = [InputBuffers(bank, cfg.max_num_batched_tokens if j == 0 else s, cfg.device)
                              for j, bank in enumerate(self.banks)]
        self.num_computed = np.zeros(s, dtype=np.int64)      # tokens of row r the committed row has consumed
        self.owner: list[str | None] = [None] * s             # the request each row's tokens belong to
        self.row_of: dict[str, int] = {}
        self.stats = DraftStats()

    # ---- the Proposer interface -------------------------------------------------------------
    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            idx = self.row_of.pop(req_id, None)
            if idx is not None and self.owner[idx] == req_id:
                self.owner[idx] = None

    @torch.inference_mode()
    def propose_rows(self, req_states: RequestStates, req_ids: list[str], rows: np.ndarray,
                     decode_next: np.ndarray) -> dict[str, list[int]]:
        """After the target's step (its books updated): the step's rows `req_ids` (target request
        rows `rows`) consume their new tokens; those whose next step is a decode (`decode_next`)
        and that caught up get k drafts."""
        start_time = time.perf_counter()
        rs, budget = req_states, self.cfg.max_num_batched_tokens
        plan: list[tuple[str, int, int, int, bool]] = []     # (req id, row, start, count, samples drafts)
        for rid, r, nxt in zip(req_ids, rows.tolist(), decode_next.tolist()):
            if self.owner[r] != rid:                           # a new request in this row: from token 0
                self.row_of.pop(self.owner[r], None)
                self.owner[r], self.num_computed[r] = rid, 0
                self.row_of[rid] = r
                self.last_drafts[r], self.committed[r] = None, 0
            end = int(rs.num_computed_tokens[r]) + int(nxt)    # + the token the step sampled
            start = int(self.num_computed[r])
            if self.last_drafts[r] is not None:               # guesses that came true: their state is kept
                self._take_guesses(r, rs.all_token_ids[r, start:end - 1].tolist())
                start = int(self.num_computed[r])
            count = min(end - start, budget)
            if count > 0:
                budget -= count
                plan.append((rid, r, start, count, bool(nxt) and start + count == end))
        drafts: dict[str, list[int]] = {}
        if plan:
            drafts = self._run(plan, rs.all_token_ids)
        self.stats.steps += 1
        self.stats.seconds += time.perf_counter() - start_time
        return drafts

    def _run(self, plan: list[tuple[str, int, int, int, bool]], history: torch.Tensor) -> dict[str, list[int]]:
        order = sort_batch(list(range(len(plan))), {i: p[3] for i, p in enumerate(plan)},
                           {i: p[2] for i, p in enumerate(plan)})
        plan = [plan[i] for i in order]
        rows = np.array([p[1] for p in plan], dtype=np.int64)
        starts = np.array([p[2] for p in plan], dtype=np.int64)
        counts = np.array([p[3] for p in plan], dtype=np.int32)
        want = np.array([p[4] for p in plan])
        # every forward's host data first (the catch-up's in bank 0, guess j's in bank j), one flush
        stage = self.staging
        ids = torch.cat([history[r, a:a + n] for r, a, n in zip(rows.tolist(), starts.tolist(), counts.tolist())])
        stage.put("token_ids", ids.numpy())
        if self.target_kv_table is not None:       # the target's block ids of these rows, as they are now
            self.kv_table[rows, :self.target_kv_table.shape[1]] = self.target_kv_table[rows]
        committed = self.slots[rows, self.committed[rows]]
        for table in self.bank_state_tables[0]:
            table[rows, 0] = committed
        forwards = [self._stage_batch(0, rows, starts, counts)]
        fresh = committed[starts == 0]               # a row starting over: its state page from zero
        stage.put("fresh_rows", fresh)
        drafting, ends = rows[want], (starts + counts)[want]
        guessing = self.k > 1 and len(drafting) > 0
        slots = self.slots[drafting]                        # [W, k]
        if guessing:          # guess j runs in the j-th slot that is not the committed one, from guess j - 1's
            others = np.argsort(np.arange(self.k)[None, :] == self.committed[drafting][:, None], axis=1,
                                kind="stable")[:, :self.k - 1]
            chain = np.concatenate([self.committed[drafting][:, None], others], axis=1)     # [W, k]
            chain = np.take_along_axis(slots, chain, axis=1)
            self.guess_slots[drafting] = chain[:, 1:]
            copies = stage.host("guess_copies")
            copies[:self.k - 1, 0, :len(drafting)] = chain[:, :-1].T
            copies[:self.k - 1, 1, :len(drafting)] = chain[:, 1:].T
            stage.written("guess_copies")
            ones = np.ones(len(drafting), dtype=np.int32)
            for j in range(1, self.k):
                for table in self.bank_state_tables[j]:
                    table[drafting, 0] = chain[:, j]
                forwards.append(self._stage_batch(j, drafting, ends - 1 + j, ones))
        stage.flush()

        if len(fresh) and self.state_tensors:
            index = stage.device("fresh_rows")[:len(fresh)]
            for t in self.state_tensors:
                t.index_fill_(0, index, 0)
        logits = self._forward(0, *forwards[0], stage.device("token_ids")[:len(ids)])
        self.num_computed[rows] = starts + counts
        if not want.any():
            return {}
        sampled = [logits[torch.from_numpy(np.nonzero(want)[0])].argmax(-1)]
        if guessing:
            copies = stage.device("guess_copies")
            for j in range(1, self.k):                 # draft j + 1 from draft j, in the next slot of the chain
                if self.state_tensors:
                    index = copies[j - 1, :, :len(drafting)]
                    for t in self.state_tensors:
                        t.index_copy_(0, index[1], t.index_select(0, index[0]))
                sampled.append(self._forward(j, *forwards[j], sampled[-1]).argmax(-1))
        out = torch.stack(sampled, dim=1).cpu().tolist()    # the drafts' one copy to the host
        for r, drafts in zip(drafting.tolist(), out, strict=True):
            self.last_drafts[r] = drafts if guessing else None
        return {p[0]: d for p, d in zip((p for p in plan if p[4]), out, strict=True)}

    def _take_guesses(self, r: int, new_tokens: list[int]) -> None:
        """Row r's new verified tokens (all but the last) begin with m of its last guesses: the state
        after them is in the slot guess m ran in, which becomes the committed one (its KV pages are
        written too), and the row continues after them. Guesses are kept by value: a token equal to a
        guess leaves the same state whether the target verified the guess or sampled it itself."""
        drafts, self.last_drafts[r] = self.last_drafts[r], None
        m = 0
        while m < min(len(new_tokens), self.k - 1) and new_tokens[m] == drafts[m]:
            m += 1
        if m:
            self.committed[r] = int(np.nonzero(self.slots[r] == self.guess_slots[r, m - 1])[0][0])
            self.num_computed[r] += m

    def _stage_batch(self, bank: int, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray
                     ) -> tuple[InputBatch, tuple[torch.Tensor, ...], torch.Tensor]:
        """Write one forward's inputs into bank `bank` (not flushed): draft rows `rows` (sorted:
        decodes first) consume `counts` tokens from position `starts`; a row of one token on top of
        consumed tokens is a decode, any other a prefill chunk. Returns (batch, block tables, slot
        mappings), device views."""
        b = len(rows)
        qsl = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        t = int(qsl[-1])
        seq_lens = (starts + counts).astype(np.int32)
        decode = (counts == 1) & (starts > 0)
        stage, d = self.banks[bank], self.input_buffers[bank]
        seq_lens_view = d.views.head(d.seq_lens, b)
        stage.put("idx_mapping", rows)
        stage.put("positions", np.repeat(starts - qsl[:-1], counts) + np.arange(t))
        stage_rows(stage, qsl, seq_lens)
        batch = InputBatch(
            req_ids=[f"draft-{r}" for r in rows.tolist()], num_reqs=b, num_tokens=t, max_query_len=int(counts.max()),
            idx_mapping=d.views.head(d.idx_mapping, b), idx_mapping_np=rows, num_scheduled_tokens=counts,
            num_computed_tokens_np=starts.astype(np.int32), prefill_len_np=np.where(decode, 0, seq_lens),
            is_prefilling_np=~decode, query_start_loc=d.views.head(d.query_start_loc, b + 1), query_start_loc_np=qsl,
            seq_lens=seq_lens_view, seq_lens_cpu_upper_bound=host_twin(seq_lens_view, seq_lens),
            input_ids=d.views.head(d.input_ids, t), positions=d.views.head(d.positions, t),
            logits_indices=d.views.head(d.logits_indices, b))
        tables = self.block_tables[bank].gather_block_tables(rows)
        slots = self.block_tables[bank].compute_slot_mappings(rows, qsl, batch.num_computed_tokens_np)
        return batch, tables, slots

    def _forward(self, bank: int, batch: InputBatch, tables: tuple[torch.Tensor, ...], slots: torch.Tensor,
                 input_ids: torch.Tensor) -> torch.Tensor:
        """One draft forward on a flushed bank's batch, reading `input_ids` (device int [T]).
        Returns float logits [B]: each row's last token's."""
        metadata = self.model_state.prepare_attn(batch, tables, slots, self.attn_groups)
        start = time.perf_counter()
        hidden = self.model(input_ids, batch.positions, metadata.by_layer, **self.model_state.prepare_inputs(batch))
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        self.stats.forward_seconds += time.perf_counter() - start
        self.stats.forwards += 1
        self.stats.tokens += batch.num_tokens
        return logits

    # ---- warmup and shutdown ----------------------------------------------------------------
    @torch.inference_mode()
    def profile_run(self) -> None:
        """The draft's share of warmup's profile run: its largest batch, no metadata."""
        cfg = self.cfg
        batch = make_dummy(self.input_buffers[0], min(self.num_rows, cfg.max_num_batched_tokens),
                           cfg.max_num_batched_tokens)
        self.staging.flush()
        hidden = self.model(batch.input_ids, batch.positions, None)
        self.model.compute_logits(hidden[batch.logits_indices]).argmax(dim=-1)

    def release(self) -> None:
        """Drop the caches, the model and the buffers (the runner's shutdown calls it)."""
        self.kv_caches.clear()
        self.model.unbind_kv_cache()
        self.attn_groups.clear()
        self.state_tensors.clear()
        for attr in ("kv_caches", "model_state", "model", "input_buffers", "block_tables", "staging"):
            if hasattr(self, attr):
                delattr(self, attr)
