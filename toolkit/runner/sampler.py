"""The Sampler the runner calls after the forward: greedy, temperature, top-k and top-p, with
position-keyed Gumbel noise (the arithmetic is described in toolkit/sampling.py)."""
from __future__ import annotations

import numpy as np
import torch

from toolkit.host import to_device
from toolkit.kernels.gumbel_ref import gumbel_argmax_ref, split_seed
from toolkit.sampling import MIN_TEMPERATURE, SamplingParams


class Sampler:
    """Per-row sampling parameters, indexed by the request's persistent row (req_idx), kept in
    host arrays so the per-step choices (any random row? any top-k?) need no device sync."""

    def __init__(self, max_num_reqs: int, device: torch.device, gumbel_argmax=None):
        self.device = device
        self.gumbel_argmax = gumbel_argmax or gumbel_argmax_ref   # the backend's op (toolkit/layers/ops.py)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)   # 0: greedy
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)           # 0: off
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)          # 1: off
        self.seeds = np.zeros((max_num_reqs, 2), dtype=np.int64)      # 32-bit words (lo, hi)

    def add_request(self, req_idx: int, params: SamplingParams, seed: int) -> None:
        """`seed`: the request's own seed, or the one derived for it at arrival."""
        t = float(params.temperature)
        self.temperature[req_idx] = 0.0 if t == 0.0 else max(t, MIN_TEMPERATURE)
        self.top_k[req_idx] = max(params.top_k, 0)
        self.top_p[req_idx] = params.top_p
        self.seeds[req_idx] = split_seed(seed)

    def remove_request(self, req_idx: int) -> None:
        self.temperature[req_idx] = 0.0
        self.top_k[req_idx] = 0
        self.top_p[req_idx] = 1.0
        self.seeds[req_idx] = 0

    def __call__(self, logits: torch.Tensor, idx_mapping_np: np.ndarray, positions: torch.Tensor,
                 draws_np: np.ndarray) -> torch.Tensor:
        """logits: float32 [B, V] in batch order; idx_mapping_np: int [B] row -> req_idx;
        positions: device int [B], the position each sampled token takes; draws_np: bool [B],
        False for rows whose sample is thrown away (partial prefill chunks: they draw nothing and
        take the argmax). Returns int64 [B]."""
        greedy = logits.argmax(dim=-1)
        temperature = self.temperature[idx_mapping_np]
        random_rows = draws_np & (temperature > 0)
        if not random_rows.any():
            return greedy
        dev = logits.device
        temp = to_device(np.where(random_rows, temperature, 1.0), dev)
        scaled = logits.float() / temp[:, None]
        top_k, top_p = self.top_k[idx_mapping_np], self.top_p[idx_mapping_np]
        if ((top_k > 0) & (top_k < logits.shape[-1]) & random_rows).any() or \
                ((top_p < 1.0) & random_rows).any():
            scaled = apply_top_k_top_p(scaled, to_device(top_k, dev),
                                       to_device(top_p, dev))
        seeds = to_device(self.seeds[idx_mapping_np], dev)
        sampled = self.gumbel_argmax(scaled, seeds, positions)
        return torch.where(to_device(random_rows, dev), sampled, greedy)


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
