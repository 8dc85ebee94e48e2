"""The Gated DeltaNet (Qwen3-Next) pure math of toolkit/layers/gdn.py: the chunked varlen prefill
equals the token-by-token recurrence (lengths 1, chunk-1, chunk, chunk+1 and longer, with and
without initial state, several sequences in one call, FLA's chunk layout and Mamba2's top-up one),
both equal HF's torch fallbacks, and the in-place forms at state indices read and write only their
slots."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf_q3n

from toolkit.attention.gdn import compute_gdn_chunk_metadata
from toolkit.attention.mamba2 import compute_chunk_metadata
from toolkit.kernels.gated_delta_rule_ref import (
    gdn_chunk_varlen,
    gdn_prefill_at_slots,
    gdn_recurrent_varlen,
    gdn_update_at_slots,
)

# the geometry of tiny-qwen3-next's GDN: 2 key heads x 8, 4 value heads x 16 (GVA, key dim != value dim)
HK, HV, KD, VD = 2, 4, 8, 16
MATH_ATOL = 1e-5
C = 16                                         # chunk size of the math tests
LENGTHS = [1, C - 1, C, C + 1, 3 * C + 5]


def gdn_inputs(seed: int, t: int, hk: int = HK, hv: int = HV, kd: int = KD, vd: int = VD):
    """Random q, k [T, Hk, K], v [T, Hv, V], g (log decay <= 0) and beta [T, Hv], as the mixer
    produces them (q, k unnormalised: the ops l2-normalise)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, kd, generator=g), torch.randn(t, hk, kd, generator=g)
    v = torch.randn(t, hv, vd, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(t, hv, generator=g))
    beta = torch.sigmoid(torch.randn(t, hv, generator=g))
    return q, k, v, decay, beta


def initial(seed: int, s: int, hv: int = HV, vd: int = VD, kd: int = KD) -> torch.Tensor:
    return 0.5 * torch.randn(s, hv, vd, kd, generator=torch.Generator().manual_seed(seed))


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def chunk_layout(lengths, chunk_size: int, num_computed=None):
    """FLA's layout (each sequence chunked from its first token), or Mamba2's (a sequence with
    num_computed tokens tops up to the next chunk boundary first)."""
    arrays = (compute_gdn_chunk_metadata(np.array(lengths), chunk_size) if num_computed is None
              else compute_chunk_metadata(np.array(lengths), np.array(num_computed), chunk_size))
    return tuple(torch.from_numpy(a) for a in arrays)


def assert_math_close(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got - want).abs().max().item()
    assert diff <= MATH_ATOL, f"max |diff| {diff:.3e} > {MATH_ATOL}"


@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("length", LENGTHS)
def test_chunked_prefill_matches_token_by_token(length, with_initial_state):
    q, k, v, g, beta = gdn_inputs(length, length)
    init = initial(length, 1) if with_initial_state else None
    cu = cu_of([length])
    y_ref, final_ref = gdn_recurrent_varlen(q, k, v, g, beta, cu, init)
    y, final = gdn_chunk_varlen(q, k, v, g, beta, *chunk_layout([length], C), C, init)
    assert y.shape == (length, HV, VD) and final.shape == (1, HV, VD, KD)
    assert y.dtype == final.dtype == torch.float32
    assert_math_close(y, y_ref)
    assert_math_close(final, final_ref)
    if with_initial_state:      # the state matters (else a dropped initial state would pass)
        assert (gdn_recurrent_varlen(q, k, v, g, beta, cu)[0] - y_ref).abs().max() > 1e-2


@pytest.mark.parametrize("layout", ["fla", "mamba2-top-up"])
def test_chunked_prefill_over_varlen_sequences(layout):
    """All lengths back to back in one call, some from an initial state: each sequence equals its
    own recurrence, for either chunk layout."""
    t = sum(LENGTHS)
    q, k, v, g, beta = gdn_inputs(1, t)
    init = initial(2, len(LENGTHS))
    init[1] = 0.0
    computed = None if layout == "fla" else [0, 0, 5, 16, 9]
    y, final = gdn_chunk_varlen(q, k, v, g, beta, *chunk_layout(LENGTHS, C, computed), C, init)
    y_ref, final_ref = gdn_recurrent_varlen(q, k, v, g, beta, cu_of(LENGTHS), init)
    assert_math_close(y, y_ref)
    assert_math_close(final, final_ref)


def test_references_match_hf_torch_fallbacks():
    """Ours vs HF's `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule` (chunk 16),
    GVA (Hv = 2 Hk), key dim != value dim; HF's state is [B, Hv, K, V], ours [S, Hv, V, K]."""
    t = 2 * C + 3
    q, k, v, g, beta = gdn_inputs(3, t)
    init = initial(4, 1)
    hf_args = dict(initial_state=init.transpose(-1, -2), output_final_state=True, use_qk_l2norm_in_kernel=True)
    y_ref, final_ref = gdn_recurrent_varlen(q, k, v, g, beta, cu_of([t]), init)
    for fn, kw in ((hf_q3n.torch_recurrent_gated_delta_rule, {}),
                   (hf_q3n.torch_chunk_gated_delta_rule, dict(chunk_size=C))):
        y_hf, state_hf = fn(q[None], k[None], v[None], g[None], beta[None], **hf_args, **kw)
        assert_math_close(y_hf[0], y_ref)
        assert_math_close(state_hf.transpose(-1, -2), final_ref)


def test_at_slots_read_and_write_only_their_slots():
    """Prefill two sequences into slots 4 (from its state) and 1 (fresh: its old content is
    ignored), then two decode steps with a padded row: every output and state equals the
    recurrence over the whole sequences; other slots are untouched; the padded row outputs 0."""
    lens, slots, dec = [C + 3, 5], [4, 1], 2
    p = sum(lens)
    q, k, v, g, beta = gdn_inputs(5, p + 2 * dec)
    cache = torch.randn(6, HV, VD, KD)
    before = cache.clone()
    y_p = gdn_prefill_at_slots(q[:p], k[:p], v[:p], g[:p], beta[:p], *chunk_layout(lens, C), C, cache,
                               torch.tensor(slots, dtype=torch.int32), torch.tensor([True, False]))
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)   # the padded row repeats sequence 0's token
    y_d = []
    for step in range(dec):
        rows = [p + 2 * step, p + 2 * step, p + 2 * step + 1]
        y_d.append(gdn_update_at_slots(cache, q[rows], k[rows], v[rows], g[rows], beta[rows], idx))
    assert all(torch.equal(cache[s], before[s]) for s in (0, 2, 3, 5))
    assert all(not y[1].any() for y in y_d)
    refs = [([*range(lens[0]), p, p + 2], before[4:5]), ([*range(lens[0], p), p + 1, p + 3], None)]
    for seq, (toks, init) in enumerate(refs):
        y_ref, final_ref = gdn_recurrent_varlen(q[toks], k[toks], v[toks], g[toks], beta[toks],
                                                cu_of([len(toks)]), init)
        off = sum(lens[:seq])
        assert_math_close(y_p[off : off + lens[seq]], y_ref[: lens[seq]])
        for step in range(dec):
            assert_math_close(y_d[step][2 * seq], y_ref[lens[seq] + step])
        assert_math_close(cache[slots[seq]], final_ref[0])
