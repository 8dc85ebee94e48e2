"""`ModelRunner.persistent_buffers()` names every buffer a step's batch and metadata can view that
the runner keeps and rewrites from step to step; every other tensor and array they hold is made
fresh by the step. A recorded step relies on it: it copies those buffers and keeps the rest.

The detector: run steps while keeping every step's batch and metadata alive, so that no memory a
step made fresh can be handed to a later step. Then memory that two steps' objects both view is
memory the runner kept, and it must lie in a declared buffer. One engine per builder family, plus
the modes that add buffers (prefix caching's aligned state indices, speculation's state columns and
accepted counts, cache mode "all", padded decode batches, the draft model)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from toolkit import LLM, SamplingParams

try:                                    # numpy >= 2 moved it
    from numpy.lib.array_utils import byte_bounds
except ImportError:                     # numpy 1.x
    from numpy import byte_bounds

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
CONFIGS = [
    ("tiny-bamba", dict(max_num_batched_tokens=16)),                     # attention + Mamba2, chunked
    ("tiny-jamba", {}),                                                  # Mamba1
    ("tiny-lfm2", dict(enable_prefix_caching=True, block_size=4, speculative_config=NGRAM)),   # short conv
    ("tiny-mamba2", dict(enable_prefix_caching=True, block_size=4, speculative_config=NGRAM,
                         cudagraph_mode="padded_eager")),
    ("tiny-bamba", dict(enable_prefix_caching=True, block_size=16, mamba_cache_mode="all")),
    ("tiny-qwen3-next", {}),                                             # gated delta net
    ("tiny-kimi-linear", {}),
    ("tiny-minimax", {}),
    ("tiny-xlstm", {}),
    ("tiny-bamba", dict(speculative_config={"method": "draft_model", "model": "tiny-mamba2",
                                            "num_speculative_tokens": 2})),
]


def byte_range(x) -> tuple[int, int] | None:
    """[first, last + 1) bytes a tensor or array reads; None when it reads nothing."""
    if isinstance(x, np.ndarray):
        lo, hi = byte_bounds(x)
        return (lo, hi) if x.size else None
    if x.numel() == 0:
        return None
    extent = 1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
    return x.data_ptr(), x.data_ptr() + extent * x.element_size()


def ranges_of(obj, out: list, path: str = "") -> list:
    """(path, byte range) of every tensor and array reachable through dataclasses, lists, tuples, dicts."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        r = byte_range(obj)
        if r is not None:
            out.append((path, r))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            ranges_of(getattr(obj, f.name), out, f"{path}.{f.name}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            ranges_of(v, out, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            ranges_of(v, out, f"{path}[{k!r}]")
    return out


@pytest.mark.parametrize("preset, kwargs", CONFIGS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CONFIGS)])
def test_memory_two_steps_view_is_a_declared_persistent_buffer(preset, kwargs):
    llm = LLM(preset, inspect="off", seed=0, **kwargs)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for prompt in ([3, 4, 5, 6] * 5, list(range(3, 14)), [7, 8], [5, 6, 7] * 4):
        llm.add_request({"prompt_token_ids": prompt}, params)
    kept, steps = [], []                    # every step's objects, alive to the end
    while llm.has_unfinished_requests():
        llm.step()
        state = llm.model_runner.execute_state
        if state is None or any(state is k[0] for k in kept):
            continue
        kept.append((state, state.input_batch, state.attn_metadata.groups))
        steps.append(ranges_of(state.input_batch, [], "input_batch") +
                     ranges_of(state.attn_metadata.groups, [], "attn_metadata"))
    declared = [(b.untyped_storage().data_ptr(), b.untyped_storage().data_ptr() + b.untyped_storage().nbytes())
                for b in llm.model_runner.persistent_buffers()]
    llm.shutdown()
    assert len(steps) > 5

    def undeclared(r):
        return not any(lo <= r[0] and r[1] <= hi for lo, hi in declared)
    seen: list[tuple[int, str, tuple[int, int]]] = []
    for i, ranges in enumerate(steps):
        mine = [(path, r) for path, r in ranges if undeclared(r)]
        for path, r in mine:
            for j, other_path, o in seen:
                assert not (r[0] < o[1] and o[0] < r[1]), (
                    f"step {i}'s {path} and step {j}'s {other_path} view the same memory, which no "
                    "persistent_buffers() declares: a record would show a later step's values")
        seen += [(i, path, r) for path, r in mine]
