#!/usr/bin/env bash
# The prepared device check, for a session that is lent a GPU. It runs in parts; each part is meant to be
# ONE device command (the device runs a command for at most 10 minutes), run from the repository root:
#
#   bash benchmarks/gpu_check.sh PART [PART ...]        e.g. `bash benchmarks/gpu_check.sh doctor kernels`
#   bash benchmarks/gpu_check.sh --dry-run [PART ...]   (or DRY_RUN=1) on any machine, no GPU needed: checks
#       the prerequisites it can, prints each part's exact commands and, for the test parts, how many tests
#       the selection collects (pytest --collect-only), and runs nothing; tests/test_gpu_check_script.py
#       runs it in CI.
#   No PART: every part but `first`, in order (more than one device command's time: use it only with no
#       time limit).
#   `bash benchmarks/gpu_check.sh first`: the one command for a 15-minute device lease (issue 41): what tells
#       most, in this order, each command with its own limit (`@N` below) and all inside FIRST_TIMEOUT
#       (default 470 s) so that a failure or a hang in one leaves the rest running.
#   `bash benchmarks/gpu_check.sh second`: what `first` left unrun: the GPU graph tests' fix, HF parity on
#       CUDA, Triton vs torch on CUDA, speculative decoding's speed; same limits scheme, inside
#       FIRST_TIMEOUT. Run on 2026-12-04 (stop 55, RESULTS.md "Second GPU run", 247 s); the next lease's
#       command, to check that run's fixes (all made in the tests but one, run on the CPU only).
#
# part     estimate  what
# second   ~5 min    what first left unrun: tests/test_cudagraph.py's GPU tests (graphs vs eager, ten cycles),
#                    the HF-parity tests on CUDA, spec_decode.py fp32 (outputs asserted equal) on demo-hybrid
#                    (n-gram, draft demo-mamba) and bamba-300m-shape (n-gram), inspect_overhead.py (recording's
#                    cost per decode step with CUDA graphs), then backend="triton" vs "torch" on CUDA until
#                    the time is out
# first    ~6 min    doctor's CUDA lines (kernels compiled on CUDA tensors, CUDA vs CPU fp32, graphs vs eager);
#                    decode (batch 1 and 128) and prefill (128 x 64) of mamba2-130m-, bamba-300m- and
#                    lfm2-350m-shape in bf16: eager, graphs, HF generate, fraction of the roofline, one
#                    process per preset; the ten-cycle memory test; then the graphs and kernels tests until
#                    the time is out
# doctor   ~3 min    python -m toolkit doctor, first: versions, device, kernels compiled on CUDA tensors, then
#                    on 6 tiny presets Triton vs torch, CUDA vs CPU fp32, padded decode and CUDA graphs vs
#                    eager, and the decode step at batch 1 and 16 (eager, graphs, HF)
# kernels  ~3 min    tests/test_kernel_*.py on CUDA tensors (RUNNERSCOPE_TEST_DEVICE=cuda, tests/harness.py
#                    KERNEL_DEVICE): every Triton kernel, compiled, against its torch reference, small shapes and
#                    the real-shape cases (mamba2-130m, mamba-130m, lfm2-350m, Qwen3-Next GDN), and the internal
#                    prefill checkpoints of cache mode "all"; 289 tests
# backend  ~3 min    tests/test_backend_triton.py: backend="triton" vs "torch" on CUDA, every preset, fp32
#                    (greedy tokens, logits 1e-4) and cache mode "all"; 33 tests, ~63 engine builds
# parity   ~5 min    tests/test_parity_*.py: the runner's HF-parity tests on CUDA in fp32 (backend "auto" =
#                    Triton; TF32 off, see tests/harness.py); 215 tests, ~150 engine builds and HF models
# graphs   ~2 min    tests/test_cudagraph.py (graphs equal eager for every preset, memory back to baseline),
#                    tests/test_model_state_routing.py, tests/test_warmup.py; 82 tests
# bench    ~6 min    kernels per decode step (benchmarks/launch_count.py), the kernel micro-benchmarks
#                    (kernel_bench.py: bandwidth vs the measured copy bandwidth; SSD prefill vs HF), decode
#                    (batch 1, 32, 128) and prefill (128 x 64) on shape-true presets, bf16: eager, CUDA graphs
#                    and HF generate (gpu_decode.py), with the fraction of the memory roofline; speculative
#                    decoding off / n-gram / draft model, tokens per forward and speed (spec_decode.py)
# tp       ~3 min    tensor parallelism on NCCL (benchmarks/tp_check.py): TP=2 vs TP=1 on 6 presets (tokens,
#                    logits 1e-4 in fp32), gathered full-mode states, a row per rank in memory_report(), a
#                    killed worker named; needs at least 2 GPUs, else it prints "tp: not run" (the H200 machine
#                    has one)
#
# Measured on an H200 on 2026-12-04 (benchmarks/RESULTS.md, "First GPU run"): `first` 364 s on a cold machine
# (doctor's three lines 36 s, the three presets 35 / 54 / 44 s, ten cycles 16 s, graphs 59 s, kernels 120 s);
# graphs alone on a cold Triton cache took more than 83 s. The other parts are still estimates, made so: a part may start on a fresh machine, so every part pays a cold
# Triton cache: one compilation (~1 s) per kernel variant it meets (a kernel x dtypes x block sizes; the
# kernel tests meet ~150, each engine part ~100-200); plus the host time of the same tests measured on a
# CPU (one thread; the tiny models are host-bound on a GPU too): parity 130 s, graphs 60 s, backend and
# kernels under a minute once compiled. Each part stops itself after PART_TIMEOUT seconds (default 540),
# with pytest's summary of what ran, so that its report comes back inside the device's 10 minutes.
# No part stops at the first failure (no -x): one run shows every result.
#
# Python and imports: the project is not installed here; a temporary folder on PYTHONPATH holds a `toolkit`
# package made of links to toolkit/* plus `toolkit/kernels` -> kernels/ (the installed layout, see
# pyproject.toml's package-dir), and PYTHONSAFEPATH=1 (Python >= 3.11) keeps `python -m` and `python -c`
# from putting the current folder (the repository root) on sys.path: there kernels/ would import as a
# top-level `kernels` package, a name transformers probes for (a PyPI package of that name exists).
#
# Needs torch with CUDA, triton, transformers >= 5.24, safetensors, tqdm and pytest (the GPU image has all,
# but its transformers 5.17 lacks Mamba2's grouped gated norm: carry the 5.24 wheel in .whl/, which this
# script installs into /tmp/site when present:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform any -d .whl transformers==5.24.0        # then run with carry [".whl"]
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${PYTHON:-python3}"
PART_TIMEOUT="${PART_TIMEOUT:-540}"
DRY="${DRY_RUN:-0}"
ALL_PARTS=(doctor kernels backend parity graphs bench tp)
FIRST_TIMEOUT="${FIRST_TIMEOUT:-470}"

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; echo "parts: first second ${ALL_PARTS[*]}"; }

