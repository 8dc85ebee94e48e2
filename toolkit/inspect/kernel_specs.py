"""Compile every Triton kernel specialization a piece of code launches for real GPUs, ahead of time,
on a machine without one.

Under TRITON_INTERPRET=1 (the CPU tests) a kernel never compiles, so a kernel that the interpreter
runs but a GPU refuses (a non-power-of-2 `tl.arange`, too much shared memory, a dtype a `tl.dot`
does not take) would only fail on the first GPU. Triton's wheel ships `ptxas`, so a CPU machine can
compile for any CUDA target: record the specializations (what Triton's JIT keys a compile on: the
argument dtypes, which integers are 1 or divisible by 16, which pointers are 16-byte aligned, the
constexpr values, num_warps / num_stages) while the code runs under the interpreter, then compile
each one with `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`.

    specs = KernelSpecs()
    with specs.recording():
        llm.generate(...)                       # any code that launches kernels, on any device
    results = compile_specs(specs.specs.values(), archs=(80, 90))
    problems(results)                           # compile errors, shared memory over the limit
    print(markdown_table(results))              # per kernel: registers, spills, shared memory

A tensor argument is recorded as its dtype and whether its data pointer is 16-byte aligned *on a
GPU*: CUDA allocations (torch's caching allocator included) start at least 256-byte aligned, so a
tensor's alignment is that of its byte offset into its storage (a view into a fused projection may
not be aligned). Constexprs a launcher picks by device are compiled as on CUDA (CUDA_LAUNCH_CHOICES).

Compiles run in fresh Python processes (this file loaded alone, TRITON_INTERPRET unset, a new Triton
cache per call, so nothing cached by an earlier run can hide a break), one compile per
(specialization, target), as JITFunction.run would compile it on such a GPU.
Registers and spill bytes come from `ptxas -v` (the log Triton writes when TRITON_DUMP_PTXAS_LOG=1),
shared memory from the compiled kernel's metadata (the dynamic shared memory Triton asks for at
launch; ptxas's static `smem` is added, 0 for Triton kernels).
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Shared memory one thread block can use (with the opt-in attribute Triton sets): CUDA reserves 1 KB
# of each SM's shared memory per block. NVIDIA Ampere GPU Architecture Tuning Guide, 1.4.2.3 "Unified
# Shared Memory/L1/Texture Cache": A100 (sm_80) 164 KB per SM, 163 KB per block; NVIDIA Hopper Tuning
# Guide, "Unified Shared Memory/L1/Texture Cache": H100 (sm_90) 228 KB per SM, 227 KB per block
# (also the CUDA C++ Programming Guide's table of technical specifications per compute capability).
# Triton refuses a launch above cudaDevAttrMaxSharedMemoryPerBlockOptin (CompiledKernel._init_handles).
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
REGISTERS_PER_BLOCK = 65536          # 64K 32-bit registers per block on sm_80 and sm_90 (same sources)

# Constexprs a launcher chooses by device, which a CPU recording cannot see: on CUDA ssd_scan's fp32
# dots are three-pass tf32 ("ieee" elsewhere). Specs compiled for CUDA take these values.
CUDA_LAUNCH_CHOICES = {
    "toolkit.kernels.ssd_scan:_chunk_state_kernel": {"DOT_PRECISION": "tf32x3"},
    "toolkit.kernels.ssd_scan:_chunk_scan_kernel": {"DOT_PRECISION": "tf32x3"},
}


# ---- recording ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelSpec:
    """One specialization of one kernel, as a launch asked for it. JSON-able.
    kernel: "module:name"; args: the launch's positional arguments, a tensor as
    {"tensor": dtype name, "aligned": bool}; kwargs: its keyword arguments (constexprs, num_warps,
    num_stages); key: Triton's specialization of those arguments (what its JIT cache keys on);
    signature: the same in words, e.g. "x_ptr=*bf16/16 dim=i32/16 eps=fp32 BLOCK_D=1024 num_warps=4"."""
    kernel: str
    args: tuple
    kwargs: tuple                      # sorted (name, value) pairs
    key: str
    signature: str

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "args": list(self.args), "kwargs": dict(self.kwargs), "key": self.key,
                "signature": self.signature}

    @classmethod
    def from_json(cls, d: dict) -> KernelSpec:
        return cls(d["kernel"], tuple(d["args"]), tuple(sorted(d["kwargs"].items())), d["key"], d["signature"])

    def for_cuda(self) -> KernelSpec:
        """This spec with the constexprs its launcher would choose on CUDA (CUDA_LAUNCH_CHOICES)."""
        choices = CUDA_LAUNCH_CHOICES.get(self.kernel, {})
        kwargs = dict(self.kwargs)
        if not choices or all(kwargs.get(k) == v for k, v in choices.items()):
            return self
        if not choices.keys() <= kwargs.keys():
            raise ValueError(f"{self.kernel}: CUDA_LAUNCH_CHOICES names {sorted(choices)} but the launch passed "
                             f"{sorted(kwargs)} by keyword: update CUDA_LAUNCH_CHOICES to what the launcher does")
        sig = " ".join(f"{name}={choices[name]}" if name in choices else part
                       for part in self.signature.split(" ") for name in [part.split("=", 1)[0]])
        return KernelSpec(self.kernel, self.args, tuple(sorted({**kwargs, **choices}.items())),
                          f"{self.key} cuda:{json.dumps(choices, sort_keys=True)}", sig)


class _TensorArg:
    """What Triton's specialization reads of a tensor: its dtype and its data pointer's alignment."""

    def __init__(self, dtype, aligned: bool):
        self.dtype, self._ptr = dtype, 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._ptr


def _describe(value):
    """A launch argument as JSON: a tensor by dtype and GPU alignment, a scalar as itself."""
    import torch
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."),
                "aligned": value.storage_offset() * value.element_size() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot record a kernel argument of type {type(value).__name__}: {value!r}")


def _stand_in(value):
    if isinstance(value, dict) and "tensor" in value:
        import torch
        return _TensorArg(getattr(torch, value["tensor"]), value["aligned"])
    return value


def _cuda_backend(arch: int = 90):
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    return make_backend(GPUTarget("cuda", arch, 32))


def _binder(jit, backend):
    """Triton's own argument binder of `jit` (a JITFunction): args -> (bound, specialization, options)."""
    from triton.runtime.jit import create_function_from_signature
    return create_function_from_signature(jit.signature, jit.params, backend)


