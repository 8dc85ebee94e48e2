"""Test setup: the Triton interpreter without a GPU, offline HF, one CPU thread, a seeded torch per
test, assert rewriting in the helper modules, and the shared fixtures of the runner-level parity
checks (`hf_folders`, `model_pair`, `hf_model`)."""
import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, so set it before anything imports one.
# Without a GPU the kernels run under the interpreter; on a GPU they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

# model_helpers, harness and kernel_workloads hold test checks (ModelParitySuite, check_*_matches_hf,
# the recorded engine runs): rewrite their asserts as pytest does a test's
pytest.register_assert_rewrite("model_helpers", "harness", "kernel_workloads")

# tiny models: one thread avoids oversubscription on CI's 2 cores (measured faster)
torch.set_num_threads(1)

from harness import load_hf, save_model_pair  # noqa: E402  (after register_assert_rewrite)


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
