"""Speculative decoding on the runner: the n-gram proposer and the verification of a step's drafts.

A verify row runs its last sampled token t0 and its d drafts x1..xd as 1 + d query tokens. The
target's token at each of those positions, s0..sd, is sampled from the logits there exactly as a
plain decode would sample it (the sampler is keyed on (seed, position, token): a position's sample
is a pure function of its logits). Draft x(j+1) is accepted while it equals s(j); the row keeps
s0..sa, a = the accepted drafts, which are the tokens plain decoding would have produced. So a
run with speculation yields the same tokens as one without, greedy and seeded (a stronger promise
than rejection sampling's "same distribution"). `num_accepted_tokens` = a + 1 (vLLM's count,
which includes the target's own token) picks the state column the row's next step starts from.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view


class Proposer(ABC):
    """What proposes drafts for the runner's verify rows. `propose_rows`: after a step, drafts for
    its rows; `forget(req_ids)`: the runner released these rows (finished, aborted or preempted), so
    what a proposer keeps per request goes."""

    @abstractmethod
    def propose_rows(self, req_states, req_ids: list[str], rows: np.ndarray, decode_next: np.ndarray
                     ) -> dict[str, list[int]]:
        """After a step (its books updated): request id -> up to k drafts, for the step's rows
        `req_ids` (request rows `rows` of the runner's `req_states`) whose next step is a decode
        (`decode_next`)."""

    def forget(self, req_ids) -> None:
        """Nothing kept per request: nothing to drop."""


class ContextProposer(Proposer):
    """A proposer that reads each request's tokens so far: `propose_many(contexts, req_ids)` -> up
    to k drafts per context (n-gram lookup; a draft model instead consumes every row's new tokens
    itself, runner/draft_model.py)."""

    @abstractmethod
    def propose_many(self, contexts: list[np.ndarray], req_ids: list[str] | None = None) -> list[list[int]]:
        """Up to k drafts per context."""

    def propose_rows(self, req_states, req_ids: list[str], rows: np.ndarray, decode_next: np.ndarray
                     ) -> dict[str, list[int]]:
        picked = [(rid, idx) for rid, idx, nxt in zip(req_ids, rows.tolist(), decode_next.tolist()) if nxt]
        contexts = [req_states.all_token_ids[idx, :int(req_states.total_len[idx])].numpy() for _, idx in picked]
        drafts = self.propose_many(contexts, [rid for rid, _ in picked])
        return {rid: d for (rid, _), d in zip(picked, drafts) if d}


class NgramIndex:
    """One request's n-grams, n in [min_n, max_n], each mapped to its earliest start, over the
    occurrences that end before the context's last token (what NgramProposer's lookup searches).
    `extend` indexes only the windows the tokens since its last call complete, so a step costs the
    new tokens, never the context's length."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.first: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed_end = 0            # windows ending (exclusively) at or before this are indexed

    def extend(self, context: np.ndarray) -> None:
        end = len(context) - 1          # windows must end before the last token
        if end <= self.indexed_end:
            return
        lo = max(self.indexed_end + 1 - self.max_n, 0)
        tokens = context[lo:end].tolist()
        for e in range(self.indexed_end + 1, end + 1):
            for n, first in self.first.items():
                if e - n >= 0:
                    first.setdefault(tuple(tokens[e - n - lo:e - lo]), e - n)
        self.indexed_end = end

    def lookup(self, context: np.ndarray, k: int) -> list[int]:
        """The up to k tokens after the earliest occurrence of the longest n-gram ending the context."""
        n_ctx = len(context)
        tail = context[max(n_ctx - self.max_n, 0):].tolist()
        for n in range(min(self.max_n, n_ctx - 1), self.min_n - 1, -1):
            start = self.first[n].get(tuple(tail[len(tail) - n:]))
            if start is not None:
                return context[start + n:start + n + k].tolist()
        return []


class NgramProposer(ContextProposer):
    """Prompt lookup (vLLM V1's CPU `NgramProposer`): find the longest n-gram, n in [min_n, max_n],
    that ends the context and occurred earlier in it (the earliest such occurrence), and propose
    the up to k tokens that followed it. No match, or a context shorter than min_n: no drafts.
    `pad` (decode graphs on): in a batch where some row has a draft, every row gets k, the missing
    ones the last token repeated (MRV2's GPU n-gram speculator), so that the verify batch is uniform
    (1 + k tokens a row); a padded draft is verified like any. A batch where no row has one proposes
    nothing: its next step runs 1-token rows, with graphs of their own (cudagraph.py).
    With request ids, each request keeps an NgramIndex updated with its new tokens (the cost of a
    step does not grow with the context); without, `propose` scans the context (the reference)."""

    def __init__(self, k: int, min_n: int, max_n: int, pad: bool = False):
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.pad = pad          # decode graphs: k drafts a row once one row of the batch has one
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, context: np.ndarray, req_id: str | None = None) -> list[int]:
        """context: int [N], the request's tokens so far (prompt + outputs). Returns <= k ids."""
        if req_id is None:
            drafts = self._lookup(context)
        else:
            index = self.indexes.get(req_id)
            if index is None or index.indexed_end > len(context) - 1:      # new, or not this context
                index = self.indexes[req_id] = NgramIndex(self.min_n, self.max_n)
            index.extend(context)
            drafts = index.lookup(context, self.k)
        return drafts

    def _lookup(self, context: np.ndarray) -> list[int]:
        n_ctx = len(context)
        for n in range(min(self.max_n, n_ctx - 1), self.min_n - 1, -1):
            windows = sliding_window_view(context[:n_ctx - 1], n)     # occurrences ending before the last token
            hits = np.nonzero((windows == context[n_ctx - n:]).all(axis=1))[0]
            if len(hits):
                start = int(hits[0]) + n
                return context[start:start + self.k].tolist()
        return []

    def propose_many(self, contexts: list[np.ndarray], req_ids: list[str] | None = None) -> list[list[int]]:
        ids = req_ids if req_ids is not None else [None] * len(contexts)
        drafts = [self.propose(c, r) for c, r in zip(contexts, ids, strict=True)]
        if self.pad and any(drafts):
            drafts = [d + [int(c[-1])] * (self.k - len(d)) if len(c) else d for d, c in zip(drafts, contexts)]
        return drafts

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self.indexes.pop(req_id, None)


