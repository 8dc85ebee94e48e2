"""A step's views of the runner's persistent buffers are the same objects from step to step
(toolkit/tensor_views.py HeadViews): a recording keeps each step's batch and metadata by reference for the
trace's life, and a view made afresh each step would be one more object held per step (a cost the
benchmark measures: RESULTS.md, stop 65)."""
from __future__ import annotations

import torch

from toolkit import LLM, SamplingParams
from toolkit.tensor_views import HeadViews


def test_head_views_are_the_slices_they_stand_for_made_once():
    t = torch.arange(24, dtype=torch.int64).reshape(3, 8)
    views = HeadViews()
    head, again, other = views.head(t, 2), views.head(t, 2), views.head(t, 1)
    assert head is again and other is not head
    for got, want in ((head, t[:2]), (other, t[:1])):
        assert (got.data_ptr(), got.shape, got.stride()) == (want.data_ptr(), want.shape, want.stride())
    row = views.row_head(t, 1, 5)
    assert row is views.row_head(t, 1, 5) and row is not views.row_head(t, 2, 5)
    assert torch.equal(row, t[1, :5]) and row.data_ptr() == t[1, :5].data_ptr()
    t[1, 0] = -1                                  # a view, not a copy: it reads the buffer as it is now
    assert int(row[0]) == -1 and int(head[1, 0]) == -1


def test_column_and_corner_views_are_made_once():
    t = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    views = HeadViews()
    column, corner = views.column(t, 0), views.corner(t, 2, 3)
    assert column is views.column(t, 0) and column is not views.column(t, 1)
    assert corner is views.corner(t, 2, 3) and corner is not views.corner(t, 3, 2)
    for got, want in ((column, t[:, 0]), (corner, t[:2, :3])):
        assert (got.data_ptr(), got.shape, got.stride()) == (want.data_ptr(), want.shape, want.stride())


def test_head_views_keep_at_most_max_views():
    t = torch.zeros(64)
    views = HeadViews()
    views.MAX_VIEWS = 8
    for n in range(20):                          # more sizes than it keeps: it starts again, bounded
        assert views.head(t, n).shape == (n,)
        assert len(views) <= 8
    assert views.head(t, 19) is views.head(t, 19)


def test_decode_steps_of_one_batch_hand_out_the_same_view_objects():
    llm = LLM("tiny-bamba", inspect="off", max_num_seqs=4)
    try:
        for i in range(3):
            llm.add_request({"prompt_token_ids": [5 + i, 6, 7]},
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        llm.step()                                # the prefill
        states = []
        for _ in range(2):                        # two decode steps of the same 3 rows
            llm.step()
            states.append(llm.model_runner.execute_state)
        first, second = states
        assert first is not second and first.input_batch is not second.input_batch
        for name in ("idx_mapping", "query_start_loc", "seq_lens", "input_ids", "positions", "logits_indices",
                     "seq_lens_cpu_upper_bound"):        # (on the CPU the staged view is the host tensor)
            assert getattr(first.input_batch, name) is getattr(second.input_batch, name), name
        assert len(first.attn_metadata.groups) == 2           # attention and Mamba2
        for g1, g2 in zip(first.attn_metadata.groups, second.attn_metadata.groups):
            for name in ("seq_lens", "block_table_tensor", "slot_mapping", "query_start_loc_cpu",
                         "seq_lens_cpu_upper_bound"):
                assert getattr(g1.common, name) is getattr(g2.common, name), (g1.kind, name)
            assert g1.common.seq_lens is first.input_batch.seq_lens       # no view of a view per group
        assert all(a is b for a, b in zip(first.block_tables, second.block_tables, strict=True))
        (group, mamba1), (_, mamba2) = (next((g.group_id, g.metadata) for g in s.attn_metadata.groups
                                             if g.kind == "mamba") for s in states)
        assert mamba1.state_indices_tensor_d is mamba2.state_indices_tensor_d     # the builder's views too
        assert torch.equal(mamba1.state_indices_tensor_d, first.block_tables[group][:3, 0])
    finally:
        llm.shutdown()
