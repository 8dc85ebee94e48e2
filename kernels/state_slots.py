"""The state-slot contract on the Triton side (torch reference: state_slots_ref.py): what the
recurrent update kernels' verify form shares (speculative decoding: each row's 1 + k tokens at most
in one launch; semantics in state_slots_ref.step_rows_at_columns): where a row's tokens are, which
slot it starts from, and which outputs its programs zero."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def verify_row(qsl_ptr, acc_ptr, idx_ptr, row, idx_r, idx_c, n_cols, num_tokens):
    """Verify row `row` of a launch with one program row per verify row. Returns
    (start, n_run, ids, src, zero_lo, zero_hi): its first token; the tokens to run (at most n_cols,
    0 for a padding row, whose column 0 is PAD_SLOT_ID); a pointer to its state-index row (column j
    at ids + j * idx_c); the slot it starts from (column num_accepted - 1; -1 for padding); and the
    token ranges [zero_lo, start) and [start + n_run, zero_hi) whose outputs its programs write as
    zeros (its own uncomputed tokens, and for row 0 / the last row the tokens before
    query_start_loc[0] / from query_start_loc[R] on)."""
    start = tl.load(qsl_ptr + row).to(tl.int64)
    end = tl.load(qsl_ptr + row + 1).to(tl.int64)
    ids = idx_ptr + row.to(tl.int64) * idx_r
    real = tl.load(ids).to(tl.int64) >= 0
    n_run = tl.where(real, tl.minimum(end - start, n_cols), 0)
    first = tl.minimum(tl.maximum(tl.load(acc_ptr + row).to(tl.int64) - 1, 0), n_cols - 1)
    src = tl.where(real, tl.load(ids + first * idx_c).to(tl.int64), -1)
    zero_lo = tl.where(row == 0, 0, start)
    zero_hi = tl.where(row == tl.num_programs(0) - 1, num_tokens, end)
    return start, n_run, ids, src, zero_lo, zero_hi


@triton.jit
def zero_uncomputed_outputs(out_ptr, stride_t, offs, mask, start, n_run, zero_lo, zero_hi):
    """Zeros at out_ptr + t * stride_t + offs for the tokens t of [zero_lo, start) and
    [start + n_run, zero_hi): the outputs a verify row's program owns but computes none of (verify_row)."""
    zero = tl.zeros_like(offs).to(out_ptr.dtype.element_ty)
    for t in range(zero_lo, start):
        tl.store(out_ptr + t * stride_t + offs, zero, mask=mask)
    for t in range(start + n_run, zero_hi):
        tl.store(out_ptr + t * stride_t + offs, zero, mask=mask)
