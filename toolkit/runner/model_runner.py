"""ModelRunner: one step = update states -> sort -> prepare inputs -> block tables and slot
mappings -> model_state.prepare_attn -> forward (execute_model), then logits -> sample -> logprobs
-> post update (sample_tokens). Shaped like vLLM's Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py`).

Logprobs never cost a sync of their own: they are computed on the device after sampling (the
sampled tokens', and per prefill chunk the prompt tokens' from the logits of every token of the
chunk, for the rows that ask) and copied to host memory without blocking (`to_host`) before the
step's one sync, the copy of the sampled ids; they are read after it (runner/logprobs.py).
"""
from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from toolkit.config import RunnerConfig, SpeculativeConfig
from toolkit.host import to_device
from toolkit.layers.ops import TORCH_OPS, set_ops, triton_ops
from toolkit.request import TokenLogprobs
from toolkit.runner.attn_utils import AttnMetadata, init_attn_groups
from toolkit.runner.block_table import BlockTables
from toolkit.runner.block_table import staging_regions as table_regions
from toolkit.runner.cudagraph import CudaGraphManager, replay_differs
from toolkit.runner.device import StageClock, on_device
from toolkit.runner.draft_model import DraftModelSpeculator
from toolkit.runner.input_batch import (
    InputBatch,
    InputBuffers,
    gather_sampled_input_ids,
    make_dummy,
    pad_decode_batch,
    prepare_inputs,
    sort_batch,
    verify_staging_regions,
)
from toolkit.runner.input_batch import staging_regions as input_regions
from toolkit.runner.kv_cache import allocate_kv_caches, check_prefill_checkpoints, make_kv_cache_groups
from toolkit.runner.logprobs import issue_logprobs, logprobs_to_host
from toolkit.runner.model_states import init_model_state
from toolkit.runner.request_states import RequestStates
from toolkit.runner.sampler import LogitsRows, Sampler
from toolkit.runner.spec_decode import NgramProposer, VerifyResult, kept_on_device, verify
from toolkit.runner.staging import Staging
from toolkit.scheduler import ModelRunnerOutput, NewRequestData, SchedulerOutput

_NO_ROWS = np.zeros(0, dtype=np.int64)     # a step without state moves (read only)


