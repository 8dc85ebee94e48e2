"""`LLM`: the user-facing engine (vLLM names): generate(), add_request(), step(), warmup(),
shutdown(). It wires a Scheduler (who runs, which blocks), a ModelRunner (what runs) and, when
inspection or checks are on, a Recorder (what happened), and delegates to them."""
from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from typing import Any

import torch
from tqdm.auto import tqdm

from toolkit.admission import Prompt, RequestIds, RequestLimits, own_params, prompt_token_ids
from toolkit.chat import chat, public_tokenizer
from toolkit.config import (
    RunnerConfig,
    resolve_backend,
    resolve_device_dtype,
    resolve_mamba_cache_mode,
    resolve_max_model_len,
    resolve_speculative_config,
)
from toolkit.distributed import TPGroup, launched_group
from toolkit.errors import EngineClosedError, InvalidRequestError, NotSupportedYetError, ToolkitError
from toolkit.generation_config import check_generation_config, load_generation_defaults
from toolkit.inspect import checks, faults
from toolkit.inspect.capture import LayerSpec, RequestSpec, check_capture_mode
from toolkit.inspect.memory import MemoryMarks, MemoryReport, collect, released_by_shutdown, resolve_trace_budget
from toolkit.inspect.prefix_cache import PrefixCacheReport, prefix_cache_report
from toolkit.inspect.ranks import WorkerInspectorFactory, gather_memory
from toolkit.inspect.recorder import MODES, Recorder, StepOutcome, step_record
from toolkit.inspect.step_record import StepRecord
from toolkit.inspect.trace import Trace
from toolkit.kv_cache_manager import prefix_cache_stats
from toolkit.models import load_model
from toolkit.models.loader import tokenizer_folder
from toolkit.outputs import RequestOutput, finished_outputs
from toolkit.request import Request, child_id
from toolkit.runner.cudagraph import CaptureReport
from toolkit.runner.cudagraph import resolve_mode as resolve_cudagraph_mode
from toolkit.runner.executor import TPExecutor, check_no_engine_group
from toolkit.runner.kv_cache import scheduler_groups
from toolkit.runner.model_runner import ModelRunner
from toolkit.runner.spec_decode import SpecDecodeStats
from toolkit.sampling import SamplingParams, check_seed, derive_seed, tokenize_bad_words
from toolkit.scheduler import Scheduler
from toolkit.tokenizer import collect_eos_token_ids, load_tokenizer


