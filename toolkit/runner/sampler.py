"""The Sampler the runner calls after the forward: the logits processors (allowed ids, bad words,
min_tokens, logit bias, penalties: toolkit/runner/logits_processors.py), greedy, temperature, min_p,
top-k and top-p, with position-keyed Gumbel noise (the arithmetic is described in
toolkit/sampling.py); and `compute_logprobs`, the logprobs of chosen tokens (raw: log_softmax of the
fp32 logits, before any of those), on the device."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.host import to_device
from toolkit.kernels.gumbel_ref import gumbel_argmax_ref, split_seed
from toolkit.runner.logits_processors import (
    RowEdits,
    TokenCounts,
    apply_min_p,
    apply_penalties,
    apply_sparse_edits,
    sparse_edits,
)
from toolkit.sampling import MIN_TEMPERATURE, SamplingParams


@dataclass
class LogitsRows:
    """The logits rows of a step as the sampler reads them: L = one per batch row, or 1 + d per
    verify row (a sample at each of its positions)."""
    idx_mapping_np: np.ndarray              # int [L]: each logits row's request row (req_idx)
    idx_mapping: torch.Tensor | None        # device int64 [L], the same (None: copied when needed)
    positions: torch.Tensor                 # device int [L]: the position each row's sample takes
    positions_np: np.ndarray                # int [L], the same on the host
    draws_np: np.ndarray                    # bool [L]: False where the sample is thrown away (partial prefill)
    drafts: torch.Tensor | None = None      # device int64 [L] (steps with drafts): the draft each row's
                                            # sample is compared to, -1 after a verify row's last
    max_drafts: int = 0                     # the most drafts a row carries
    # (i, n) -> the last n output tokens before logits row i's position (a verify row's drafts included):
    # read only for requests with bad_words
    last_outputs: Callable[[int, int], Sequence[int]] | None = None

    @classmethod
    def of(cls, idx_mapping_np: np.ndarray, positions: torch.Tensor, draws_np: np.ndarray) -> LogitsRows:
        """Rows without drafts or bad words, from the host (tests, a sampler used alone)."""
        return cls(np.asarray(idx_mapping_np), None, positions, positions.cpu().numpy(), np.asarray(draws_np))


class Sampler:
    """Per-row sampling parameters, indexed by the request's persistent row (req_idx), kept in
    host arrays so the per-step choices (any random row? any top-k?) need no device sync, and in
    one packed int64 table on the device (temperature and top_p as their float32 bits, top_k, the
    seed's two words), copied only after a request was added: a sampled step gathers its rows'
    parameters there by the staged idx_mapping, so it copies nothing of its own (MRV2 keeps its
    sampling states on the device the same way)."""

    def __init__(self, max_num_reqs: int, device: torch.device, gumbel_argmax=None, vocab_size: int = 0):
        self.device = device
        self.gumbel_argmax = gumbel_argmax or gumbel_argmax_ref   # the backend's op (toolkit/layers/ops.py)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)   # 0: greedy
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)           # 0: off
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)          # 1: off
        self.seeds = np.zeros((max_num_reqs, 2), dtype=np.int64)      # 32-bit words (lo, hi)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)        # -1: no logprobs
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: no prompt logprobs
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)          # 0: off
        self.penalized = np.zeros(max_num_reqs, dtype=bool)            # any of the three penalties on
        self.edits: list[RowEdits | None] = [None] * max_num_reqs      # bias, allowed ids, bad words, min_tokens
        self.has_edits = np.zeros(max_num_reqs, dtype=bool)            # edits[i] is not None (a vector test)
        self.token_counts = TokenCounts(max_num_reqs, vocab_size, device)    # penalties
        # temp bits, top_k, top_p bits, seed lo, hi, min_p bits, repetition, presence, frequency penalty bits
        self.packed = np.zeros((max_num_reqs, 9), dtype=np.int64)
        self._packed_device: torch.Tensor | None = None               # None: refresh before the next use

    def add_request(self, req_idx: int, params: SamplingParams, seed: int, num_prompt_tokens: int = 0,
                    min_tokens_stop_ids: tuple[int, ...] = (), num_prompt_logprobs: int | None = None,
                    token_ids: Sequence[int] = ()) -> None:
        """`seed`: the request's own seed, or the one derived for it at arrival; the min_tokens
        mask covers `min_tokens_stop_ids` at positions below num_prompt_tokens + min_tokens.
        `token_ids`: the request's known tokens (its prompt, then its outputs when resumed): a
        penalized request's counts start from them."""
        t = float(params.temperature)
        self.temperature[req_idx] = 0.0 if t == 0.0 else max(t, MIN_TEMPERATURE)
        self.top_k[req_idx] = max(params.top_k, 0)
        self.top_p[req_idx] = params.top_p
        self.seeds[req_idx] = split_seed(seed)
        self.num_logprobs[req_idx] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[req_idx] = -1 if num_prompt_logprobs is None else num_prompt_logprobs
        self.num_prompt_tokens[req_idx] = num_prompt_tokens
        self.min_p[req_idx] = params.min_p
        self.penalized[req_idx] = params.penalized
        if params.penalized:
            self.token_counts.add_request(req_idx, token_ids[:num_prompt_tokens], token_ids[num_prompt_tokens:])
        edits = RowEdits(
            bias_ids=None if not params.logit_bias else np.fromiter(params.logit_bias, np.int64),
            bias_values=None if not params.logit_bias else np.array(list(params.logit_bias.values()), np.float32),
            allowed_ids=None if params.allowed_token_ids is None else np.array(params.allowed_token_ids, np.int64),
            bad_words=tuple(tuple(w) for w in params.bad_words_token_ids),
            min_tokens_ids=tuple(min_tokens_stop_ids),
            min_len=num_prompt_tokens + params.min_tokens if min_tokens_stop_ids else 0)
        self.edits[req_idx] = None if edits.empty else edits
        self.has_edits[req_idx] = not edits.empty
        self.packed[req_idx] = (_float_bits(self.temperature[req_idx]), self.top_k[req_idx],
                                _float_bits(self.top_p[req_idx]), *self.seeds[req_idx], _float_bits(params.min_p),
                                _float_bits(params.repetition_penalty), _float_bits(params.presence_penalty),
                                _float_bits(params.frequency_penalty))
        self._packed_device = None

    def remove_request(self, req_idx: int) -> None:
        self.temperature[req_idx] = 0.0
        self.top_k[req_idx] = 0
        self.top_p[req_idx] = 1.0
        self.seeds[req_idx] = 0
        self.num_logprobs[req_idx] = self.num_prompt_logprobs[req_idx] = -1
        self.num_prompt_tokens[req_idx] = 0
        self.min_p[req_idx] = 0.0
        self.penalized[req_idx] = False
        self.edits[req_idx] = None
        self.has_edits[req_idx] = False
        self.token_counts.remove_request(req_idx)
        # the packed table is left as it is: a removed row is gathered by no batch until it is added again

    def device_params(self, idx_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(temperature float32, top_k int64, top_p float32, seeds int64 [., 2], min_p, repetition,
        presence and frequency penalty float32) of the rows `idx_mapping` (device int64 [B]) names,
        gathered on the device."""
        if self._packed_device is None:
            self._packed_device = to_device(self.packed, idx_mapping.device)
        p = self._packed_device[idx_mapping]
        floats = p.to(torch.int32).view(torch.float32)
        return floats[:, 0], p[:, 1], floats[:, 2], p[:, 3:5], floats[:, 5], floats[:, 6], floats[:, 7], floats[:, 8]

    def process(self, logits: torch.Tensor, rows: LogitsRows) -> torch.Tensor:
        """The logits every row's choice is made from, greedy rows' too: allowed ids, bad words,
        min_tokens, logit bias (one host-to-device copy of the edits, when a row has any) and the
        penalties (token counts on the device). `logits` itself is left raw (logprobs read it)."""
        idx = rows.idx_mapping_np
        table = (sparse_edits([self.edits[i] for i in idx], rows.positions_np, rows.last_outputs)
                 if self.has_edits[idx].any() else None)
        penalized = self.penalized[idx].any()
        if table is None and not penalized:
            return logits
        logits = logits.float()
        if rows.idx_mapping is None:
            rows.idx_mapping = to_device(np.ascontiguousarray(idx, dtype=np.int64), logits.device)
        if table is not None:
            logits = apply_sparse_edits(logits, to_device(table[0], logits.device), table[1])
        if penalized:
            if self.token_counts.counts.shape[-1] != logits.shape[-1]:
                raise ValueError(f"the penalties' token counts cover {self.token_counts.counts.shape[-1]} tokens, "
                                 f"the logits {logits.shape[-1]}: Sampler(vocab_size=...) must be the logits' width")
            self.token_counts.flush()
            counts, in_prompt = self.token_counts.rows(rows.idx_mapping, rows.drafts, rows.max_drafts)
            *_, repetition, presence, frequency = self.device_params(rows.idx_mapping)
            logits = apply_penalties(logits, counts, in_prompt, repetition, presence, frequency)
        return logits

    def count_kept(self, rows: LogitsRows, sampled: torch.Tensor,
                   last_kept: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """After sampling: add the kept samples to the penalized requests' output counts (nothing
        to do when no row of the step is penalized). A step with drafts: `last_kept` = (the logits
        row of each batch row's last kept sample [B], each logits row's batch row [L]), the samples
        up to it are kept; else the rows that draw."""
        if not self.penalized[rows.idx_mapping_np].any():
            return
        if last_kept is not None:
            last, batch_row = last_kept
            kept = torch.arange(len(sampled), device=sampled.device) <= last[batch_row]
        else:
            kept = (torch.ones(len(sampled), dtype=torch.bool, device=sampled.device) if rows.draws_np.all()
                    else to_device(rows.draws_np, sampled.device))
        self.token_counts.commit(rows.idx_mapping, sampled, kept)

    def __call__(self, logits: torch.Tensor, rows: LogitsRows) -> torch.Tensor:
        """logits: float32 [L, V] in logits-row order. Rows that draw nothing (partial prefill
        chunks) take the argmax. Returns int64 [L]."""
        logits = self.process(logits, rows)
        greedy = logits.argmax(dim=-1)
        idx_mapping_np, draws_np = rows.idx_mapping_np, rows.draws_np
        temperature = self.temperature[idx_mapping_np]
        random_rows = draws_np & (temperature > 0)
        if not random_rows.any():
            return greedy
        dev = logits.device
        if rows.idx_mapping is None:
            rows.idx_mapping = to_device(np.ascontiguousarray(idx_mapping_np, dtype=np.int64), dev)
        temp, top_k_dev, top_p_dev, seeds, min_p_dev, *_ = self.device_params(rows.idx_mapping)
        # a row that draws and is not greedy; every row draws in a decode step (no copy then)
        random_dev = temp > 0 if draws_np.all() else to_device(random_rows, dev)
        scaled = logits.float() / torch.where(random_dev, temp, 1.0)[:, None]
        if ((self.min_p[idx_mapping_np] > 0) & random_rows).any():
            scaled = apply_min_p(scaled, min_p_dev)
        top_k, top_p = self.top_k[idx_mapping_np], self.top_p[idx_mapping_np]
        if ((top_k > 0) & (top_k < logits.shape[-1]) & random_rows).any() or \
                ((top_p < 1.0) & random_rows).any():
            scaled = apply_top_k_top_p(scaled, top_k_dev, top_p_dev)
        sampled = self.gumbel_argmax(scaled, seeds, rows.positions)
        return torch.where(random_dev, sampled, greedy)


def _float_bits(x: float) -> int:
    """The float32 bit pattern of x, as a signed int32 (packed in the int64 parameter table)."""
    return int(np.float32(x).view(np.int32))


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logprobs (vLLM's default): log_softmax of the fp32 logits [N, V], before the min_tokens
    mask, temperature, top-k and top-p. token_ids: int64 [N], the chosen token of each row.
    Returns (token ids int64 [N, 1 + k], logprobs float32 [N, 1 + k], ranks int64 [N]): column 0
    the chosen token, then the k most likely; rank = how many tokens are at least as likely as the
    chosen one (vLLM's `batched_count_greater_than`: 1 for the most likely). All on the device."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1)
    ids, values = token_ids[:, None], chosen
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        ids, values = torch.cat([ids, top.indices], dim=1), torch.cat([values, top.values], dim=1)
    return ids, values, ranks


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: float32 [B, V]; top_k: int64 [B] (0: off); top_p: float32 [B] (1: off).
    Returns the logits with filtered tokens set to -inf (every row keeps its largest logit)."""
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # drop a token when the tokens before it already reach top_p (the first token always stays)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p[:, None].to(probs.dtype)
    drop_sorted &= (top_p < 1.0)[:, None]           # cumsum rounding must not cut a top_p=1 row
    drop_sorted |= torch.isinf(sorted_logits)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
