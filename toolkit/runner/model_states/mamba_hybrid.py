"""`MambaHybridModelState`: hybrid (attention + Mamba-family) AND attention-free models.

What it adds over the default state (vLLM `model_states/mamba_hybrid.py`):
- state hygiene: a request's fresh state slots are zeroed when it is added (vLLM #35219/#56524),
  except an n > 1 child's that took its parent's slot over (`inherits_state`: the slot holds the
  state of the prompt the parent computed);
- with prefix caching ("align" mode), `preprocess_state`: a row whose last scheduled token lies in a
  new column of its position-indexed row gets its state there before the forward, copied from the
  page of the column before (a checkpoint, or a prefix hit's page), or zeroed when it starts from
  scratch (MRV2 `preprocess_state`; one batched copy per state tensor, no host sync);
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
from toolkit.scheduler import NewRequestData


@dataclass
class StateCopies:
    """What `preprocess_state` did this step ("align" mode), one entry per row that entered a new
    block: its running state went from page `src` (the checkpoint after `from_tokens` tokens: the
    page of the column it left, or a prefix hit's page; 0 = none, the new page was zeroed) to page
    `dst` before the forward."""
    request_ids: list[str]
    from_tokens: np.ndarray      # int64 [R]: tokens the source state covers (a block multiple; 0: zeroed)
    src: np.ndarray              # int64 [R]
    dst: np.ndarray              # int64 [R]


class MambaHybridModelState(DefaultModelState):
    def __init__(self, model, cfg) -> None:
        super().__init__(model, cfg)
        self.num_speculative_tokens = cfg.num_speculative_tokens
        self.num_accepted_tokens = torch.ones(cfg.max_num_seqs, dtype=torch.int32, device=cfg.device)

    def initialize_kv_cache(self, kv_cache_groups: list[KVCacheGroup], caches) -> None:
        self.mamba_groups = [g for g in kv_cache_groups if g.kind == "mamba"]
        self.state_tensors = [t for g in self.mamba_groups for name in g.layer_names
                              for t in caches[name]]

    def add_request(self, req_idx: int, new_req: NewRequestData) -> None:
        self.num_accepted_tokens[req_idx] = 1
        if self.cfg.enable_prefix_caching:
            return                          # its running page is set up by preprocess_state
        slots = [s for g in self.mamba_groups for s in new_req.block_ids[g.group_id]]
        if 0 in slots:
            raise RuntimeError(f"request {new_req.req_id} was given the null state slot 0")
        if slots and not new_req.inherits_state:
            index = to_device(np.array(slots, dtype=np.int64), self.device)
            for t in self.state_tensors:
                t.index_fill_(0, index, 0)

    def preprocess_state(self, input_batch: InputBatch, block_tables: BlockTables) -> StateCopies | None:
        if not self.cfg.enable_prefix_caching or not self.mamba_groups:
            return None
        group = self.mamba_groups[0]
        bs, table = group.block_size, block_tables.tables[group.group_id]
        start = input_batch.num_computed_tokens_np.astype(np.int64)
        end = start + input_batch.num_scheduled_tokens
        old, new = -(-start // bs) - 1, -(-end // bs) - 1
        rows = np.nonzero(new != old)[0]
        if not len(rows):
            return None
        idx = input_batch.idx_mapping_np[rows]
        dst = table[idx, new[rows]]
        if (dst == 0).any():
            raise RuntimeError(f"prefix caching: a row's running column has no state page "
                               f"(rows {rows[dst == 0].tolist()})")
        has_src = old[rows] >= 0
        src = table[idx[has_src], old[rows][has_src]]
        if (src == 0).any():
            raise RuntimeError("prefix caching: a row's state to copy from has no page (rows "
                               f"{rows[has_src][src == 0].tolist()})")
        copy = to_device(np.stack([src, dst[has_src]]).astype(np.int64), self.device) if len(src) else None
        zero = to_device(dst[~has_src].astype(np.int64), self.device) if (~has_src).any() else None
        for t in self.state_tensors:
            if copy is not None:
                t.index_copy_(0, copy[1], t.index_select(0, copy[0]))
            if zero is not None:
                t.index_fill_(0, zero, 0)
        source = np.zeros(len(rows), dtype=np.int64)
        source[has_src] = src
        return StateCopies([input_batch.req_ids[r] for r in rows], (old[rows] + 1) * bs, source,
                           dst.astype(np.int64))

    def postprocess_state(self, input_batch: InputBatch, sampled: torch.Tensor,
                          num_accepted: np.ndarray | None = None) -> None:
        """Speculative decoding: each row's request keeps `num_accepted` [B] (1 for rows without
        drafts), where its next step finds its state (column num_accepted - 1)."""
        if self.num_speculative_tokens and input_batch.num_reqs:
            values = np.ones(input_batch.num_reqs, dtype=np.int32) if num_accepted is None else num_accepted
            self.num_accepted_tokens[input_batch.idx_mapping] = to_device(values.astype(np.int32), self.device)

    def attn_metadata_kwargs(self, input_batch: InputBatch, for_capture: bool) -> dict:
        kwargs = super().attn_metadata_kwargs(input_batch, for_capture)
        kwargs["is_prefilling"] = torch.from_numpy(input_batch.is_prefilling_np)
        if self.num_speculative_tokens:
            kwargs["num_accepted_tokens"] = self.num_accepted_tokens[input_batch.idx_mapping]
            drafts = np.where(input_batch.is_prefilling_np, -1, input_batch.num_drafts_np)
            kwargs["num_decode_draft_tokens_cpu"] = torch.from_numpy(drafts.astype(np.int32))
        return kwargs
