"""Persistent per-request state (MRV2 `RequestState`): one row per running request.

A request takes a free row (`req_idx`) when the runner first sees it and keeps it until it
finishes or is preempted. Every per-request tensor is indexed by that row; a step gathers rows
in batch order through `idx_mapping`.
"""
from __future__ import annotations

import numpy as np
import torch


class RequestStates:
    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: list[str | None] = [None] * max_num_reqs
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # CPU: token history, the truth for prompt tokens (prompt + outputs when resumed)
        self.all_token_ids = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int32)
        self.prefill_len = np.zeros(max_num_reqs, dtype=np.int32)      # tokens given at add time
        self.total_len = np.zeros(max_num_reqs, dtype=np.int32)        # prefill_len + sampled since
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # device: the last sampled token of each row, the input of its next decode step
        self.last_sampled_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, req_id: str, prefill_token_ids: list[int], num_computed_tokens: int) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request row: the scheduler admitted more than max_num_seqs")
        idx = self._free_rows.pop()
        self.req_id_to_index[req_id] = idx
        self.index_to_req_id[idx] = req_id
        n = len(prefill_token_ids)
        self.all_token_ids[idx, :n] = torch.tensor(prefill_token_ids, dtype=torch.int32)
        self.prefill_len[idx] = n
        self.total_len[idx] = n
        self.num_computed_tokens[idx] = num_computed_tokens
        return idx

    def remove_request(self, req_id: str) -> int | None:
        idx = self.req_id_to_index.pop(req_id, None)
        if idx is None:
            return None
        self.index_to_req_id[idx] = None
        self.prefill_len[idx] = self.total_len[idx] = self.num_computed_tokens[idx] = 0
        self._free_rows.append(idx)
        return idx