class KernelSpecs:
    """The distinct kernel specializations launched while `recording()` (any number of times).

    specs: key -> the first launch of that specialization; launches: kernel -> launches seen;
    labels: the labels of the recordings that ran to the end (a workload recorded once need not
    run again)."""

    def __init__(self) -> None:
        self.specs: dict[str, KernelSpec] = {}
        self.launches: Counter[str] = Counter()
        self.labels: set[str] = set()
        self._jits: dict[str, tuple] = {}

    @property
    def kernels(self) -> set[str]:
        return {s.kernel for s in self.specs.values()}

    @contextlib.contextmanager
    def recording(self, label: str | None = None) -> Iterator[KernelSpecs]:
        """Record every Triton launch inside (interpreted or compiled); the launches still run."""
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
        recorder, patched = self, []
        for cls in (JITFunction, InterpretedFunction):
            original = cls.run

            def run(self, *args, grid, warmup, _original=original, **kwargs):
                if not warmup:
                    recorder.record(self.fn, args, kwargs, _unspecialized(self))
                return _original(self, *args, grid=grid, warmup=warmup, **kwargs)

            patched.append((cls, original))
            cls.run = run
        try:
            yield self
        finally:
            for cls, original in patched:
                cls.run = original
        if label is not None:
            self.labels.add(label)

    def record(self, fn, args: tuple, kwargs: dict, do_not_specialize: tuple = ()) -> KernelSpec:
        """Record the launch of kernel function `fn` (the Python function under @triton.jit, whose
        decorator's do_not_specialize this is)."""
        kernel = f"{fn.__module__}:{fn.__qualname__}"
        self.launches[kernel] += 1
        args_j = tuple(_describe(a) for a in args)
        kwargs_j = tuple(sorted((k, _describe(v)) for k, v in kwargs.items()))
        jit, binder = self._jit(kernel, fn, do_not_specialize)
        _, specialization, options = binder(*map(_stand_in, args_j), **{k: _stand_in(v) for k, v in kwargs_j})
        key = json.dumps([kernel, specialization, sorted(options.items())], default=str)
        if key not in self.specs:
            self.specs[key] = KernelSpec(kernel, args_j, kwargs_j, key, _signature(jit, specialization, options))
        return self.specs[key]

    def _jit(self, kernel: str, fn, do_not_specialize: tuple = ()) -> tuple:
        if kernel not in self._jits:
            from triton.runtime.jit import JITFunction
            # parameters and binder only: never launched or compiled here
            jit = JITFunction(fn, do_not_specialize=list(do_not_specialize))
            self._jits[kernel] = (jit, _binder(jit, _cuda_backend()))
        return self._jits[kernel]

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps({"labels": sorted(self.labels), "launches": dict(self.launches),
                                          "specs": [s.to_json() for s in self.specs.values()]}, indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> KernelSpecs:
        d = json.loads(Path(path).read_text())
        out = cls()
        out.specs = {s["key"]: KernelSpec.from_json(s) for s in d["specs"]}
        out.launches, out.labels = Counter(d["launches"]), set(d["labels"])
        return out


def _unspecialized(kernel) -> tuple:
    """The do_not_specialize of a JITFunction or an InterpretedFunction (which keeps its decorator's
    arguments in `kwargs`), as its decorator gave it."""
    kwargs = getattr(kernel, "kwargs", None)
    names = kwargs.get("do_not_specialize") if kwargs is not None else kernel.do_not_specialize
    return tuple(names or ())


def _signature(jit, specialization, options) -> str:
    parts = []
    for param, (ty, attr) in zip(jit.params, specialization, strict=True):
        if ty == "constexpr":
            parts.append(f"{param.name}={attr}")
        else:
            parts.append(f"{param.name}={ty}" + ("/16" if attr == "D" else ""))
    parts += [f"{k}={v}" for k, v in sorted(options.items())]
    return " ".join(parts)


def launched_kernels() -> dict[str, str]:
    """Every kernel the launchers in toolkit.kernels launch (`name[grid](...)` in a kernel family's
    source, read without importing it): "module:name" -> file."""
    folder = Path(importlib.util.find_spec("toolkit.kernels").submodule_search_locations[0])
    found = {}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        jitted = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                  and any(ast.unparse(d).startswith(("triton.jit", "jit")) for d in node.decorator_list)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in jitted):
                found[f"toolkit.kernels.{path.stem}:{node.func.value.id}"] = path.name
    return found


