"""The logprobs a step's requests asked for (`SamplingParams(logprobs=k, prompt_logprobs=k)`), in two
halves around the step's one sync: `issue_logprobs` computes them on the device and issues their host
copies without blocking; `logprobs_to_host` reads those copies after the sync and cuts them into
TokenLogprobs per request. Rows that asked nothing cost nothing: a recording derives theirs from the
recorded logits (`StepRecord.logprob_of`).

Shapes: B = rows of the batch, L = logits rows (1 per row, 1 + d for a verify row with d drafts),
k = the largest top-k asked; ids, logprobs [n, 1 + k] (column 0: the chosen token), ranks [n].
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from toolkit.host import to_device, to_host
from toolkit.request import TokenLogprobs
from toolkit.runner.sampler import Sampler, compute_logprobs

if TYPE_CHECKING:                     # the runner imports this module
    from toolkit.runner.model_runner import ExecuteModelState

# (sampled part: host copies of (ids, logprobs, ranks) over the L logits rows, or None;
#  prompt part: (batch rows, first position predicted, tokens predicted, host copies), or None)
PendingLogprobs = tuple[tuple[torch.Tensor, ...] | None, tuple[list, list, list, tuple[torch.Tensor, ...]] | None]


def issue_logprobs(state: ExecuteModelState, sampled: torch.Tensor, sampler: Sampler, all_token_ids: torch.Tensor,
                   compute_logits: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> PendingLogprobs:
    """Logprobs of the step's sampled tokens [L] and of the prompt tokens each prefill chunk predicts,
    for the rows that ask: computed on the device, their host copies issued without blocking.
    `all_token_ids` [max requests, max model len]: the requests' known tokens (the prompt targets);
    `compute_logits`: the model's head, run on the prefill chunks' hidden states."""
    batch = state.input_batch
    idx = batch.idx_mapping_np
    want = sampler.num_logprobs[idx]
    sampled_part = prompt_part = None
    if (want >= 0).any():
        tensors = compute_logprobs(state.logits, sampled, max(int(want.max()), 0))
        sampled_part = tuple(to_host(t) for t in tensors)
    # prompt logprobs: the chunk's token at position p predicts the prompt token at p + 1
    rows, starts, counts = [], [], []
    want_prompt = sampler.num_prompt_logprobs[idx]
    for row in np.nonzero(want_prompt >= 0)[0]:
        first = int(batch.num_computed_tokens_np[row]) + 1          # the first token predicted
        count = min(int(batch.num_scheduled_tokens[row]), int(sampler.num_prompt_tokens[idx[row]]) - first)
        if count > 0:
            rows.append(int(row))
            starts.append(first)
            counts.append(count)
    if rows:
        token_index = np.concatenate([np.arange(c) + batch.query_start_loc_np[r]
                                      for r, c in zip(rows, counts, strict=True)])
        targets = np.concatenate([all_token_ids[idx[r], s:s + c].numpy()
                                  for r, s, c in zip(rows, starts, counts, strict=True)])
        index = to_device(np.stack([token_index, targets.astype(np.int64)]), device)
        prompt_logits = compute_logits(state.hidden_states[index[0]])
        tensors = compute_logprobs(prompt_logits, index[1], int(want_prompt[rows].max()))
        prompt_part = (rows, starts, counts, tuple(to_host(t) for t in tensors))
    return sampled_part, prompt_part


def logprobs_to_host(state: ExecuteModelState, pending: PendingLogprobs, num_kept: np.ndarray,
                     sampler: Sampler) -> None:
    """After the sync: the host copies `issue_logprobs` issued, as TokenLogprobs per request in
    `state.sampled_logprobs` / `state.prompt_logprobs`, each cut to the top k its request asked for
    (0 for rows that did not ask); a verify row's hold one row per kept token (`num_kept` [B])."""
    sampled_part, prompt_part = pending
    batch = state.input_batch
    positions = batch.seq_lens_cpu_upper_bound.numpy() - batch.num_drafts_np
    if sampled_part is not None:
        ids, lps, ranks = (t.numpy() for t in sampled_part)
        want = sampler.num_logprobs[batch.idx_mapping_np]
        first = batch.cu_num_logits_np
        state.sampled_logprobs = {
            rid: TokenLogprobs(int(positions[row]), ids[a:b, :1 + max(int(want[row]), 0)].copy(),
                               lps[a:b, :1 + max(int(want[row]), 0)].copy(), ranks[a:b].copy())
            for row, rid, a, b in zip(range(batch.num_reqs), batch.req_ids, first, first[:-1] + num_kept)
            if want[row] >= 0}
    if prompt_part is not None:
        rows, starts, counts, tensors = prompt_part
        ids, lps, ranks = (t.numpy() for t in tensors)
        out, at = {}, 0
        for row, start, count in zip(rows, starts, counts, strict=True):
            k = 1 + int(sampler.num_prompt_logprobs[batch.idx_mapping_np[row]])
            out[batch.req_ids[row]] = TokenLogprobs(start, ids[at:at + count, :k].copy(),
                                                    lps[at:at + count, :k].copy(), ranks[at:at + count].copy())
            at += count
        state.prompt_logprobs = out
