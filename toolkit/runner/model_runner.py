"""ModelRunner: one step = update states -> sort -> prepare inputs -> block tables and slot
mappings -> model_state.prepare_attn -> forward (execute_model), then logits -> sample -> post
update (sample_tokens). Shaped like vLLM's Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py`).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.config import RunnerConfig
from toolkit.runner.attn_utils import AttnMetadata, init_attn_groups
from toolkit.runner.block_table import PAD_SLOT_ID, BlockTables
from toolkit.runner.input_batch import InputBatch, InputBuffers, make_dummy, prepare_inputs, sort_batch
from toolkit.runner.kv_cache import allocate_kv_caches, make_kv_cache_groups
from toolkit.runner.model_states import init_model_state
from toolkit.runner.request_states import RequestStates
from toolkit.sampling import Sampler
from toolkit.scheduler import SchedulerOutput


@dataclass
class ExecuteModelState:
    """What execute_model hands to sample_tokens, and what a StepRecord shows."""
    input_batch: InputBatch
    attn_metadata: AttnMetadata
    hidden_states: torch.Tensor          # [T, hidden]
    logits: torch.Tensor | None = None   # float32 [B, vocab], set by sample_tokens


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: RunnerConfig):
        self.cfg = cfg
        self.device = cfg.device
        self.model = model
        self.model_state = init_model_state(model, cfg)
        self.kv_cache_groups = make_kv_cache_groups(model.kv_cache_specs(), cfg)
        self.kv_caches = allocate_kv_caches(self.kv_cache_groups, cfg.device)
        model.bind_kv_cache(self.kv_caches)
        self.model_state.initialize_kv_cache(self.kv_cache_groups, self.kv_caches)
        self.attn_groups = init_attn_groups(self.kv_cache_groups)
        self.req_states = RequestStates(cfg.max_num_seqs, cfg.max_model_len, cfg.device)
        self.block_tables = BlockTables([g.block_size for g in self.kv_cache_groups],
                                        [g.width for g in self.kv_cache_groups],
                                        cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.device)
        self.input_buffers = InputBuffers(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.device)
        self.sampler = Sampler(cfg.max_num_seqs, cfg.device)
        self.cudagraph_manager = None    # CUDA-graph capture is not implemented yet: eager only
        self.execute_state: ExecuteModelState | None = None

    # ---- state updates ---------------------------------------------------------------------
    def _update_states(self, sched_out: SchedulerOutput) -> None:
        for req_id in sched_out.finished_req_ids:
            idx = self.req_states.remove_request(req_id)
            if idx is None:
                continue
            self.model_state.remove_request(req_id)
            self.block_tables.clear_row(idx)
            self.sampler.remove_request(idx)
        for new in sched_out.scheduled_new_reqs:
            idx = self.req_states.add_request(new.req_id, new.prefill_token_ids, new.num_computed_tokens)
            self.block_tables.append_block_ids(idx, new.block_ids, overwrite=True)
            self.model_state.add_request(idx, new)
            self.sampler.add_request(idx, new.sampling_params, new.sampling_seed)
        cached = sched_out.scheduled_cached_reqs
        for req_id, new_ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                             cached.num_computed_tokens):
            idx = self.req_states.req_id_to_index[req_id]
            self.req_states.num_computed_tokens[idx] = computed
            self.block_tables.append_block_ids(idx, new_ids, overwrite=False)

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched_out: SchedulerOutput) -> ExecuteModelState | None:
        self._update_states(sched_out)
        self.execute_state = None
        if sched_out.total_num_scheduled_tokens == 0:
            return None
        computed = {r: int(self.req_states.num_computed_tokens[self.req_states.req_id_to_index[r]])
                    for r in sched_out.num_scheduled_tokens}
        req_ids = sort_batch(list(sched_out.num_scheduled_tokens), sched_out.num_scheduled_tokens,
                             computed)
        input_batch = prepare_inputs(self.input_buffers, self.req_states, req_ids,
                                     sched_out.num_scheduled_tokens)
        block_tables = self.block_tables.gather_block_tables(input_batch.idx_mapping_np)
        slot_mappings = self.block_tables.compute_slot_mappings(
            block_tables, input_batch.query_start_loc, input_batch.positions, input_batch.num_tokens)
        self.model_state.preprocess_state(input_batch)
        attn_metadata = self.model_state.prepare_attn(input_batch, block_tables, slot_mappings,
                                                      self.attn_groups)
        hidden = self.model(input_batch.input_ids, input_batch.positions, attn_metadata.by_layer,
                            **self.model_state.prepare_inputs(input_batch))
        self.execute_state = ExecuteModelState(input_batch, attn_metadata, hidden)
        return self.execute_state

    @torch.inference_mode()
    def sample_tokens(self) -> dict[str, int]:
        """Sample one token per row of the last executed batch; returns req_id -> token."""
        state = self.execute_state
        if state is None:
            return {}
        batch = state.input_batch
        logits = self.model.compute_logits(state.hidden_states[batch.logits_indices])
        state.logits = logits
        # a row whose chunk ends before its known tokens do (partial prefill) draws nothing
        draws = batch.num_computed_tokens_np + batch.num_scheduled_tokens >= batch.prefill_len_np
        sampled = self.sampler(logits, batch.idx_mapping_np, batch.seq_lens, draws)
        self._post_update(batch, sampled)
        self.model_state.postprocess_state(batch, sampled)
        return dict(zip(batch.req_ids, sampled.tolist()))

    def _post_update(self, batch: InputBatch, sampled: torch.Tensor) -> None:
        """MRV2 `post_update`: remember each row's sample, advance num_computed_tokens, and append
        the sample to the history of rows that consumed every known token (not partial prefills)."""
        rs = self.req_states
        rs.last_sampled_tokens[batch.idx_mapping] = sampled
        sampled_cpu = sampled.cpu()
        for row, idx in enumerate(batch.idx_mapping_np):
            rs.num_computed_tokens[idx] += batch.num_scheduled_tokens[row]
            if rs.num_computed_tokens[idx] >= rs.total_len[idx]:
                if rs.total_len[idx] < self.cfg.max_model_len:
                    rs.all_token_ids[idx, rs.total_len[idx]] = sampled_cpu[row]
                rs.total_len[idx] += 1

    # ---- warmup -----------------------------------------------------------------------------
    @torch.inference_mode()
    def profile_run(self) -> None:
        """Largest batch, no attention metadata (layers skip cache/state I/O), then the sampler."""
        batch = make_dummy(self.input_buffers, min(self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens),
                           self.cfg.max_num_batched_tokens)
        hidden = self.model(batch.input_ids, batch.positions, None)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        logits.argmax(dim=-1)

    @torch.inference_mode()
    def dummy_run(self, num_reqs: int, num_tokens: int) -> AttnMetadata:
        """A dummy batch whose metadata goes through the same prepare_attn as real steps. Block
        tables point at the null block/slot 0; slot mappings are all PAD_SLOT_ID."""
        batch = make_dummy(self.input_buffers, num_reqs, num_tokens)
        block_tables = tuple(t[:num_reqs].zero_() for t in self.block_tables.input_block_tables)
        self.block_tables.slot_mappings.fill_(PAD_SLOT_ID)
        slot_mappings = self.block_tables.slot_mappings[:, :num_tokens]
        attn_metadata = self.model_state.prepare_attn(batch, block_tables, slot_mappings,
                                                      self.attn_groups)
        self.model(batch.input_ids, batch.positions, attn_metadata.by_layer,
                   **self.model_state.prepare_inputs(batch))
        return attn_metadata

    # ---- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release in vLLM's order (post #52374): graphs first, then caches, model state, model."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.cudagraph_manager = None
        self.execute_state = None
        if hasattr(self, "kv_caches"):
            self.kv_caches.clear()
            self.model.unbind_kv_cache()
        if hasattr(self, "attn_groups"):
            self.attn_groups.clear()
        if hasattr(self, "model_state"):
            del self.model_state
        if hasattr(self, "model"):
            del self.model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
