"""Speculative decoding's verify rows in one op call per layer: every recurrent update op (conv, Mamba1,
Mamba2, Gated DeltaNet, mLSTM), given vLLM's `query_start_loc` and `num_accepted_tokens` and state indices
[R, 1 + k], equals the same op run token by token, each token's state first copied into its own
column (what the runner did before, kernels/state_slots_ref.step_rows_at_columns): ragged rows (0 to k
drafts), every accepted count, a padded row, fp32 and bf16 state caches. The torch references on the
CPU; the Triton kernels under TRITON_INTERPRET=1 (or compiled on CUDA: harness.KERNEL_DEVICE)."""
from __future__ import annotations

import pytest
import torch

from toolkit.layers.ops import TORCH_OPS

from harness import KERNEL_DEVICE

K = 3                                    # drafts per row at most: 1 + K state columns
LENS = [1, 4, 2, 3]                      # tokens per real row: 0, 3, 1 and 2 drafts
ACCEPTED = [1, 2, 4, 3]                  # each row starts from column accepted - 1
NUM_SLOTS = 24


def _ops(name: str):
    if name == "torch":
        return TORCH_OPS, torch.device("cpu")
    pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")
    from toolkit.layers.ops import triton_ops
    return triton_ops(torch.device(KERNEL_DEVICE)), KERNEL_DEVICE


def _rows(device, padded_tokens: int):
    """state_indices [R+1, 1+K] (distinct slots; the last row padded, PAD_SLOT_ID), query_start_loc,
    num_accepted_tokens; T tokens (the padded row holds `padded_tokens` of them)."""
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:len(LENS) * (1 + K)].view(len(LENS), 1 + K)
    idx = torch.cat([slots, torch.full((1, 1 + K), -1)]).to(device=device, dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(LENS + [padded_tokens]).cumsum(0).tolist()], dtype=torch.int32, device=device)
    accepted = torch.tensor(ACCEPTED + [1], dtype=torch.int32, device=device)
    return idx, qsl, accepted, int(qsl[-1])


def _token_by_token(op, cache, idx, qsl, accepted, inputs, call):
    """The verify rows as the runner ran them before: per token, copy the state the token starts from
    into its own column, then the one-token op there."""
    ys = {}
    for r in range(idx.shape[0]):
        if int(idx[r, 0]) < 0:
            continue
        src = int(idx[r, int(accepted[r]) - 1])
        for j, t in enumerate(range(int(qsl[r]), int(qsl[r + 1]))):
            dst = int(idx[r, j])
            cache[dst] = cache[src]
            ys[t] = call(op, cache, [x[t:t + 1] for x in inputs], idx[r, j:j + 1])[0]
            src = dst
    return ys


CASES = {
    # name: (op attribute, state shape per slot, input makers, the call)
    "conv": "conv_update",
    "mamba1": "mamba1_update",
    "mamba2": "mamba2_update",
    "gdn": "gdn_update",
    "mlstm": "mlstm_update",
}


def _case(name: str, t: int, device, gen):
    """(state [S, ...], per-token inputs [T, ...], call(op, cache, inputs, state_indices, **verify))."""
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)
    if name == "conv":
        dc, width = 12, 4
        weight, bias = rnd(dc, width), rnd(dc)
        return rnd(NUM_SLOTS, width - 1, dc), [rnd(t, dc)], \
            lambda op, cache, ins, idx, **v: op(ins[0], cache, idx, weight, bias, "silu", **v)
    if name == "mamba1":
        di, n = 8, 4
        A, D = -torch.rand(di, n, generator=gen).to(device) - 0.1, rnd(di)
        dt = (torch.rand(t, di, generator=gen) * 0.5 + 0.05).to(device)
        return rnd(NUM_SLOTS, di, n), [rnd(t, di), dt, rnd(t, n), rnd(t, n)], \
            lambda op, cache, ins, idx, **v: op(cache, ins[0], ins[1], A, ins[2], ins[3], D, idx, **v)
    if name == "mamba2":
        h, p, g, n = 4, 8, 2, 4
        A, D, dt_bias = -torch.rand(h, generator=gen).to(device) - 0.1, rnd(h), rnd(h)
        return rnd(NUM_SLOTS, h, p, n), [rnd(t, h, p), rnd(t, h), rnd(t, g, n), rnd(t, g, n)], \
            lambda op, cache, ins, idx, **v: op(cache, ins[0], ins[1], A, ins[2], ins[3], D, idx, dt_bias,
                                                 (0.0, 6.0), **v)
    if name == "mlstm":
        # the three states (C [H, K, V], n [H, K], m [H]) as views of one packed tensor [S, H, K*V + K + 1],
        # so that a slot copy, a clone and a comparison take all three
        h, kd, vd = 2, 8, 4
        i_gate, f_gate = rnd(t, h, scale=2.0), rnd(t, h) + 2

        def states(cache):
            return (cache[..., :kd * vd].unflatten(-1, (kd, vd)), cache[..., kd * vd:kd * vd + kd],
                    cache[..., -1])
        return rnd(NUM_SLOTS, h, kd * vd + kd + 1, scale=0.5), [rnd(t, h, kd), rnd(t, h, kd), rnd(t, h, vd), i_gate,
                                                                 f_gate], \
            lambda op, cache, ins, idx, **v: op(*states(cache), *ins, idx, **v)
    hk, hv, kd, vd = 1, 2, 8, 4
    g_log = -torch.rand(t, hv, generator=gen).to(device)
    beta = torch.rand(t, hv, generator=gen).to(device)
    return rnd(NUM_SLOTS, hv, vd, kd, scale=0.5), [rnd(t, hk, kd), rnd(t, hk, kd), rnd(t, hv, vd), g_log, beta], \
        lambda op, cache, ins, idx, **v: op(cache, *ins, idx, **v)


