"""Test helpers that drive models/layers directly, without the runner.

They build the per-layer metadata the contract files describe (toolkit/attention/paged_attn.py,
toolkit/attention/mamba2.py) for a few sequence chunks, and allocate/bind caches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.attention.mamba1 import Mamba1AttentionMetadata
from toolkit.attention.mamba2 import Mamba2AttentionMetadata, compute_chunk_metadata
from toolkit.attention.paged_attn import PagedAttentionMetadata
from toolkit.attention.short_conv import ShortConvAttentionMetadata
from toolkit.runner.kv_cache_spec import AttentionSpec, MambaSpec


@dataclass
class SeqChunk:
    """One row of a step: `query_len` new tokens after `num_computed` cached ones.

    block_ids: the row's KV blocks (enough for num_computed + query_len tokens);
    state_slot: its Mamba state slot; is_decode: defaults to query_len == 1 and num_computed > 0.
    """
    num_computed: int
    query_len: int
    block_ids: list[int]
    state_slot: int
    is_decode: bool | None = None

    @property
    def decode(self) -> bool:
        return self.is_decode if self.is_decode is not None else (self.query_len == 1 and self.num_computed > 0)


def allocate_caches(
    model, *, num_blocks: int = 16, block_size: int = 16, num_slots: int = 4,
    device: torch.device | str = "cpu", fill: float = float("nan"),
) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
    """Allocate every cache the model's specs ask for (filled with NaN so stray reads show) and bind."""
    caches: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    for name, spec in model.kv_cache_specs().items():
        if isinstance(spec, AttentionSpec):
            caches[name] = torch.full(
                (num_blocks, 2, block_size, spec.num_kv_heads, spec.head_dim), fill, dtype=spec.dtype, device=device
            )
        elif isinstance(spec, MambaSpec):
            caches[name] = tuple(
                torch.full((num_slots, *shape), fill, dtype=dt, device=device)
                for shape, dt in zip(spec.shapes, spec.dtypes)
            )
        else:  # pragma: no cover
            raise TypeError(spec)
    model.bind_kv_cache(caches)
    return caches