class RankZeroProposes(Proposer):
    """The proposer of tensor-parallel ranks 1..N-1: none of their own. Rank 0 proposes (an n-gram
    lookup, or a draft model that runs whole in rank 0's runner, as vLLM V0's draft TP of 1), its
    scheduler puts the drafts in the next SchedulerOutput, and every rank verifies the same ones."""

    def propose_rows(self, req_states, req_ids: list[str], rows: np.ndarray, decode_next: np.ndarray
                     ) -> dict[str, list[int]]:
        return {}


@dataclass
class VerifyResult:
    """What one step's verification decided, per verify row (rows with drafts), in batch order."""
    req_ids: list[str]
    drafts: list[list[int]]            # x1..xd of each row
    target: list[list[int]]            # s0..sd: the target's token at each position of the row
    num_accepted: np.ndarray           # int32 [R]: a + 1, the tokens each row keeps (vLLM num_accepted_tokens)

    def kept(self, row: int) -> list[int]:
        """The tokens row `row` keeps: its accepted drafts, then the target's token after them."""
        return self.target[row][:int(self.num_accepted[row])]


def verify(req_ids: list[str], drafts: dict[str, list[int]], num_drafts: np.ndarray,
           cu_num_logits: np.ndarray, sampled: np.ndarray) -> VerifyResult:
    """Accept each verify row's drafts while they equal the target's samples. `sampled`: int [L],
    the target's token at every logits row (cu_num_logits [B+1] delimits a row's)."""
    rows = np.nonzero(num_drafts > 0)[0]
    ids, ds, targets, accepted = [], [], [], np.zeros(len(rows), dtype=np.int32)
    for i, row in enumerate(rows):
        rid = req_ids[row]
        d = drafts[rid]
        s = sampled[cu_num_logits[row]:cu_num_logits[row + 1]].tolist()
        a = 0
        while a < len(d) and d[a] == s[a]:
            a += 1
        ids.append(rid)
        ds.append(list(d))
        targets.append(s)
        accepted[i] = a + 1
    return VerifyResult(ids, ds, targets, accepted)


def kept_on_device(sampled: torch.Tensor, next_draft: torch.Tensor, logit_rows: torch.Tensor,
                   num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify`'s kept counts, made on the device without a host sync (for the device-side books:
    each row's last sampled token, the recurrent state's accepted column), so a step with drafts
    copies nothing to the device after its sync.

        sampled     int64 [L]: the target's token at every logits row
        next_draft  int64 [L]: the draft in the token after the logits row's (-1: none, as after
                    a row's last token, which therefore always ends its row's kept run)
        logit_rows  int [L]: the batch row of each logits row (ascending)
    Returns (num_kept int32 [B]: 1 + the drafts accepted, the logits row of each row's last kept
    sample int64 [B])."""
    n = sampled.shape[0]
    index = torch.arange(n, device=sampled.device)
    rows = logit_rows.to(torch.int64)
    stops = torch.where(sampled == next_draft, n, index)        # a logits row whose sample rejects what follows
    last = torch.full((num_rows,), n, dtype=torch.int64, device=sampled.device).scatter_reduce_(0, rows, stops, "amin")
    first = torch.full((num_rows,), n, dtype=torch.int64, device=sampled.device).scatter_reduce_(0, rows, index, "amin")
    return (last - first + 1).to(torch.int32), last


@dataclass
class SpecDecodeStats:
    """Counts over an engine's verify rows (`LLM.stats()`; warmup's steps are not counted)."""
    num_verify_rows: int = 0           # decode rows that carried drafts
    num_draft_tokens: int = 0          # drafts proposed and verified
    num_accepted_drafts: int = 0       # drafts equal to the target's token

    def add(self, result: VerifyResult | None) -> None:
        if result is None:
            return
        self.num_verify_rows += len(result.req_ids)
        self.num_draft_tokens += sum(len(d) for d in result.drafts)
        self.num_accepted_drafts += int(result.num_accepted.sum()) - len(result.req_ids)

    def as_dict(self) -> dict[str, float | int]:
        """acceptance rate: accepted / proposed drafts; mean accepted length: tokens a verify row
        keeps (its accepted drafts + the target's own token, vLLM's mean acceptance length)."""
        rows, drafts = self.num_verify_rows, self.num_draft_tokens
        return {"spec_verify_rows": rows, "spec_draft_tokens": drafts,
                "spec_accepted_drafts": self.num_accepted_drafts,
                "spec_acceptance_rate": self.num_accepted_drafts / drafts if drafts else 0.0,
                "spec_mean_accepted_length": (self.num_accepted_drafts + rows) / rows if rows else 0.0}
