"""kernels/gumbel.py: the Gumbel-max sampling kernel against toolkit.sampling, under TRITON_INTERPRET=1 on the CPU
or compiled on CUDA (harness.KERNEL_DEVICE): the integer hash bit for bit, the noise within an ulp or so (log
rounding may differ by device and library), the sampled token ids equal to the reference's, and exact ties
resolved to the first index."""
from __future__ import annotations

import math

import pytest
import torch

from harness import KERNEL_DEVICE as DEV  # the test device: CPU (interpreter) or CUDA (compiled)

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
from toolkit.kernels import (
    gumbel,
    gumbel_ref,
)

M32 = 2**32 - 1
# the noise is -log(-log(u)) with u exact on both sides: only the two logs' rounding may differ, so
# about one ulp of the noise (|noise| <= 17.4) or of the inner log where the noise is near 0
NOISE_TOL = dict(atol=2e-7, rtol=1e-6)


def _seeds_positions(b, pos_dtype, g):
    seeds = torch.randint(0, 2**32, (b, 2), generator=g, dtype=torch.int64)
    seeds[0] = torch.tensor([0, 0])
    seeds[1] = torch.tensor([M32, M32])
    seeds[2] = torch.tensor([M32, 0])
    seeds[3] = torch.tensor([0, M32])
    positions = torch.randint(0, 2**31 - 1, (b,), generator=g).to(pos_dtype)
    positions[0], positions[1], positions[2], positions[3] = 0, 2**31 - 1, 1, 2**31 - 1
    return seeds.to(DEV), positions.to(DEV)


def _reference_hash(seeds, positions, vocab):
    keys = gumbel_ref.row_keys(seeds, positions)
    return keys, gumbel_ref._mix32(keys[:, None] ^ gumbel_ref._token_terms(vocab, keys.device)[None, :])


@pytest.mark.parametrize("vocab", [37, 1000, 2 * gumbel.BLOCK_V + 77])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_hash_is_bit_identical_and_noise_matches(vocab, pos_dtype):
    g = torch.Generator().manual_seed(0)
    seeds, positions = _seeds_positions(6, pos_dtype, g)
    keys, hashes, noise = gumbel.gumbel_debug(seeds, positions, vocab)
    ref_keys, ref_hashes = _reference_hash(seeds, positions, vocab)
    assert torch.equal(keys, ref_keys)
    assert torch.equal(hashes, ref_hashes)                       # all 32 bits, so the top 24 too
    assert torch.equal(hashes >> 8, ref_hashes >> 8)
    assert int(hashes.min()) >= 0 and int(hashes.max()) <= M32
    torch.testing.assert_close(noise, gumbel_ref.gumbel_noise(seeds, positions, vocab), **NOISE_TOL)
    assert torch.equal(gumbel.gumbel_noise(seeds, positions, vocab), noise)


def test_noise_matches_the_pinned_values():
    """The values pinned in tests/test_sampling.py::test_noise_function_is_pinned."""
    seeds = torch.tensor([[7, 0], list(gumbel_ref.split_seed(2**64 - 1))], device=DEV)
    positions = torch.tensor([3, 100_000], device=DEV)
    keys, _, noise = gumbel.gumbel_debug(seeds, positions, 6)
    assert keys.tolist() == [3280815260, 736141308]
    expected = torch.tensor([[-0.5307542085647583, 0.5065405368804932, 4.152034759521484, -0.5772920846939087,
                              2.116760015487671, 1.557175874710083],
                             [1.0151939392089844, 3.7878448963165283, -0.7357837557792664, 0.031313855201005936,
                              -0.5239468216896057, -0.27157124876976013]], device=DEV)
    torch.testing.assert_close(noise, expected, **NOISE_TOL)