@dataclass
class ExecuteModelState:
    """What execute_model hands to sample_tokens, and what a StepRecord shows."""
    input_batch: InputBatch
    attn_metadata: AttnMetadata
    hidden_states: torch.Tensor | None   # [T, hidden], set by the forward
    logits: torch.Tensor | None = None   # float32 [B, vocab], set by sample_tokens
    block_tables: tuple[torch.Tensor, ...] = ()   # per group: int32 [B or P, W_g] (device views)
    timings: dict[str, float] = field(default_factory=dict)   # host seconds: prepare_inputs, build_metadata,
                                                              # forward, sample, wait (at the one sync)
    device_timings: dict[str, float] = field(default_factory=dict)   # CUDA: device seconds of the same
                                                                     # stages, from events (StageClock)
    graph: str = "eager"                 # what ran the forward: "eager", "padded eager", "graph"
    padded_size: int | None = None       # P: rows the forward ran (padded decode batch), else None
    state_copies: Any = None             # prefix caching: model_state.preprocess_state's StateCopies
    checkpoint_copies: Any = None        # prefix caching + spec decoding: postprocess_state's CheckpointCopies
    # speculative decoding, set by sample_tokens: what the verification decided (None: no drafts this
    # step), and the drafts proposed for each row's next step
    verification: VerifyResult | None = None
    proposed_drafts: dict[str, list[int]] = field(default_factory=dict)
    # set by sample_tokens (host, after the sync): each row's sampled token with its logprob and rank
    # (the top k its request asked for; every row while an observer records), and the prompt
    # logprobs of the prefill chunks whose request asked
    sampled_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class StepObserver(Protocol):
    """What the inspection layer hooks into a step (`ModelRunner.observer`; None = nothing runs).
    It may read the caches; it must not change them."""

    def before_forward(self, runner: ModelRunner, state: ExecuteModelState) -> None: ...

    def after_forward(self, runner: ModelRunner, state: ExecuteModelState) -> None: ...

    def after_logits(self, runner: ModelRunner, state: ExecuteModelState) -> None:
        """`state.logits` is set and the step's one sync (the sampled ids' copy) is still ahead:
        a non_blocking device-to-host copy issued here is complete when the step returns."""


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: RunnerConfig, speculative_config: SpeculativeConfig | None = None,
                 proposer: Any = None, draft_model: nn.Module | None = None):
        """`proposer`: what proposes drafts (speculative decoding), a spec_decode.Proposer; None:
        with `draft_model` (method "draft_model"), that model run inside the step
        (draft_model.DraftModelSpeculator), else the n-gram proposer of `speculative_config`."""
        self.cfg = cfg
        self.speculative_config = speculative_config
        self.draft: DraftModelSpeculator | None = None
        # with decode graphs, MRV2's rule: k drafts for every row once one row has a draft (padded with
        # the last token), so that decode batches are uniform 1 + k rows a graph can replay; a step where
        # no row has one runs 1-token rows (vLLM: no match, no drafts)
        if proposer is None and speculative_config is not None and draft_model is None:
            proposer = NgramProposer(speculative_config.num_speculative_tokens, speculative_config.prompt_lookup_min,
                                     speculative_config.prompt_lookup_max, pad=cfg.cudagraph_mode != "none")
        self.proposer = proposer
        self.device = cfg.device
        self.model = model
        self.ops = TORCH_OPS if cfg.backend == "torch" else triton_ops(cfg.device)
        set_ops(model, self.ops)
        self.model_state = init_model_state(model, cfg)
        if cfg.prefill_checkpoints:
            check_prefill_checkpoints(model, cfg.block_size)
        self.kv_cache_groups = make_kv_cache_groups(model.kv_cache_specs(), cfg)
        self.kv_caches = allocate_kv_caches(self.kv_cache_groups, cfg.device)
        model.bind_kv_cache(self.kv_caches)
        self.model_state.initialize_kv_cache(self.kv_cache_groups, self.kv_caches)
        self.attn_groups = init_attn_groups(self.kv_cache_groups, align=cfg.enable_prefix_caching,
                                            checkpoints=cfg.prefill_checkpoints,
                                            num_speculative_tokens=cfg.num_speculative_tokens)
        self.req_states = RequestStates(cfg.max_num_seqs, cfg.max_model_len, cfg.device)
        widths = [g.width for g in self.kv_cache_groups]
        max_num_logits = min(cfg.max_num_seqs * (1 + cfg.num_speculative_tokens), cfg.max_num_batched_tokens)
        inputs32, inputs64 = input_regions(cfg.max_num_seqs, cfg.max_num_batched_tokens, max_num_logits)
        tables32, tables64 = table_regions(widths, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        # steps with drafts stage two regions more, last: a plain step's copy stops before them
        verify64 = verify_staging_regions(cfg.max_num_batched_tokens) if cfg.num_speculative_tokens else {}
        state64 = self.model_state.staging_regions()      # prefix caching: a step's state page copies
        self.staging = Staging({**inputs32, **tables32}, {**inputs64, **tables64, **state64, **verify64}, cfg.device)
        self.block_tables = BlockTables([g.block_size for g in self.kv_cache_groups], widths, cfg.max_num_seqs,
                                        self.staging, aligned=[cfg.enable_prefix_caching and g.kind == "mamba"
                                                               for g in self.kv_cache_groups], incremental=True)
        self.input_buffers = InputBuffers(self.staging, cfg.max_num_batched_tokens, cfg.device)
        if proposer is None and draft_model is not None:   # its attention layers use the target's block ids
            # (the full-attention group's: a sliding-window group's rows lose their early blocks)
            attn = [g for g in self.kv_cache_groups if g.kind == "attention" and g.sliding_window is None]
            proposer = self.draft = DraftModelSpeculator(
                draft_model, cfg, speculative_config.num_speculative_tokens,
                self.block_tables.tables[attn[0].group_id] if attn else None,
                attn[0].num_blocks if attn else None)
            self.proposer = proposer
        self.sampler = Sampler(cfg.max_num_seqs, cfg.device, self.ops.gumbel_argmax, self.model.config.vocab_size)
        # a padded decode batch of size rows holds size * (1 + k) tokens: at most the step's token
        # budget (the persistent buffers' size), and the model's own graph limit (a MoE layer's)
        graph_tokens = min(model.max_graph_tokens() or cfg.max_num_batched_tokens, cfg.max_num_batched_tokens)
        graph_mode, unsafe = cfg.cudagraph_mode, model.graph_unsafe_reason()
        if graph_mode == "full_decode" and unsafe:      # the same padded batches, run eagerly
            warnings.warn(f"CUDA graphs off for this model ({unsafe}): decode batches run padded, eagerly",
                          stacklevel=2)
            graph_mode = "padded_eager"
        # n-gram drafts (no draft model): a step none of whose rows found a match runs 1-token rows,
        # with graphs of their own (cudagraph.py's families)
        plain_rows = speculative_config is not None and speculative_config.method != "draft_model"
        self.cudagraph_manager = CudaGraphManager(graph_mode, cfg.max_num_seqs, cfg.device,
                                                  graph_tokens, 1 + cfg.num_speculative_tokens, plain_rows)
        self._check_slots: list[int] = []       # the capture check's scratch state pages (capture_cudagraphs)
        self.execute_state: ExecuteModelState | None = None
        self.observer: StepObserver | None = None
        self.clock = StageClock(use_events=cfg.device.type == "cuda")

    def persistent_buffers(self) -> list[torch.Tensor]:
        """The tensors a step's batch and metadata may view that the runner keeps and rewrites from
        step to step: the staging arena, the input ids, the metadata builders' and the model state's
        own buffers (what a recorded step copies; every other tensor of the batch and metadata is
        made fresh by its step). tests/test_persistent_buffers.py finds one left out."""
        out = self.staging.persistent_buffers() + self.input_buffers.persistent_buffers()
        for group in self.attn_groups:
            out += group.builder.persistent_buffers()
        return out + self.model_state.persistent_buffers()

    # ---- state updates ---------------------------------------------------------------------
    def remove_requests(self, req_ids) -> None:
        """Release the rows of finished, aborted or preempted requests (unknown ids are skipped)."""
        req_ids = list(req_ids)
        if self.proposer is not None:
            self.proposer.forget(req_ids)
        for req_id in req_ids:
            idx = self.req_states.remove_request(req_id)
            if idx is None:
                continue
            self.model_state.remove_request(req_id)
            self.block_tables.clear_row(idx)
            self.sampler.remove_request(idx)

    def _update_states(self, sched_out: SchedulerOutput) -> None:
        self.remove_requests(sched_out.finished_req_ids)
        for new in sched_out.scheduled_new_reqs:
            idx = self.req_states.add_request(new.req_id, new.prefill_token_ids, new.num_computed_tokens)
            self.block_tables.append_block_ids(idx, new.block_ids, overwrite=True)
            self.model_state.add_request(idx, new)
            self.sampler.add_request(idx, new.sampling_params, new.sampling_seed, new.num_prompt_tokens,
                                     new.min_tokens_stop_ids, new.num_prompt_logprobs, new.prefill_token_ids)
        self._copy_forked(sched_out.scheduled_new_reqs)
        cached = sched_out.scheduled_cached_reqs
        for req_id, new_ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                             cached.num_computed_tokens):
            idx = self.req_states.req_id_to_index[req_id]
            self.req_states.num_computed_tokens[idx] = computed
            self.block_tables.append_block_ids(idx, new_ids, overwrite=False)

    def _copy_forked(self, new_reqs: list[NewRequestData]) -> None:
        """n > 1 children admitted this step (all but a parent's last): copy the parent's KV blocks
        and state page into the child's own (its page was just zeroed by model_state.add_request),
        for every layer, before the forward. One index copy per group and step. The parent's ids are
        its own until its last child takes them over (scheduler.py), and that child writes them
        only in its forward, after these copies."""
        forks = [new for new in new_reqs if new.fork_src is not None]
        if not forks:
            return
        for group in self.kv_cache_groups:
            g = group.group_id
            # a sliding-window group's columns out of the window hold the null id in both rows: skipped
            pairs = [(s, d) for new in forks for s, d in zip(new.fork_src[g], new.block_ids[g]) if s and d]
            src, dst = [s for s, _ in pairs], [d for _, d in pairs]
            if not src:
                continue
            index = to_device(np.array([src, dst], dtype=np.int64), self.device)
            for name in group.layer_names:
                cache = self.kv_caches[name]
                for t in (cache if isinstance(cache, tuple) else (cache,)):
                    t.index_copy_(0, index[1], t.index_select(0, index[0]))

    # ---- one step ---------------------------------------------------------------------------
    @on_device
    @torch.inference_mode()
    def execute_model(self, sched_out: SchedulerOutput) -> ExecuteModelState | None:
        clock = self.clock
        clock.start()
        self._update_states(sched_out)
        self.execute_state = None
        if sched_out.total_num_scheduled_tokens == 0:
            return None
        computed = {r: int(self.req_states.num_computed_tokens[self.req_states.req_id_to_index[r]])
                    for r in sched_out.num_scheduled_tokens}
        drafts = sched_out.scheduled_spec_decode_tokens
        req_ids = sort_batch(list(sched_out.num_scheduled_tokens), sched_out.num_scheduled_tokens,
                             computed, {r: len(d) for r, d in drafts.items()})
        input_batch = prepare_inputs(self.input_buffers, self.req_states, req_ids,
                                     sched_out.num_scheduled_tokens, drafts)
        n = input_batch.num_reqs
        graphs = self.cudagraph_manager
        per_row = input_batch.num_tokens // n if n else 0      # a uniform decode batch's tokens per row
        uniform = bool(input_batch.runs_as_decode_np.all()) and (
            per_row == 1 or bool((input_batch.num_drafts_np == per_row - 1).all()))
        padded = graphs.padded_size(n, input_batch.num_tokens, uniform)
        # the forward runs `forward_batch`: the batch itself, or it padded to a capture size
        forward_batch = input_batch if padded is None else pad_decode_batch(self.input_buffers, input_batch, padded)
        block_tables = self.block_tables.gather_block_tables(input_batch.idx_mapping_np, padded)
        slot_mappings = self.block_tables.compute_slot_mappings(
            input_batch.idx_mapping_np, input_batch.query_start_loc_np, input_batch.num_computed_tokens_np,
            None if padded is None else padded * per_row)
        moves = sched_out.state_moves       # prefix caching: rows entering a new column (the scheduler's plan)
        move_rows = np.array([self.req_states.req_id_to_index[r] for r in moves.req_ids], dtype=np.int64) \
            if moves.req_ids else _NO_ROWS
        self.model_state.stage_state(input_batch, self.block_tables, self.staging, moves, move_rows)
        self.staging.flush()                    # the step's host data in one copy (staging.py)
        if input_batch.input_ids_sampled:
            gather_sampled_input_ids(self.input_buffers, self.req_states, input_batch)
        clock.mark("prepare_inputs")
        state_copies = self.model_state.preprocess_state(input_batch, self.block_tables)
        attn_metadata = self.model_state.prepare_attn(forward_batch, block_tables, slot_mappings,
                                                      self.attn_groups)
        state = ExecuteModelState(input_batch, attn_metadata, None, block_tables=block_tables,
                                  graph=graphs.label(padded, per_row), padded_size=padded, state_copies=state_copies)
        clock.mark("build_metadata")
        if self.observer is not None:
            self.observer.before_forward(self, state)
            clock.skip()
        if graphs.has_graph(padded, per_row):
            state.hidden_states = graphs.replay(padded, per_row)
        else:
            state.hidden_states = self.model(forward_batch.input_ids, forward_batch.positions,
                                             attn_metadata.by_layer,
                                             **self.model_state.prepare_inputs(forward_batch))
        clock.mark("forward")
        if self.observer is not None:
            self.observer.after_forward(self, state)
        state.timings = clock.host
        self.execute_state = state
        return state

    @on_device
    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        """Sample one token per row of the last executed batch (a verify row: one at each of its
        positions, then `verify`); returns what the scheduler's books take: each row's kept tokens,
        the logprobs asked for, and the next step's drafts (the same objects as the state's).
        `state.timings` gets "sample" and "wait" (host seconds waiting at the sync); on CUDA,
        `state.device_timings` the device seconds of each stage (StageClock). With speculative
        decoding, `state.verification` and `state.proposed_drafts` (spec_decode.py)."""
        state = self.execute_state
        if state is None:
            return ModelRunnerOutput({})
        clock = self.clock
        clock.skip()
        batch = state.input_batch
        hidden = state.hidden_states
        # one token per row: the last tokens are rows 0..B-1 (a view, no gather); a verify row
        # samples at each of its 1 + d positions (logits rows cu_num_logits[r]..cu_num_logits[r+1]-1)
        last = hidden[:batch.num_reqs] if batch.num_tokens == batch.num_reqs else hidden[batch.logits_indices]
        logits = self.model.compute_logits(last)
        state.logits = logits
        if self.observer is not None:
            self.observer.after_logits(self, state)
        # a row whose chunk ends before its known tokens do (partial prefill) draws nothing
        draws = batch.num_computed_tokens_np + batch.num_scheduled_tokens >= batch.prefill_len_np
        positions_np = batch.seq_lens_cpu_upper_bound.numpy()[:batch.num_reqs]
        kept_device = None
        if batch.num_draft_tokens is None:
            rows = LogitsRows(batch.idx_mapping_np, batch.idx_mapping, batch.seq_lens, positions_np, draws,
                              last_outputs=self._last_outputs(batch, positions_np))
            sampled = self.sampler(logits, rows)
            self.sampler.count_kept(rows, sampled)
        else:       # each logits row samples the token at its own position: its token's + 1
            per_row = 1 + batch.num_draft_tokens
            positions_np = np.repeat(positions_np - batch.num_draft_tokens, per_row) + \
                np.arange(len(logits)) - np.repeat(batch.cu_num_logits_np[:-1], per_row)
            logit_tokens = batch.logits_indices
            next_draft = batch.draft_ids[logit_tokens + 1]
            rows = LogitsRows(np.repeat(batch.idx_mapping_np, per_row), batch.token_req_rows[logit_tokens],
                              batch.positions[logit_tokens] + 1, positions_np, np.repeat(draws, per_row),
                              drafts=next_draft, max_drafts=int(batch.num_draft_tokens.max()),
                              last_outputs=self._last_outputs(batch, positions_np, per_row))
            sampled = self.sampler(logits, rows)
            # the rows' kept counts on the device too (the host's come after the sync, from `verify`)
            logit_rows = torch.searchsorted(batch.query_start_loc[1:], logit_tokens.to(torch.int32), right=True)
            kept_device = kept_on_device(sampled, next_draft, logit_rows, batch.num_reqs)
            self.sampler.count_kept(rows, sampled, (kept_device[1], logit_rows))
        pending = issue_logprobs(state, sampled, self.sampler, self.req_states.all_token_ids,
                                 self.model.compute_logits, self.device)   # device work, copied without blocking
        clock.mark("sample")
        sampled_np = sampled.cpu().numpy()      # the step's one device -> host copy (a sync)
        clock.mark("wait", event=False)
        state.device_timings = clock.device_times()
        num_kept = np.ones(batch.num_reqs, dtype=np.int32)
        if batch.num_draft_tokens is not None:
            state.verification = verify(batch.req_ids, batch.draft_token_ids, batch.num_draft_tokens,
                                  batch.cu_num_logits_np, sampled_np)
            num_kept[batch.num_draft_tokens > 0] = state.verification.num_accepted
        logprobs_to_host(state, pending, num_kept, self.sampler)
        last_kept = self._post_update(batch, sampled, sampled_np, num_kept, kept_device)
        state.checkpoint_copies, state_offsets = self.model_state.postprocess_state(
            batch, sampled, num_kept if self.proposer else None, None if kept_device is None else kept_device[0])
        kept = {rid: [token] for rid, token in zip(batch.req_ids, last_kept.tolist())}
        if state.verification is not None:
            kept.update((rid, state.verification.kept(i)) for i, rid in enumerate(state.verification.req_ids))
        if self.proposer is not None:
            state.proposed_drafts = self._propose(batch)
        clock.mark("sample", event=False)
        state.timings = dict(clock.host)
        return ModelRunnerOutput(kept, state.sampled_logprobs, state.prompt_logprobs, state.proposed_drafts,
                                 state_offsets)

    def _last_outputs(self, batch: InputBatch, positions_np: np.ndarray, per_row: np.ndarray | None = None):
        """`LogitsRows.last_outputs` for this step: (logits row i, n) -> the last n output tokens
        before its position, from the request's known tokens and, past them, its row's drafts."""
        rs, sampler = self.req_states, self.sampler
        drafts = batch.draft_token_ids or {}

        def last_outputs(i: int, n: int) -> list[int]:
            row = i if per_row is None else int(np.searchsorted(batch.cu_num_logits_np, i, side="right")) - 1
            idx, position = batch.idx_mapping_np[row], int(positions_np[i])
            start, known = max(int(sampler.num_prompt_tokens[idx]), position - n), int(rs.total_len[idx])
            out = rs.all_token_ids[idx, start:min(position, known)].numpy().tolist()
            if position > known:
                out += drafts.get(batch.req_ids[row], [])[max(start - known, 0):position - known]
            return out
        return last_outputs

    def _propose(self, batch: InputBatch) -> dict[str, list[int]]:
        """Drafts for the next step of each row that consumed all its known tokens (its next step
        is a decode), from the request's own tokens (the proposer: n-gram or a draft model)."""
        rs, idx = self.req_states, batch.idx_mapping_np
        # a row whose next token is still a prompt token (a prefill chunk that stopped before the
        # prompt's last token) gets none: its next step is a prefill chunk, not a verify row
        computed = rs.num_computed_tokens[idx]
        decode_next = (computed == rs.total_len[idx] - 1) & (computed >= rs.prefill_len[idx])
        return self.proposer.propose_rows(rs, batch.req_ids, idx, decode_next)

    def _post_update(self, batch: InputBatch, sampled: torch.Tensor, sampled_cpu: np.ndarray,
                     num_kept: np.ndarray, kept_device: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> np.ndarray:
        """MRV2 `post_update`: remember each row's last kept sample, advance num_computed_tokens,
        and append the kept samples to the history of rows that consumed every known token (not
        partial prefills). A verify row keeps `num_kept[row]` of its samples; its rejected drafts'
        positions are not computed (its KV there is overwritten later). `sampled_cpu`: the host
        copy of `sampled` [L]; `kept_device`: (num_kept, the logits row of the last kept sample) of
        each row on the device (`kept_on_device`), with drafts. Returns each row's last kept sample
        (host int64 [B])."""
        rs = self.req_states
        if batch.num_draft_tokens is None:
            rs.last_sampled_tokens[batch.idx_mapping] = sampled
            last = sampled_cpu
        else:
            rs.last_sampled_tokens[batch.idx_mapping] = sampled[kept_device[1]]
            last = sampled_cpu[batch.cu_num_logits_np[:-1] + num_kept - 1]
        # on arrays, not a loop over rows (it was the largest host cost of a 128-row step); a batch's
        # rows are distinct requests, so the fancy-indexed updates do not collide
        idx = batch.idx_mapping_np
        rs.num_computed_tokens[idx] += batch.num_scheduled_tokens - (1 + batch.num_drafts_np - num_kept)
        rows = np.nonzero(rs.num_computed_tokens[idx] >= rs.total_len[idx])[0]     # consumed every known token
        if len(rows):
            counts = num_kept[rows]
            sample_row = np.repeat(rows, counts)                      # one entry per kept sample
            offset = np.arange(len(sample_row)) - np.repeat(np.cumsum(counts) - counts, counts)
            req = idx[sample_row]
            pos = rs.total_len[req] + offset
            fits = pos < self.cfg.max_model_len                       # past it: counted, not stored
            tokens = sampled_cpu[batch.cu_num_logits_np[sample_row] + offset]
            rs.all_token_ids.numpy()[req[fits], pos[fits]] = tokens[fits]
            rs.total_len[idx[rows]] += counts
        return last

    # ---- warmup -----------------------------------------------------------------------------
    @on_device
    @torch.inference_mode()
    def profile_run(self) -> ExecuteModelState:
        """Largest batch, no attention metadata (layers skip cache/state I/O), then the sampler."""
        batch = make_dummy(self.input_buffers, min(self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens),
                           self.cfg.max_num_batched_tokens)
        self.staging.flush()
        hidden = self.model(batch.input_ids, batch.positions, None)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        logits.argmax(dim=-1)
        if self.draft is not None:
            self.draft.profile_run()
        return ExecuteModelState(batch, AttnMetadata([], {}), hidden, logits)

    @on_device
    @torch.inference_mode()
    def dummy_run(self, num_reqs: int, num_tokens: int) -> ExecuteModelState:
        """A dummy batch whose metadata goes through the same prepare_attn as real steps. Block
        tables point at the null block/slot 0; slot mappings are all PAD_SLOT_ID."""
        batch, block_tables, attn_metadata, forward = self._prepare_dummy(num_reqs, num_tokens)
        return ExecuteModelState(batch, attn_metadata, forward(), block_tables=block_tables)

    @on_device
    def capture_cudagraphs(self, progress: bool = False, check: bool = True, scratch_slots: list[int] = ()):
        """Warmup's last stage on CUDA: one graph per decode capture size (cudagraph.py), each
        checked against the eager forward (`check`). The dummy batch and its metadata are prepared
        outside the capture (host work and host-to-device copies cannot be captured); the graph
        records the forward. `scratch_slots`: free state pages holding nothing cached (the
        scheduler's pool says which), one per row of the check's dummy batch (see _check_graph)."""
        self._check_slots = list(scratch_slots)
        with torch.inference_mode():
            return self.cudagraph_manager.capture(
                lambda size, per_row, vary_tokens=False: self._prepare_dummy(
                    size, size * per_row, True, vary_tokens)[3],
                self._check_graph if check else None, progress)

    def _check_graph(self, size: int, run_eager, replay) -> str | None:
        """A graph's replay against the eager forward on the same dummy batch (cudagraph.py): None
        when the greedy tokens are equal and the logits within the dtype's tolerance, else the
        first differing output (`replay_differs`). Each dummy row reads and writes a scratch state
        page of its own (`_prepare_dummy(vary_tokens=True)`: rows sharing the null slot race on it
        on a GPU), zeroed before each run so that both start from the same state, and after (a free
        slot is zero)."""
        slots = [0, *self._check_slots[:size]]
        logits = []
        for run in (run_eager, replay):
            self._zero_state_slots(slots)
            logits.append(self.model.compute_logits(run()[:size]).float())
        self._zero_state_slots(slots)
        return replay_differs(*logits, self.cfg.dtype)

    def _zero_state_slots(self, slots: list[int]) -> None:
        """Zero these recurrent state pages (the null page and the capture check's)."""
        index = torch.tensor(slots, device=self.device)
        for group in self.kv_cache_groups:
            if group.kind == "mamba":
                for name in group.layer_names:
                    for t in self.kv_caches[name]:
                        t.index_fill_(0, index, 0)

    def _prepare_dummy(self, num_reqs: int, num_tokens: int, for_capture: bool = False, vary_tokens: bool = False):
        """Write a dummy batch into the persistent buffers and build its metadata. Returns
        (batch, block_tables, attn_metadata, forward), `forward()` running the model on it.
        `vary_tokens`: token ids other than the capture's zeros (the capture check's inputs)."""
        # a capture of speculative decoding's graphs: uniform verify rows of 1 + k tokens (or of 1: the
        # n-gram engine's steps without drafts)
        drafts = num_tokens // num_reqs - 1 if for_capture else 0
        batch = make_dummy(self.input_buffers, num_reqs, num_tokens, drafts)
        block_tables = self.block_tables.null_block_tables(num_reqs)
        if vary_tokens:     # the capture check: a scratch state page per row (see _check_graph)
            self.block_tables.distinct_state_slots(
                num_reqs, {g.group_id: self._check_slots for g in self.kv_cache_groups if g.kind == "mamba"})
        slot_mappings = self.block_tables.pad_slot_mappings(num_tokens)
        self.staging.flush()
        if vary_tokens:
            vocab = self.model.get_input_embeddings().num_embeddings
            ids = torch.arange(1, num_tokens + 1, device=self.device) * 7919 % vocab
            self.input_buffers.input_ids[:num_tokens] = ids.to(self.input_buffers.input_ids.dtype)
        attn_metadata = self.model_state.prepare_attn(batch, block_tables, slot_mappings, self.attn_groups,
                                                      for_capture=for_capture)
        extra = self.model_state.prepare_inputs(batch)
        return batch, block_tables, attn_metadata, lambda: self.model(batch.input_ids, batch.positions,
                                                                      attn_metadata.by_layer, **extra)

    # ---- shutdown ---------------------------------------------------------------------------
    def shutdown(self, collect_garbage: bool = True) -> None:
        """Release in vLLM's order (post #52374): graphs first, then caches, model state, model,
        persistent buffers. `release_log` records the order (the inspection layer checks it).
        collect_garbage=False leaves the garbage collection (a full pass: about 0.2 s in a process
        that has imported torch and transformers) to the caller, `LLM.shutdown`, which makes one
        only when a reference cycle still holds a cache or the model."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.release_log: list[str] = []

        def release(what: str, *attrs: str) -> None:
            for attr in attrs:
                if hasattr(self, attr):
                    delattr(self, attr)
            self.release_log.append(what)

        if self.cudagraph_manager is not None:
            self.cudagraph_manager.release()
        self.cudagraph_manager = None
        self.release_log.append("cudagraph_manager")
        self.execute_state = None
        if hasattr(self, "kv_caches"):
            self.kv_caches.clear()
            self.model.unbind_kv_cache()
        release("kv_caches", "kv_caches")
        if self.draft is not None:       # its caches, model and buffers (the proposer is the draft)
            self.draft.release()
            self.draft = self.proposer = None
            self.release_log.append("draft")
        if hasattr(self, "attn_groups"):
            self.attn_groups.clear()
        release("attn_groups", "attn_groups")
        release("model_state", "model_state")
        release("model", "model")
        release("persistent_buffers", "input_buffers", "block_tables", "staging", "req_states", "sampler")
        self.observer = None
        if collect_garbage:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
