"""The Mamba2 pure math: chunked varlen SSD == per-token recurrence; conv with state == plain conv
over the concatenated history; one-step updates == their sequence forms; chunk layout rules."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toolkit.kernels.causal_conv1d_ref import causal_conv1d_step, causal_conv1d_varlen
from toolkit.kernels.selective_state_update_ref import mamba2_dt, ssm_step
from toolkit.kernels.ssd_scan_ref import ssd_chunk_scan_varlen, ssm_scan_sequential_ref

from model_helpers import mamba2_chunk_layout

TOL = dict(atol=1e-5, rtol=1e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ssm_inputs(t: int, s: int, h: int = 6, p: int = 5, n: int = 7, g: int = 2, seed: int = 0):
    gen = _gen(seed)
    x = torch.randn(t, h, p, generator=gen)
    dt = mamba2_dt(torch.randn(t, h, generator=gen) - 1.0, torch.randn(h, generator=gen) * 0.5)
    A = -torch.exp(torch.rand(h, generator=gen) * 2.0)
    B = torch.randn(t, g, n, generator=gen)
    C = torch.randn(t, g, n, generator=gen)
    D = 1.0 + 0.1 * torch.randn(h, generator=gen)
    init = torch.randn(s, h, p, n, generator=gen)
    return x, dt, A, B, C, D, init


def _cu(lens: list[int]) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def test_chunk_layout_rules():
    # fresh 37-token prompt: 16 | 16 | 5
    assert mamba2_chunk_layout([37], [0], 16) == ([0, 16, 32, 37], [0, 0, 0], [2])
    # continuing at 10: top up to 16 first (6), then 11
    assert mamba2_chunk_layout([17], [10], 16) == ([0, 6, 17], [0, 0], [1])
    # continuing at 27 with 3 tokens: the top-up chunk is cut by the end of the query
    assert mamba2_chunk_layout([3], [27], 16) == ([0, 3], [0], [0])
    # several sequences: chunks never cross a sequence
    assert mamba2_chunk_layout([20, 4, 16], [0, 32, 8], 16) == (
        [0, 16, 20, 24, 32, 40], [0, 0, 1, 2, 2], [1, 2, 4])


@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("chunk_size", [4, 16])
def test_chunked_scan_matches_sequential_varlen_with_initial_states(chunk_size: int, g: int):
    lens = [37, 5, 16, 1, 23, 2]
    computed = [10, 0, 32, 7, 3, 0]          # mid-chunk starts (10, 7, 3) and aligned ones
    has_init = torch.tensor([c > 0 for c in computed])
    x, dt, A, B, C, D, init = _ssm_inputs(sum(lens), len(lens), g=g, seed=chunk_size + g)
    init = torch.where(has_init[:, None, None, None], init, torch.zeros(()))
    cu, sidx, last = mamba2_chunk_layout(lens, computed, chunk_size)
    y, fin = ssd_chunk_scan_varlen(
        x, dt, A, B, C, D, torch.tensor(cu), torch.tensor(sidx), torch.tensor(last), chunk_size, init
    )
    y_ref, fin_ref = ssm_scan_sequential_ref(x, dt, A, B, C, D, _cu(lens), init)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(fin, fin_ref, **TOL)


def test_chunked_scan_split_anywhere_equals_one_shot():
    """Feeding a sequence in pieces (state carried between calls) equals one call."""
    x, dt, A, B, C, D, _ = _ssm_inputs(50, 1, seed=3)
    cs = 16
    cu, sidx, last = mamba2_chunk_layout([50], [0], cs)
    y_full, fin_full = ssd_chunk_scan_varlen(
        x, dt, A, B, C, D, torch.tensor(cu), torch.tensor(sidx), torch.tensor(last), cs, None)
    state = None
    ys = []
    done = 0
    for q in [10, 17, 1, 1, 21]:
        cu, sidx, last = mamba2_chunk_layout([q], [done], cs)
        sl = slice(done, done + q)
        y, state = ssd_chunk_scan_varlen(
            x[sl], dt[sl], A, B[sl], C[sl], D, torch.tensor(cu), torch.tensor(sidx), torch.tensor(last), cs, state)
        ys.append(y)
        done += q
    torch.testing.assert_close(torch.cat(ys), y_full, **TOL)
    torch.testing.assert_close(state, fin_full, **TOL)


def test_ssm_step_matches_sequential():
    x, dt, A, B, C, D, init = _ssm_inputs(6, 6, seed=4)
    # six one-token sequences == six independent steps
    y_ref, fin_ref = ssm_scan_sequential_ref(x, dt, A, B, C, D, _cu([1] * 6), init)
    y, fin = ssm_step(init, x, dt, A, B, C, D)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(fin, fin_ref, **TOL)


def _plain_conv(hist: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """silu(depthwise conv) over hist [L, D] with zero left padding -> [L, D]."""
    k = w.shape[-1]
    out = F.conv1d(hist.t()[None], w[:, None, :], b, padding=k - 1, groups=hist.shape[1])[0, :, : hist.shape[0]]
    return F.silu(out).t()


@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_with_state_equals_conv_over_history(with_bias: bool):
    gen = _gen(5)
    d, k = 12, 4
    w = torch.randn(d, k, generator=gen)
    b = torch.randn(d, generator=gen) if with_bias else None
    lens = [9, 1, 2, 5, 3]
    prefix_lens = [6, 3, 0, 11, 2]            # history before each sequence (0 = fresh, zero state)
    prefixes = [torch.randn(pl, d, generator=gen) for pl in prefix_lens]
    xs = [torch.randn(n, d, generator=gen) for n in lens]
    init = torch.zeros(len(lens), k - 1, d)
    for i, pre in enumerate(prefixes):
        m = min(k - 1, pre.shape[0])
        if m:
            init[i, k - 1 - m:] = pre[-m:]
    out, fin = causal_conv1d_varlen(torch.cat(xs), w, b, _cu(lens), init, "silu")
    cu = _cu(lens).tolist()
    for i, (pre, x) in enumerate(zip(prefixes, xs)):
        hist = torch.cat([pre, x])
        ref = _plain_conv(hist, w, b)[pre.shape[0]:]
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], ref, **TOL)
        full = torch.cat([torch.zeros(k - 1, d), hist])
        torch.testing.assert_close(fin[i], full[-(k - 1):], **TOL)


def test_conv_step_equals_varlen():
    gen = _gen(6)
    d, k, bsz = 10, 4, 5
    w, b = torch.randn(d, k, generator=gen), torch.randn(d, generator=gen)
    state = torch.randn(bsz, k - 1, d, generator=gen)
    x = torch.randn(bsz, d, generator=gen)
    out, new = causal_conv1d_step(x, state, w, b, "silu")
    out_ref, new_ref = causal_conv1d_varlen(x, w, b, _cu([1] * bsz), state, "silu")
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(new, new_ref, **TOL)
    torch.testing.assert_close(new[:, -1], x)


def test_chunk_scan_rejects_bad_layout():
    x, dt, A, B, C, D, _ = _ssm_inputs(20, 1, seed=7)
    with pytest.raises(ValueError, match="chunk layout"):
        ssd_chunk_scan_varlen(x, dt, A, B, C, D, torch.tensor([0, 20]), torch.tensor([0]), torch.tensor([0]), 16, None)


def test_cached_A_follows_in_place_edits_and_inference_mode_parameters():
    """A = -exp(A_log) is cached per weight version (no kernels per step); an in-place edit of
    A_log must show in the next call, and parameters made under inference_mode (no version
    counter) are recomputed every time."""
    from toolkit.layers.mamba2_mixer import Mamba2Mixer
    kw = dict(layer_name="m", hidden_size=16, num_heads=4, head_dim=4, state_size=8, n_groups=1, conv_kernel=4,
              chunk_size=8)
    mixer = Mamba2Mixer(**kw)
    with torch.no_grad():
        mixer.A_log.copy_(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    first = mixer.neg_exp_A()
    assert mixer.neg_exp_A() is first                                  # cached
    with torch.no_grad():
        mixer.A_log.mul_(2.0)
    torch.testing.assert_close(mixer.neg_exp_A(), -torch.exp(torch.tensor([0.0, 2.0, 4.0, 6.0])))
    with torch.inference_mode():
        frozen = Mamba2Mixer(**kw)
        frozen.A_log.fill_(1.0)
        assert frozen.A_log.is_inference()
        torch.testing.assert_close(frozen.neg_exp_A(), torch.full((4,), -torch.e))
        frozen.A_log.fill_(0.0)
        torch.testing.assert_close(frozen.neg_exp_A(), torch.full((4,), -1.0))
