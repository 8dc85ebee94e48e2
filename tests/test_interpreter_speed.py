"""tests/interpreter_speed.py: helpers called inside an interpreted kernel skip re-patching
triton.language, and nothing else changes (the kernel's results, the language restored after)."""
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
