"""CommonAttentionMetadata: per-batch metadata shared by every layer group (vLLM §b.2).

B = num_reqs (rows in the batch, decodes first), T = num_actual_tokens.
"Device" tensors live on the runner's device; "CPU" tensors always live on the CPU so builders can
derive host-side facts (prefill/decode split, chunk layout) without a device->host sync.

vLLM's optional fields for decode-context parallelism, cross-attention, fast prefill, multimodal
prefix-LM ranges and R-SWA are left out: no feature of this toolkit produces or reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor        # device int32 [B+1], cumulative query lengths
    query_start_loc_cpu: torch.Tensor    # CPU int32 [B+1], same values
    seq_lens: torch.Tensor               # device int32 [B], computed + scheduled tokens
    num_reqs: int
    num_actual_tokens: int               # total tokens in the step
    max_query_len: int
    max_seq_len: int                     # may be an upper bound
    block_table_tensor: torch.Tensor     # device int32 [B, max_blocks] of this KV-cache group
    slot_mapping: torch.Tensor           # device int64 [T]; PAD_SLOT_ID (-1) = do not write
    causal: bool = True
    # CPU int32 [B]: computed + scheduled per row. Exact here (no async spec decode); vLLM calls it an
    # upper bound. The Mamba builders require it (the field whose absence was vLLM bug #46759).
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    # CPU bool [B]: True while the row still consumes prompt tokens. Tells decodes from short extends.
    is_prefilling: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # device int64 [T]
    # speculative decoding (MRV2 hands these to the Mamba builders); None without it
    num_accepted_tokens: torch.Tensor | None = None          # device int32 [B]: tokens each row's request
                                                             # kept at its last step (1 if none)
    num_decode_draft_tokens_cpu: torch.Tensor | None = None  # CPU int32 [B]: drafts of a decode-phase row
                                                             # (0 or more), -1 for a prefilling row

    def batch_size(self) -> int:
        return self.num_reqs

    def replace(self, **kwargs) -> CommonAttentionMetadata:
        return replace(self, **kwargs)

    def field_names(self) -> list[str]:
        return [f.name for f in fields(self)]
