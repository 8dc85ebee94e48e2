import os

import torch  # noqa: E402  (defines no Triton kernel)

# Triton reads TRITON_INTERPRET when a kernel is decorated, so set it before anything imports one.
# Without a GPU the kernels run under the interpreter; on a GPU they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

# model_helpers and harness hold test checks (ModelParitySuite, check_*_matches_hf): rewrite their
# asserts as pytest does a test's
pytest.register_assert_rewrite("model_helpers", "harness")

# tiny models: one thread avoids oversubscription on CI's 2 cores (measured faster)
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
