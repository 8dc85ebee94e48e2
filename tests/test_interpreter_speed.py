"""tests/interpreter_speed.py: the interpreter's redundant work skipped (helpers' re-patching, the
unread overflow check, same-shape broadcasts, the dtype table per call), and nothing else changes: the
kernels' results, Triton's types, the language restored after, the overflow check where debug is on."""
from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="TRITON_INTERPRET is not 1: this run compiles the kernels (a GPU), so there is no interpreter to check")

import interpreter_speed  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


@triton.jit
def _scaled(x, s):
    return x * s + tl.arange(0, 8).to(tl.float32)


@triton.jit
def _helper_kernel(x_ptr, y_ptr, s, STEPS: tl.constexpr):
    d = tl.arange(0, 8)
    x = tl.load(x_ptr + d)
    for _ in tl.static_range(STEPS):
        x = _scaled(x, s)
    tl.store(y_ptr + d, x)


def test_helpers_inside_a_kernel_skip_the_repatch_and_compute_the_same(monkeypatch):
    assert interpreter_speed.install()               # conftest installed it: still installed, idempotent
    patch = interpreter._patch_lang
    assert patch._skips_repatching
    calls = []
    monkeypatch.setattr(patch, "original", lambda fn, real=patch.original: calls.append(fn.__name__) or real(fn))
    x = torch.arange(8, dtype=torch.float32)
    y = torch.empty(8)
    _helper_kernel[(1,)](x, y, 2.0, STEPS=3)
    want = x.clone()
    for _ in range(3):
        want = want * 2 + torch.arange(8)
    assert torch.equal(y, want)
    assert calls == ["_helper_kernel"]               # the launch patched; the 3 helper calls did not
    assert tl.core.is_builtin(tl.arange)             # and the launch put the language back


def test_every_patch_is_installed_on_this_triton():
    assert interpreter_speed.installed() == ["repatch", "sanitizer", "broadcast", "np_dtype"]


@triton.jit
def _int_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    d = tl.arange(0, N)
    a = tl.load(a_ptr + d)
    b = tl.load(b_ptr + d)
    rows = tl.arange(0, 2)[:, None] * N + d[None, :]         # [2, N]: a block broadcast to a bigger one
    tl.store(out_ptr + rows, (a * b + a - b)[None, :] + rows)


def test_int_arithmetic_and_broadcasts_compute_what_tritons_own_code_computes(monkeypatch):
    """The same kernel with Triton's own sanitizer and broadcast, then with the patched ones: equal
    outputs (int32 arithmetic, equal-shape and unequal-shape broadcasts)."""
    a = torch.tensor([3, -7, 2**20, 5, 0, 11, -1, 9], dtype=torch.int32)
    b = torch.tensor([4, 6, 2**9, -5, 8, 0, -1, 2], dtype=torch.int32)
    outs = {}
    sem = interpreter.interpreter_semantic
    for mode in ("triton", "patched"):
        if mode == "triton":
            monkeypatch.setattr(sem, "binary_op_sanitize_overflow_impl", sem.binary_op_sanitize_overflow_impl.original)
            monkeypatch.setattr(sem, "broadcast_impl_value", sem.broadcast_impl_value.original)
        out = torch.empty(2, 8, dtype=torch.int32)
        _int_kernel[(1,)](a, b, out, N=8)
        outs[mode] = out
        monkeypatch.undo()
    rows = torch.arange(16, dtype=torch.int32).view(2, 8)
    assert torch.equal(outs["triton"], (a * b + a - b)[None, :] + rows)
    assert torch.equal(outs["patched"], outs["triton"])


def test_the_overflow_check_still_runs_where_triton_would_assert(monkeypatch):
    """With the builder's `debug` option on, device_assert checks, and the patched sanitizer hands
    the overflow to it as Triton's own does: int32 2**20 * 2**12 overflows."""
    a = torch.full((8,), 2**20, dtype=torch.int32)
    b = torch.full((8,), 2**12, dtype=torch.int32)
    out = torch.empty(2, 8, dtype=torch.int32)
    _int_kernel[(1,)](a, b, out, N=8)                       # debug off: no check, as without the patch
    builder = interpreter.interpreter_semantic.builder
    monkeypatch.setattr(builder, "options", interpreter.InterpreterOptions(debug=True))
    with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
        _int_kernel[(1,)](a, b, out, N=8)


def test_the_numpy_dtype_table_answers_as_tritons_function():
    get = interpreter._get_np_dtype
    for name in ("int1", "float16", "float32", "bfloat16", "int8", "uint8", "int16", "int32", "uint32", "int64",
                 "uint64", "float8e5", "float8e4nv"):
        dtype = getattr(tl, name)
        assert get(dtype) == get.original(dtype)
        assert get(tl.block_type(dtype, [4, 2])) == get.original(tl.block_type(dtype, [4, 2]))
        assert get(tl.pointer_type(dtype)) == get.original(tl.pointer_type(dtype))
    ptr_block = tl.block_type(tl.pointer_type(tl.float32), [8])
    assert get(ptr_block) == get.original(ptr_block)


def test_broadcasts_give_tritons_types_and_values():
    """The patched broadcast against Triton's own on blocks of equal and of different shapes: the same
    block types and the same values (NumPy would broadcast a wrong type's data anyway, so the types
    are what a mistake would change)."""
    import numpy as np
    sem = interpreter.interpreter_semantic

    def block(shape):
        data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        return sem.make_tensor(interpreter.TensorHandle(data, tl.float32), tl.block_type(tl.float32, list(shape)))
    for a, b in [((8,), (8,)), ((2, 8), (2, 8)), ((1, 8), (2, 8)), ((2, 1), (1, 8)), ((8,), (2, 8))]:
        ours = sem.broadcast_impl_value(block(a), block(b))
        theirs = sem.broadcast_impl_value.original(block(a), block(b))
        for x, y in zip(ours, theirs):
            assert x.type == y.type and x.handle.data.shape == y.type.get_block_shapes()
            assert np.array_equal(x.handle.data, y.handle.data)
