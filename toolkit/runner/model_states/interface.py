"""`ModelState`: the per-model-kind hooks of the runner (vLLM `model_states/interface.py`).

The runner calls, per step: add_request / remove_request while updating request states,
stage_state before the step's flush and preprocess_state after it (before metadata), prepare_attn
to build metadata, prepare_inputs for extra model kwargs, and postprocess_state after sampling.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch
from torch import nn

from toolkit.config import RunnerConfig
from toolkit.runner.attn_utils import AttentionGroup, AttnMetadata
from toolkit.runner.block_table import BlockTables
from toolkit.runner.input_batch import InputBatch
from toolkit.runner.kv_cache import KVCacheGroup
from toolkit.scheduler import NewRequestData


class ModelState(ABC):
    def __init__(self, model: nn.Module, cfg: RunnerConfig):
        self.model = model
        self.cfg = cfg
        self.device = cfg.device
        self.max_model_len = cfg.max_model_len

    @property
    def name(self) -> str:
        return type(self).__name__

    def persistent_buffers(self) -> list[torch.Tensor]:
        """Tensors kept from step to step and written in place that the step's metadata may view
        (AttentionMetadataBuilder.persistent_buffers)."""
        return []

    def initialize_kv_cache(self, kv_cache_groups: list[KVCacheGroup],
                            caches: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]) -> None:
        """Called once the caches exist."""

    def add_request(self, req_idx: int, new_req: NewRequestData) -> None:
        """A request took row `req_idx`."""

    def remove_request(self, req_id: str) -> None:
        """A request finished or was preempted."""

    def staging_regions(self) -> dict[str, tuple[int, ...]]:
        """int64 staging regions this state writes each step (runner/staging.py), laid out by the
        runner in its arena; none by default."""
        return {}

    def stage_state(self, input_batch: InputBatch, block_tables: BlockTables, staging, moves,
                    move_rows: np.ndarray) -> None:
        """Before the step's flush: stage what `preprocess_state` will do (the scheduler's
        `SchedulerOutput.state_moves`; `move_rows`: their request rows), so its indices reach the
        device with the step's other host data (no copy of their own)."""

    def preprocess_state(self, input_batch: InputBatch, block_tables: BlockTables):
        """After the flush, before metadata is built (vLLM: Mamba align-mode state copies), as
        `stage_state` planned. Real rows only; returns what it did, for the step's record (None:
        nothing)."""
        return None

    def postprocess_state(self, input_batch: InputBatch, sampled: torch.Tensor,
                          num_accepted: np.ndarray | None = None,
                          num_accepted_device: torch.Tensor | None = None) -> tuple[object | None, dict[str, int]]:
        """After sampling. `num_accepted` (speculative decoding): int32 [B], the tokens each row
        kept (1 + its accepted drafts; 1 for rows without drafts); `num_accepted_device`: the same
        on the device when the step has drafts. Returns what it copied, for the step's record (None:
        nothing), and the state offsets the scheduler books (ModelRunnerOutput.state_offsets)."""
        return None, {}

    def prepare_inputs(self, input_batch: InputBatch) -> dict:
        """Extra model kwargs (vLLM: M-RoPE positions, embeddings); none for our models."""
        return {}

    @abstractmethod
    def prepare_attn(self, input_batch: InputBatch, block_tables: tuple[torch.Tensor, ...],
                     slot_mappings: tuple[torch.Tensor, ...], attn_groups: list[AttentionGroup],
                     for_capture: bool = False) -> AttnMetadata:
        """Build the metadata of every layer group for this batch."""
