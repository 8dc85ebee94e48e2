"""The per-step input batch (MRV2 `InputBuffers` + `InputBatch`).

`InputBuffers` are allocated once at their maximum sizes; every step writes into them, and the
`InputBatch` holds views of the written prefix, so a later CUDA-graph capture can reuse the same
storage. B = num_reqs, T = num_tokens. Rows are in batch order: decodes first (see `sort_batch`).

All but `input_ids` are staged (runner/staging.py): the host writes them into the staging's host
twin and the runner's one flush per step sends them; `input_ids` are gathered on the device from
the last sampled tokens for a decode step (`gather_sampled_input_ids`, after the flush), and copied
from the CPU token history otherwise. A decode step with drafts (speculative decoding) stages the
drafts and each token's request row beside the rest (VERIFY_INT64, MRV2's
combine_sampled_and_draft_tokens): its input ids, its sampler's rows and positions, and its kept
counts are then made on the device, and the step copies nothing more than a plain decode step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.host import copy_to, to_device
from toolkit.runner.request_states import RequestStates
from toolkit.runner.staging import Staging, StagingBank
from toolkit.tensor_views import HeadViews

STAGED_INT32 = ("query_start_loc", "seq_lens")                        # staging regions of InputBuffers
STAGED_INT64 = ("idx_mapping", "logits_indices", "positions")
VERIFY_INT64 = ("token_req_rows", "draft_ids")        # written by steps with drafts only


def staging_regions(max_num_reqs: int, max_num_tokens: int, max_num_logits: int | None = None
                    ) -> tuple[dict, dict]:
    """(int32, int64) staging regions of the input buffers, small first. `max_num_logits`: rows of
    logits a step samples from (max_num_reqs, or with speculative decoding up to 1 + k per row)."""
    shapes = {"query_start_loc": (max_num_reqs + 1,), "seq_lens": (max_num_reqs,),
              "idx_mapping": (max_num_reqs,), "logits_indices": (max_num_logits or max_num_reqs,),
              "positions": (max_num_tokens,)}
    return {n: shapes[n] for n in STAGED_INT32}, {n: shapes[n] for n in STAGED_INT64}


def verify_staging_regions(max_num_tokens: int) -> dict:
    """int64 staging regions of steps with drafts: each token's request row, and each token's draft
    id (-1: not a draft; one entry past the last token, so the token after any logits row can be
    read). The runner lays them out last: a step without drafts leaves them out of its copy."""
    return {"token_req_rows": (max_num_tokens,), "draft_ids": (max_num_tokens + 1,)}


class InputBuffers:
    def __init__(self, staging: Staging | StagingBank, max_num_tokens: int, device: torch.device):
        self.staging = staging
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.positions = staging.device("positions")
        self.query_start_loc = staging.device("query_start_loc")
        self.seq_lens = staging.device("seq_lens")
        self.idx_mapping = staging.device("idx_mapping")
        self.logits_indices = staging.device("logits_indices")
        verify = staging.has("draft_ids")           # speculative decoding
        self.token_req_rows = staging.device("token_req_rows") if verify else None
        self.draft_ids = staging.device("draft_ids") if verify else None
        self.views = HeadViews()            # a step's views of these, the same objects from step to step

    def persistent_buffers(self) -> list[torch.Tensor]:
        """What the batch views besides the staging arena: the input ids."""
        return [self.input_ids]


@dataclass
class InputBatch:
    req_ids: list[str]                     # [B] in batch order
    num_reqs: int
    num_tokens: int
    max_query_len: int
    idx_mapping: torch.Tensor              # device int64 [B]: batch row -> request row (req_idx)
    idx_mapping_np: np.ndarray             # int64 [B]
    num_scheduled_tokens: np.ndarray       # int32 [B]
    num_computed_tokens_np: np.ndarray     # int32 [B]: tokens already in the cache/state
    prefill_len_np: np.ndarray             # int32 [B]
    is_prefilling_np: np.ndarray           # bool [B]: still consuming prompt tokens
    query_start_loc: torch.Tensor          # device int32 [B+1]
    query_start_loc_np: np.ndarray         # int32 [B+1]
    seq_lens: torch.Tensor                 # device int32 [B]: computed + scheduled
    seq_lens_cpu_upper_bound: torch.Tensor  # CPU int32 [B]: same values, no device sync needed
    input_ids: torch.Tensor                # device int32 [T]
    positions: torch.Tensor                # device int64 [T]
    logits_indices: torch.Tensor           # device int64 [L]: the tokens sampled from: the last of each
                                           # row, and every token of a verify row (L = B + drafts)
    input_ids_sampled: bool = False        # a decode-only step: input ids are the last sampled tokens
                                           # (and a verify row's drafts), gathered on the device after the flush
    # speculative decoding: drafts each row verifies (0: none; a verify row runs its last sampled
    # token then its d drafts, and samples at all 1 + d of them)
    num_draft_tokens: np.ndarray | None = None   # int32 [B], None when the step has no drafts
    draft_token_ids: dict[str, list[int]] | None = None
    token_req_rows: torch.Tensor | None = None   # device int64 [T]: each token's request row (steps with drafts)
    draft_ids: torch.Tensor | None = None        # device int64 [T+1]: each token's draft id, -1 for none

    @property
    def num_drafts_np(self) -> np.ndarray:
        """int32 [B]: drafts per row (zeros without speculative decoding)."""
        if self.num_draft_tokens is None:
            return np.zeros(self.num_reqs, dtype=np.int32)
        return self.num_draft_tokens

    @property
    def cu_num_logits_np(self) -> np.ndarray:
        """int32 [B+1]: row r's logits are rows cu[r]..cu[r+1]-1 of the step's logits (1 + its drafts)."""
        cu = np.zeros(self.num_reqs + 1, dtype=np.int32)
        np.cumsum(1 + self.num_drafts_np, out=cu[1:])
        return cu

    @property
    def has_prefill(self) -> bool:
        return bool(self.is_prefilling_np.any())

    @property
    def runs_as_decode_np(self) -> np.ndarray:
        """bool [B]: rows that run as decodes (see `runs_as_decode`)."""
        return runs_as_decode(self.num_scheduled_tokens, self.num_computed_tokens_np, self.num_drafts_np)

    @property
    def num_decodes(self) -> int:
        return int(self.runs_as_decode_np.sum())


def runs_as_decode(num_scheduled, num_computed, num_drafts=0):
    """A row runs as a decode when it has one token on top of existing state -- also a one-token
    prefill chunk that continues a saved state (vLLM #42430) -- plus, with speculative decoding,
    the drafts it verifies; the Mamba builders split the batch by the same rule. Works on ints and
    on numpy arrays."""
    return (num_scheduled - num_drafts == 1) & (num_computed > 0)


def sort_batch(req_ids: list[str], num_scheduled: dict[str, int], num_computed: dict[str, int],
               num_drafts: dict[str, int] | None = None) -> list[str]:
    """vLLM's batch order: decode rows first, then the rest by ascending token count. Mamba
    kernels split tokens as [decode | prefill] and trust this."""
    drafts = num_drafts or {}

    def key(rid: str) -> tuple[int, int]:
        decode = runs_as_decode(num_scheduled[rid], num_computed[rid], drafts.get(rid, 0))
        return (0 if decode else 1, num_scheduled[rid])
    return sorted(req_ids, key=key)


def prepare_inputs(buffers: InputBuffers, req_states: RequestStates, req_ids: list[str],
                   num_scheduled: dict[str, int], drafts: dict[str, list[int]] | None = None) -> InputBatch:
    """Write this step's inputs into the persistent buffers (staged: they reach the device at the
    runner's flush); `req_ids` are already sorted. A decode-only step's input ids are left to
    `gather_sampled_input_ids`, after the flush. `drafts`: the drafts of verify rows (speculative
    decoding), which follow the row's last sampled token."""
    b = len(req_ids)
    idx_np = np.array([req_states.req_id_to_index[r] for r in req_ids], dtype=np.int64)
    q = np.array([num_scheduled[r] for r in req_ids], dtype=np.int32)
    drafts = {r: d for r, d in (drafts or {}).items() if d}
    num_drafts = np.array([len(drafts.get(r, ())) for r in req_ids], dtype=np.int32) if drafts else None
    computed = req_states.num_computed_tokens[idx_np].copy()
    prefill_len = req_states.prefill_len[idx_np].copy()
    qsl = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(q, out=qsl[1:])
    t = int(qsl[-1])
    seq_lens = computed + q

    token_rows = np.repeat(np.arange(b), q)
    # row r's tokens sit at computed[r], computed[r] + 1, ...: one array expression, no loop over rows
    positions = computed.astype(np.int64)[token_rows] + np.arange(t, dtype=np.int64) - qsl[token_rows]
    from_sampled = positions >= prefill_len[token_rows]
    is_draft = None
    if num_drafts is not None:               # a verify row: its last sampled token, then its drafts
        is_draft = positions > computed[token_rows]
        is_draft &= np.repeat(num_drafts > 0, q)
        from_sampled &= ~is_draft

    d, stage = buffers, buffers.staging
    stage.put("idx_mapping", idx_np)
    # prompt tokens come from the CPU history; positions past prefill_len are decode inputs and
    # come from the device-side last sampled token (MRV2: combine_sampled_and_draft_tokens)
    if is_draft is None:
        decode_only = bool(b and t == b and from_sampled.all())
    else:
        draft_ids = np.full(t + 1, -1, dtype=np.int64)
        draft_ids[np.nonzero(is_draft)[0]] = [tok for r in req_ids for tok in drafts.get(r, ())]
        stage.put("draft_ids", draft_ids)
        stage.put("token_req_rows", idx_np[token_rows])
        decode_only = bool(b and (from_sampled | is_draft).all())
    if not decode_only:
        ids = req_states.all_token_ids[torch.from_numpy(idx_np[token_rows]),
                                       torch.from_numpy(np.minimum(positions, prefill_len[token_rows] - 1))]
        if is_draft is not None:
            ids[torch.from_numpy(np.nonzero(is_draft)[0])] = torch.from_numpy(draft_ids[:t][is_draft]).to(ids.dtype)
        copy_to(d.input_ids[:t], ids)
        if from_sampled.any():
            tok_idx = to_device(np.nonzero(from_sampled)[0], d.input_ids.device)
            rows = to_device(idx_np[token_rows[from_sampled]], d.input_ids.device)
            d.input_ids[tok_idx] = req_states.last_sampled_tokens[rows].to(torch.int32)
    stage.put("positions", positions.astype(np.int64))
    stage_rows(stage, qsl, seq_lens, num_drafts)

    head = d.views.head
    seq_lens_view = head(d.seq_lens, b)
    return InputBatch(
        req_ids=list(req_ids), num_reqs=b, num_tokens=t, max_query_len=int(q.max()) if b else 0,
        idx_mapping=head(d.idx_mapping, b), idx_mapping_np=idx_np, num_scheduled_tokens=q,
        num_computed_tokens_np=computed, prefill_len_np=prefill_len,
        is_prefilling_np=computed < prefill_len,
        query_start_loc=head(d.query_start_loc, b + 1), query_start_loc_np=qsl,
        seq_lens=seq_lens_view, seq_lens_cpu_upper_bound=host_twin(seq_lens_view, seq_lens),
        input_ids=head(d.input_ids, t), positions=head(d.positions, t),
        logits_indices=head(d.logits_indices, b + (0 if num_drafts is None else int(num_drafts.sum()))),
        input_ids_sampled=decode_only, num_draft_tokens=num_drafts,
        draft_token_ids={r: list(drafts[r]) for r in req_ids if r in drafts} if drafts else None,
        token_req_rows=None if is_draft is None else head(d.token_req_rows, t),
        draft_ids=None if is_draft is None else head(d.draft_ids, t + 1))


def host_twin(view: torch.Tensor, values: np.ndarray | Callable[[], np.ndarray]) -> torch.Tensor:
    """The host tensor of a staged region's rows (`seq_lens_cpu_upper_bound`, `query_start_loc_cpu`):
    on a CPU device `view` itself, the staged view, which holds `values` already (the arena is host
    memory) and is made once (HeadViews: no tensor object made per step, which a recording would keep);
    on a GPU a tensor of `values` (int32; a function making them is called only there)."""
    if view.is_cpu:
        return view
    return torch.from_numpy(np.ascontiguousarray(values() if callable(values) else values, dtype=np.int32))


def stage_rows(stage: Staging | StagingBank, qsl: np.ndarray, seq_lens: np.ndarray,
               num_drafts: np.ndarray | None = None) -> None:
    """query_start_loc, seq_lens and logits_indices of B rows (qsl int32 [B+1], seq_lens [B];
    `num_drafts` [B]: a verify row samples at its last 1 + d tokens). The whole regions are
    written, so the rows past B need no separate fill: query_start_loc repeats the total there,
    seq_lens is 0."""
    b = len(seq_lens)
    qsl_full = stage.host("query_start_loc")
    qsl_full[:] = qsl[-1]
    qsl_full[:b + 1] = qsl
    stage.written("query_start_loc")
    seq_lens_full = stage.host("seq_lens")
    seq_lens_full[:] = 0
    seq_lens_full[:b] = seq_lens
    stage.written("seq_lens")
    last = qsl[1:].astype(np.int64) - 1
    if num_drafts is None:
        stage.put("logits_indices", last)
    else:
        stage.put("logits_indices", np.concatenate([np.arange(e - n, e + 1) for e, n in zip(last, num_drafts)]))


def gather_sampled_input_ids(buffers: InputBuffers, req_states: RequestStates, batch: InputBatch) -> None:
    """A decode-only step's input ids: each row's last sampled token, gathered on the device by
    idx_mapping (staged, so call it after the flush), and with drafts, the staged drafts after it
    (token_req_rows, draft_ids). Only the batch's real rows: a padded row reads token 0, written
    by pad_decode_batch."""
    d, t = buffers, batch.num_tokens
    if batch.draft_ids is None:
        d.input_ids[:t] = req_states.last_sampled_tokens[d.idx_mapping[:t]]
    else:
        drafts = batch.draft_ids[:t]
        d.input_ids[:t] = torch.where(drafts >= 0, drafts, req_states.last_sampled_tokens[batch.token_req_rows])


def make_dummy(buffers: InputBuffers, num_reqs: int, num_tokens: int, num_drafts: int = 0) -> InputBatch:
    """A batch for warmup/profiling (MRV2 `InputBatch.make_dummy`): tokens split evenly, ids and
    positions zero, seq_len == query_len, no row prefilling, and a non-None upper bound. Its
    block tables point at the null block and its slot mappings are all PAD_SLOT_ID. `num_drafts`
    (speculative decoding's graph capture): every row a verify row of 1 + num_drafts tokens,
    sampled at each of them."""
    q = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int32)
    q[num_reqs - num_tokens % num_reqs:] += 1         # ascending, so the batch order holds
    qsl = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(q, out=qsl[1:])
    d, stage = buffers, buffers.staging
    d.input_ids[:num_tokens] = 0
    stage.put("positions", np.zeros(num_tokens, dtype=np.int64))
    drafts = np.full(num_reqs, num_drafts, dtype=np.int32) if num_drafts else None
    stage_rows(stage, qsl, q, drafts)
    stage.put("idx_mapping", np.zeros(num_reqs, dtype=np.int64))
    zeros = np.zeros(num_reqs, dtype=np.int32)
    num_logits = num_reqs * (1 + num_drafts)
    return InputBatch(
        req_ids=[f"dummy-{i}" for i in range(num_reqs)], num_reqs=num_reqs, num_tokens=num_tokens,
        max_query_len=int(q.max()), idx_mapping=d.idx_mapping[:num_reqs],
        idx_mapping_np=np.zeros(num_reqs, dtype=np.int64), num_scheduled_tokens=q,
        num_computed_tokens_np=zeros, prefill_len_np=zeros, is_prefilling_np=zeros.astype(bool),
        query_start_loc=d.query_start_loc[:num_reqs + 1], query_start_loc_np=qsl,
        seq_lens=d.seq_lens[:num_reqs], seq_lens_cpu_upper_bound=torch.from_numpy(q.copy()),
        input_ids=d.input_ids[:num_tokens], positions=d.positions[:num_tokens],
        logits_indices=d.logits_indices[:num_logits], num_draft_tokens=drafts)


