"""Position-keyed Gumbel noise and the Gumbel-max draw, in torch: the reference of `gumbel.py`
(the sampler's arithmetic is described in toolkit/sampling.py).

    gumbel(s, p, v) = -log(-log(u)),  u = min((bits + 0.5) / 2**24, 1 - 2**-24)

`bits` are the top 24 bits of `hash32(s, p, v)`, a counter-based integer hash (`_mix32`,
"lowbias32") chained over the seed's two 32-bit words, the position and the token id: a pure
function, bit-identical on every device.
"""
from __future__ import annotations

import functools

import torch

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


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
    # float32 holds bits + 0.5 exactly below 2**23 only; above, it rounds to even, and the top value,
    # 2**24 - 1, to 2**24: u = 1 and noise +inf (a filtered -inf token would then win, as NaN). So u is
    # capped at the largest float32 below 1; every other value is unchanged.
    u = ((bits.to(torch.float32) + 0.5) * (1.0 / 2**24)).clamp(max=1.0 - 2**-24)
    return -torch.log(-torch.log(u))


def gumbel_argmax_ref(scaled: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """scaled: float32 [B, V] (temperature applied, filtered tokens -inf); seeds int64 [B, 2];
    positions int [B] -> int64 [B] = argmax_v(scaled + gumbel_noise) (first index on ties)."""
    return (scaled + gumbel_noise(seeds, positions, scaled.shape[-1])).argmax(dim=-1)


def split_seed(seed: int) -> tuple[int, int]:
    return seed & _M32, (seed >> 32) & _M32
