"""backend="triton" (every op a Triton kernel, here under TRITON_INTERPRET=1 on the CPU, Qwen3-Next's
Gated DeltaNet recurrence included) gives the same greedy tokens as backend="torch" for every tiny
preset, and logits within 1e-4 in fp32: on a single request and on the chunked, mixed, queued batch
of the runner-level parity checks; seeded sampled rows draw the same tokens. The records say which
ops ran; on the CPU the interpreter is set, or the engine says why it cannot be. The triton runs
record the kernel specializations they launch (kernel_workloads.py), which test_compile_for_gpus.py
compiles for GPUs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")

from toolkit import LLM

from harness import BATCH_LIMITS, BATCH_PROMPT_LENS, TINY_PRESETS
from kernel_workloads import CHECKPOINT_MODELS, checkpoint_run, parity_run, sampled_run

LOGITS_ATOL = 1e-4
# with pytest-xdist, in one worker with test_compile_for_gpus.py, which compiles what these runs record
pytestmark = pytest.mark.xdist_group("triton-kernels")
_run = parity_run          # (model, backend, prompt lengths, seed, **limits): fp32 greedy, by hand


def _assert_same(torch_res, triton_res):
    assert torch_res.tokens == triton_res.tokens
    for rid, ours in triton_res.logits.items():
        for step, (a, b) in enumerate(zip(torch_res.logits[rid], ours, strict=True)):
            diff = (a - b).abs().max().item()
            assert diff <= LOGITS_ATOL, f"request {rid}, output token {step}: logits differ by {diff:.2e}"


@pytest.mark.parametrize("model", TINY_PRESETS + ["demo-hybrid"])
def test_single_request_triton_equals_torch(model):
    _assert_same(_run(model, "torch", [23], 0), _run(model, "triton", [23], 0))


@pytest.mark.parametrize("model", TINY_PRESETS)
def test_chunked_mixed_batch_triton_equals_torch(model):
    ref = _run(model, "torch", BATCH_PROMPT_LENS, 1, **BATCH_LIMITS)
    ours = _run(model, "triton", BATCH_PROMPT_LENS, 1, **BATCH_LIMITS)
    assert any(r.num_prefills and r.num_decodes for r in ours.records), "the batch must mix"
    _assert_same(ref, ours)


def test_sampled_rows_triton_equals_torch():
    """The Gumbel kernel draws the same tokens as the torch noise for seeded, top-k/top-p rows."""
    outs = {backend: sampled_run(backend) for backend in ("torch", "triton")}
    assert outs["torch"] == outs["triton"]


def test_auto_is_triton_on_cuda_and_torch_on_cpu(monkeypatch):
    """backend="auto" on this host (device "auto"): the Triton kernels on a CUDA device (triton is
    installed: importorskip above), the torch ops on the CPU; both rules checked without a GPU too."""
    import torch

    from toolkit import config
    llm = LLM("tiny-llama", backend="auto")
    assert llm.backend == ("triton" if llm.cfg.device.type == "cuda" else "torch")
    assert config.resolve_backend("auto", torch.device("cuda")) == "triton"
    assert config.resolve_backend("auto", torch.device("cpu")) == "torch"
    monkeypatch.setattr(config, "triton_installed", lambda: False)          # macOS / Windows
    assert config.resolve_backend("auto", torch.device("cuda")) == "torch"


SET_INTERPRETER = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
from toolkit import LLM, SamplingParams
if "triton" in sys.modules:
    # something imported triton before the engine could set the variable: on a CUDA host, torch 2.11's
    # torch._dynamo does (torch.utils._triton.has_triton_package), seen on an H200. Then the engine
    # must say why it cannot run the interpreter instead.
    try:
        LLM("tiny-mamba2", device="cpu", backend="triton")
    except ValueError as err:
        assert "TRITON_INTERPRET=1" in str(err), err
        print("ok")
    sys.exit(0)
llm = LLM("tiny-mamba2", device="cpu", backend="triton")      # sets TRITON_INTERPRET=1 itself
assert os.environ["TRITON_INTERPRET"] == "1" and llm.backend == "triton"
out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, temperature=0.0))
assert len(out[0].outputs[0].token_ids) == 2
print("ok")
"""

TOO_LATE = """
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton                                                   # imported before the variable is set
from toolkit import LLM
try:
    LLM("tiny-mamba2", device="cpu", backend="triton")
except ValueError as err:
    assert "TRITON_INTERPRET=1" in str(err), err
    print("ok")
"""


@pytest.mark.parametrize("script", [SET_INTERPRETER, TOO_LATE], ids=["sets-interpreter", "imported-too-early"])
def test_triton_on_cpu_runs_the_interpreter_or_says_why_not(script):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parent.parent, timeout=300)
    assert proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


@pytest.mark.parametrize("model", CHECKPOINT_MODELS)
def test_internal_checkpoints_triton_equals_torch(model):
    """Cache mode "all": the Triton conv, Mamba1 scan, Mamba2 SSD scan and gated delta rule save the
    states inside a prefill chunk as their references do: the second prompt hits the first one's
    state at 32 and the tokens equal the torch backend's."""
    ref, ours = checkpoint_run(model, "torch"), checkpoint_run(model, "triton")
    assert ours == ref and ref[1][1] == 32