class LLM:
    """`LLM("tiny-bamba")` or `LLM("/path/to/hf_folder")`; docs/guides/engine.md groups every argument."""

    def __init__(self, model: str, *, device: str | torch.device = "auto",
                 dtype: str | torch.dtype = "auto", max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, block_size: int = 16,
                 max_model_len: int | None = None, num_kv_blocks: int | None = None, seed: int = 0,
                 inspect: str = "metadata", trace_capacity: int | None = 256,
                 trace_max_bytes: int | str | None = "auto", inspect_layers: LayerSpec = None,
                 inspect_requests: RequestSpec = None, checks: bool | None = None, backend: str = "auto",
                 enforce_eager: bool = False, cudagraph_mode: str = "auto",
                 enable_prefix_caching: bool = False, num_state_pages: int | None = None,
                 mamba_cache_mode: str | None = None, speculative_config: dict | None = None,
                 tensor_parallel_size: int = 1, revision: str | None = None, download_dir: str | None = None,
                 tokenizer: str | None = None, generation_config: str = "auto"):
        # what Reset in the StepInspector (or a user) needs to build the same engine again
        self.init_args: dict[str, Any] = dict(
            model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, seed=seed, inspect=inspect,
            trace_capacity=trace_capacity, trace_max_bytes=trace_max_bytes, inspect_layers=inspect_layers,
            inspect_requests=inspect_requests, checks=checks, backend=backend, enforce_eager=enforce_eager,
            cudagraph_mode=cudagraph_mode, enable_prefix_caching=enable_prefix_caching,
            num_state_pages=num_state_pages, mamba_cache_mode=mamba_cache_mode,
            speculative_config=speculative_config, tensor_parallel_size=tensor_parallel_size,
            revision=revision, download_dir=download_dir, tokenizer=tokenizer, generation_config=generation_config)
        # arguments first, so that a bad one fails before the model loads
        if inspect not in MODES:
            raise ValueError(f"inspect={inspect!r}: use one of {MODES}")
        self.trace = Trace(trace_capacity, max_bytes=resolve_trace_budget(trace_max_bytes))
        check_capture_mode(inspect, inspect_layers, inspect_requests)
        check_seed(seed)
        check_generation_config(generation_config)
        self.speculative_config = resolve_speculative_config(speculative_config)
        k = self.speculative_config.num_speculative_tokens if self.speculative_config else 0
        dev, dt = resolve_device_dtype(device, dtype)
        self.backend = resolve_backend(backend, dev)      # "torch" or "triton"
        self.cudagraph_mode = resolve_cudagraph_mode(cudagraph_mode, enforce_eager, dev, self.backend)
        # tensor parallelism: this process's rank (SINGLE for one); None: this engine starts the workers
        if tensor_parallel_size != 1:
            check_no_engine_group()
        self.tp = launched_group(tensor_parallel_size)
        if tensor_parallel_size > 1 and inspect == "full" and (enable_prefix_caching or self.speculative_config):
            raise NotSupportedYetError("inspect='full' with tensor_parallel_size > 1 and prefix caching or speculative "
                                       "decoding is not built yet (its cold-replay checks run the model on rank 0 "
                                       "alone); use inspect='metadata' there")
        self.checks = (inspect != "off") if checks is None else bool(checks)
        recording = inspect != "off" or self.checks        # a Recorder; on workers, their inspectors observe
        self._executor: TPExecutor | None = None
        # rank 0's shard; a configuration that cannot shard raises here, before any worker starts
        loaded = load_model(model, dtype=dt, device=dev, seed=seed,
                            tp=self.tp if self.tp is not None else TPGroup(0, tensor_parallel_size),
                            revision=revision, download_dir=download_dir)
        self.hub_source = loaded.hub      # repo, commit sha and snapshot folder of a Hub id; None otherwise
        self.hf_config = loaded.config
        self.cfg = RunnerConfig(device=dev, dtype=dt, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                                max_model_len=resolve_max_model_len(max_model_len, loaded.config),
                                num_kv_blocks=num_kv_blocks, seed=seed, backend=self.backend,
                                cudagraph_mode=self.cudagraph_mode, enable_prefix_caching=enable_prefix_caching,
                                num_state_pages=num_state_pages,
                                mamba_cache_mode=resolve_mamba_cache_mode(mamba_cache_mode, enable_prefix_caching),
                                num_speculative_tokens=k)
        self.model_name = model
        self.vocab_size = int(loaded.config.vocab_size)
        # save_hf_folder(llm, ...) copies it; `tokenizer`: another folder or Hub repo's tokenizer files
        self.tokenizer_dir = (loaded.tokenizer_dir if tokenizer is None
                              else tokenizer_folder(tokenizer, download_dir=download_dir))
        self.tokenizer = load_tokenizer(self.tokenizer_dir, self.vocab_size)
        self.eos_token_ids = collect_eos_token_ids(loaded.config, loaded.source, self.tokenizer)
        # the model's sampling defaults (generation_config.json): fill each request's unset fields
        self.generation_defaults = load_generation_defaults(generation_config, loaded.source)

        draft_model = None        # speculative_config method "draft_model": run inside rank 0's runner
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            draft_model = self._load_draft(self.speculative_config, dev, dt, seed)
        if self.tp is None:       # start ranks 1..N-1 (they load and shard their own copy)
            planted = faults.active()
            # a Hub id's ranks read the snapshot rank 0 resolved: the same commit, no request
            self._executor = TPExecutor(tensor_parallel_size, loaded.hub.folder if loaded.hub else model,
                                        self.cfg, self.speculative_config,
                                        worker_hooks=WorkerInspectorFactory(recording, self.checks),
                                        worker_context=functools.partial(faults.inject, *planted) if planted else None)
            self.tp = self._executor.group
        try:
            self.model_runner = ModelRunner(loaded.model, self.cfg, self.speculative_config, draft_model=draft_model)
        except BaseException:
            if self._executor is not None:
                self._executor.shutdown()
            raise
        if self._executor is not None:
            self._executor.mirror(self.model_runner)
        kinds, num_kv_blocks = scheduler_groups(self.model_runner.kv_cache_groups)
        self.scheduler = Scheduler(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.cfg.max_model_len, groups=kinds,
            num_kv_blocks=num_kv_blocks, decode=self.tokenizer.decode,
            enable_prefix_caching=enable_prefix_caching, num_state_pages=self.cfg.state_pages,
            prefill_checkpoints=self.cfg.prefill_checkpoints, num_speculative_tokens=k,
            # a draft model's guesses are written at the target's block ids, past the scheduled tokens
            num_lookahead_tokens=self.model_runner.draft.num_lookahead_tokens if self.model_runner.draft else 0)
        self.spec_stats = SpecDecodeStats()
        # the draft model's host seconds (in all, and in its forwards), kept past shutdown
        self._draft_stats = self.model_runner.draft.stats if self.model_runner.draft is not None else None
        self.limits = RequestLimits(self.vocab_size, self.cfg.max_model_len, block_size,
                                    self.scheduler.kv.kv_pool.num_total if num_kv_blocks else None)
        self._request_ids = RequestIds()
        self._carried_outputs: list[RequestOutput] = []   # finished inside generate(), not its own
        self._arrivals = 0            # user requests only: warmup does not shift derived seeds
        self._step_index = 0
        self._closed = False
        self.cudagraph_report = None      # CaptureReport after warmup() captured graphs (CUDA)
        self.inspect = inspect
        self._recorder = (Recorder(inspect, self.checks, self.model_runner, self.scheduler, self.trace,
                                   self.backend, inspect_layers, inspect_requests)
                          if recording else None)
        self._memory = MemoryMarks(self.model_runner, self.trace, dev)
        self._memory.mark("load")

    def _load_draft(self, spec, device, dtype, seed: int) -> torch.nn.Module:
        """The draft model (a preset or a folder, loaded whole, unsharded), checked against the
        target's vocabulary; the runner runs it inside the step (runner/draft_model.py)."""
        draft = load_model(spec.model, dtype=dtype, device=device, seed=seed)
        vocab = int(draft.config.vocab_size)
        if vocab != self.vocab_size:
            raise ValueError(f"speculative_config model={spec.model!r} has a vocabulary of {vocab} tokens, "
                             f"the target {self.model_name!r} {self.vocab_size}: a draft model must share "
                             "the target's vocabulary")
        return draft.model

    @property
    def model(self) -> torch.nn.Module:
        return self.model_runner.model

    # ---- requests -----------------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (see `eos_token_ids` for all of them)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def _make_request(self, prompt: Prompt, params: SamplingParams | None,
                      request_id: str | None, taken: set[str] = frozenset()) -> Request:
        """Validate everything a step could fail on; `taken`: ids claimed by the same call."""
        self._check_open()
        params = self.generation_defaults.apply(own_params(params))     # the model's defaults, unset fields
        text, ids = prompt_token_ids(prompt, self.tokenizer.encode)
        if params.bad_words:
            tokenize_bad_words(params, functools.partial(self.tokenizer.encode, add_special_tokens=False))
        self.limits.check(ids, params)
        request_id = self._request_ids.claim(request_id, self.scheduler.requests, taken)
        for i in range(params.n if params.n > 1 else 0):    # the ids its children will take
            cid = child_id(request_id, i)
            if cid in self.scheduler.requests or cid in taken or cid in self._request_ids.finished:
                raise InvalidRequestError(f"request {request_id!r} asks for n={params.n} samples, whose ids "
                                          f"'<i>_{request_id}' include {cid!r}, already used: choose another id")
        return Request(request_id, ids, params, frozenset(self.eos_token_ids), prompt=text)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; returns its id. Invalid input raises and queues nothing."""
        request = self._make_request(prompt, params, request_id)
        self._enqueue(request)
        return request.request_id

    def _enqueue(self, request: Request, count_arrival: bool = True) -> None:
        seed = request.sampling_params.seed
        if seed is None and count_arrival:
            seed = derive_seed(self.cfg.seed, self._arrivals)
        request.sampling_seed = 0 if seed is None else seed
        if count_arrival:
            self._arrivals += 1
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; its blocks and state page are freed. Returns whether a running or
        waiting request was aborted (an unknown or finished id changes nothing)."""
        self._check_open()
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return False
        children = [c.request_id for c in request.children]
        self.model_runner.remove_requests([request_id, *children])
        self._request_ids.finished.update([request_id, *children])
        parent = request.parent
        if parent is not None and all(c.status.is_finished for c in parent.children):
            self._request_ids.finished.add(parent.request_id)    # its other samples finished before
            self._carried_outputs += finished_outputs([request], self.tokenizer.decode)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or a finished one awaits delivery by step()."""
        return self.scheduler.has_unfinished_requests() or bool(self._carried_outputs)

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        """Run one scheduler step and return what happened, as the runner saw it (in every
        `inspect` mode; with "metadata" or "full" the record also goes into `llm.trace`)."""
        self._check_open()
        record, outputs = self._step("step", want_record=True)
        record.outputs, self._carried_outputs = self._carried_outputs + outputs, []
        return record

    def _step(self, stage: str, want_record: bool = False
              ) -> tuple[StepRecord | None, list[RequestOutput]]:
        """schedule -> execute_model (prepare inputs, metadata, forward) -> sample -> update.

        All or nothing: if anything after scheduling raises (a bug, a KeyboardInterrupt), the
        step's requests are put back to be recomputed and the exception propagates; the engine
        serves the next step and the outputs are those of an uninterrupted run. A runtime check
        that fails raises InvariantError after the step has completed and been recorded."""
        warm = stage.startswith("warmup")
        start = time.perf_counter()
        sched_out = self.scheduler.schedule()
        scheduled_at = time.perf_counter()
        if self._recorder is not None:
            self._recorder.begin(f"{stage} step" if warm else f"step {self._step_index}", sched_out)
        try:
            state = self.model_runner.execute_model(sched_out)
            output = self.model_runner.sample_tokens()
            update_start = time.perf_counter()
            finished, kept = self.scheduler.update_from_output(sched_out, output)
            if state is not None and self.speculative_config is not None and not warm:
                self.spec_stats.add(state.verification)
        except BaseException:
            self.scheduler.recover_from_failed_step(sched_out)
            raise
        done = time.perf_counter()
        if finished:                    # (tensor parallelism: each call is a broadcast to the workers)
            self.model_runner.remove_requests([r.request_id for r in finished])
        outputs = finished_outputs(finished, self.tokenizer.decode)
        if not warm:                    # warmup's own ids ("warmup-<i>") may be used again
            self._request_ids.finished.update(r.request_id for r in finished)
            self._request_ids.finished.update(o.request_id for o in outputs)   # n > 1: the parent
        step_index = None if warm else self._step_index
        if not warm:
            self._step_index += 1
        if self._recorder is None and not want_record:
            return None, outputs
        outcome = StepOutcome(step_index, stage, sched_out, state, output.last_kept, kept, finished, outputs,
                              {"schedule": scheduled_at - start, "update": done - update_start})
        if self._recorder is None:
            return step_record(outcome, self.backend, read_device=False), outputs
        return self._recorder.record_step(outcome), outputs

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. All prompts are validated before
        any is queued, so a bad one raises and leaves the engine as it was."""
        self._check_open()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError("prompts: a prompt (a str or {'prompt_token_ids': [...]}) or a list "
                                      f"of them, got {type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise InvalidRequestError("prompts is empty: nothing to generate")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError(f"{len(sampling_params)} sampling params for "
                                          f"{len(prompts)} prompts")
            params_list = sampling_params
        else:
            params_list = [sampling_params] * len(prompts)
        taken: set[str] = set()
        requests = []
        next_auto = self._request_ids.next_auto
        try:
            for p, sp in zip(prompts, params_list):
                requests.append(self._make_request(p, sp, None, taken))
                taken.add(requests[-1].request_id)
        except InvalidRequestError:
            self._request_ids.next_auto = next_auto     # a refused call uses up no automatic ids
            raise
        for r in requests:
            self._enqueue(r)
        ids = [r.request_id for r in requests]
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        try:
            with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
                while wanted - done.keys():
                    for out in self._step("generate")[1]:
                        if out.request_id in wanted:
                            done[out.request_id] = out
                            bar.update(1)
                        else:           # a request from add_request(): the next step() reports it
                            self._carried_outputs.append(out)
        except BaseException:
            # interrupted (e.g. KeyboardInterrupt in a notebook): nobody will collect these
            for rid in wanted - done.keys():
                self.abort_request(rid)         # frees its blocks and row; the id stays used
            raise
        return [done[i] for i in ids]

    def chat(self, messages: list, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation ([{"role", "content"}, ...]) or a list of them, each
        rendered with the chat template and generated (toolkit/chat.py); outputs in order."""
        self._check_open()
        return chat(self, messages, sampling_params, use_tqdm, chat_template, add_generation_prompt,
                    continue_final_message)

    def get_tokenizer(self) -> Any:
        """The tokenizer (vLLM's name): an HF folder's transformers tokenizer, else the ByteTokenizer."""
        return public_tokenizer(self.tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's name: SamplingParams with the model's generation defaults (toolkit/generation_config.py)."""
        return self.generation_defaults.sampling_params()

    # ---- inspection ---------------------------------------------------------------------------
    def set_inspect_filter(self, layers: LayerSpec = None, requests: RequestSpec = None) -> str:
        """What the next full-mode steps capture: recurrent layers (a regex, names, or None for
        all) and requests (an id, ids, a predicate, or None for all); see inspect/capture.py.
        Returns the capture in words. Bad values raise and leave the capture as it was."""
        self._check_open()
        check_capture_mode(self.inspect, layers, requests, always=True)
        self._recorder.capture = self._recorder.make_filter(layers, requests, self._request_ids.finished)
        return self._recorder.capture.describe()

    @property
    def inspect_filter(self) -> str | None:
        """What a full-mode step captures, in words (None unless inspect='full')."""
        return self._recorder.capture.describe() if self.inspect == "full" else None

    # ---- lifecycle ----------------------------------------------------------------------------
    def warmup(self, progress: bool = True) -> dict[str, float]:
        """vLLM's startup sequence: (1) a profile run with no metadata, (2) dummy batches whose
        metadata goes through the real prepare_attn path (a field that is not forwarded fails
        here), (3) real requests: prefill, decode steps, finish. Returns seconds per stage."""
        self._check_open()
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() needs an idle engine: requests are still running")
        cfg, timings = self.cfg, {}
        runner = self.model_runner
        few = min(cfg.max_num_seqs, 4)     # the token budget over a few rows, none longer than max_model_len
        dummy_shapes = [(1, 1), (cfg.max_num_seqs, cfg.max_num_seqs),
                        (few, min(cfg.max_num_batched_tokens, few * cfg.max_model_len))]
        stages = [("profile run", runner.profile_run)]
        stages += [(f"dummy batch {r} reqs x {t} tokens",
                    lambda r=r, t=t: runner.dummy_run(r, t)) for r, t in dummy_shapes]
        stages += [("real prefill + decode", self._warmup_requests)]
        if self.cudagraph_mode == "full_decode":       # CUDA: after the kernels have compiled
            stages += [("capture CUDA graphs", lambda: self._capture(progress))]
        for name, fn in tqdm(stages, desc="warmup", disable=not progress):
            start = time.perf_counter()
            try:
                exec_state = fn()
            except ToolkitError as err:       # e.g. a metadata contract: the stage is in the trace
                if self._recorder is not None:
                    self._recorder.record_failed_stage(f"warmup/{name}", err)
                raise
            timings[name] = time.perf_counter() - start
            if self._recorder is None or exec_state is None:
                continue
            if isinstance(exec_state, CaptureReport):
                self._recorder.record_capture(f"warmup/{name}", exec_state)
            else:
                self._recorder.record_stage(f"warmup/{name}", exec_state, timings[name])
        self._memory.mark("warmup")
        return timings

    def _capture(self, progress: bool) -> CaptureReport:
        # the capture check's dummy rows each write a state page of their own: free ones that hold
        # nothing a prefix hit could read (a cached checkpoint stays untouched)
        rows = max((sizes[-1] for sizes in self.model_runner.cudagraph_manager.family_sizes.values() if sizes),
                   default=0)
        scratch = self.scheduler.kv.state_pool.scratch_ids(rows)
        report = self.model_runner.capture_cudagraphs(progress, scratch_slots=scratch)
        self.cudagraph_report = report
        if progress:
            dropped = f"; {len(report.failed)} dropped to eager: {sorted(report.failed)}" if report.failed else ""
            plain = f", and {len(report.plain_sizes)} of 1-token rows" if report.plain_sizes else ""
            print(f"captured {len(report.sizes)} decode graphs (sizes {report.sizes}){plain} in "
                  f"{report.seconds:.1f} s (checks {report.check_seconds:.1f} s), "
                  f"{report.graph_bytes / 2**20:.1f} MiB{dropped}")
        return report

    def _warmup_requests(self) -> None:
        """Real requests through real steps (stage "warmup/requests"). They do not count: the
        user's first step() is still step 0, and unseeded seeds are not shifted."""
        n = min(self.cfg.max_num_seqs, 4)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        ids = []
        for i in range(n):
            request = self._make_request({"prompt_token_ids": [1, 3 + i]}, params, f"warmup-{i}")
            self._enqueue(request, count_arrival=False)
            ids.append(request.request_id)
        while any(i in self.scheduler.requests for i in ids):
            self._step("warmup/requests")

    def stats(self) -> dict[str, Any]:
        """Pool and queue counts. `runner_rows_in_use`: persistent request rows the runner holds
        (released as soon as a request finishes or is aborted)."""
        kv = self.scheduler.kv
        return {"kv_blocks_total": kv.kv_pool.num_total, "kv_blocks_free": kv.kv_pool.num_free,
                "state_pages_total": kv.state_pool.num_total, "state_pages_free": kv.state_pool.num_free,
                **({"window_kv_blocks_total": sum(p.num_total for p in kv.window_pools.values()),
                    "window_kv_blocks_free": sum(p.num_free for p in kv.window_pools.values())}
                   if kv.window_pools else {}),
                "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "runner_rows_in_use": self.model_runner.req_states.num_reqs if not self._closed else 0,
                "model_state": type(self.model_runner.model_state).__name__ if not self._closed else None,
                **(prefix_cache_stats(kv) if kv.caching else {}),
                **(self.spec_stats.as_dict() if self.speculative_config else {}),
                **(self._draft_stats.as_dict() if self._draft_stats is not None else {})}

    def shutdown(self) -> None:
        """Free the runner (graphs, caches, model state, model, buffers). Safe to call twice.
        With checks on, anything still alive afterwards raises InvariantError."""
        if self._closed:
            return
        self._closed = True
        self.trace.materialize()        # records kept by reference let go of the runner's objects
        runner = self.model_runner
        released = released_by_shutdown(runner)
        runner.shutdown(collect_garbage=False)
        if self._executor is not None:
            self._executor.shutdown()
        # reference counting frees the caches and the model as their last references go: a full
        # garbage collection (0.1-0.2 s in a process with torch and transformers) only when a
        # reference cycle still holds one of them; CUDA's cache is emptied either way
        collect(full=any(ref() is not None for ref in released))
        self._memory.mark("shutdown")
        if self.checks:
            checks.raise_if_any(checks.check_shutdown(runner))

    @property
    def prefix_cache(self) -> PrefixCacheReport:
        """What the prefix cache holds now (`enable_prefix_caching=True`): every cached KV block and
        state page (checkpoint), the prompt block it stands for, who shares it, and the counts."""
        return prefix_cache_report(self.scheduler.kv)

    def memory_report(self) -> MemoryReport:
        """Bytes by category (weights, kv_cache, state_cache, persistent_buffers, graphs, trace;
        cuda_allocated on a GPU), measured from the tensors at load, after warmup, after
        shutdown, and now. A tensor-parallel engine adds a row per rank (`ranks`: each rank's bytes
        now, asked of the workers; not after shutdown)."""
        report = self._memory.report()
        if self.tp.sharded and not self._closed:
            report.ranks = gather_memory(self._executor, report.marks["now"])
        return report

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this LLM has been shut down: build a new one, e.g. "
                                    "LLM(**llm.init_args)")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Iterable) -> None:
        self.shutdown()
