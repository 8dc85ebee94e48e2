"""Metadata builders (Mamba2, Gated DeltaNet, paged attention) and their contracts, fed hand-made
CommonAttentionMetadata: the decode/prefill split, state indices, chunk layouts, and the errors
naming a missing or malformed field, the builder and the producer."""
import numpy as np
import pytest
import torch

from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.gdn import GDN_CHUNK_SIZE, GDNAttentionMetadata, GDNMetadataBuilder
from toolkit.attention.mamba2 import Mamba2MetadataBuilder, compute_chunk_metadata
from toolkit.attention.paged_attn import PagedAttentionMetadataBuilder
from toolkit.errors import MetadataContractError


def common(query_lens, computed, prefilling, slots):
    q = np.array(query_lens, dtype=np.int32)
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(q)]).astype(np.int32))
    seq = torch.tensor(np.array(computed) + q, dtype=torch.int32)
    t = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(), num_reqs=len(q),
        num_actual_tokens=t, max_query_len=int(q.max()), max_seq_len=int(seq.max()),
        block_table_tensor=torch.tensor(slots, dtype=torch.int32).view(-1, 1),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64), seq_lens_cpu_upper_bound=seq,
        is_prefilling=torch.tensor(prefilling))


def test_chunks_top_up_to_boundary_and_never_cross_sequences():
    cu, seq_idx, last = compute_chunk_metadata(np.array([10, 40]), np.array([0, 20]), 16)
    # row 0: 10 tokens from 0 -> one chunk; row 1 starts at 20: tops up 12 to 32, then 16, then 12
    assert cu.tolist() == [0, 10, 22, 38, 50]
    assert seq_idx.tolist() == [0, 1, 1, 1]
    assert last.tolist() == [0, 3]


def test_mamba2_split_decodes_first_and_state_indices():
    md = Mamba2MetadataBuilder(16).build(
        common([1, 1, 1, 5, 20], computed=[7, 3, 9, 0, 16], prefilling=[False, False, True, True, True],
               slots=[4, 2, 6, 1, 3]), producer="test")
    # the third row is a 1-token prefill chunk on top of saved state: it runs as a decode
    assert (md.num_decodes, md.num_prefills) == (3, 2)
    assert (md.num_decode_tokens, md.num_prefill_tokens) == (3, 25)
    assert md.state_indices_tensor_d.tolist() == [4, 2, 6]
    assert md.state_indices_tensor_p.tolist() == [1, 3]
    assert md.has_initial_states_p.tolist() == [False, True]
    assert md.query_start_loc_p.tolist() == [0, 5, 25]
    assert md.prep_initial_states
    assert md.cu_chunk_seqlen_p.tolist() == [0, 5, 21, 25]
    assert md.last_chunk_indices_p.tolist() == [0, 2]


def test_single_token_prompt_is_a_prefill_without_initial_state():
    md = Mamba2MetadataBuilder(16).build(common([1], [0], [True], [5]), producer="test")
    assert (md.num_decodes, md.num_prefills) == (0, 1)
    assert md.has_initial_states_p.tolist() == [False]
    assert md.state_indices_tensor_d is None


def test_gdn_builder_splits_and_chunks_each_row_from_its_start():
    md = GDNMetadataBuilder(16).build(
        common([1, 1, 5, 40], computed=[7, 9, 0, 20], prefilling=[False, True, True, True], slots=[4, 6, 1, 3]),
        producer="test")
    assert isinstance(md, GDNAttentionMetadata) and md.chunk_size == 16
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == (2, 2, 2, 45)
    assert md.state_indices_tensor_d.tolist() == [4, 6] and md.state_indices_tensor_p.tolist() == [1, 3]
    assert md.has_initial_states_p.tolist() == [False, True]
    assert md.query_start_loc_p.tolist() == [0, 5, 45]
    # row 1 continues at token 20: FLA chunks it from its first scheduled token (no top-up to 32)
    assert md.cu_chunk_seqlen_p.tolist() == [0, 5, 21, 37, 45]
    assert md.seq_idx_p.tolist() == [0, 1, 1, 1] and md.last_chunk_indices_p.tolist() == [0, 3]
    decode_only = GDNMetadataBuilder().build(common([1], [3], [False], [2]), producer="test")
    assert decode_only.num_prefills == 0 and decode_only.cu_chunk_seqlen_p is None
    assert GDNMetadataBuilder().chunk_size == GDN_CHUNK_SIZE == 64


@pytest.mark.parametrize("builder, field", [
    (Mamba2MetadataBuilder(16), "seq_lens_cpu_upper_bound"),
    (PagedAttentionMetadataBuilder(16), "seq_lens_cpu_upper_bound"),
    # the GDN builder, with every field it requires (the base Mamba set)
    *[(GDNMetadataBuilder(), spec.name) for spec in GDNMetadataBuilder.required_fields]],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__)
def test_missing_upper_bound_names_field_builder_and_producer(builder, field):
    c = common([3], [0], [True], [1]).replace(**{field: None})
    with pytest.raises(MetadataContractError) as err:
        builder.build(c, producer="SomeState.prepare_attn")
    msg = str(err.value)
    assert field in msg and type(builder).__name__ in msg
    assert "SomeState.prepare_attn" in msg and err.value.field == field


@pytest.mark.parametrize("bad, problem", [
    (dict(is_prefilling=torch.tensor([1])), "dtype"),
    (dict(seq_lens_cpu_upper_bound=torch.tensor([3, 4], dtype=torch.int32)), "shape"),
    (dict(query_start_loc_cpu=torch.tensor([0, 3], dtype=torch.int64)), "dtype"),
    (dict(block_table_tensor=torch.tensor([1], dtype=torch.int32)), "shape"),
])
def test_malformed_fields_are_named(bad, problem):
    c = common([3], [0], [True], [1]).replace(**bad)
    with pytest.raises(MetadataContractError, match=f"'{next(iter(bad))}'.*{problem}"):
        Mamba2MetadataBuilder(16).build(c, producer="test")


def test_decode_after_prefill_breaks_batch_order():
    c = common([4, 1], [0, 5], [True, False], [1, 2])
    with pytest.raises(MetadataContractError, match="decodes-first"):
        Mamba2MetadataBuilder(16).build(c, producer="test")


def test_chunk_size_must_be_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        Mamba2MetadataBuilder(12)
