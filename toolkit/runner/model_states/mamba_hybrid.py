"""`MambaHybridModelState`: hybrid (attention + Mamba-family) AND attention-free models.

What it adds over the default state (vLLM `model_states/mamba_hybrid.py`):
- state hygiene: a request's fresh state slots are zeroed when it is added (vLLM #35219/#56524),
  except an n > 1 child's that took its parent's slot over (`inherits_state`: the slot holds the
  state of the prompt the parent computed);
- `is_prefilling`, which the Mamba builders need to tell decodes from one-token prefill chunks;
- forwarding `seq_lens_cpu_upper_bound` (the field vLLM forgot to forward, #46759).
"""
from __future__ import annotations

import numpy as np
import torch

from toolkit.host import to_device
from toolkit.runner.input_batch import InputBatch
from toolkit.runner.kv_cache import KVCacheGroup
from toolkit.runner.model_states.default import DefaultModelState
from toolkit.scheduler import NewRequestData


class MambaHybridModelState(DefaultModelState):
    def initialize_kv_cache(self, kv_cache_groups: list[KVCacheGroup], caches) -> None:
        self.mamba_groups = [g for g in kv_cache_groups if g.kind == "mamba"]
        self.state_tensors = [t for g in self.mamba_groups for name in g.layer_names
                              for t in caches[name]]

    def add_request(self, req_idx: int, new_req: NewRequestData) -> None:
        slots = [s for g in self.mamba_groups for s in new_req.block_ids[g.group_id]]
        if 0 in slots:
            raise RuntimeError(f"request {new_req.req_id} was given the null state slot 0")
        if slots and not new_req.inherits_state:
            index = to_device(np.array(slots, dtype=np.int64), self.device)
            for t in self.state_tensors:
                t.index_fill_(0, index, 0)

    def attn_metadata_kwargs(self, input_batch: InputBatch, for_capture: bool) -> dict:
        kwargs = super().attn_metadata_kwargs(input_batch, for_capture)
        kwargs["is_prefilling"] = torch.from_numpy(input_batch.is_prefilling_np)
        return kwargs
