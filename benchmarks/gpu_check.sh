#!/usr/bin/env bash
# The prepared device check, for a session that is lent a GPU (run once, from the repo root):
#   1. every Triton kernel against its torch reference, compiled (not interpreted), small shapes and
#      the real-shape cases (mamba2-130m, mamba-130m, lfm2-350m) that only run on a GPU;
#   2. backend="triton" vs backend="torch" on the GPU, every preset, fp32 (greedy tokens, logits 1e-4);
#   3. the runner's HF-parity tests on CUDA in fp32 (backend "auto" = Triton on CUDA; TF32 off, see
#      tests/harness.py);
#   4. the kernel micro-benchmarks (bandwidth vs the measured copy bandwidth; SSD layer prefill vs HF);
#   5. a decode-throughput table, runner vs HF generate, bf16, shape-true presets.
# Needs torch with CUDA, triton, transformers, safetensors, tqdm and pytest importable (the GPU image has
# all but pytest: pip install pytest, or carry its wheel). Runs from the source tree, no install.
# Steps 1-2 run to the end even if one fails, so one run shows every result.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RUNNERSCOPE_TEST_DEVICE=cuda PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python -c "import torch, triton, transformers; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
status=0
python -m pytest tests/test_kernels*.py -q -p no:cacheprovider -rs || status=1
python -m pytest tests/test_backend_triton.py -q -p no:cacheprovider -x || status=1
python -m pytest tests/test_runner_parity.py tests/test_zoo_runner.py -q -p no:cacheprovider || status=1
python benchmarks/kernel_bench.py --dtype bfloat16 || status=1
python benchmarks/decode_throughput.py --device cuda --dtype bfloat16 \
    --presets mamba2-130m-shape mamba-130m-shape lfm2-350m-shape tiny-bamba --batches 1 32 128 --new-tokens 32 \
    || status=1
exit $status
