"""Every Triton kernel compiles for real GPUs, sm_80 (A100) and sm_90 (H100/H200), on a machine
without one (toolkit/inspect/kernel_specs.py). The interpreter runs what a GPU would refuse (a
`tl.arange` of 3 in a branch the test shapes never take, a tile too big for shared memory), so each
specialization the engine launches under it (kernel_workloads.py: the backend-parity runs, which record
as they run, plus fp16 / bf16, padded decode, sampling and the shape-true presets) is compiled to PTX
and a cubin with the ptxas of Triton's wheel: it must compile, fit in the shared memory one block can
have and in the register file; and every kernel in toolkit/kernels must have been launched. The
per-kernel registers, spills and shared memory are in benchmarks/RESULTS.md
(benchmarks/kernel_compile.py prints them).

The workloads come in four groups (kernel_workloads.WORKLOAD_GROUPS), each compiled by its own test
(the specializations its runs recorded) and each one pytest-xdist group, so that `make test` runs the
four on whichever workers are free. The parity group shares its worker with test_backend_triton.py,
which runs first: its parity runs have recorded already. The other workloads run here, one test each
(all of them when this file runs alone), then their group's test compiles. The bf16 group launches
every kernel in toolkit/kernels.
"""
from __future__ import annotations

import importlib.util
import re
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows; the torch path runs there")

import toolkit.inspect.kernel_specs as ks
from toolkit.models import PRESETS, get_model_class

from kernel_workloads import (
    GROUP_OF,
    GROUP_RECORDED,
    SHAPE_TRIMS,
    WORKLOAD_GROUPS,
    WORKLOADS,
    record_all,
    trimmed_config,
)

ARCHS = (80, 90)
# with pytest-xdist, each workload group in one worker, the parity group in the one that ran
# test_backend_triton.py's recordings (same xdist group)
XDIST_GROUPS = {"parity": "triton-kernels", "engines-bf16": "triton-kernels-bf16",
                "engines-fp16": "triton-kernels-fp16", "shapes": "triton-kernels-shapes"}
assert XDIST_GROUPS.keys() == WORKLOAD_GROUPS.keys()


def _in_group(value: str, group: str):
    return pytest.param(value, marks=pytest.mark.xdist_group(XDIST_GROUPS[group]))


@pytest.mark.parametrize("label", [_in_group(label, GROUP_OF[label]) for label in WORKLOADS])
def test_workload_runs_on_triton_and_records(label):
    """One workload of kernel_workloads.py (a backend-parity run that test_backend_triton.py ran in
    this process has recorded already: nothing to do)."""
    recorded = GROUP_RECORDED[GROUP_OF[label]]
    if label not in recorded.labels:
        WORKLOADS[label]()
    assert label in recorded.labels


@pytest.mark.timeout(1800)     # when selected alone it runs its group's workloads first
@pytest.mark.parametrize("group", [_in_group(group, group) for group in WORKLOAD_GROUPS])
def test_every_kernel_specialization_compiles_for_sm80_and_sm90(group):
    """What `group`'s workloads recorded, compiled for sm_80 and sm_90; the bf16 group (every model)
    must have launched every kernel."""
    ran = record_all(group)     # none after the tests above; all when this test runs alone (slow)
    recorded = GROUP_RECORDED[group]
    if group == "engines-bf16":
        missing = sorted(set(ks.launched_kernels()) - recorded.kernels)
        assert not missing, (f"no bf16 workload launched {missing}: add one to kernel_workloads.py "
                             "(BF16_WORKLOADS, which must launch every kernel)")
    start = time.perf_counter()
    results = ks.compile_specs(recorded.specs.values(), ARCHS)
    print(f"\n{group}: {len(recorded.kernels)} kernels, {len(recorded.specs)} specializations, {len(results)} "
          f"compiles in {time.perf_counter() - start:.0f} s ({len(ran)} workloads recorded in this test)\n"
          f"{ks.markdown_table(results)}")
    bad = ks.problems(results)
    failed = sum(not r.ok for r in results)
    assert not bad, (f"{failed} of {len(results)} compiles failed; what would stop a kernel on a GPU:\n"
                     + "\n".join(bad))


BROKEN = '''
import triton
import triton.language as tl


@triton.jit
def twice_kernel(x_ptr, n, BLOCK: tl.constexpr):
    d = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + d, mask=d < n)
    if n > BLOCK:                          # never on the test's shapes: the interpreter never sees it
        tl.store(x_ptr + tl.arange(0, 3), tl.zeros([3], tl.float32))
    tl.store(x_ptr + d, 2 * x, mask=d < n)
'''


def test_a_kernel_the_interpreter_runs_but_a_gpu_refuses_fails_the_check(tmp_path, monkeypatch):
    (tmp_path / "aot_broken_kernel.py").write_text(textwrap.dedent(BROKEN))
    monkeypatch.syspath_prepend(str(tmp_path))          # the compile worker imports the module too
    import aot_broken_kernel
    specs = ks.KernelSpecs()
    x = torch.ones(8)
    with specs.recording():
        aot_broken_kernel.twice_kernel[(1,)](x, 8, BLOCK=8)
    assert x.tolist() == [2.0] * 8                       # the interpreter ran it
    (result,) = ks.compile_specs(specs.specs.values(), archs=(90,), workers=1)
    (problem,) = ks.problems([result])
    assert problem.startswith("aot_broken_kernel:twice_kernel does not compile for sm_90 in 1 of its 1 "
                              "specializations, e.g. [x_ptr=*fp32/16 n=i32 BLOCK=8]:"), problem
    assert problem.endswith("arange's range must be a power of 2"), problem
    print(problem)


