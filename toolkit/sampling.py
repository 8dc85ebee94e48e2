"""SamplingParams (validated on construction) and the Sampler the runner calls after the forward.

Greedy when temperature == 0. Otherwise: temperature, then top-k, then top-p, then a draw from a
per-request `torch.Generator` (seeded by `seed`, else by the LLM's seed and the request's arrival
index), so a request samples the same tokens whether it runs alone or in a batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from toolkit.errors import InvalidRequestError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0            # 0 or -1: off
    top_p: float = 1.0        # 1.0: off
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an int >= 1")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "must be an int; 0 or -1 disables it")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an int or None")
        self.stop_token_ids = list(self.stop_token_ids)
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative ints")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Per-row sampling state, indexed by the request's persistent row (req_idx)."""

    def __init__(self, max_num_reqs: int, device: torch.device):
        self.device = device
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs

    def add_request(self, req_idx: int, params: SamplingParams, default_seed: int) -> None:
        self.params[req_idx] = params
        if params.greedy:
            self.generators[req_idx] = None
        else:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else default_seed)
            self.generators[req_idx] = gen

    def remove_request(self, req_idx: int) -> None:
        self.params[req_idx] = None
        self.generators[req_idx] = None

    def __call__(self, logits: torch.Tensor, idx_mapping: list[int]) -> torch.Tensor:
        """logits: float32 [B, V] in batch order; idx_mapping: row -> req_idx. Returns int64 [B]."""
        sampled = logits.argmax(dim=-1)
        for row, req_idx in enumerate(idx_mapping):
            params = self.params[req_idx]
            if params is None or params.greedy:
                continue
            probs = _filtered_probs(logits[row], params)
            sampled[row] = torch.multinomial(probs, 1, generator=self.generators[req_idx])[0]
        return sampled


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] -> probabilities after temperature, top-k and top-p."""
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first token always stays)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)
