"""Test setup: the Triton interpreter without a GPU, offline HF, one CPU thread, a seeded torch per
test, assert rewriting in the helper modules, and the shared fixtures of the runner-level parity
checks (`hf_folders`, `model_pair`, `hf_model`)."""
import gc
import os

# One thread per process, set before torch is imported: torch reads these when it starts, and every
# process the tests spawn (tensor-parallel ranks, notebook kernels, the CLI, the compile workers)
# inherits them, so two xdist workers and their children never oversubscribe CI's two cores.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402  (after the thread variables)

# Triton reads TRITON_INTERPRET when a kernel is decorated, so set it before anything imports one.
# Without a GPU the kernels run under the interpreter; on a GPU they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # helpers called inside a kernel no longer re-patch triton.language (a fifth of an interpreted
    # engine's time, nothing the kernels compute): tests/interpreter_speed.py
    import interpreter_speed
    interpreter_speed.install()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

# model_helpers, harness and kernel_workloads hold test checks (ModelParitySuite, check_*_matches_hf,
# the recorded engine runs): rewrite their asserts as pytest does a test's
pytest.register_assert_rewrite("model_helpers", "harness", "kernel_workloads")

# tiny models: one thread avoids oversubscription on CI's 2 cores (measured faster)
torch.set_num_threads(1)

from toolkit.models import PRESETS  # noqa: E402

from harness import load_hf, save_model_pair  # noqa: E402  (after register_assert_rewrite)


def pytest_collection_finish(session):
    """Move everything alive after collection (torch, transformers, the toolkit, the test modules and
    items: about 300k objects) out of the garbage collector's sight (gc.freeze). Each
    `LLM.shutdown()` makes a full collection, which scanned them all: about 0.2 s an engine in this
    process, more than a tiny engine's whole life. What the tests create is still collected."""
    gc.freeze()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


# ---- HF folders and models of the runner-level parity checks (model_helpers.RunnerParityChecks) ----

@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory):
    """name -> (LLM model argument, HF folder with the same weights) of `harness.save_model_pair`,
    saved once per session. The folders are shared: a test that changes one works on a copy."""
    pairs: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in pairs:
            pairs[name] = save_model_pair(name, tmp_path_factory)
        return pairs[name]
    return get


@pytest.fixture(scope="class")
def model_pair(request, hf_folders):
    """hf_folders(name) for the model name a test class is parametrized with (indirect)."""
    return hf_folders(request.param)


@pytest.fixture(scope="class")
def hf_model(model_pair):
    """The HF model on model_pair's folder (fp32, eval) whose `generate` ignores EOS (harness.load_hf)."""
    return load_hf(model_pair[1])


# ---- the fast tier (`make test-fast`: -m "not slow") ----------------------------------------------
# Modules that spawn processes or run the Triton interpreter on whole engines: the notebooks, the
# browser, the CLI and wheel installs, tensor-parallel ranks, GPU compiles, the property programs.
SLOW_MODULES = {
    "test_backend_triton", "test_browser", "test_compile_for_gpus", "test_demo_models", "test_doctor",
    "test_engine_soak", "test_gpu_check_script", "test_install_cli", "test_notebooks", "test_properties",
    "test_schedule_independence", "test_tensor_parallel", "test_tensor_parallel_inspect", "test_trace",
}
# Tests parametrized over models keep two models in the fast tier: attention (tiny-llama) and a
# recurrent state (tiny-mamba2); every family's own parity file (test_parity_<family>.py: Mamba1,
# short conv, Gated DeltaNet and the hybrids too) runs whole. Tests marked `slow` by hand run Triton
# engines under the interpreter.
FAST_PRESETS = {"tiny-llama", "tiny-mamba2"}


def _is_slow(item) -> bool:
    module = item.module.__name__.rpartition(".")[2]
    if module in SLOW_MODULES or item.get_closest_marker("slow"):
        return True
    if module.startswith("test_parity_"):
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(isinstance(v, str) and (v in PRESETS or v.startswith("demo-")) and v not in FAST_PRESETS
               for v in params.values())


def pytest_itemcollected(item):
    """Mark the slow tier as each test is collected (before `-m` deselects in modifyitems)."""
    if isinstance(item, pytest.Function) and _is_slow(item):
        item.add_marker(pytest.mark.slow)


# ---- pytest-xdist groups (`make test`: --dist loadgroup) ------------------------------------------
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Put a test's xdist_group name on its node id on pytest 9 too. pytest-xdist (3.8) does it by
    setting `item._nodeid`, which pytest 9 (whose node ids are `item._id`, a NodeId) no longer reads:
    every test is then scheduled alone and the groups (the Triton recordings and the compile tests
    that need them in the same process) are split over the workers. Only on an xdist worker under
    --dist loadgroup, where xdist's own hook has run first; a no-op where that hook worked."""
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import NodeId  # pytest 9's node id type (private: absent, nothing to fix)
    except ImportError:
        return
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        if not names or "@" in item.nodeid.rpartition("]")[2]:
            continue
        item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(names))}")
