"""SamplingParams (validated on construction) and the Sampler the runner calls after the forward.

Sampling is keyed on position, as in vLLM's Model Runner V2, so no scheduling decision (batch
composition, chunk size, preemption, warmup) can change a request's tokens:

    token = argmax_v( logits[v] / T  (top-k and top-p applied)  +  gumbel(seed, position, v) )

- `position` is the index the sampled token will take in the request's sequence (its prompt
  length for the first output token).
- `gumbel(s, p, v) = -log(-log(u))` with `u = (bits + 0.5) / 2**24` and `bits` the top 24 bits of
  `hash32(s, p, v)`, a counter-based integer hash (`_mix32`, "lowbias32") chained over the seed's
  two 32-bit words, the position and the token id. It is a pure function: nothing is drawn from a
  generator, so partial-prefill rows, preempted and resumed requests and batch neighbours leave it
  untouched, and the integer part is bit-identical on every device.
- `seed` is the request's own, or for an unseeded request one derived once at arrival from the
  LLM's seed and an arrival counter (`derive_seed`) that warmup requests do not advance.
- Greedy when temperature == 0. A positive temperature below `MIN_TEMPERATURE` (1e-2) is raised to
  it (vLLM's floor), so a tiny temperature cannot overflow. top-k (0 or -1: off) and top-p (1.0: off)
  are applied as vLLM does: keep the k largest logits (ties at the k-th kept), then the smallest set
  of most likely tokens whose probability reaches top_p.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from toolkit.errors import InvalidRequestError
from toolkit.runner.host import to_device

MIN_TEMPERATURE = 1e-2
MAX_SEED = 2**64 - 1
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0            # 0 or -1: off
    top_p: float = 1.0        # 1.0: off
    seed: int | None = None   # 0 .. 2**64-1; -1 or None: derived from the LLM's seed
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False   # keep a stop token's text in `text`

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an int >= 1")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an int; 0 or -1 disables it")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if self.seed == -1:                   # vLLM: -1 means "no seed"
            self.seed = None
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise bad("seed", f"must be None, -1 or an int in [0, {MAX_SEED}]")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise bad("stop_token_ids", "must be a list of non-negative ints")
        self.stop_token_ids = list(self.stop_token_ids)
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative ints")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ---- the noise: a counter-based hash turned into Gumbel noise ------------------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without leaving int64's range: x is split into
    16-bit halves so every product stays below 2**48 (signed overflow is not portable)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons): a bijective avalanche hash of 32-bit words held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _combine(h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _mix32(h ^ _mix32(v ^ _GOLDEN))


@functools.lru_cache(maxsize=8)
def _token_terms(vocab_size: int, device: torch.device) -> torch.Tensor:
    """int64 [V]: the token-id half of `_combine`, the same every step."""
    return _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _GOLDEN)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """seeds: int64 [B, 2] (low and high 32-bit words); positions: int [B] -> int64 [B] keys."""
    h = torch.full_like(positions, 0x85EBCA6B, dtype=torch.int64)
    h = _combine(h, seeds[:, 1])
    h = _combine(h, seeds[:, 0])
    return _combine(h, positions.to(torch.int64))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [B, V]: the Gumbel noise of (seed, position, token id) for every row and token."""
    keys = row_keys(seeds, positions)
    bits = _mix32(keys[:, None] ^ _token_terms(vocab_size, keys.device)[None, :]) >> 8
    u = (bits.to(torch.float32) + 0.5) * (1.0 / 2**24)        # exact in float32, in (0, 1)
    return -torch.log(-torch.log(u))


def gumbel_argmax_ref(scaled: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """scaled: float32 [B, V] (temperature applied, filtered tokens -inf); seeds int64 [B, 2];
    positions int [B] -> int64 [B] = argmax_v(scaled + gumbel_noise) (first index on ties)."""
    return (scaled + gumbel_noise(seeds, positions, scaled.shape[-1])).argmax(dim=-1)


def split_seed(seed: int) -> tuple[int, int]:
    return seed & _M32, (seed >> 32) & _M32


def derive_seed(llm_seed: int, arrival_index: int) -> int:
    """The seed of an unseeded request: splitmix64 of (LLM seed, arrival counter), in [0, 2**64)."""
    def splitmix64(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & MAX_SEED
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MAX_SEED
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MAX_SEED
        return z ^ (z >> 31)
    return splitmix64(splitmix64(llm_seed & MAX_SEED) ^ (arrival_index & MAX_SEED))


# ---- the sampler --------------------------------------------------------------------------------
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
