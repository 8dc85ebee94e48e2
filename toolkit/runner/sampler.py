"""The Sampler the runner calls after the forward: the min_tokens mask, greedy, temperature, top-k
and top-p, with position-keyed Gumbel noise (the arithmetic is described in toolkit/sampling.py);
and `compute_logprobs`, the logprobs of chosen tokens (raw: log_softmax of the fp32 logits, before
any of those), on the device."""
from __future__ import annotations

import numpy as np
import torch

from toolkit.host import to_device
from toolkit.kernels.gumbel_ref import gumbel_argmax_ref, split_seed
from toolkit.sampling import MIN_TEMPERATURE, SamplingParams


class Sampler:
    """Per-row sampling parameters, indexed by the request's persistent row (req_idx), kept in
    host arrays so the per-step choices (any random row? any top-k?) need no device sync, and in
    one packed int64 table on the device (temperature and top_p as their float32 bits, top_k, the
    seed's two words), copied only after a request was added: a sampled step gathers its rows'
    parameters there by the staged idx_mapping, so it copies nothing of its own (MRV2 keeps its
    sampling states on the device the same way)."""

    def __init__(self, max_num_reqs: int, device: torch.device, gumbel_argmax=None):
        self.device = device
        self.gumbel_argmax = gumbel_argmax or gumbel_argmax_ref   # the backend's op (toolkit/layers/ops.py)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)   # 0: greedy
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)           # 0: off
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)          # 1: off
        self.seeds = np.zeros((max_num_reqs, 2), dtype=np.int64)      # 32-bit words (lo, hi)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)        # -1: no logprobs
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: no prompt logprobs
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_len = np.zeros(max_num_reqs, dtype=np.int64)   # stop ids masked at positions below
        self.min_tokens_stop_ids: list[tuple[int, ...]] = [()] * max_num_reqs
        self.packed = np.zeros((max_num_reqs, 5), dtype=np.int64)     # temp bits, top_k, top_p bits, seed lo, hi
        self._packed_device: torch.Tensor | None = None               # None: refresh before the next use

    def add_request(self, req_idx: int, params: SamplingParams, seed: int, num_prompt_tokens: int = 0,
                    min_tokens_stop_ids: tuple[int, ...] = (), num_prompt_logprobs: int | None = None) -> None:
        """`seed`: the request's own seed, or the one derived for it at arrival; the min_tokens
        mask covers `min_tokens_stop_ids` at positions below num_prompt_tokens + min_tokens."""
        t = float(params.temperature)
        self.temperature[req_idx] = 0.0 if t == 0.0 else max(t, MIN_TEMPERATURE)
        self.top_k[req_idx] = max(params.top_k, 0)
        self.top_p[req_idx] = params.top_p
        self.seeds[req_idx] = split_seed(seed)
        self.num_logprobs[req_idx] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[req_idx] = -1 if num_prompt_logprobs is None else num_prompt_logprobs
        self.num_prompt_tokens[req_idx] = num_prompt_tokens
        self.min_len[req_idx] = num_prompt_tokens + params.min_tokens if min_tokens_stop_ids else 0
        self.min_tokens_stop_ids[req_idx] = tuple(min_tokens_stop_ids)
        self.packed[req_idx] = (_float_bits(self.temperature[req_idx]), self.top_k[req_idx],
                                _float_bits(self.top_p[req_idx]), *self.seeds[req_idx])
        self._packed_device = None

    def remove_request(self, req_idx: int) -> None:
        self.temperature[req_idx] = 0.0
        self.top_k[req_idx] = 0
        self.top_p[req_idx] = 1.0
        self.seeds[req_idx] = 0
        self.num_logprobs[req_idx] = self.num_prompt_logprobs[req_idx] = -1
        self.num_prompt_tokens[req_idx] = self.min_len[req_idx] = 0
        self.min_tokens_stop_ids[req_idx] = ()
        # the packed table is left as it is: a removed row is gathered by no batch until it is added again

    def device_params(self, idx_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(temperature float32, top_k int64, top_p float32, seeds int64 [., 2]) of the rows
        `idx_mapping` (device int64 [B]) names, gathered on the device."""
        if self._packed_device is None:
            self._packed_device = to_device(self.packed, idx_mapping.device)
        p = self._packed_device[idx_mapping]
        return (p[:, 0].to(torch.int32).view(torch.float32), p[:, 1], p[:, 2].to(torch.int32).view(torch.float32),
                p[:, 3:5])

    def apply_min_tokens(self, logits: torch.Tensor, idx_mapping_np: np.ndarray,
                         positions_np: np.ndarray) -> torch.Tensor:
        """The logits with each row's stop ids at -inf while the token it samples (at
        `positions_np`) comes before its min_tokens-th output (a copy; `logits` is left raw).
        The (row, id) pairs are built on the host: one host-to-device copy, no sync."""
        masked = np.nonzero(positions_np < self.min_len[idx_mapping_np])[0]
        if not len(masked):
            return logits
        pairs = np.array([(row, t) for row in masked for t in self.min_tokens_stop_ids[idx_mapping_np[row]]],
                         dtype=np.int64).reshape(-1, 2).T
        index = to_device(np.ascontiguousarray(pairs), logits.device)
        # the fill value made on the device (torch.tensor(-inf, device=...) would copy it from pageable
        # host memory: a synchronising copy on a GPU)
        return logits.index_put((index[0], index[1]), torch.full((), float("-inf"), device=logits.device,
                                                                 dtype=logits.dtype))

    def __call__(self, logits: torch.Tensor, idx_mapping_np: np.ndarray, positions: torch.Tensor,
                 draws_np: np.ndarray, positions_np: np.ndarray | None = None,
                 idx_mapping: torch.Tensor | None = None) -> torch.Tensor:
        """logits: float32 [B, V] in batch order; idx_mapping_np: int [B] row -> req_idx
        (`idx_mapping`: the same on the device, when the runner has it staged; else it is copied);
        positions: device int [B], the position each sampled token takes (`positions_np`: the same
        on the host, needed for the min_tokens mask); draws_np: bool [B], False for rows whose
        sample is thrown away (partial prefill chunks: they draw nothing and take the argmax).
        Returns int64 [B]."""
        if positions_np is not None:
            logits = self.apply_min_tokens(logits, idx_mapping_np, positions_np)
        greedy = logits.argmax(dim=-1)
        temperature = self.temperature[idx_mapping_np]
        random_rows = draws_np & (temperature > 0)
        if not random_rows.any():
            return greedy
        dev = logits.device
        if idx_mapping is None:
            idx_mapping = to_device(np.ascontiguousarray(idx_mapping_np, dtype=np.int64), dev)
        temp, top_k_dev, top_p_dev, seeds = self.device_params(idx_mapping)
        # a row that draws and is not greedy; every row draws in a decode step (no copy then)
        random_dev = temp > 0 if draws_np.all() else to_device(random_rows, dev)
        scaled = logits.float() / torch.where(random_dev, temp, 1.0)[:, None]
        top_k, top_p = self.top_k[idx_mapping_np], self.top_p[idx_mapping_np]
        if ((top_k > 0) & (top_k < logits.shape[-1]) & random_rows).any() or \
                ((top_p < 1.0) & random_rows).any():
            scaled = apply_top_k_top_p(scaled, top_k_dev, top_p_dev)
        sampled = self.gumbel_argmax(scaled, seeds, positions)
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
