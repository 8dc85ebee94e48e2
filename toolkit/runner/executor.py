"""Tensor-parallel worker processes (vLLM `MultiprocExecutor`, cut down): rank 0 is the caller's
process (a notebook kernel included) and owns the scheduler, the sampler's outputs and the trace;
ranks 1..N-1 are processes this module starts (torch.multiprocessing, `start_context()`: "forkserver"
where the platform has one, else "spawn") that hold their shard of the model and a ModelRunner of
their own.

Every call of the runner that runs the model (MIRRORED: the step's execute_model and sample_tokens,
warmup's profile and dummy runs, graph capture, releasing finished requests' rows) is broadcast by
rank 0 (`torch.distributed.broadcast_object_list`: the method's name and arguments, a
SchedulerOutput for a step) before rank 0 runs it, and each worker runs the same call on its own
runner. So every rank builds the same batch and metadata itself; the collectives happen inside the
model (the row-parallel all-reduces, the LM head's all-gather), and every rank samples the same
tokens from the same gathered logits (as MRV2 does).

Besides the runner's calls, rank 0 can ask the workers' helper (an object the engine's `worker_hooks`
builds in each worker around its runner: the inspection side, inspect/ranks.py) a question with
`ask(name, ...)`: every worker answers and rank 0 gathers the answers (`gather_object`). A
`worker_context` (a picklable context-manager factory, e.g. planted faults) wraps each worker's life.

Failures: the process group has a timeout (`timeout_s`, 30 s), so a hung worker makes rank 0's
collective raise instead of waiting for gloo's 30-minute default; a worker that raises sends its
traceback over a pipe before it exits, and a dead worker closes its end of the group, so rank 0's
collective raises within milliseconds. Rank 0 then raises `TensorParallelError` naming the rank,
its exit code and its error. `shutdown()` tells the workers to stop, waits, terminates what is left,
destroys the process group; a new engine can start another group in the same process.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from toolkit.config import RunnerConfig, SpeculativeConfig
from toolkit.distributed import TPGroup
from toolkit.errors import TensorParallelError
from toolkit.models import load_model
from toolkit.runner.model_runner import ModelRunner
from toolkit.runner.spec_decode import RankZeroProposes

MIRRORED = ("execute_model", "sample_tokens", "profile_run", "dummy_run", "capture_cudagraphs", "remove_requests")
DEFAULT_TIMEOUT_S = 30.0
STOP = None                      # the broadcast that ends a worker's loop
ASK = "?"                        # a broadcast method name starting with it asks the workers' helper
WorkerHooks = Callable[[ModelRunner, TPGroup], Any]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


START_METHOD_VAR = "RUNNERSCOPE_WORKER_MULTIPROC_METHOD"    # as vLLM's VLLM_WORKER_MULTIPROC_METHOD
START_METHODS = ("forkserver", "spawn")


def start_context():
    """The multiprocessing context the workers start in. "forkserver" where the platform has it (Linux,
    macOS): the first tensor-parallel engine of a process starts a server that imports torch and the
    toolkit once (this module preloaded), and every worker after that forks from it, ready in about
    0.1 s instead of the ~5 s a fresh interpreter takes to import them (a notebook that rebuilds its
    engine, a test suite). "spawn" elsewhere (Windows). Neither inherits the caller's CUDA state, which
    torch requires (plain "fork" it does not support with CUDA), and both re-import the caller's main
    module in the worker. RUNNERSCOPE_WORKER_MULTIPROC_METHOD=spawn picks spawn everywhere.
    A forked worker would see the server's environment, set when the server started: `_worker_main`
    takes the caller's environment as it is at each start instead, as a spawned worker does. It runs
    the code the server imported, though: after editing the toolkit in a running session, restart it
    or choose spawn."""
    default = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    method = os.environ.get(START_METHOD_VAR) or default
    if method not in START_METHODS:
        raise ValueError(f"{START_METHOD_VAR}={method!r}: the tensor-parallel workers start with one of "
                         f"{', '.join(START_METHODS)}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([__name__])      # read once, when this process's server starts
    return ctx


def worker_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r on CUDA (one GPU per rank), the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _worker_main(rank: int, world: int, store: str, timeout_s: float, model: str, cfg: RunnerConfig,
                 spec: SpeculativeConfig | None, conn, hooks: WorkerHooks | None,
                 context: Callable[[], contextlib.AbstractContextManager] | None, environ: dict[str, str]) -> None:
    """A worker: join the group, build its shard and runner, then run each broadcast call until STOP.
    `environ`: the caller's environment when it started the worker (a forked worker has the server's)."""
    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
    runner = None
    try:
        with context() if context is not None else contextlib.nullcontext():
            runner = _serve(rank, world, store, timeout_s, model, cfg, spec, conn, hooks)
    except BaseException as err:            # tell rank 0 why, then leave (rank 0's collective fails)
        try:
            conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        except (BrokenPipeError, OSError):
            pass
        os._exit(1)
    finally:
        if runner is not None:
            runner.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def _serve(rank: int, world: int, store: str, timeout_s: float, model: str, cfg: RunnerConfig,
           spec: SpeculativeConfig | None, conn, hooks: WorkerHooks | None) -> ModelRunner:
    """The worker's life inside its context; returns its runner (shut down by the caller)."""
    if cfg.device.type == "cpu":          # the ranks share the machine's cores (OMP_NUM_THREADS caps it)
        share = max(1, (os.cpu_count() or 1) // world)
        cap = os.environ.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(min(share, int(cap)) if cap.isdigit() and int(cap) > 0 else share)
    else:                                 # NCCL's object collectives use the current device: this rank's
        torch.cuda.set_device(cfg.device)
    dist.init_process_group(_backend(cfg.device), init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    tp = TPGroup(rank, world)
    loaded = load_model(model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed, tp=tp)
    runner = ModelRunner(loaded.model, cfg, spec, RankZeroProposes() if spec is not None else None)
    helper = hooks(runner, tp) if hooks is not None else None
    conn.send(("ready", None))
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is STOP:
            return runner
        method, args, kwargs = box[0]
        if method.startswith(ASK):
            dist.gather_object(getattr(helper, method[len(ASK):])(*args, **kwargs), None, dst=0)
        else:
            getattr(runner, method)(*args, **kwargs)


def _forget_failed_rendezvous() -> None:
    """Undo what a failed `init_process_group` leaves behind. It names the default group after a
    process-wide counter (torch's `_world.group_count`, the prefix of the group's store keys), counts
    before it rendezvouses, and only `destroy_process_group` resets the count: after a rendezvous
    that timed out, rank 0's next group would be "1" while its fresh workers' is "0", and that engine's
    rendezvous would time out too."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


_running: list[TPExecutor] = []        # the executor whose group this process is in (at most one)


@atexit.register
def _shut_down_at_exit() -> None:
    """An engine left running at interpreter exit: stop its workers and destroy its group (before
    multiprocessing's own exit hook, registered earlier, terminates what is left)."""
    for executor in list(_running):
        executor.shutdown()


def check_no_engine_group() -> None:
    """Refuse a second tensor-parallel engine while one this process started still runs: its process
    group would look like a launcher's (torchrun) to the new engine, whose collectives would then
    meet the running engine's workers."""
    if _running:
        raise TensorParallelError("a tensor-parallel engine this process started is still running: shut it "
                                  "down (llm.shutdown()) before building another tensor-parallel engine")


class TPExecutor:
    """Starts ranks 1..N-1 and joins rank 0 (this process) to their group; `mirror(runner)` makes the
    runner's MIRRORED calls broadcast first. See the module docstring."""

    def __init__(self, world_size: int, model: str, cfg: RunnerConfig, spec: SpeculativeConfig | None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, worker_hooks: WorkerHooks | None = None,
                 worker_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        if dist.is_initialized():
            raise TensorParallelError("torch.distributed is initialised already in this process: shut the other "
                                      "tensor-parallel engine down first (or run under torchrun)")
        self.world_size, self.timeout_s = world_size, timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="runnerscope_tp_"))
        store = str(self._dir / "store")
        ctx = start_context()
        self.workers, self.pipes, self.closed = [], [], False
        self._inside = False             # rank 0 is running a mirrored call
        self.failure: str | None = None  # why the group is unusable (a worker failed)
        for rank in range(1, world_size):
            here, there = ctx.Pipe(duplex=False)
            worker_cfg = dataclasses.replace(cfg, device=worker_device(cfg.device, rank))
            proc = ctx.Process(target=_worker_main, name=f"runnerscope-tp-rank{rank}", daemon=True,
                               args=(rank, world_size, store, timeout_s, model, worker_cfg, spec, there,
                                     worker_hooks, worker_context, dict(os.environ)))
            proc.start()
            there.close()
            self.workers.append(proc)
            self.pipes.append(here)
        try:
            dist.init_process_group(_backend(cfg.device), init_method=f"file://{store}", rank=0,
                                    world_size=world_size, timeout=timedelta(seconds=timeout_s))
            for rank in range(1, world_size):
                self._wait_ready(rank)
        except BaseException as err:
            gone = {r: p.exitcode for r, p in enumerate(self.workers, start=1) if not p.is_alive()}
            said = {r: why for r in gone if (why := self._error_sent(r)) is not None}
            self.shutdown()
            if isinstance(err, RuntimeError) and said:       # a worker raised before it joined: its error
                rank, why = next(iter(said.items()))
                raise TensorParallelError(f"tensor-parallel rank {rank} (exit code {gone[rank]}) failed before "
                                          f"joining the process group: {why}") from err
            if isinstance(err, RuntimeError) and gone:       # the rendezvous timed out: a worker never came
                ranks = ", ".join(f"rank {r} (exit code {code})" for r, code in gone.items())
                raise TensorParallelError(
                    f"tensor-parallel {ranks} exited before joining the process group. In a script, "
                    "build the engine under `if __name__ == \"__main__\":` (each worker imports the main "
                    "module)") from err
            raise
        self.group = TPGroup(0, world_size)
        _running.append(self)

    def _error_sent(self, rank: int) -> str | None:
        """The error a worker that has exited sent over its pipe (`_worker_main`), if any."""
        pipe = self.pipes[rank - 1]
        with contextlib.suppress(EOFError, OSError):
            if pipe.poll(0):
                kind, message = pipe.recv()
                return message if kind == "error" else None
        return None

    def _wait_ready(self, rank: int) -> None:
        pipe = self.pipes[rank - 1]
        if not pipe.poll(max(self.timeout_s * 4, 120.0)):      # loading a model can take a while
            raise TensorParallelError(f"tensor-parallel rank {rank} did not start within the timeout")
        kind, message = pipe.recv()
        if kind != "ready":
            raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {message}")

    # ---- the calls ------------------------------------------------------------------------------
    def mirror(self, runner: ModelRunner) -> None:
        """Wrap the runner's MIRRORED methods (on the instance): broadcast, then run here."""
        for name in MIRRORED:
            setattr(runner, name, self._mirrored(name, getattr(runner, name)))

    def _mirrored(self, name: str, local):
        def call(*args, **kwargs):
            if self._inside:                     # a mirrored call made by another one (execute_model
                return local(*args, **kwargs)     # releases finished rows): the workers make it too
            self.broadcast((name, args, kwargs))
            self._inside = True
            try:
                return local(*args, **kwargs)
            except RuntimeError as err:          # a worker failed? say which rank and why
                self.raise_worker_failure(err, collective=False)
                raise
            finally:
                self._inside = False
        call.__wrapped__ = local
        call.__name__ = name
        return call

    def broadcast(self, message: Any) -> None:
        if self.closed:
            raise TensorParallelError("the tensor-parallel workers are shut down")
        if self.failure is not None:
            raise TensorParallelError(f"the tensor-parallel engine failed earlier: {self.failure}")
        try:
            dist.broadcast_object_list([message], src=0)
        except RuntimeError as err:
            self.raise_worker_failure(err, collective=True)
            raise

    def ask(self, name: str, here: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """Every rank's answer to `name(*args, **kwargs)` of its helper, in rank order (`here`: rank
        0's own answer)."""
        self.broadcast((ASK + name, args, kwargs))
        answers: list[Any] = [None] * self.world_size
        try:
            dist.gather_object(here, answers, dst=0)
        except RuntimeError as err:
            self.raise_worker_failure(err, collective=True)
            raise
        return answers

    def raise_worker_failure(self, err: BaseException, collective: bool) -> None:
        """Raise TensorParallelError naming the failed ranks (their exit codes and errors). With none
        found: raise it anyway for a failed collective (a hung worker: the group timed out), else
        return (the error is rank 0's own, raised as it is)."""
        failed = []
        for rank, (proc, pipe) in enumerate(zip(self.workers, self.pipes, strict=True), start=1):
            message = ""
            if pipe.poll(0.5 if not proc.is_alive() else 0):
                try:
                    kind, message = pipe.recv()
                except (EOFError, OSError):
                    message = ""
            proc.join(0.5 if message or not proc.is_alive() else 1.0)     # a worker just killed: reaped soon
            if message or not proc.is_alive():
                code = proc.exitcode
                failed.append(f"rank {rank} ({'exit code ' + str(code) if code is not None else 'alive'})"
                              + (f": {message.strip()}" if message else ""))
        if failed:
            self.failure = "; ".join(failed)
            raise TensorParallelError(f"tensor-parallel worker failed: {self.failure} (rank 0 saw: {err})") from err
        if collective:
            self.failure = f"a collective failed on rank 0 ({err})"
            raise TensorParallelError(f"a tensor-parallel collective failed on rank 0 ({err}); the workers are alive "
                                      f"(a hung worker makes it time out after {self.timeout_s:g} s)") from err

    # ---- the end --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (STOP, then terminate, then kill what is left) and destroy the group."""
        if self.closed and not self.workers:
            return
        if not self.closed and self.failure is None and dist.is_initialized():
            try:
                dist.broadcast_object_list([STOP], src=0)
            except RuntimeError:
                pass                            # a worker is gone: terminate the rest below
        self.closed = True
        for proc in self.workers:
            proc.join(5.0)
        for proc in self.workers:
            if proc.is_alive():
                proc.terminate()
                proc.join(4.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for pipe in self.pipes:
            pipe.close()
        self.workers, self.pipes = [], []
        if dist.is_initialized():
            dist.destroy_process_group()
        else:
            _forget_failed_rendezvous()
        if self in _running:
            _running.remove(self)
        for f in self._dir.glob("*"):
            f.unlink(missing_ok=True)
        self._dir.rmdir()

    @property
    def alive(self) -> list[int]:
        """The worker ranks whose processes are alive."""
        return [rank for rank, proc in enumerate(self.workers, start=1) if proc.is_alive()]