@pytest.mark.parametrize("vocab", [37, 1000, 2 * gumbel.BLOCK_V + 77])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_gumbel_argmax_equals_reference(vocab, pos_dtype):
    g = torch.Generator().manual_seed(1)
    b = 12
    wide = torch.randn(b, vocab + 9, generator=g) * 3.0             # row stride > V: a column slice
    scaled = wide[:, 5:5 + vocab]
    scaled[torch.rand(b, vocab, generator=g) < 0.5] = float("-inf")  # filtered tokens
    scaled[4] = float("-inf")
    scaled[4, vocab - 1] = 0.3                                       # one finite token, the last
    scaled[5, : vocab // 2] = float("-inf")                          # only the second half alive
    scaled[6] = scaled[6] / 0.01                                     # a tiny temperature
    scaled = wide.to(DEV)[:, 5:5 + vocab]                            # the same view, on the test device
    seeds_c, positions = _seeds_positions(b, pos_dtype, g)
    seeds = torch.zeros(b, 3, dtype=torch.int64, device=DEV)
    seeds[:, 1:] = seeds_c
    seeds = seeds[:, 1:]                                             # a non-contiguous view
    ours = gumbel.gumbel_argmax(scaled, seeds, positions)
    assert ours.dtype == torch.int64 and ours.shape == (b,)
    assert torch.equal(ours, gumbel_ref.gumbel_argmax_ref(scaled, seeds, positions))
    assert ours[4] == vocab - 1 and (ours[5] >= vocab // 2)
    assert torch.isfinite(scaled.gather(1, ours[:, None])).all()


def _exact_partner(target, noise_b):
    """A float32 s with s + noise_b == target exactly, or None: float32 sums step by s's ULP, which
    can be twice target's, so some (target, noise_b) pairs have none."""
    s = target - noise_b
    for _ in range(8):
        total = s + noise_b
        if total == target:
            return s
        s = torch.nextafter(s, s + (target - total))
    return None


def _tie_row(noise_ours, noise_ref, vocab, first, second):
    """A row that is -inf except tokens a < b (a: the first token >= `first`, b: the first >= `second`
    that admits an exact tie, both with the same noise on both sides) whose sums scaled + noise are
    exactly equal, and a lower third token."""
    same = noise_ours == noise_ref
    a = first + int(same[first:].nonzero()[0])
    row = torch.full((vocab,), float("-inf"), device=noise_ours.device)
    row[a] = 0.0
    target = noise_ours[a]                                           # the sum at a: 0 + noise, exact
    for b in (second + same[second:].nonzero()[:, 0]).tolist():
        s = _exact_partner(target, noise_ours[b])
        if s is not None:
            break
    assert a < b and s is not None and s + noise_ours[b] == target
    row[b] = s
    third = (a + b) // 2 if (a + b) // 2 not in (a, b) else b + 1
    row[third] = target - noise_ours[third] - 1.0                   # clearly below the tie
    return row, a, b


def test_exact_ties_take_the_first_index():
    block = gumbel.BLOCK_V
    vocab = 2 * block + 100
    pairs = [(3, 3 + block),              # same lane, different loop steps
             (block + 5, 2 * block + 2),  # the later token sits in a lower lane
             (10, 11),                    # neighbours in one step
             (0, vocab - 60)]             # first and (near) last token
    seeds = torch.tensor([[11, 22], [M32, M32], [5, 0], [0, 9]], device=DEV)
    positions = torch.tensor([0, 2**31 - 1, 42, 7], device=DEV)
    noise = gumbel.gumbel_noise(seeds, positions, vocab)
    noise_ref = gumbel_ref.gumbel_noise(seeds, positions, vocab)
    rows, firsts = [], []
    for i, (first, second) in enumerate(pairs):
        row, a, bb = _tie_row(noise[i], noise_ref[i], vocab, first, second)
        assert row[a] + noise[i, a] == row[bb] + noise[i, bb]            # an exact tie for the kernel
        assert row[a] + noise_ref[i, a] == row[bb] + noise_ref[i, bb]    # and for the reference
        rows.append(row)
        firsts.append(a)
    scaled = torch.stack(rows)
    ours = gumbel.gumbel_argmax(scaled, seeds, positions)
    assert ours.tolist() == firsts
    assert torch.equal(ours, gumbel_ref.gumbel_argmax_ref(scaled, seeds, positions))


def test_rows_outside_the_contract_behave_as_torch_argmax():
    """NaN in a row: the first NaN wins; an all -inf row gives 0 (both as torch.argmax)."""
    vocab = 300
    g = torch.Generator().manual_seed(3)
    scaled = torch.randn(3, vocab, generator=g)
    scaled[0, [40, 250]] = float("nan")
    scaled[1] = float("-inf")
    scaled[2, 7] = float("nan")
    scaled = scaled.to(DEV)
    seeds, positions = torch.tensor([[1, 2], [3, 4], [5, 6]], device=DEV), torch.tensor([9, 8, 7], device=DEV)
    ours = gumbel.gumbel_argmax(scaled, seeds, positions)
    assert ours.tolist() == [40, 0, 7]
    assert torch.equal(ours, gumbel_ref.gumbel_argmax_ref(scaled, seeds, positions))


def test_gumbel_launcher_names_what_is_wrong():
    scaled = torch.zeros(3, 50)
    seeds, positions = torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"scaled must be float32 \[B, V\], got torch.float16"):
        gumbel.gumbel_argmax(scaled.half(), seeds, positions)
    with pytest.raises(ValueError, match=r"seeds must be int64 \[B=3, 2\].*\(3,\)"):
        gumbel.gumbel_argmax(scaled, torch.zeros(3, dtype=torch.int64), positions)
    with pytest.raises(ValueError, match=r"seeds must be int64 \[B=3, 2\].*torch.int32"):
        gumbel.gumbel_argmax(scaled, seeds.int(), positions)
    with pytest.raises(ValueError, match=r"positions must be int32/int64 \[B=3\], got torch.int64 \(4,\)"):
        gumbel.gumbel_argmax(scaled, seeds, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"positions must be int32/int64 \[B=3\], got torch.float32"):
        gumbel.gumbel_argmax(scaled, seeds, torch.zeros(3))
    with pytest.raises(ValueError, match="contiguous in its last"):
        gumbel.gumbel_argmax(torch.zeros(50, 3).t(), seeds, positions)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 0"):
        gumbel.gumbel_noise(seeds, positions, -1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: real shapes")
def test_real_shape_on_cuda():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    b, vocab = 256, 151936
    logits = torch.randn(b, vocab + 64, generator=g, device=dev)[:, :vocab] * 4.0
    temperature = torch.rand(b, 1, generator=g, device=dev) * 1.5 + 0.05
    scaled = logits / temperature
    kth = scaled.topk(50, dim=-1).values[:, -1:]
    scaled[: b // 2] = scaled[: b // 2].masked_fill(scaled[: b // 2] < kth[: b // 2], float("-inf"))  # top-k rows
    seeds = torch.randint(0, 2**32, (b, 2), generator=g, device=dev, dtype=torch.int64)
    seeds[0] = M32
    positions = torch.randint(0, 2**31 - 1, (b,), generator=g, device=dev, dtype=torch.int32)
    positions[0], positions[1] = 0, 2**31 - 1
    ours = gumbel.gumbel_argmax(scaled, seeds, positions)
    assert torch.equal(ours, gumbel_ref.gumbel_argmax_ref(scaled, seeds, positions))
    keys, hashes, noise = gumbel.gumbel_debug(seeds, positions, vocab)
    ref_keys, ref_hashes = _reference_hash(seeds, positions, vocab)
    assert torch.equal(keys, ref_keys) and torch.equal(hashes, ref_hashes)
    torch.testing.assert_close(noise, gumbel_ref.gumbel_noise(seeds, positions, vocab), **NOISE_TOL)


def test_the_largest_hash_gives_finite_noise_and_a_filtered_token_never_wins():
    """Seed (7, 0), position 1871289: token 0's 24 hash bits are all ones. In float32 bits + 0.5 rounds
    to 2**24 there, so u would be 1 and the noise +inf (a -inf filtered token would win as NaN); u is
    capped below 1 on both sides: the noise is finite and the largest any token gets."""
    seeds = torch.tensor([[7, 0]], device=DEV)
    positions = torch.tensor([1871289], device=DEV)
    keys, hashed, noise = gumbel.gumbel_debug(seeds, positions, 16)
    assert int(hashed[0, 0]) >> 8 == 2**24 - 1
    ref = gumbel_ref.gumbel_noise(seeds, positions, 16)
    assert torch.isfinite(noise).all()
    torch.testing.assert_close(noise, ref, **NOISE_TOL)
    top = -math.log(-math.log1p(-2.0**-24))
    assert abs(float(noise[0, 0]) - top) < 1e-5
    scaled = torch.zeros(1, 16, device=DEV)
    scaled[0, 0] = float("-inf")                                     # token 0 filtered (top-k / top-p)
    assert gumbel.gumbel_argmax(scaled, seeds, positions).item() != 0
    assert gumbel_ref.gumbel_argmax_ref(scaled, seeds, positions).item() != 0
