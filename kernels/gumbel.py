"""The sampler's Gumbel-max step: the Triton kernel, its launcher and the torch reference it must equal.

scaled float32 [B, V] (temperature applied, top-k / top-p filtered tokens -inf; the row stride may
exceed V, the vocabulary dimension must be contiguous); seeds int64 [B, 2] (the seed's low and high
32-bit words, each in [0, 2**32)); positions int32 / int64 [B] (in [0, 2**32)). Returns int64 [B]:

    token[b] = argmax_v( scaled[b, v] + gumbel(seeds[b], positions[b], v) )   (first index on ties,
                                                                                 NaN wins, as torch)

gumbel(s, p, v) is `gumbel_ref.gumbel_noise`: a counter-based hash, bit-identical here,
    key  = combine(combine(combine(0x85EBCA6B, s_hi), s_lo), p)      combine(h, x) = mix32(h ^ mix32(x ^ GOLDEN))
    bits = mix32(key ^ mix32(v ^ GOLDEN)) >> 8                      mix32 = lowbias32
    u = min((bits + 0.5) / 2**24, 1 - 2**-24) ;  noise = -log(-log(u))      (float32; the min: see gumbel_ref)
The hash runs in uint32: multiplies wrap mod 2**32 and `>>` on an unsigned type is a logical shift,
which is the arithmetic torch emulates in int64 with 16-bit splits.

`gumbel_noise(seeds, positions, vocab_size)` -> float32 [B, V] and `gumbel_debug(...)` -> (keys int64
[B], hash32 int64 [B, V], noise float32 [B, V]) run the same jit functions, so the integer part can be
checked bit for bit against torch's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048          # vocabulary tokens a program handles per loop step (tails masked)
_SEED0 = tl.constexpr(0x85EBCA6B)    # the chain's initial value (gumbel_ref.row_keys)
_GOLDEN = tl.constexpr(0x9E3779B9)    # literals above 2**31 - 1 are uint32 in Triton


@triton.jit
def _mix32(x):
    """lowbias32 on uint32: the multiplies wrap mod 2**32, the shifts are logical."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _combine(h, x):
    """uint32 h, x -> mix32(h ^ mix32(x ^ GOLDEN))."""
    return _mix32(h ^ _mix32(x ^ _GOLDEN))


@triton.jit
def _row_key(seed_ptr, pos_ptr, row, stride_sb, stride_sw, stride_p):
    """The row's uint32 key: the hash chain over seed hi, seed lo and position."""
    lo = tl.load(seed_ptr + row * stride_sb).to(tl.uint32)           # int64 in [0, 2**32): truncation
    hi = tl.load(seed_ptr + row * stride_sb + stride_sw).to(tl.uint32)
    pos = tl.load(pos_ptr + row * stride_p).to(tl.uint32)
    h = _mix32(_mix32(hi ^ _GOLDEN) ^ _SEED0)                        # _combine(SEED0, hi)
    h = _combine(h, lo)
    return _combine(h, pos)


