"""Triton kernels, one file per family, each with its launcher and a torch reference beside it.

This folder sits at the top of the repository but installs as `toolkit.kernels` (see the
package-dir mapping in pyproject.toml): a PyPI package named `kernels` exists and transformers
probes for it, so a top-level `kernels` module must never be installed.
"""
