"""Lightning-attention (MiniMax) metadata, vLLM `LinearAttentionMetadata`.

vLLM's builder (vllm/v1/attention/backends/linear_attn.py) hands its layers the base split only:
num_prefills / num_prefill_tokens / num_decodes / num_decode_tokens, query_start_loc, seq_lens and one
state index per row (no conv, so no has_initial_state). Here the same fields come from the base
builder (mamba_base.py), plus Mamba2's chunk layout (mamba2.py: seq_idx_p, cu_chunk_seqlen_p,
last_chunk_indices_p, chunk_size), because this project's lightning prefill IS the SSD chunk scan
(toolkit/layers/lightning.py: dt = 1, A = -slope, B = k, C = q, x = v); that is the one addition,
and the reason for it.
"""
from __future__ import annotations

from dataclasses import dataclass

from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.mamba2 import Mamba2AttentionMetadata, Mamba2MetadataBuilder


@dataclass
class LinearAttentionMetadata(Mamba2AttentionMetadata):
    pass


class LinearAttentionMetadataBuilder(Mamba2MetadataBuilder):
    def _build(self, common: CommonAttentionMetadata, producer: str) -> LinearAttentionMetadata:
        md = super()._build(common, producer)
        return LinearAttentionMetadata(**vars(md))