def pad_decode_batch(buffers: InputBuffers, batch: InputBatch, size: int) -> InputBatch:
    """The batch a decode graph of `size` rows runs: `batch`'s n decode rows (t tokens each: 1, or
    with speculative decoding 1 + k), then size - n padded rows of t tokens at positions 0..t-1 with
    seq_len t (never an empty softmax), reading token 0. Their block tables and slot mappings are
    set by the runner (null block, PAD_SLOT_ID). Writes the padded rows into the persistent
    buffers; `batch` itself is unchanged."""
    n = batch.num_reqs
    t = batch.num_tokens // n if n else 1
    drafts = batch.num_drafts_np
    if batch.num_tokens != n * t or size < n or (t > 1 and not (drafts == t - 1).all()):
        raise ValueError(f"pad_decode_batch: {n} rows / {batch.num_tokens} tokens is not a uniform decode "
                         f"batch that fits {size} rows")
    d, stage = buffers, buffers.staging
    pad = size - n
    d.input_ids[n * t:size * t] = 0
    qsl = np.arange(size + 1, dtype=np.int32) * t
    for name, values in (("positions", np.tile(np.arange(t), pad)), ("seq_lens", t), ("idx_mapping", 0)):
        rows = slice(n * t, size * t) if name == "positions" else slice(n, size)
        stage.host(name)[rows] = values
        stage.written(name, rows.stop)
    qsl_full = stage.host("query_start_loc")
    qsl_full[n + 1:size + 1] = qsl[n + 1:]
    qsl_full[size + 1:] = size * t
    stage.written("query_start_loc")
    if t == 1:
        stage.host("logits_indices")[n:size] = qsl[n:size]
        stage.written("logits_indices", size)
    else:                           # a verify row samples at each of its t tokens
        stage.host("logits_indices")[n * t:size * t] = np.arange(n * t, size * t)
        stage.written("logits_indices", size * t)
    seq_lens_view = d.views.head(d.seq_lens, size)
    return InputBatch(
        req_ids=batch.req_ids + [f"pad-{i}" for i in range(pad)], num_reqs=size, num_tokens=size * t,
        max_query_len=t, idx_mapping=d.views.head(d.idx_mapping, size),
        idx_mapping_np=np.concatenate([batch.idx_mapping_np, np.zeros(pad, dtype=np.int64)]),
        num_scheduled_tokens=np.full(size, t, dtype=np.int32),
        num_computed_tokens_np=np.concatenate([batch.num_computed_tokens_np, np.zeros(pad, dtype=np.int32)]),
        prefill_len_np=np.concatenate([batch.prefill_len_np, np.zeros(pad, dtype=np.int32)]),
        is_prefilling_np=np.zeros(size, dtype=bool),
        query_start_loc=d.views.head(d.query_start_loc, size + 1), query_start_loc_np=qsl,
        seq_lens=seq_lens_view, seq_lens_cpu_upper_bound=host_twin(seq_lens_view, lambda: np.concatenate(
            [batch.seq_lens_cpu_upper_bound.numpy(), np.full(pad, t, dtype=np.int32)])),
        input_ids=d.views.head(d.input_ids, size * t), positions=d.views.head(d.positions, size * t),
        logits_indices=d.views.head(d.logits_indices, size * t), input_ids_sampled=batch.input_ids_sampled,
        num_draft_tokens=None if t == 1 else np.full(size, t - 1, dtype=np.int32),
        draft_token_ids=batch.draft_token_ids, token_req_rows=batch.token_req_rows, draft_ids=batch.draft_ids)