parts=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) usage; exit 0 ;;
        *) if [[ " first second ${ALL_PARTS[*]} " == *" $arg "* ]]; then parts+=("$arg")
           else echo "gpu_check.sh: unknown part '$arg'"; usage; exit 2; fi ;;
    esac
done
[ ${#parts[@]} -eq 0 ] && parts=("${ALL_PARTS[@]}")

# ---- each part's estimate and commands (the test parts: one pytest selection of whole files) -----------
estimate_of() {  # estimated device minutes on a cold Triton cache (see the header)
    case "$1" in first) echo 6 ;; second) echo 5 ;; doctor) echo 3 ;; kernels) echo 3 ;; backend) echo 3 ;; parity) echo 5 ;; graphs) echo 2 ;;
                 bench) echo 6 ;; tp) echo 3 ;; esac
}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs --durations=10)
tests_of() {    # the test files of a test part (empty for the others)
    case "$1" in
        kernels) echo tests/test_kernel_*.py ;;
        backend) echo tests/test_backend_triton.py ;;
        parity)  echo tests/test_parity_*.py ;;
        graphs)  echo tests/test_cudagraph.py tests/test_model_state_routing.py tests/test_warmup.py ;;
        first)   echo "$(tests_of graphs) $(tests_of kernels)" ;;
        second)  echo "tests/test_cudagraph.py $(tests_of parity) $(tests_of backend)" ;;
    esac
}
commands_of() { # one command per line; "@N " first: that command stops after at most N seconds
    case "$1" in
        first)
            echo "@90 $PY -m toolkit doctor --check kernel_compile --check device_vs_cpu --check graphs_vs_eager"
            # the first preset pays the cold Triton cache (one compilation per kernel variant)
            for preset_limit in mamba2-130m-shape:110 bamba-300m-shape:100 lfm2-350m-shape:90; do
                echo "@${preset_limit#*:} $PY benchmarks/gpu_decode.py --dtype bfloat16 --presets ${preset_limit%:*} --batches 1 128 --repeats 2 --hf-repeats 1"
            done
            echo "@60 ${PYTEST[*]} tests/test_cudagraph.py -k ten_cycles"
            echo "${PYTEST[*]} $(tests_of graphs)"
            echo "${PYTEST[*]} $(tests_of kernels)" ;;
        second)
            echo "@90 ${PYTEST[*]} tests/test_cudagraph.py -k gpu"   # graphs vs eager per preset, ten cycles
            echo "@220 ${PYTEST[*]} $(tests_of parity)"
            echo "@100 $PY benchmarks/spec_decode.py --device cuda --dtype float32 --presets demo-hybrid bamba-300m-shape --ks 2 --repeats 2 --draft demo-hybrid=demo-mamba"
            # what recording costs where the forward is a graph replay (issue 36: "metadata" within 5% of "off")
            echo "@55 $PY benchmarks/inspect_overhead.py --device cuda --presets tiny-bamba tiny-mamba2 --batch 8 --new-tokens 33 --repeats 3"
            echo "${PYTEST[*]} $(tests_of backend)" ;;
        doctor) echo "$PY -m toolkit doctor" ;;
        kernels|backend|parity|graphs) echo "${PYTEST[*]} $(tests_of "$1")" ;;
        bench)
            echo "$PY benchmarks/launch_count.py --device cuda --presets mamba2-130m-shape lfm2-350m-shape bamba-300m-shape tiny-mamba2 tiny-qwen3-next"
            echo "$PY benchmarks/kernel_bench.py --dtype bfloat16"
            echo "$PY benchmarks/gpu_decode.py --dtype bfloat16 --repeats 2"
            echo "$PY benchmarks/spec_decode.py --device cuda --dtype bfloat16" ;;
        tp) echo "$PY benchmarks/tp_check.py --device cuda" ;;
    esac
}

