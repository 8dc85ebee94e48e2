"""`build_attn_metadata`: one CommonAttentionMetadata per KV-cache group, one builder call per
attention group, and a layer_name -> metadata map for the forward (vLLM §b.1).

The result keeps the per-group common metadata beside the builder output, so a StepRecord can
show exactly what each builder was given and what it produced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from toolkit.attention.builder import AttentionMetadataBuilder
from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.gdn import GDNMetadataBuilder
from toolkit.attention.linear_attn import LinearAttentionMetadataBuilder
from toolkit.attention.mamba1 import Mamba1MetadataBuilder
from toolkit.attention.mamba2 import Mamba2MetadataBuilder
from toolkit.attention.mlstm import MLSTMMetadataBuilder
from toolkit.attention.paged_attn import PagedAttentionMetadataBuilder
from toolkit.attention.short_conv import ShortConvMetadataBuilder
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.runner.kv_cache import KVCacheGroup


@dataclass
class AttentionGroup:
    kv_cache_group: KVCacheGroup
    builder: AttentionMetadataBuilder

    @property
    def layer_names(self) -> list[str]:
        return self.kv_cache_group.layer_names


def make_builder(group: KVCacheGroup, align: bool = False, checkpoints: bool = False,
                 num_speculative_tokens: int = 0) -> AttentionMetadataBuilder:
    """`align`: prefix caching's Mamba mode, where a row's state page is the column of its last
    scheduled token (`mamba_block_size` = the group's block size); `checkpoints`: cache mode "all",
    which also saves the states at the block boundaries inside prefill chunks (every recurrent builder)."""
    spec = group.spec
    if isinstance(spec, AttentionSpec):
        return PagedAttentionMetadataBuilder(group.block_size)
    kw = {"mamba_block_size": group.block_size} if align else {}
    if checkpoints:
        kw["prefill_checkpoints"] = True
    if num_speculative_tokens:
        kw["num_speculative_tokens"] = num_speculative_tokens
    if isinstance(spec, MambaSpec) and spec.mamba_type == "mamba2":
        return Mamba2MetadataBuilder(spec.chunk_size, **kw)
    if isinstance(spec, MambaSpec) and spec.mamba_type == "mamba1":
        return Mamba1MetadataBuilder(**kw)
    if isinstance(spec, MambaSpec) and spec.mamba_type == "short_conv":
        return ShortConvMetadataBuilder(**kw)
    if isinstance(spec, MambaSpec) and spec.mamba_type == "gdn":
        return GDNMetadataBuilder(spec.chunk_size, **kw)
    if isinstance(spec, MambaSpec) and spec.mamba_type == "linear_attention":
        return LinearAttentionMetadataBuilder(spec.chunk_size, **kw)
    if isinstance(spec, MambaSpec) and spec.mamba_type == "mlstm":
        return MLSTMMetadataBuilder(**kw)
    raise ValueError(f"no metadata builder for cache spec {spec}")


def init_attn_groups(kv_cache_groups: list[KVCacheGroup], align: bool = False,
                     checkpoints: bool = False, num_speculative_tokens: int = 0) -> list[AttentionGroup]:
    return [AttentionGroup(g, make_builder(g, align, checkpoints, num_speculative_tokens))
            for g in kv_cache_groups]


@dataclass
class GroupMetadata:
    group_id: int
    kind: str                          # "attention" or "mamba"
    builder: str                       # builder class name
    layer_names: list[str]
    common: CommonAttentionMetadata    # what the builder was given
    metadata: Any                      # what it built (shared by every layer of the group)


@dataclass
class AttnMetadata:
    groups: list[GroupMetadata]
    by_layer: dict[str, Any]           # layer_name -> metadata, read by the model's layers


def build_attn_metadata(*, attn_groups: list[AttentionGroup], num_reqs: int, num_tokens: int,
                        query_start_loc_gpu: torch.Tensor, query_start_loc_cpu: torch.Tensor,
                        max_query_len: int, seq_lens: torch.Tensor, max_seq_len: int,
                        block_tables: tuple[torch.Tensor, ...], slot_mappings: tuple[torch.Tensor, ...],
                        producer: str, seq_lens_cpu_upper_bound: torch.Tensor | None = None,
                        is_prefilling: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None, num_accepted_tokens: torch.Tensor | None = None,
                        num_decode_draft_tokens_cpu: torch.Tensor | None = None) -> AttnMetadata:
    """`producer` names the model state calling this; contract errors report it."""
    groups, by_layer = [], {}
    # the batch's own tensors when they hold its rows (no view made per group per step: a recording
    # keeps them; toolkit/tensor_views.py HeadViews)
    if len(seq_lens) != num_reqs:
        seq_lens = seq_lens[:num_reqs]
    if seq_lens_cpu_upper_bound is not None and len(seq_lens_cpu_upper_bound) != num_reqs:
        seq_lens_cpu_upper_bound = seq_lens_cpu_upper_bound[:num_reqs]
    for i, attn_group in enumerate(attn_groups):
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc_gpu, query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=seq_lens, num_reqs=num_reqs, num_actual_tokens=num_tokens,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
            block_table_tensor=block_tables[i], slot_mapping=slot_mappings[i],
            seq_lens_cpu_upper_bound=seq_lens_cpu_upper_bound,
            is_prefilling=is_prefilling, positions=positions, num_accepted_tokens=num_accepted_tokens,
            num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu)
        metadata = attn_group.builder.build(common, producer=producer)
        kv_group = attn_group.kv_cache_group
        groups.append(GroupMetadata(kv_group.group_id, kv_group.kind, type(attn_group.builder).__name__,
                                    list(kv_group.layer_names), common, metadata))
        for name in kv_group.layer_names:
            by_layer[name] = metadata
    return AttnMetadata(groups, by_layer)
