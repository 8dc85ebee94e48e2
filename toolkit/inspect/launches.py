"""Count the kernels a piece of code launches, on any device: the torch ops that launch a kernel on a
GPU (every dispatched op but views and allocations) and the Triton kernel launches.

On a GPU, a CUDA-graph decode step at small batch takes about (number of kernels) x (a few
microseconds): the count, which the CPU can measure, is what decides it. Used by
benchmarks/launch_count.py, tests/test_launch_counts.py and notebook 05.

    with LaunchCounter() as c:
        llm.step()
    c.total, c.torch_ops, c.triton        # Counter of op name -> launches

    forward, step = count_decode_step(llm)   # one decode step: its model forward, and the whole step
"""
from __future__ import annotations

import sys
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

from toolkit.sampling import SamplingParams

# ops that allocate or alias without launching a kernel (views are recognised by their schema)
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
              "lift_fresh", "promote_types", "_local_scalar_dense", "resize_", "set_", "record_stream"}


class LaunchCounter(TorchDispatchMode):
    """A dispatch mode counting torch ops that launch kernels, plus Triton launches (their own
    internal torch ops, e.g. the interpreter's copies, are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.torch_ops: Counter[str] = Counter()
        self.triton: Counter[str] = Counter()
        self._in_triton = 0
        self._patched: list[tuple[type, object]] = []

    @property
    def total(self) -> int:
        return sum(self.torch_ops.values()) + sum(self.triton.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._in_triton and not func.is_view and name not in _NO_KERNEL:
            self.torch_ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._patch_triton()
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, run in self._patched:
            cls.run = run
        self._patched.clear()
        return super().__exit__(*exc)

    def _patch_triton(self) -> None:
        if "triton.runtime.jit" not in sys.modules:     # no kernel imported: only torch ops to count (and
            return                                      # importing triton here would fix TRITON_INTERPRET)
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
        counter = self
        for cls in (JITFunction, InterpretedFunction):
            original = cls.run

            def run(self, *args, _original=original, **kwargs):
                counter.triton[getattr(self, "__name__", None) or self.fn.__name__] += 1
                counter._in_triton += 1
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    counter._in_triton -= 1

            self._patched.append((cls, original))
            cls.run = run

    def table(self) -> list[tuple[str, int]]:
        """(name, launches), most first; Triton kernels are prefixed "triton:"."""
        rows = [(n, c) for n, c in self.torch_ops.items()] + [(f"triton:{n}", c) for n, c in self.triton.items()]
        return sorted(rows, key=lambda r: -r[1])


def count_decode_step(llm) -> tuple[LaunchCounter, LaunchCounter]:
    """Counters of one decode step at batch 1 on `llm` (a greedy 3-token request; its last step is
    counted): (the model forward, what a CUDA graph replays; the whole runner step, execute_model
    and sample_tokens: inputs, metadata, forward, LM head, sampling). Leaves the engine as it was."""
    runner, model = llm.model_runner, llm.model
    forward, execute, sample = model.forward, runner.execute_model, runner.sample_tokens
    counters: list[tuple[LaunchCounter, LaunchCounter]] = []

    def counted(fn, which: int):
        def call(*args, **kwargs):
            if fn is execute:                   # a new step
                counters.append((LaunchCounter(), LaunchCounter()))
            with counters[-1][which]:
                return fn(*args, **kwargs)
        return call

    model.forward = counted(forward, 0)
    runner.execute_model, runner.sample_tokens = counted(execute, 1), counted(sample, 1)
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                     SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:                                    # back to the class's methods
        del model.forward, runner.execute_model, runner.sample_tokens
    return counters[-1]                         # steps: prefill, decode, decode