# ---- environment: the package from a temporary folder, never the repository root ----------------------
SHADOW="$(mktemp -d "${TMPDIR:-/tmp}/runnerscope-path.XXXXXX")"
trap 'rm -rf "$SHADOW"' EXIT
mkdir "$SHADOW/toolkit"
for entry in "$REPO"/toolkit/*; do
    name="$(basename "$entry")"
    [ "$name" = kernels ] || [ "$name" = __pycache__ ] || ln -s "$entry" "$SHADOW/toolkit/$name"
done
ln -s "$REPO/kernels" "$SHADOW/toolkit/kernels"
if ls .whl/*.whl >/dev/null 2>&1; then
    if [ "$DRY" = 1 ]; then
        echo "dry run: would install $(ls .whl/*.whl | tr '\n' ' ')into /tmp/site"
    else
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
export PYTHONPATH="$SHADOW${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 RUNNERSCOPE_TEST_DEVICE=cuda PYTHONUNBUFFERED=1
unset TRITON_INTERPRET      # compiled kernels (conftest sets the interpreter only where there is no GPU)

# ---- prerequisites ------------------------------------------------------------------------------------
# What can be checked without a GPU; CUDA itself only when not a dry run.
PREREQ='
import importlib.metadata as md, importlib.util, os, sys
problems = []
if sys.version_info < (3, 11):
    problems.append(f"python {sys.version.split()[0]}: PYTHONSAFEPATH needs >= 3.11")
import torch, toolkit, toolkit.kernels, toolkit.doctor
shadow = os.environ["PYTHONPATH"].split(os.pathsep)[0]
if not toolkit.__file__.startswith(shadow):
    problems.append(f"toolkit imports from {toolkit.__file__}, not the temporary folder {shadow}")
spec = importlib.util.find_spec("kernels")
if spec is not None and spec.origin and spec.origin.startswith(os.getcwd() + os.sep):
    problems.append(f"the repository root is on sys.path: kernels imports from {spec.origin}")
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        problems.append(f"{name} is not installed")
        return None
import transformers
versions = {n: version(n) for n in ("triton", "safetensors", "tqdm", "pytest")}
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24):
    problems.append(f"transformers {transformers.__version__} < 5.24 (carry the 5.24 wheel in .whl/, see the header)")
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| transformers", transformers.__version__, "|", " | ".join(f"{n} {v}" for n, v in versions.items()))
if os.environ.get("CHECK_CUDA") == "1":
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    else:
        problems.append("torch sees no CUDA device")
for p in problems:
    print("prerequisite:", p)
sys.exit(1 if problems else 0)
'
CHECK_CUDA=$([ "$DRY" = 1 ] && echo 0 || echo 1) "$PY" -c "$PREREQ"
prereq=$?

# ---- dry run: the selections and their sizes, nothing run ---------------------------------------------
if [ "$DRY" = 1 ]; then
    status=$prereq
    files=()
    for part in "${parts[@]}"; do
        for f in $(tests_of "$part"); do files+=("$f"); done
    done
    declare -A count=()
    if [ ${#files[@]} -gt 0 ]; then
        # one collection for every test part (each part selects whole files): "FILE: N" per file
        collected="$("$PY" -m pytest --collect-only -qq -p no:cacheprovider "${files[@]}" 2>&1)"
        collect_rc=$?
        while read -r file n; do count["${file%:}"]=$n; done < <(echo "$collected" | grep -E '^tests/[^ ]+\.py: [0-9]+$')
        if [ $collect_rc -ne 0 ]; then
            echo "dry run: pytest --collect-only failed (rc $collect_rc):"; echo "$collected" | tail -20; status=1
        fi
    fi
    for part in "${parts[@]}"; do
        echo "part $part (~$(estimate_of "$part") min):"
        commands_of "$part" | sed 's/^/  $ /'
        sel=$(tests_of "$part")
        if [ -n "$sel" ]; then
            total=0
            for f in $sel; do
                if [ ! -f "$f" ]; then echo "  missing: $f"; status=1; continue; fi
                total=$((total + ${count[$f]:-0}))
            done
            echo "  selects $total tests in $(echo "$sel" | wc -w) file(s)"
            [ "$total" -gt 0 ] || { echo "  no tests selected"; status=1; }
        fi
        for script in $(commands_of "$part" | sed 's/^@[0-9]* //' | awk '{print $2}' | grep '\.py$'); do
            [ -f "$script" ] || { echo "  missing: $script"; status=1; }
        done
    done
    echo "dry run: $([ $status = 0 ] && echo ok || echo FAILED)"
    exit $status
fi

# ---- the parts ----------------------------------------------------------------------------------------
[ $prereq = 0 ] || { echo "gpu_check.sh: prerequisites missing (above)"; exit 1; }
status=0
for part in "${parts[@]}"; do
    budget=$PART_TIMEOUT; [ "$part" = first ] || [ "$part" = second ] && budget=$FIRST_TIMEOUT
    echo "==== part $part (estimate ~$(estimate_of "$part") min; stops itself after ${budget} s)"
    start=$SECONDS
    part_rc=0
    mapfile -t cmds < <(commands_of "$part")
    for cmd in "${cmds[@]}"; do
        left=$((budget - (SECONDS - start)))
        own=$left
        if [[ "$cmd" == @* ]]; then own=${cmd%% *}; own=${own#@}; cmd=${cmd#* }; fi
        if [ $left -le 10 ]; then echo "part $part: out of time before: $cmd"; part_rc=124; break; fi
        [ "$own" -lt "$left" ] && left=$own
        echo "\$ $cmd   (at most $left s)"
        cmd_start=$SECONDS
        # SIGINT first: pytest prints its summary of what ran; KILL 20 s later if it does not stop
        timeout -s INT -k 20 "$left" $cmd </dev/null; rc=$?
        echo "---- rc $rc in $((SECONDS - cmd_start)) s"
        [ $rc = 0 ] || part_rc=$rc
    done
    echo "==== part $part: rc $part_rc in $((SECONDS - start)) s (estimate ~$(estimate_of "$part") min)"
    [ $part_rc = 0 ] || status=1
done
exit $status
