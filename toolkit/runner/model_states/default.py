"""`DefaultModelState`: plain decoders (attention only). Cannot manage Mamba state."""
from __future__ import annotations

import torch

from toolkit.errors import ModelStateError
from toolkit.runner.attn_utils import AttentionGroup, AttnMetadata, build_attn_metadata
from toolkit.runner.input_batch import InputBatch, host_twin
from toolkit.runner.kv_cache import KVCacheGroup
from toolkit.runner.model_states.interface import ModelState


class DefaultModelState(ModelState):
    def initialize_kv_cache(self, kv_cache_groups: list[KVCacheGroup], caches) -> None:
        mamba = [g.group_id for g in kv_cache_groups if g.kind == "mamba"]
        if mamba:
            raise ModelStateError(
                f"{self.name} got Mamba state groups {mamba} but manages none (no is_prefilling, "
                f"no state-slot hygiene). init_model_state routes models whose class declares "
                f"is_hybrid or is_attention_free to MambaHybridModelState: does "
                f"{type(self.model).__name__} declare it?")

    def prepare_attn(self, input_batch: InputBatch, block_tables: tuple[torch.Tensor, ...],
                     slot_mappings: tuple[torch.Tensor, ...], attn_groups: list[AttentionGroup],
                     for_capture: bool = False) -> AttnMetadata:
        kwargs = self.attn_metadata_kwargs(input_batch, for_capture)
        return build_attn_metadata(attn_groups=attn_groups, block_tables=block_tables,
                                   slot_mappings=slot_mappings, producer=f"{self.name}.prepare_attn",
                                   **kwargs)

    def attn_metadata_kwargs(self, input_batch: InputBatch, for_capture: bool) -> dict:
        """The batch-level arguments this state forwards to `build_attn_metadata`."""
        seq_lens_cpu_upper_bound = input_batch.seq_lens_cpu_upper_bound
        max_seq_len = self.max_model_len if for_capture else int(seq_lens_cpu_upper_bound.numpy().max())
        return dict(num_reqs=input_batch.num_reqs, num_tokens=input_batch.num_tokens,
                    query_start_loc_gpu=input_batch.query_start_loc,
                    query_start_loc_cpu=host_twin(input_batch.query_start_loc, input_batch.query_start_loc_np),
                    max_query_len=input_batch.max_query_len, seq_lens=input_batch.seq_lens,
                    max_seq_len=max_seq_len, seq_lens_cpu_upper_bound=seq_lens_cpu_upper_bound,
                    positions=input_batch.positions)