@triton.jit
def _hash_and_noise(key, v):
    """uint32 key, int32 token ids v -> (uint32 hash32, float32 Gumbel noise)."""
    hashed = _mix32(key ^ _mix32(v.to(tl.uint32) ^ _GOLDEN))
    u = ((hashed >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)    # power-of-two scale
    u = tl.minimum(u, 0.99999994039535522)          # 1 - 2**-24: bits 2**24 - 1 would round to u = 1 (gumbel_ref)
    return hashed, -tl.log(-tl.log(u))


@triton.jit
def _gumbel_argmax_kernel(scaled_ptr, seed_ptr, pos_ptr, out_ptr, vocab,
                          stride_xb, stride_sb, stride_sw, stride_p, BLOCK: tl.constexpr):
    """One program per row: loop over the vocabulary, keep each lane's running max and its index."""
    row = tl.program_id(0)
    key = _row_key(seed_ptr, pos_ptr, row, stride_sb, stride_sw, stride_p)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = lanes                                   # a lane never updated: its first index (all -inf)
    x_row = scaled_ptr + row.to(tl.int64) * stride_xb
    for start in range(0, vocab, BLOCK):
        v = start + lanes
        x = tl.load(x_row + v, mask=v < vocab, other=float("-inf"))
        _, noise = _hash_and_noise(key, v)
        s = x + noise
        # strict >: a lane sees increasing indices, so it keeps its first max; NaN wins, as in torch
        take = (s > best) | ((s != s) & (best == best))
        best = tl.where(take, s, best)
        best_idx = tl.where(take, v, best_idx)
    is_nan = best != best
    top = tl.max(tl.where(is_nan, float("-inf"), best), axis=0)
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    cand = tl.where(any_nan, is_nan, best == top)
    tl.store(out_ptr + row, tl.min(tl.where(cand, best_idx, 2147483647), axis=0).to(tl.int64))


@triton.jit
def _gumbel_noise_kernel(seed_ptr, pos_ptr, key_ptr, hash_ptr, noise_ptr, vocab,
                         stride_sb, stride_sw, stride_p, BLOCK: tl.constexpr):
    """Program (row, block of tokens): the row key, the 32-bit hashes and the noise (debug / tests)."""
    row = tl.program_id(0)
    key = _row_key(seed_ptr, pos_ptr, row, stride_sb, stride_sw, stride_p)
    if tl.program_id(1) == 0:
        tl.store(key_ptr + row, key.to(tl.int64))      # uint32 -> int64 zero-extends
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = v < vocab
    hashed, noise = _hash_and_noise(key, v)
    off = row.to(tl.int64) * vocab + v
    tl.store(hash_ptr + off, hashed.to(tl.int64), mask=mask)
    tl.store(noise_ptr + off, noise, mask=mask)


def _check_seeds_positions(seeds: torch.Tensor, positions: torch.Tensor, b: int | None) -> int:
    if seeds.dim() != 2 or seeds.shape[1] != 2 or seeds.dtype != torch.int64 \
            or (b is not None and seeds.shape[0] != b):
        rows = "B" if b is None else f"B={b}"
        raise ValueError(f"seeds must be int64 [{rows}, 2] (low, high 32-bit words), got {seeds.dtype} "
                         f"{tuple(seeds.shape)}")
    b = seeds.shape[0]
    if tuple(positions.shape) != (b,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [B={b}], got {positions.dtype} {tuple(positions.shape)}")
    if positions.device != seeds.device:
        raise ValueError(f"positions is on {positions.device}, seeds on {seeds.device}")
    return b


def gumbel_argmax(scaled: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Launcher: checks shapes, dtypes, devices and strides; returns int64 [B] =
    argmax_v(scaled + gumbel(seed, position, v)), the first index on exact ties."""
    if scaled.dim() != 2 or scaled.dtype != torch.float32:
        raise ValueError(f"scaled must be float32 [B, V], got {scaled.dtype} {tuple(scaled.shape)}")
    b, vocab = scaled.shape
    _check_seeds_positions(seeds, positions, b)
    if seeds.device != scaled.device:
        raise ValueError(f"seeds is on {seeds.device}, scaled on {scaled.device}")
    if vocab == 0:
        raise ValueError("scaled has an empty vocabulary dimension (V=0): nothing to sample")
    if vocab > 1 and scaled.stride(1) != 1:
        raise ValueError(f"scaled must be contiguous in its last (vocabulary) dimension, strides {scaled.stride()}")
    out = torch.empty(b, dtype=torch.int64, device=scaled.device)
    if b == 0:
        return out
    block = min(BLOCK_V, triton.next_power_of_2(vocab))
    _gumbel_argmax_kernel[(b,)](
        scaled, seeds, positions, out, vocab,
        scaled.stride(0), seeds.stride(0), seeds.stride(1), positions.stride(0),
        BLOCK=block, num_warps=max(1, min(8, block // 256)))
    return out


def gumbel_debug(seeds: torch.Tensor, positions: torch.Tensor,
                 vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's hash and noise for every row and token, to check against gumbel_ref:
    (row keys int64 [B], 32-bit hashes int64 [B, V] (bits = hash >> 8), noise float32 [B, V])."""
    b = _check_seeds_positions(seeds, positions, None)
    if not isinstance(vocab_size, int) or vocab_size < 0:
        raise ValueError(f"vocab_size must be an int >= 0, got {vocab_size!r}")
    dev = seeds.device
    keys = torch.empty(b, dtype=torch.int64, device=dev)
    hashes = torch.empty(b, vocab_size, dtype=torch.int64, device=dev)
    noise = torch.empty(b, vocab_size, dtype=torch.float32, device=dev)
    if b == 0 or vocab_size == 0:
        return keys, hashes, noise
    block = min(BLOCK_V, triton.next_power_of_2(vocab_size))
    _gumbel_noise_kernel[(b, triton.cdiv(vocab_size, block))](
        seeds, positions, keys, hashes, noise, vocab_size,
        seeds.stride(0), seeds.stride(1), positions.stride(0), BLOCK=block)
    return keys, hashes, noise


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [B, V]: the Gumbel noise of (seed, position, token id), as the argmax kernel adds it."""
    return gumbel_debug(seeds, positions, vocab_size)[2]