# (ops, case, state dtype): bf16 state caches where the op takes them (the Mamba1, Gated DeltaNet and
# mLSTM kernels take fp32 state caches only, as the mixers allocate them; their launchers refuse others)
COMBOS = [(ops, case, dtype) for ops in ("torch", "triton") for case in sorted(CASES)
          for dtype in (torch.float32, torch.bfloat16)
          if not (ops == "triton" and case in ("mamba1", "gdn", "mlstm") and dtype != torch.float32)]


@pytest.mark.parametrize("padded_tokens", [1, 1 + K])     # a padded row still has its token(s)
@pytest.mark.parametrize("ops_name, case, state_dtype", COMBOS)
def test_verify_rows_in_one_call_equal_the_op_token_by_token(ops_name, case, padded_tokens, state_dtype):
    ops, device = _ops(ops_name)
    op = getattr(ops, CASES[case])
    idx, qsl, accepted, t = _rows(device, padded_tokens)
    gen = torch.Generator().manual_seed(2)
    state, inputs, call = _case(case, t, device, gen)
    state = state.to(state_dtype)
    one_call, by_token = state.clone(), state.clone()
    y = call(op, one_call, inputs, idx, query_start_loc=qsl, num_accepted_tokens=accepted)
    expected = _token_by_token(op, by_token, idx, qsl, accepted, inputs, call)
    assert y.shape[0] == t
    for tok in range(t):
        want = expected.get(tok, torch.zeros_like(y[tok]))     # the padded row's tokens: 0
        torch.testing.assert_close(y[tok], want.to(y.dtype), atol=1e-6, rtol=1e-6, msg=f"token {tok}")
    # every slot the rows wrote equals the token-by-token run; the slots no row touched are unchanged
    torch.testing.assert_close(one_call, by_token, atol=1e-6, rtol=1e-6)
    touched = {int(s) for r, n in enumerate(LENS) for s in idx[r, :n]}
    untouched = [s for s in range(NUM_SLOTS) if s not in touched]
    assert torch.equal(one_call[untouched], state[untouched])


def test_rows_without_drafts_cost_one_position():
    """The torch verify loops over positions; with no row longer than T - R + 1 tokens (known from the
    shapes, no host sync) it runs only those: rows without drafts cost one position, not 1 + k."""
    from toolkit.kernels.state_slots_ref import step_rows_at_columns
    calls = []

    def step(state, x):
        calls.append(len(x))
        return x * 2, state + x[:, None]
    cache = torch.zeros(NUM_SLOTS, 3)
    idx = torch.arange(4 * (1 + K), dtype=torch.int32).view(4, 1 + K)
    accepted = torch.ones(4, dtype=torch.int32)
    for lens, positions in (([1, 1, 1, 1], 1), ([1, 3, 1, 1], 3), ([4, 4, 4, 4], 4)):
        calls.clear()
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.arange(1, sum(lens) + 1, dtype=torch.float32)
        y = step_rows_at_columns(cache, idx, qsl, accepted, step, (x,), sum(lens))
        assert len(calls) == positions and torch.equal(y, 2 * x)
