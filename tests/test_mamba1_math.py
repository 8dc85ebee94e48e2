"""The Mamba1 pure math: the varlen selective scan equals the one-token update applied token by
token (with initial states), a prefill fed in pieces equals one call, and the scan equals HF's
torch reference (`mamba_selective_scan`) from a zero state."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toolkit.kernels.selective_scan_ref import selective_scan_varlen, selective_state_update
from toolkit.layers.mamba1_mixer import weightless_rms_norm

TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(t: int, s: int, di: int = 12, n: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(t, di, generator=g)
    delta = F.softplus(torch.randn(t, di, generator=g) - 1.0)
    A = -torch.exp(torch.rand(di, n, generator=g) * 2.0)
    B = torch.randn(t, n, generator=g)
    C = torch.randn(t, n, generator=g)
    D = 1.0 + 0.1 * torch.randn(di, generator=g)
    init = torch.randn(s, di, n, generator=g)
    return u, delta, A, B, C, D, init


def _cu(lens: list[int]) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _step_by_step(u, delta, A, B, C, D, lens, init):
    """Reference: `selective_state_update` one token at a time, one sequence at a time."""
    ys, finals = [], []
    cu = _cu(lens).tolist()
    for i in range(len(lens)):
        st = init[i : i + 1]
        for j in range(cu[i], cu[i + 1]):
            y, st = selective_state_update(st, u[j : j + 1], delta[j : j + 1], A, B[j : j + 1], C[j : j + 1], D)
            ys.append(y)
        finals.append(st)
    return torch.cat(ys), torch.cat(finals)


def test_varlen_scan_matches_step_updates_with_initial_states():
    lens = [7, 1, 13, 2, 5]
    u, delta, A, B, C, D, init = _inputs(sum(lens), len(lens), seed=1)
    init[1] = 0.0                                             # a fresh sequence among continuing ones
    y, fin = selective_scan_varlen(u, delta, A, B, C, D, _cu(lens), init)
    y_ref, fin_ref = _step_by_step(u, delta, A, B, C, D, lens, init)
    assert y.dtype == torch.float32 and fin.shape == (len(lens), 12, 5)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(fin, fin_ref, **TOL)


def test_initial_states_none_means_zeros_and_empty_sequence_keeps_its_state():
    lens = [4, 0, 3]
    u, delta, A, B, C, D, init = _inputs(sum(lens), len(lens), seed=2)
    y0, fin0 = selective_scan_varlen(u, delta, A, B, C, D, _cu(lens), None)
    y1, fin1 = selective_scan_varlen(u, delta, A, B, C, D, _cu(lens), torch.zeros_like(init))
    torch.testing.assert_close(y0, y1, **TOL)
    torch.testing.assert_close(fin0, fin1, **TOL)
    _, fin = selective_scan_varlen(u, delta, A, B, C, D, _cu(lens), init)
    torch.testing.assert_close(fin[1], init[1])
    # the initial state matters (a scan that ignored it would pass the checks above)
    assert not torch.allclose(fin[0], fin0[0], atol=1e-3)


def test_prefill_in_pieces_equals_one_call():
    u, delta, A, B, C, D, init = _inputs(40, 1, seed=3)
    y_full, fin_full = selective_scan_varlen(u, delta, A, B, C, D, _cu([40]), init)
    state, ys, done = init, [], 0
    for q in [10, 17, 1, 1, 11]:
        sl = slice(done, done + q)
        y, state = selective_scan_varlen(u[sl], delta[sl], A, B[sl], C[sl], D, _cu([q]), state)
        ys.append(y)
        done += q
    torch.testing.assert_close(torch.cat(ys), y_full, **TOL)
    torch.testing.assert_close(state, fin_full, **TOL)


def test_step_update_equals_scan_of_one_token_sequences():
    u, delta, A, B, C, D, init = _inputs(6, 6, seed=4)
    y_ref, fin_ref = selective_scan_varlen(u, delta, A, B, C, D, _cu([1] * 6), init)
    y, fin = selective_state_update(init, u, delta, A, B, C, D)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(fin, fin_ref, **TOL)


def test_scan_matches_hf_torch_reference():
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    u, delta, A, B, C, D, _ = _inputs(21, 1, seed=5)
    dt_raw, dt_bias = torch.randn(21, 12), torch.randn(12) - 2.0
    delta = F.softplus(dt_raw + dt_bias)
    y, fin = selective_scan_varlen(u, delta, A, B, C, D, _cu([21]), None)
    ref, ref_state = mamba_selective_scan(
        u.t()[None], dt_raw.t()[None], A, B.t()[None], C.t()[None], D=D, z=None,
        delta_bias=dt_bias, delta_softplus=True, return_last_state=True, use_associative_scan=False,
    )
    torch.testing.assert_close(y, ref[0].t(), **TOL)
    torch.testing.assert_close(fin[0], ref_state[0], **TOL)


def test_weightless_rms_norm():
    x = torch.randn(5, 7)
    torch.testing.assert_close(weightless_rms_norm(x, 1e-6), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weightless_rms_norm_is_the_rms_norm_op_with_a_weight_of_ones(dtype):
    """FalconMamba's B/C/dt norms run as the RMS-norm op (one Triton launch) with a weight of ones:
    bit-identical to HF's weightless norm, as x * 1 is exact."""
    from toolkit.kernels.rms_norm_ref import rms_norm
    x = (3 * torch.randn(5, 7, 24)).to(dtype)
    assert torch.equal(rms_norm(x, torch.ones(24, dtype=dtype), 1e-6), weightless_rms_norm(x, 1e-6))