def test_shared_memory_above_a_block_and_too_many_registers_are_problems():
    def result(arch, shared, registers=32, num_warps=4):
        return ks.CompileResult("m:k", "sig", arch, ok=True, registers=registers, spill_stores=0, spill_loads=0,
                             stack=0, shared=shared, num_warps=num_warps)
    assert ks.SHARED_MEMORY_LIMIT == {80: 166912, 90: 232448}
    assert ks.problems([result(80, 166912), result(90, 232448), result(90, 0, registers=255, num_warps=8)]) == []
    over = ks.problems([result(80, 166913), result(90, 232449), result(90, 0, registers=255, num_warps=16)])
    assert [p.split(" needs ")[0] for p in over] == ["m:k for sm_80 [sig]", "m:k for sm_90 [sig]",
                                                     "m:k for sm_90 [sig]"]
    failed = [ks.CompileResult("m:k", f"sig{i}", arch, ok=False, error="CompilationError: at 1:2:\nsource\nreason")
              for i in (1, 2) for arch in (80, 90)]
    assert ks.problems(failed + [result(80, 0)]) == [
        "m:k does not compile for sm_80, sm_90 in 2 of its 3 specializations, e.g. [sig1]:\n"
        "    CompilationError: at 1:2:\n    source\n    reason"]
    assert "166913 bytes of shared memory, above the 166912" in over[0]
    assert "255 registers x 512 threads" in over[2]


def test_a_spec_records_what_a_gpu_launch_specializes_on(tmp_path):
    """Dtypes, 16-byte alignment of the pointer *on a GPU* (the view's byte offset), ints that are 1
    or divisible by 16 (but not those the kernel's do_not_specialize names: the row count), constexprs
    and num_warps, as Triton keys its compile cache."""
    from toolkit.kernels.rms_norm import rms_norm
    specs = ks.KernelSpecs()
    x = torch.randn(1, 48)
    with specs.recording("norms"):
        rms_norm(x[:, 4:36], torch.ones(32), 1e-6)       # 16 bytes in: aligned, dim 32
        rms_norm(x[:, 4:36], torch.ones(32), 1e-5)       # the same specialization
        rms_norm(torch.randn(16, 48)[:, 4:36], torch.ones(32), 1e-6)    # and 16 rows (n_rows unspecialized)
        rms_norm(x[:, 1:33], torch.ones(32), 1e-6)       # 4 bytes in: not aligned
        rms_norm(torch.randn(2, 17, dtype=torch.bfloat16), torch.ones(17, dtype=torch.bfloat16), 1e-6)
    assert specs.labels == {"norms"} and specs.launches["toolkit.kernels.rms_norm:_rms_norm_kernel"] == 5
    assert sorted(s.signature for s in specs.specs.values()) == [
        "x_ptr=*bf16/16 w_ptr=*bf16/16 out_ptr=*bf16/16 n_rows=i32 dim=i32 stride_x=i32 stride_o=i32 eps=fp32 "
        "BLOCK_M=64 BLOCK_D=32 num_warps=8",
        "x_ptr=*fp32 w_ptr=*fp32/16 out_ptr=*fp32/16 n_rows=i32 dim=i32/16 stride_x=i32/16 stride_o=i32/16 eps=fp32 "
        "BLOCK_M=64 BLOCK_D=32 num_warps=8",
        "x_ptr=*fp32/16 w_ptr=*fp32/16 out_ptr=*fp32/16 n_rows=i32 dim=i32/16 stride_x=i32/16 stride_o=i32/16 "
        "eps=fp32 BLOCK_M=64 BLOCK_D=32 num_warps=8"]
    specs.save(tmp_path / "specs.json")
    again = ks.KernelSpecs.load(tmp_path / "specs.json")
    assert again.specs == specs.specs and again.labels == specs.labels


def test_launch_choices_by_device_are_known():
    """A launcher that picks a constexpr by device (CPU recording, CUDA compile) is listed in
    CUDA_LAUNCH_CHOICES with the value it picks on CUDA."""
    folder = Path(importlib.util.find_spec("toolkit.kernels").submodule_search_locations[0])
    by_device = {p.stem for p in folder.glob("*.py")
                 if re.search(r"\.type\s*[!=]=|\.is_cuda|torch\.version|torch\.cuda", p.read_text())}
    listed = {k.split(":")[0].rsplit(".", 1)[1] for k in ks.CUDA_LAUNCH_CHOICES}
    assert by_device == listed
    for kernel, choices in ks.CUDA_LAUNCH_CHOICES.items():
        source = (folder / (kernel.split(":")[0].rsplit(".", 1)[1] + ".py")).read_text()
        assert kernel.split(":")[1] in source and all(f'"{v}"' in source for v in choices.values())


@pytest.mark.parametrize("preset", sorted(SHAPE_TRIMS))
def test_trimmed_shape_presets_keep_every_layer_kind(preset):
    """The shape-true presets run cut to one layer of each kind: the same module classes (on the
    meta device: no memory, no weights)."""
    def classes(config):
        with torch.device("meta"):
            return {type(m) for m in get_model_class(config)(config).modules()}
    full, trimmed = PRESETS[preset](), trimmed_config(preset)
    assert trimmed.num_hidden_layers <= full.num_hidden_layers and trimmed.to_dict() != full.to_dict()
    assert classes(trimmed) == classes(full)
