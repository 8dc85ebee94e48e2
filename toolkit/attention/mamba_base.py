"""What every Mamba-family builder shares (vLLM `BaseMambaAttentionMetadataBuilder`).

Rows are decodes first. A row runs as a decode when it has one token on top of existing state:
query_len == 1 and (not is_prefilling or seq_len > 1) -- so a one-token prefill chunk that
continues a saved state is a decode too (vLLM #42430). That rule needs `is_prefilling` and
`seq_lens_cpu_upper_bound`, which is why both are required on every build.
State index of a row (`mamba_block_size`, keyword-only on every Mamba-family builder; vLLM's
`mamba_get_block_table_tensor`, vllm/v1/attention/backends/utils.py):
  None  "none" mode (prefix caching off): column 0 of its block table, one state page per request;
        the index is a view of the block table.
  bs    "align" mode (prefix caching on, bs = mamba_block_size = the cache block size): the block
        table row is position-indexed (column i holds the state of tokens [i*bs, (i+1)*bs)), and a
        row's state is the page in the column of its last scheduled token,
        block_table[row, max((seq_len - 1) // bs, 0)] -- a seq_len of 0 reads column 0, as vLLM
        clamps it. Decode and prefill rows alike. Computed on the device from `seq_lens` and
        `block_table_tensor` (no host read, no host-to-device copy), into a buffer the builder
        keeps per batch size: a CUDA graph captured for a decode batch of B rows reads the same
        address that every later B-row step rewrites (metadata is built outside the graph).
Internal checkpoints (`prefill_checkpoints=True`, cache mode "all", align only): every block boundary
b strictly inside a prefill row's chunk (computed < b < seq_len) saves the state after token b - 1
into the row's page for column b / bs - 1, if the scheduler gave it one (a 0 there, no free page, is
handed on as PAD_SLOT_ID: nothing written). The token indices come from the host lengths, the pages
from a gather on the block table's device.
Speculative decoding (`num_speculative_tokens` k > 0; vLLM's spec-decode path): every decode row --
its last sampled token plus d <= k drafts, d possibly 0 -- is a verify row. Its state pages
(`state_indices_tensor_d` [D, 1 + k]) are the 1 + k columns of its block-table row ("none"), or
("align") its running column -- that of its last draft -- and the k spec columns after it:
the step starts from column `num_accepted_tokens - 1` (where the last step's last accepted
position left its state) and writes the state after its position j into column j. Each recurrent
update op takes every row's positions in one launch from these three fields and
`query_start_loc_d` (vLLM's arguments; kernels/state_slots_ref.step_rows_at_columns).
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from numbers import Integral

import numpy as np
import torch

from toolkit.attention.builder import AttentionMetadataBuilder
from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.contracts import FieldSpec
from toolkit.errors import MetadataContractError, NotSupportedYetError
from toolkit.host import to_device
from toolkit.kv_cache_spec import PAD_SLOT_ID
from toolkit.tensor_views import HeadViews

MAMBA_REQUIRED_FIELDS = (
    FieldSpec("query_start_loc", torch.int32, shape="[B+1]"),
    FieldSpec("query_start_loc_cpu", torch.int32, on_cpu=True, shape="[B+1]"),
    FieldSpec("seq_lens", torch.int32, shape="[B]"),
    FieldSpec("block_table_tensor", torch.int32, shape="[B, *]"),
    FieldSpec("seq_lens_cpu_upper_bound", torch.int32, on_cpu=True, shape="[B]"),
    FieldSpec("is_prefilling", torch.bool, on_cpu=True, shape="[B]"),
)
# speculative decoding: what MRV2's MambaHybridModelState hands the Mamba builders on top
SPEC_DECODE_FIELDS = (
    FieldSpec("num_accepted_tokens", torch.int32, shape="[B]"),
    FieldSpec("num_decode_draft_tokens_cpu", torch.int32, on_cpu=True, shape="[B]"),
)


@dataclass
class BaseMambaAttentionMetadata:
    """Fields every Mamba-family layer reads (vLLM `BaseMambaAttentionMetadata`).

    Tokens are [decode tokens | prefill tokens]; P = num_prefills, D = num_decodes.
    """
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_reqs: int
    # prefill-only; None when num_prefills == 0
    query_start_loc_p: torch.Tensor | None       # device int32 [P+1], rebased to start at 0
    has_initial_states_p: torch.Tensor | None    # device bool [P]: num_computed_tokens > 0
    state_indices_tensor_p: torch.Tensor | None  # device int32 [P]: state page per prefill row
    # decode-only; None when num_decodes == 0
    state_indices_tensor_d: torch.Tensor | None  # device int32 [D]: state page per decode row
    # internal checkpoints (cache mode "all"); None otherwise or when the prefill rows cross no
    # block boundary inside their chunk. M = checkpoints in the step.
    checkpoint_token_index_p: torch.Tensor | None  # device int64 [M]: index among the prefill tokens of
                                                    # the token after which a state is saved
    checkpoint_slots_p: torch.Tensor | None        # device int32 [M]: its page (PAD_SLOT_ID: none free)
    # speculative decoding only (None otherwise, or without decodes). state_indices_tensor_d is then
    # [D, 1 + k], a row's 1 + k state columns. Keyword-only with None defaults: metadata built without
    # speculation need not name them
    _: KW_ONLY
    query_start_loc_d: torch.Tensor | None = None      # device int32 [D+1]: the verify rows' tokens
    num_accepted_tokens: torch.Tensor | None = None    # device int32 [D]: tokens each row kept at its last
                                                       # step (>= 1): its state is in column num_accepted - 1


def verify_start_slots(md: BaseMambaAttentionMetadata) -> torch.Tensor | None:
    """Device [D]: the slot each verify row starts from (column num_accepted_tokens - 1 of its state
    columns), or None when the metadata has no verify rows. What inspection checks and shows."""
    if md.num_accepted_tokens is None or md.state_indices_tensor_d is None:
        return None
    first = (md.num_accepted_tokens.to(torch.int64) - 1).clamp(min=0)
    return md.state_indices_tensor_d.gather(1, first[:, None])[:, 0]


@dataclass
class MambaSplit:
    """Host-side facts of one batch, shared by the Mamba builders."""
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    query_lens: np.ndarray            # int32 [B]
    num_computed_p: np.ndarray        # int32 [P]: tokens already in each prefill row's state


def check_mamba_block_size(mamba_block_size) -> int | None:
    """None ("none" mode) or a positive int ("align" mode: tokens per Mamba block)."""
    if mamba_block_size is None:
        return None
    if isinstance(mamba_block_size, bool) or not isinstance(mamba_block_size, Integral) or mamba_block_size < 1:
        raise ValueError(f"mamba_block_size must be None (cache mode \"none\") or an int >= 1 (tokens per "
                         f"Mamba block, cache mode \"align\"), got {mamba_block_size!r}")
    return int(mamba_block_size)


def align_state_columns(seq_lens: torch.Tensor, mamba_block_size: int) -> torch.Tensor:
    """int64 [B, 1] on seq_lens' device: the block-table column of each row's last scheduled token,
    max((seq_len - 1) // mamba_block_size, 0) (vLLM `mamba_get_block_table_tensor`, "align")."""
    return ((seq_lens - 1) // mamba_block_size).clamp_(min=0).to(torch.int64).unsqueeze(1)


def align_state_indices(block_table: torch.Tensor, seq_lens: torch.Tensor, mamba_block_size: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """[B], block_table's dtype: block_table[row, max((seq_lens[row] - 1) // mamba_block_size, 0)],
    a gather on the tables' device (written into `out` [B] when given). A column past the table's
    width is an error (vLLM's CPU path raises on it too)."""
    cols = align_state_columns(seq_lens, mamba_block_size)
    if out is None:
        return torch.gather(block_table, 1, cols).squeeze(1)
    torch.gather(block_table, 1, cols, out=out.view(-1, 1))
    return out


class BaseMambaMetadataBuilder(AttentionMetadataBuilder):
    required_fields = MAMBA_REQUIRED_FIELDS

    def __init__(self, *, mamba_block_size: int | None = None, prefill_checkpoints: bool = False,
                 num_speculative_tokens: int = 0):
        self.mamba_block_size = check_mamba_block_size(mamba_block_size)
        if prefill_checkpoints and self.mamba_block_size is None:
            raise ValueError("prefill_checkpoints (cache mode \"all\") needs mamba_block_size (align mode)")
        if num_speculative_tokens and prefill_checkpoints:
            raise NotSupportedYetError("speculative decoding with prefill_checkpoints (cache mode \"all\") "
                                       "is not built: use cache mode \"align\"")
        self.prefill_checkpoints = prefill_checkpoints
        self.num_speculative_tokens = num_speculative_tokens
        if num_speculative_tokens:
            self.required_fields = self.required_fields + SPEC_DECODE_FIELDS
        # align mode (and speculative decoding's column 0): (device, B) -> the persistent int32 [B] the
        # state indices of a B-row batch are gathered into (one per batch size seen: at most
        # max_num_reqs of them, B ints each)
        self._align_buffers: dict[tuple[torch.device, int], torch.Tensor] = {}
        # speculative decoding with align: (device, D) -> the [D, 1 + k] state columns gathered from the
        # position-indexed rows
        self._spec_columns: dict[tuple[torch.device, int], torch.Tensor] = {}
        # the views of the block tables (the runner's, made once: runner/block_table.py) and of the
        # buffers above that each step hands out, made once too (a recording keeps a step's metadata)
        self.views = HeadViews()

    def persistent_buffers(self) -> list[torch.Tensor]:
        return [*self._align_buffers.values(), *self._spec_columns.values()]

    def state_indices(self, common: CommonAttentionMetadata) -> torch.Tensor:
        """Device int32 [B]: the state page of every row (see the module docstring for the modes)."""
        table = common.block_table_tensor
        if self.mamba_block_size is None and not self.num_speculative_tokens:
            return self.views.column(table, 0)
        key = (table.device, table.shape[0])
        out = self._align_buffers.get(key)
        if out is None:        # never replaced: a graph captured on it keeps reading it
            out = self._align_buffers[key] = torch.empty(table.shape[0], dtype=table.dtype, device=table.device)
        if self.mamba_block_size is None:        # speculative decoding: column 0 of 1 + k, made contiguous
            return out.copy_(table[:, 0])
        return align_state_indices(table, common.seq_lens, self.mamba_block_size, out=out)

    def split(self, common: CommonAttentionMetadata, producer: str = "") -> MambaSplit:
        qsl = common.query_start_loc_cpu.numpy()
        query_lens = np.diff(qsl).astype(np.int32)
        seq_lens = common.seq_lens_cpu_upper_bound.numpy()
        prefilling = common.is_prefilling.numpy()
        drafts = np.maximum(common.num_decode_draft_tokens_cpu.numpy(), 0) if self.num_speculative_tokens else 0
        is_decode = (query_lens - drafts == 1) & (~prefilling | (seq_lens > 1))
        num_decodes = int(is_decode.sum())
        if not is_decode[:num_decodes].all():
            row = int(np.argmin(is_decode[:num_decodes]))
            raise MetadataContractError(
                "query_start_loc_cpu", type(self).__name__, producer or "the runner",
                f"breaks the decodes-first batch order: row {row} is a prefill but a decode row "
                f"follows it (query lens {query_lens.tolist()})")
        num_decode_tokens = int(qsl[num_decodes])
        num_computed_p = (seq_lens[num_decodes:] - query_lens[num_decodes:]).astype(np.int32)
        return MambaSplit(num_decodes, len(query_lens) - num_decodes, num_decode_tokens,
                          int(qsl[-1]) - num_decode_tokens, query_lens, num_computed_p)

    def common_fields(self, common: CommonAttentionMetadata, s: MambaSplit) -> dict:
        device = common.query_start_loc.device
        state_indices = self.state_indices(common)
        fields = dict(num_prefills=s.num_prefills, num_prefill_tokens=s.num_prefill_tokens,
                      num_decodes=s.num_decodes, num_decode_tokens=s.num_decode_tokens,
                      num_reqs=common.num_reqs,
                      state_indices_tensor_d=self.views.head(state_indices, s.num_decodes) if s.num_decodes else None,
                      state_indices_tensor_p=None, query_start_loc_p=None, has_initial_states_p=None,
                      checkpoint_token_index_p=None, checkpoint_slots_p=None, query_start_loc_d=None,
                      num_accepted_tokens=None)
        if self.num_speculative_tokens and s.num_decodes:
            fields.update(self.spec_fields(common, s))
        if s.num_prefills:
            fields.update(
                state_indices_tensor_p=state_indices[s.num_decodes:],
                query_start_loc_p=common.query_start_loc[s.num_decodes:] - s.num_decode_tokens,
                has_initial_states_p=to_device(s.num_computed_p > 0, device))
            if self.prefill_checkpoints:
                fields.update(self.checkpoint_fields(common, s))
        return fields

    def spec_fields(self, common: CommonAttentionMetadata, s: MambaSplit) -> dict:
        """The verify rows' state columns, token ranges and accepted counts (module docstring)."""
        d = s.num_decodes
        return dict(state_indices_tensor_d=self.spec_columns(common, d),
                    query_start_loc_d=common.query_start_loc[:d + 1],
                    num_accepted_tokens=common.num_accepted_tokens[:d])

    def spec_columns(self, common: CommonAttentionMetadata, d: int) -> torch.Tensor:
        """Device [D, 1 + k], the block table's dtype: each decode row's state columns. "none": the
        first 1 + k columns of its row (a view). "align": the running column -- that of the row's
        last scheduled token, its last draft -- and the k spec columns after it,
        block_table[row, (seq_len - 1) // bs + j] (vLLM `mamba_get_block_table_tensor`), gathered
        into a buffer kept per D."""
        k1 = 1 + self.num_speculative_tokens
        table = common.block_table_tensor
        if self.mamba_block_size is None:
            return self.views.corner(table, d, k1)
        key = (table.device, d)
        out = self._spec_columns.get(key)
        if out is None:        # never replaced: a graph captured on it keeps reading it
            out = self._spec_columns[key] = torch.empty((d, k1), dtype=table.dtype, device=table.device)
        cols = align_state_columns(common.seq_lens[:d], self.mamba_block_size) + \
            torch.arange(k1, device=table.device)
        return torch.gather(table[:d], 1, cols, out=out)

    def checkpoint_fields(self, common: CommonAttentionMetadata, s: MambaSplit) -> dict:
        """The internal checkpoints of the prefill rows (see the module docstring), or Nones."""
        bs = self.mamba_block_size
        lens = s.query_lens[s.num_decodes:].astype(np.int64)
        start = s.num_computed_p.astype(np.int64)
        first = (start // bs + 1) * bs                       # the first boundary after `start`
        counts = np.maximum(-(-(start + lens) // bs) - first // bs, 0)   # boundaries b < start + len
        if not counts.sum():
            return {}
        rows = np.repeat(np.arange(len(lens)), counts)
        k = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        boundary = first[rows] + k * bs
        token_start = np.concatenate([[0], np.cumsum(lens)[:-1]])
        token_index = token_start[rows] + boundary - start[rows] - 1
        device = common.block_table_tensor.device
        table_rows = to_device((rows + s.num_decodes).astype(np.int64), device)
        cols = to_device(boundary // bs - 1, device)
        pages = common.block_table_tensor[table_rows, cols]
        return dict(checkpoint_token_index_p=to_device(token_index.astype(np.int64), device),
                    checkpoint_slots_p=torch.where(pages == 0, PAD_SLOT_ID, pages).to(torch.int32))
