import pytest
import torch

from toolkit.errors import InvalidRequestError
from toolkit.sampling import Sampler, SamplingParams, _filtered_probs


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(max_tokens=1.5), dict(temperature=-1),
                                    dict(temperature=float("nan")), dict(top_p=0), dict(top_p=1.5),
                                    dict(top_k=-2), dict(seed="x"), dict(stop_token_ids=[-1])])
def test_bad_values_raise_naming_the_field(kwargs):
    with pytest.raises(InvalidRequestError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_filter():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = _filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.allclose(p[:2].sum(), torch.tensor(1.0))
    p = _filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert (p > 0).tolist() == [True, True, False, False]
    p = _filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.4))
    assert (p > 0).tolist() == [True, False, False, False]


def test_seeded_rows_sample_independently_of_batch_position():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=123)
    alone = Sampler(4, torch.device("cpu"))
    alone.add_request(0, params, default_seed=0)
    first = [alone(logits[1:2], [0]).item() for _ in range(5)]
    batched = Sampler(4, torch.device("cpu"))
    batched.add_request(2, SamplingParams(temperature=0.0), 0)
    batched.add_request(3, params, default_seed=99)
    batched.add_request(1, SamplingParams(temperature=1.0, seed=5), 0)
    got = [batched(logits, [2, 3, 1])[1].item() for _ in range(5)]
    assert got == first


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 0.0]])
    s = Sampler(2, torch.device("cpu"))
    s.add_request(0, SamplingParams(temperature=0.0), 0)
    s.add_request(1, SamplingParams(temperature=0.0), 0)
    assert s(logits, [0, 1]).tolist() == [1, 0]
