#!/usr/bin/env bash
# The prepared device check, for a session that is lent a GPU (run once, from the repo root):
#   1. the runner's HF-parity tests on CUDA in fp32 (eager; TF32 off, see tests/harness.py);
#   2. a decode-throughput table, runner vs HF generate, bf16, shape-true presets.
# Needs torch with CUDA, transformers, safetensors, tqdm and pytest importable (the GPU image has
# all but pytest: pip install pytest, or carry its wheel). Runs from the source tree, no install.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RUNNERSCOPE_TEST_DEVICE=cuda
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python -m pytest tests/test_runner_parity.py tests/test_zoo_runner.py -q -p no:cacheprovider
python benchmarks/decode_throughput.py --device cuda --dtype bfloat16 \
    --presets mamba-130m-shape lfm2-350m-shape tiny-bamba --batches 1 16 64 --new-tokens 32
