#!/usr/bin/env bash
# The prepared device check, for a session that is lent a GPU (run once, from the repo root):
#   1. every Triton kernel against its torch reference, compiled (not interpreted), small shapes and
#      the real-shape cases (mamba2-130m, mamba-130m, lfm2-350m) that only run on a GPU;
#   2. backend="triton" vs backend="torch" on the GPU, every preset, fp32 (greedy tokens, logits 1e-4);
#   3. the runner's HF-parity tests on CUDA in fp32 (backend "auto" = Triton on CUDA; TF32 off, see
#      tests/harness.py);
#   4. the kernel micro-benchmarks (bandwidth vs the measured copy bandwidth; SSD layer prefill vs HF);
#   5. decode (batch 1, 32, 128) and prefill (128 x 64) on shape-true presets, bf16: runner eager, runner
#      with CUDA graphs and HF generate in one process, with the fraction of the memory roofline;
#   6. kernels per decode step on CUDA (benchmarks/launch_count.py: forward and the rest of the step);
#   (tests/test_cudagraph.py's GPU cases: graphs equal eager for every preset, memory back to baseline.)
# Needs torch with CUDA, triton, transformers >= 5.24, safetensors, tqdm and pytest (the GPU image has all,
# but its transformers 5.17 lacks Mamba2's grouped gated norm: carry the 5.24 wheel in .whl/, which this
# script installs into /tmp/site when present:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform any -d .whl transformers==5.24.0        # then run with carry [".whl"]
# Runs from the source tree, no install of the project. `bash benchmarks/gpu_check.sh tests` runs steps 1-3,
# `... bench` steps 4-6 (each should fit one 10-minute device command), no argument both.
# Steps 1-2 run to the end even if one fails, so one run shows every result.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RUNNERSCOPE_TEST_DEVICE=cuda PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 -c "import torch, triton, transformers; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
part="${1:-all}"            # "tests", "bench" or "all": one command fits the device's 10-minute limit
status=0
if [ "$part" != "bench" ]; then
python3 -m pytest tests/test_kernel_*.py -q -p no:cacheprovider -rs || status=1
python3 -m pytest tests/test_backend_triton.py -q -p no:cacheprovider -x || status=1
python3 -m pytest tests/test_cudagraph.py tests/test_parity_*.py tests/test_model_state_routing.py tests/test_warmup.py -q -p no:cacheprovider \
    || status=1
fi
if [ "$part" != "tests" ]; then
python3 benchmarks/launch_count.py --device cuda --presets mamba2-130m-shape lfm2-350m-shape bamba-300m-shape \
    tiny-mamba2 tiny-qwen3-next || status=1
python3 benchmarks/kernel_bench.py --dtype bfloat16 || status=1
python3 benchmarks/gpu_decode.py --dtype bfloat16 --repeats 2 || status=1
fi
exit $status
