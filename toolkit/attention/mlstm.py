"""mLSTM (xLSTM) metadata: the base Mamba split only.

vLLM has no mLSTM layer and so no mLSTM builder. The layer here (toolkit/layers/mlstm.py) keeps no
conv state and its prefill op runs the recurrence over `query_start_loc_p` sequences itself, so it
reads exactly the fields of vLLM's linear-attention builder without chunk fields, which are the base
builder's (mamba_base.py): num_prefills / num_prefill_tokens / num_decodes / num_decode_tokens, the
state indices of both kinds of rows, query_start_loc_p, has_initial_states_p (a fresh sequence
starts from HF's zero state), the internal checkpoints of cache mode "all" (any token: the
recurrence runs token by token), and the verify rows' fields. No chunk layout: a chunked mLSTM
kernel, when one exists, would tile on its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.mamba_base import BaseMambaAttentionMetadata, BaseMambaMetadataBuilder


@dataclass
class MLSTMAttentionMetadata(BaseMambaAttentionMetadata):
    pass


class MLSTMMetadataBuilder(BaseMambaMetadataBuilder):
    def _build(self, common: CommonAttentionMetadata, producer: str) -> MLSTMAttentionMetadata:
        return MLSTMAttentionMetadata(**self.common_fields(common, self.split(common, producer)))