def build_metadata(
    model, rows: list[SeqChunk], *, block_size: int = 16, device: torch.device | str = "cpu"
) -> dict[str, object]:
    """layer_name -> metadata for one step made of `rows` (decode rows must come first)."""
    kinds = [r.decode for r in rows]
    if kinds != sorted(kinds, reverse=True):
        raise ValueError("decode rows must come first")
    dev = torch.device(device)
    i32 = dict(dtype=torch.int32)
    qlens = [r.query_len for r in rows]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    seq_lens = [r.num_computed + r.query_len for r in rows]
    max_blocks = max(max(math.ceil(s / block_size) for s in seq_lens), 1)
    table = torch.zeros(len(rows), max_blocks, **i32)
    slots: list[int] = []
    for i, r in enumerate(rows):
        need = math.ceil(seq_lens[i] / block_size)
        if len(r.block_ids) < need:
            raise ValueError(f"row {i} needs {need} blocks, got {len(r.block_ids)}")
        table[i, :need] = torch.tensor(r.block_ids[:need], **i32)
        for p in range(r.num_computed, seq_lens[i]):
            slots.append(r.block_ids[p // block_size] * block_size + p % block_size)
    qsl_cpu = torch.tensor(qsl, **i32)
    paged = PagedAttentionMetadata(
        num_actual_tokens=qsl[-1], num_reqs=len(rows), max_query_len=max(qlens), max_seq_len=max(seq_lens),
        block_size=block_size, query_start_loc=qsl_cpu.to(dev), query_start_loc_cpu=qsl_cpu,
        seq_lens=torch.tensor(seq_lens, **i32).to(dev), seq_lens_cpu=torch.tensor(seq_lens, **i32),
        block_table=table.to(dev), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
    )

    dec = [r for r in rows if r.decode]
    pre = [r for r in rows if not r.decode]
    mamba_md: dict[int, Mamba2AttentionMetadata] = {}

    def mamba_for(chunk_size: int) -> Mamba2AttentionMetadata:
        if chunk_size in mamba_md:
            return mamba_md[chunk_size]
        p_fields: dict[str, torch.Tensor | None] = dict(
            query_start_loc_p=None, has_initial_states_p=None, state_indices_tensor_p=None,
            seq_idx_p=None, cu_chunk_seqlen_p=None, last_chunk_indices_p=None,
        )
        if pre:
            pq = [r.query_len for r in pre]
            pqsl = [0]
            for q in pq:
                pqsl.append(pqsl[-1] + q)
            cu, sidx, last = mamba2_chunk_layout(pq, [r.num_computed for r in pre], chunk_size)
            p_fields = dict(
                query_start_loc_p=torch.tensor(pqsl, **i32).to(dev),
                has_initial_states_p=torch.tensor([r.num_computed > 0 for r in pre], device=dev),
                state_indices_tensor_p=torch.tensor([r.state_slot for r in pre], **i32).to(dev),
                seq_idx_p=torch.tensor(sidx, **i32).to(dev),
                cu_chunk_seqlen_p=torch.tensor(cu, **i32).to(dev),
                last_chunk_indices_p=torch.tensor(last, **i32).to(dev),
            )
        md = Mamba2AttentionMetadata(
            num_prefills=len(pre), num_prefill_tokens=sum(r.query_len for r in pre),
            num_decodes=len(dec), num_decode_tokens=len(dec), num_reqs=len(rows), chunk_size=chunk_size,
            prep_initial_states=any(r.num_computed > 0 for r in pre),
            state_indices_tensor_d=torch.tensor([r.state_slot for r in dec], **i32).to(dev) if dec else None,
            **p_fields,
        )
        mamba_md[chunk_size] = md
        return md

    out: dict[str, object] = {}
    for name, spec in model.kv_cache_specs().items():
        if isinstance(spec, MambaSpec) and spec.mamba_type == "short_conv":
            out[name] = short_conv_metadata(rows, device=dev)
            continue
        if isinstance(spec, MambaSpec) and spec.mamba_type == "mamba1":
            out[name] = mamba1_metadata(rows, device=dev)
            continue
        out[name] = paged if isinstance(spec, AttentionSpec) else mamba_for(int(spec.chunk_size))
    return out


def short_conv_metadata(rows: list[SeqChunk], *, device: torch.device | str = "cpu") -> ShortConvAttentionMetadata:
    """ShortConv (LFM2) metadata of one step: the base Mamba fields only (decode rows first)."""
    dev = torch.device(device)
    i32 = dict(dtype=torch.int32, device=dev)
    dec = [r for r in rows if r.decode]
    pre = [r for r in rows if not r.decode]
    pqsl = [0]
    for r in pre:
        pqsl.append(pqsl[-1] + r.query_len)
    return ShortConvAttentionMetadata(
        num_prefills=len(pre), num_prefill_tokens=pqsl[-1], num_decodes=len(dec), num_decode_tokens=len(dec),
        num_reqs=len(rows),
        query_start_loc_p=torch.tensor(pqsl, **i32) if pre else None,
        has_initial_states_p=torch.tensor([r.num_computed > 0 for r in pre], device=dev) if pre else None,
        state_indices_tensor_p=torch.tensor([r.state_slot for r in pre], **i32) if pre else None,
        state_indices_tensor_d=torch.tensor([r.state_slot for r in dec], **i32) if dec else None,
    )


def mamba1_metadata(rows: list[SeqChunk], *, device: torch.device | str = "cpu") -> Mamba1AttentionMetadata:
    """Mamba1 metadata of one step: the base Mamba fields only (decode rows first)."""
    dev = torch.device(device)
    i32 = dict(dtype=torch.int32, device=dev)
    dec = [r for r in rows if r.decode]
    pre = [r for r in rows if not r.decode]
    pqsl = [0]
    for r in pre:
        pqsl.append(pqsl[-1] + r.query_len)
    return Mamba1AttentionMetadata(
        num_prefills=len(pre), num_prefill_tokens=pqsl[-1], num_decodes=len(dec), num_decode_tokens=len(dec),
        num_reqs=len(rows),
        query_start_loc_p=torch.tensor(pqsl, **i32) if pre else None,
        has_initial_states_p=torch.tensor([r.num_computed > 0 for r in pre], device=dev) if pre else None,
        state_indices_tensor_p=torch.tensor([r.state_slot for r in pre], **i32) if pre else None,
        state_indices_tensor_d=torch.tensor([r.state_slot for r in dec], **i32) if dec else None,
    )


def one_seq_metadata(
    model, num_computed: int, query_len: int, block_ids: list[int], state_slot: int, *,
    block_size: int = 16, device: torch.device | str = "cpu", is_decode: bool | None = None,
) -> dict[str, object]:
    """Metadata of a step holding a single sequence chunk (see `build_metadata`)."""
    return build_metadata(
        model, [SeqChunk(num_computed, query_len, block_ids, state_slot, is_decode)],
        block_size=block_size, device=device,
    )


def mamba2_chunk_layout(query_lens, num_computed, chunk_size):
    """`compute_chunk_metadata` as python lists: (cu_chunk_seqlens, seq_idx, last_chunk_indices)."""
    arrays = compute_chunk_metadata(np.asarray(query_lens), np.asarray(num_computed), chunk_size)
    return tuple(a.tolist() for a in arrays)
