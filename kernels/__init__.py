"""Triton kernels, one file per family (`<family>.py`: the kernels and their launchers, which check
shapes), each with its torch reference beside it (`<family>_ref.py`). The references are the op set
the runner uses on the CPU (`toolkit.layers.ops.TORCH_OPS`); the tests check each kernel against its
reference. Nothing here imports the engine: a kernel file imports torch, triton and its siblings;
a reference imports torch and its siblings (so the references import without triton, on any OS).

This folder sits at the top of the repository but installs as `toolkit.kernels` (see the
package-dir mapping in pyproject.toml): a PyPI package named `kernels` exists and transformers
probes for it, so a top-level `kernels` module must never be installed.
"""