# ---- compiling ------------------------------------------------------------------------------------

@dataclass
class CompileResult:
    kernel: str
    signature: str
    arch: int
    ok: bool
    error: str = ""
    registers: int | None = None
    spill_stores: int | None = None          # bytes
    spill_loads: int | None = None           # bytes
    stack: int | None = None                 # bytes of stack frame
    shared: int | None = None                # bytes: Triton's dynamic shared memory + ptxas's static smem
    num_warps: int | None = None
    seconds: float = 0.0
    triton: str = ""
    ptxas_log: str = field(default="", repr=False)


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "smem": re.compile(r"(\d+) bytes smem"),
}


def parse_ptxas_log(log: str) -> dict[str, int]:
    return {k: int(m.group(1)) if (m := rx.search(log)) else 0 for k, rx in _PTXAS.items()}


def _ptxas_v(ptx: str, arch: int) -> str:
    """ptxas -v on the PTX (when the Triton version does not print its log)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}",
                               str(src), "-o", str(Path(d) / "k.cubin")], capture_output=True, text=True)
        return proc.stdout + proc.stderr


def compile_spec(spec: KernelSpec, arch: int) -> CompileResult:
    """Compile one spec for sm_<arch> as JITFunction.run would on such a GPU (in this process, which
    must not run the interpreter). Never raises for a kernel's error: the result says it."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    module, name = spec.kernel.split(":")
    jit = getattr(importlib.import_module(module), name)
    if not isinstance(jit, JITFunction):
        raise RuntimeError(f"{spec.kernel} is a {type(jit).__name__}, not a JITFunction: compile in a process "
                           "where TRITON_INTERPRET is unset when the kernels are imported")
    res = CompileResult(spec.kernel, spec.signature, arch, ok=False, triton=triton.__version__)
    start = time.perf_counter()
    out = io.StringIO()
    try:
        target = GPUTarget("cuda", arch, 32)
        backend = _cuda_backend(arch)
        # the keyword arguments JITFunction.run adds before binding
        kwargs = {k: _stand_in(v) for k, v in spec.kwargs}
        kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
        for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, knob):
                kwargs[knob] = getattr(knobs.compilation, knob)
        bound, specialization, options = _binder(jit, backend)(*map(_stand_in, spec.args), **kwargs)
        options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
        with contextlib.redirect_stdout(out):
            kernel = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)
    except Exception as err:            # a kernel that does not compile: say why, keep going
        res.error = f"{type(err).__name__}: {err}"
        res.seconds = time.perf_counter() - start
        return res
    log = out.getvalue()
    if "Used" not in log:
        log = _ptxas_v(kernel.asm["ptx"], arch)
    info = parse_ptxas_log(log)
    res.ok, res.ptxas_log = True, log
    res.registers, res.spill_stores, res.spill_loads, res.stack = (
        info["registers"], info["spill_stores"], info["spill_loads"], info["stack"])
    res.shared = int(kernel.metadata.shared or 0) + info["smem"]
    res.num_warps = int(kernel.metadata.num_warps)
    res.seconds = time.perf_counter() - start
    return res


