"""The Mamba-family builders' state index in both cache modes (toolkit/attention/mamba_base.py), on
hand-made metadata: `mamba_block_size=None` keeps column 0 of the block table ("none"); an int bs picks
the column of each row's last scheduled token, max((seq_len - 1) // bs, 0) ("align", vLLM
`mamba_get_block_table_tensor`), for decode and prefill rows alike, on the device, with no host read,
into a buffer whose address a CUDA graph of the same batch size can keep reading. The comparison with
vLLM's own builders is tests/test_vllm_builder_goldens.py (the align golden file)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_host_syncs import HostSyncRecorder

from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.gdn import GDNMetadataBuilder
from toolkit.attention.mamba1 import Mamba1MetadataBuilder
from toolkit.attention.mamba2 import Mamba2MetadataBuilder
from toolkit.attention.mamba_base import align_state_indices
from toolkit.attention.short_conv import ShortConvMetadataBuilder

FACTORIES = {
    "mamba1": lambda **kw: Mamba1MetadataBuilder(**kw),
    "mamba2": lambda **kw: Mamba2MetadataBuilder(16, **kw),
    "short_conv": lambda **kw: ShortConvMetadataBuilder(**kw),
    "gdn": lambda **kw: GDNMetadataBuilder(**kw),
}


def table(rows: int, width: int) -> torch.Tensor:
    """int32 [rows, width]: entry (r, j) = 100 * (r + 1) + j (every column of every row distinct)."""
    return (100 * torch.arange(1, rows + 1).view(-1, 1) + torch.arange(width).view(1, -1)).to(torch.int32)


def common(query_lens, computed, prefilling, block_table, device="cpu") -> CommonAttentionMetadata:
    q = np.array(query_lens, dtype=np.int32)
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(q)]).astype(np.int32))
    seq = torch.tensor(np.array(computed) + q, dtype=torch.int32)
    t = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device), num_reqs=len(q),
        num_actual_tokens=t, max_query_len=int(q.max()), max_seq_len=int(seq.max()),
        block_table_tensor=block_table.to(device),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=seq, is_prefilling=torch.tensor(prefilling))


# bs = 4; seq_lens 4, 5, 8, 1 -> columns 0, 1, 1, 0. Rows: two decodes (3 + 1, 4 + 1 tokens), a chunk that
# continues a state (5 + 3) and a one-token prompt (0 + 1): both kinds of row take the aligned column.
BATCH = dict(query_lens=[1, 1, 3, 1], computed=[3, 4, 5, 0], prefilling=[False, False, True, True])


@pytest.mark.parametrize("family", FACTORIES)
def test_align_mode_takes_the_column_of_the_last_scheduled_token(family):
    bt = table(4, 3)
    md = FACTORIES[family](mamba_block_size=4).build(common(**BATCH, block_table=bt), producer="test")
    assert (md.num_decodes, md.num_prefills) == (2, 2)
    assert md.state_indices_tensor_d.tolist() == [bt[0, 0], bt[1, 1]] == [100, 201]
    assert md.state_indices_tensor_p.tolist() == [bt[2, 1], bt[3, 0]] == [301, 400]
    assert md.state_indices_tensor_d.dtype == md.state_indices_tensor_p.dtype == torch.int32


@pytest.mark.parametrize("family", FACTORIES)
def test_none_mode_keeps_column_0(family):
    bt = table(4, 3)
    for builder in (FACTORIES[family](), FACTORIES[family](mamba_block_size=None)):
        assert builder.mamba_block_size is None
        md = builder.build(common(**BATCH, block_table=bt), producer="test")
        assert md.state_indices_tensor_d.tolist() == [100, 200]
        assert md.state_indices_tensor_p.tolist() == [300, 400]
        # a view of the block table, as before the align mode existed
        assert md.state_indices_tensor_d.data_ptr() == bt.data_ptr()


def test_columns_on_block_edges_and_seq_len_0():
    bt = table(8, 4)
    seq_lens = torch.tensor([0, 1, 4, 5, 8, 9, 12, 16], dtype=torch.int32)
    # (seq_len - 1) // 4, and seq_len 0 -> column 0 (vLLM clamps: a zero-length row of a CUDA graph)
    assert align_state_indices(bt, seq_lens, 4).tolist() == [100, 200, 300, 401, 501, 602, 702, 803]
    assert align_state_indices(bt[:3], seq_lens[:3], 2).tolist() == [100, 200, 301]
    assert align_state_indices(bt, seq_lens, 1024).tolist() == [100 * (r + 1) for r in range(8)]


def test_a_column_past_the_table_is_an_error():
    with pytest.raises(RuntimeError):      # vLLM's CPU path (torch.gather) raises too; no silent clamp
        align_state_indices(table(1, 2), torch.tensor([9], dtype=torch.int32), 4)


@pytest.mark.parametrize("bad", [0, -16, True, 2.5, "16"])
def test_mamba_block_size_is_validated(bad):
    for family in FACTORIES.values():
        with pytest.raises(ValueError, match="mamba_block_size must be None .* or an int >= 1"):
            family(mamba_block_size=bad)


def test_mamba_block_size_is_keyword_only():
    assert Mamba1MetadataBuilder(mamba_block_size=np.int64(16)).mamba_block_size == 16
    with pytest.raises(TypeError):
        Mamba1MetadataBuilder(16)
    with pytest.raises(TypeError):
        ShortConvMetadataBuilder(16)
    with pytest.raises(TypeError):
        Mamba2MetadataBuilder(16, 16)
    with pytest.raises(TypeError):
        GDNMetadataBuilder(64, 16)


def test_align_indices_of_a_batch_size_stay_at_one_address():
    """Metadata is built outside a CUDA graph, which keeps reading the capture's tensors: every B-row
    build writes its state indices to the same B-row buffer, so the capture's tensor holds the values
    of the step being replayed. (A fresh tensor per build would leave the graph on stale slots.)"""
    builder = Mamba1MetadataBuilder(mamba_block_size=4)
    decode = dict(query_lens=[1, 1], computed=[3, 4], prefilling=[False, False])
    first = builder.build(common(**decode, block_table=table(2, 3)), producer="test").state_indices_tensor_d
    assert first.tolist() == [100, 201]
    again = builder.build(common(**decode, block_table=table(2, 3) + 1000), producer="test").state_indices_tensor_d
    assert again.data_ptr() == first.data_ptr()
    assert first.tolist() == again.tolist() == [1100, 1201]
    other = builder.build(common(**BATCH, block_table=table(4, 3)), producer="test").state_indices_tensor_d
    assert other.data_ptr() != first.data_ptr() and first.tolist() == [1100, 1201]


@pytest.mark.parametrize("family", FACTORIES)
def test_align_mode_reads_nothing_on_the_host(family, monkeypatch):
    """No op of the build that would synchronise with a GPU, beyond what "none" mode's build does."""
    events = {}
    for bs in (None, 4):
        recorder = HostSyncRecorder()
        recorder.count_host_reads(monkeypatch)
        with recorder:
            FACTORIES[family](mamba_block_size=bs).build(common(**BATCH, block_table=table(4, 3)), producer="test")
        events[bs] = recorder.events
        monkeypatch.undo()
    assert events[4] == events[None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: a CUDA graph")
@pytest.mark.parametrize("family", FACTORIES)
def test_a_cuda_graph_replays_with_the_new_steps_align_indices(family):
    """On a GPU: no host sync in an align-mode build (sync debug mode "error"), and a graph that read a
    decode batch's state indices at capture reads the indices of a later build of the same size."""
    device = torch.device("cuda")
    builder = FACTORIES[family](mamba_block_size=4)
    decode = dict(query_lens=[1, 1, 1], computed=[3, 4, 9], prefilling=[False, False, False])

    def build(bt):
        cm = common(**decode, block_table=bt, device=device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return builder.build(cm, producer="test")
        finally:
            torch.cuda.set_sync_debug_mode("default")

    md = build(table(3, 4))
    out = torch.zeros(3, dtype=torch.int32, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(md.state_indices_tensor_d + 0)
    graph.replay()
    assert out.tolist() == [100, 201, 302]
    build(table(3, 4) + 1000)
    graph.replay()
    assert out.tolist() == [1100, 1201, 1302]
