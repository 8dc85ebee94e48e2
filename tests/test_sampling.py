"""SamplingParams validation and the position-keyed sampler, without a model."""
import numpy as np
import pytest
import torch

from toolkit.errors import InvalidRequestError
from toolkit.kernels.gumbel_ref import _mix32, _token_terms, gumbel_noise, row_keys, split_seed
from toolkit.runner.sampler import LogitsRows, Sampler, apply_top_k_top_p
from toolkit.sampling import MIN_TEMPERATURE, SamplingParams, derive_seed

CPU = torch.device("cpu")


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(max_tokens=1.5), dict(temperature=-1),
                                    dict(temperature=float("nan")), dict(top_p=0), dict(top_p=1.5),
                                    dict(top_k=-2), dict(seed="x"), dict(seed=2**64), dict(seed=-2),
                                    dict(stop_token_ids=[-1]), dict(stop_token_ids="ab"),
                                    dict(ignore_eos="yes")])
def test_bad_values_raise_naming_the_field(kwargs):
    with pytest.raises(InvalidRequestError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_noise_function_is_pinned():
    """Fixed (seed, position, token id) give fixed noise: a change to the definition (and so to
    every seeded request's tokens) must be deliberate."""
    seeds = torch.tensor([[7, 0], list(split_seed(2**64 - 1))])
    positions = torch.tensor([3, 100_000])
    assert row_keys(seeds, positions).tolist() == [3280815260, 736141308]
    # the hash: 24 random bits per token, exact integers (u = (bits + 0.5) / 2**24, noise = -log(-log(u)))
    bits = _mix32(row_keys(seeds, positions)[:, None] ^ _token_terms(6, seeds.device)[None, :]) >> 8
    assert bits.tolist() == [[3064264, 9183838, 16515335, 2825861, 14873790, 13589417],
                             [11677799, 16401576, 2081116, 6365230, 3099814, 4517674]]
    expected = torch.tensor([[-0.5307542085647583, 0.5065405368804932, 4.152034759521484, -0.5772920846939087,
                              2.116760015487671, 1.5571757555007935],
                             [1.0151939392089844, 3.7878448963165283, -0.7357837557792664, 0.031313855201005936,
                              -0.5239468216896057, -0.27157124876976013]])
    # float32 log's last bit depends on the CPU's vector unit (AVX2 and AVX-512 machines differ by 1
    # ULP on [0, 5]: 1.5571758747 against 1.5571757555, the latter correctly rounded): 2 ULPs allowed
    torch.testing.assert_close(gumbel_noise(seeds, positions, 6), expected, rtol=2.4e-7, atol=0)
    assert derive_seed(0, 0) == 12035550249420947055
    assert derive_seed(2**60, 5) == 18384697002094791854


def test_noise_depends_on_each_input_and_is_gumbel_distributed():
    base = gumbel_noise(torch.tensor([[1, 0]]), torch.tensor([10]), 4096)[0]
    for seeds, pos in [([[2, 0]], [10]), ([[1, 1]], [10]), ([[1, 0]], [11])]:
        other = gumbel_noise(torch.tensor(seeds), torch.tensor(pos), 4096)[0]
        assert (other != base).float().mean() > 0.99
    # Gumbel(0, 1): mean 0.5772 (Euler's constant), variance pi^2 / 6
    assert abs(base.mean().item() - 0.5772) < 0.06 and abs(base.var().item() - 1.6449) < 0.15


def test_sampled_frequencies_follow_the_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    s = Sampler(1, CPU)
    s.add_request(0, SamplingParams(temperature=1.0, seed=3), seed=3)
    logits = probs.log().expand(n, 4)
    sampled = s(logits, LogitsRows.of(np.zeros(n, dtype=np.int64), torch.arange(n), np.ones(n, dtype=bool)))
    freq = torch.bincount(sampled, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_top_k_and_top_p_filter_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    out = apply_top_k_top_p(logits, torch.tensor([2, 0, 0, 0]), torch.tensor([1.0, 0.7, 0.4, 1.0]))
    kept = torch.isfinite(out).tolist()
    assert kept == [[True, True, False, False], [True, True, False, False],
                    [True, False, False, False], [True, True, True, True]]


def test_seeded_rows_sample_independently_of_batch_position():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=123)
    alone = Sampler(4, CPU)
    alone.add_request(0, params, seed=123)
    first = [alone(logits[1:2], LogitsRows.of(np.array([0]), torch.tensor([p]), np.array([True]))).item()
             for p in range(5)]
    batched = Sampler(4, CPU)
    batched.add_request(2, SamplingParams(temperature=0.0), 0)
    batched.add_request(3, params, seed=123)
    batched.add_request(1, SamplingParams(temperature=1.0, seed=5), 5)
    got = [batched(logits, LogitsRows.of(np.array([2, 3, 1]), torch.tensor([9, p, 4]), np.ones(3, bool)))[1].item()
           for p in range(5)]
    assert got == first


def test_rows_that_draw_nothing_take_the_argmax():
    logits = torch.tensor([[0.0, 0.1, 0.05]] * 2)
    s = Sampler(2, CPU)
    s.add_request(0, SamplingParams(temperature=100.0), seed=1)
    s.add_request(1, SamplingParams(temperature=100.0), seed=1)
    draws = [s(logits, LogitsRows.of(np.array([0, 1]), torch.tensor([p, p]), np.array([True, False]))).tolist()
             for p in range(40)]
    assert all(d[1] == 1 for d in draws) and len({d[0] for d in draws}) == 3


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 0.0]])
    s = Sampler(2, CPU)
    s.add_request(0, SamplingParams(temperature=0.0), 0)
    s.add_request(1, SamplingParams(temperature=0.0), 0)
    assert s(logits, LogitsRows.of(np.array([0, 1]), torch.tensor([1, 1]), np.ones(2, bool))).tolist() == [1, 0]


def test_tiny_temperature_is_floored_and_stays_finite():
    s = Sampler(1, CPU)
    s.add_request(0, SamplingParams(temperature=1e-45, seed=0), seed=0)
    assert s.temperature[0] == np.float32(MIN_TEMPERATURE)
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    # at T = 1e-2 a gap of 1 is 100 nats: the sampler picks the argmax, with no NaN on the way
    assert s(logits, LogitsRows.of(np.array([0]), torch.tensor([0]), np.array([True]))).tolist() == [1]


def test_noise_is_the_same_on_cuda_when_present():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CPU/CUDA comparison runs on a GPU machine")
    seeds = torch.randint(0, 2**32, (8, 2))
    pos = torch.randint(0, 10_000, (8,))
    assert torch.equal(gumbel_noise(seeds, pos, 1000), gumbel_noise(seeds.cuda(), pos.cuda(), 1000).cpu())