def _serve() -> None:
    """A compile worker: one JSON [spec, arch] per line on stdin -> one JSON CompileResult per line."""
    import warnings
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                                 # anything else written to stdout goes to stderr
    sys.stdout = sys.stderr
    for line in sys.stdin:
        spec, arch = json.loads(line)
        protocol.write(json.dumps(asdict(compile_spec(KernelSpec.from_json(spec), arch))) + "\n")
        protocol.flush()


# A worker loads this file alone (not the toolkit.inspect package, which imports the engine).
_WORKER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_kernel_specs_worker", sys.argv[1])
module = sys.modules["_kernel_specs_worker"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module._serve()
"""


class _Worker:
    def __init__(self, env: dict, log: Path):
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, __file__], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env, text=True)

    def compile(self, task: tuple[dict, int]) -> CompileResult:
        self.proc.stdin.write(json.dumps(task) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the compile worker died on {task[0]['kernel']} for sm_{task[1]}:\n"
                               + self.log.read_text()[-3000:])
        return CompileResult(**json.loads(line))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def compile_specs(specs: Iterable[KernelSpec], archs: Iterable[int] = (80, 90), workers: int = 2,
                  cuda_choices: bool = True) -> list[CompileResult]:
    """Compile every spec for every sm_<arch>, one compile per distinct (spec, arch), in `workers`
    fresh Python processes (TRITON_INTERPRET unset, a new Triton cache each call, removed after).
    cuda_choices: compile the constexprs the launchers choose on CUDA (CUDA_LAUNCH_CHOICES) instead
    of the recorded ones. Results in the order of (spec, arch)."""
    specs = [s.for_cuda() if cuda_choices else s for s in specs]
    specs = list({s.key: s for s in specs}.values())
    tasks = [(s.to_json(), arch) for s in specs for arch in archs]
    scratch = Path(tempfile.mkdtemp(prefix="triton-aot-"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}      # real JITFunctions
    env.update(TRITON_CACHE_DIR=str(scratch / "cache"),   # fresh: no compile of an earlier run is reused
               TRITON_DUMP_PTXAS_LOG="1",                 # Triton prints ptxas -v's log: registers, spills
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))    # the toolkit this process imports
    idle: queue.Queue[_Worker] = queue.Queue()
    started = [_Worker(env, scratch / f"worker{i}.log") for i in range(max(1, min(workers, len(tasks))))]
    for w in started:
        idle.put(w)

    def run(task):
        worker = idle.get()
        try:
            return worker.compile(task)
        finally:
            idle.put(worker)
    try:
        with ThreadPoolExecutor(len(started)) as threads:
            return list(threads.map(run, tasks))
    finally:
        for w in started:
            with contextlib.suppress(Exception):
                w.close()
        shutil.rmtree(scratch, ignore_errors=True)


def problems(results: Iterable[CompileResult], limits: dict[int, int] = SHARED_MEMORY_LIMIT) -> list[str]:
    """What would stop a kernel on a GPU: a compile error (one entry per kernel and error: the
    targets, how many of its specializations, the first one, the error), shared memory above what
    one block can get, or more registers per block than the register file has."""
    results = list(results)
    out, errors = [], defaultdict(list)
    for r in results:
        if not r.ok:
            errors[r.kernel, r.error].append(r)
    for (kernel, error), rs in errors.items():
        specs = {r.signature for r in results if r.kernel == kernel}
        failed = {r.signature for r in rs}
        lines = [ln for ln in error.strip().splitlines() if ln.strip()]
        if len(lines) > 14:                   # Triton's message ends with the reason, after the source
            lines = lines[:4] + ["..."] + lines[-9:]
        archs = ", ".join(f"sm_{a}" for a in sorted({r.arch for r in rs}))
        out.append(f"{kernel} does not compile for {archs} in {len(failed)} of its {len(specs)} specializations, "
                   f"e.g. [{rs[0].signature}]:\n    " + "\n    ".join(lines))
    for r in results:
        if not r.ok:
            continue
        where = f"{r.kernel} for sm_{r.arch} [{r.signature}]"
        if r.shared > limits[r.arch]:
            out.append(f"{where} needs {r.shared} bytes of shared memory, above the {limits[r.arch]} a block "
                       f"can have on sm_{r.arch}")
        per_warp = -(-r.registers * 32 // 256) * 256            # registers are allocated per warp, by 256
        if r.num_warps * per_warp > REGISTERS_PER_BLOCK:
            out.append(f"{where} needs {r.registers} registers x {r.num_warps * 32} threads, above the "
                       f"{REGISTERS_PER_BLOCK} registers of a block")
    return out


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def markdown_rows(results: Iterable[CompileResult]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per kernel, its specializations, the float dtypes of its pointer arguments, and
    per target the registers (range), the most spill bytes (stores + loads) and the most shared
    memory (bytes) over its specializations."""
    by_kernel: dict[str, dict[int, list[CompileResult]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        by_kernel[r.kernel][r.arch].append(r)
    archs = sorted({a for per in by_kernel.values() for a in per})
    header = ["kernel", "specs", "float dtypes"]
    for a in archs:
        header += [f"sm_{a} regs", f"sm_{a} spill B", f"sm_{a} smem B"]
    rows = []
    for kernel in sorted(by_kernel, key=lambda k: (k.split(":")[0], k)):
        per = by_kernel[kernel]
        dtypes = {t for r in per[archs[0]] for t in re.findall(r"=\*(fp32|fp16|bf16)\b", r.signature)}
        row = [f"{kernel.split(':')[0].rsplit('.', 1)[1]}.{kernel.split(':')[1]}", str(len(per[archs[0]])),
               " ".join(t for t in ("fp32", "fp16", "bf16") if t in dtypes)]
        for a in archs:
            ok = [r for r in per[a] if r.ok]
            failed = len(per[a]) - len(ok)
            if not ok:
                row += ["FAILED"] * 3
                continue
            row += [_span([r.registers for r in ok]) + (f" ({failed} FAILED)" if failed else ""),
                    str(max(r.spill_stores + r.spill_loads for r in ok)), str(max(r.shared for r in ok))]
        rows.append(row)
    return header, rows


def markdown_table(results: Iterable[CompileResult]) -> str:
    header, rows = markdown_rows(results)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join(lines)
