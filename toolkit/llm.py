"""`LLM`: the user-facing engine (vLLM names): generate(), add_request(), step(), warmup(),
shutdown(). It owns a Scheduler (who runs, which blocks) and a ModelRunner (what runs)."""
from __future__ import annotations

import time
from typing import Any, Iterable

import torch
from tqdm.auto import tqdm

from toolkit.config import RunnerConfig, resolve_device_dtype
from toolkit.errors import InvalidRequestError
from toolkit.inspect.step_record import ScheduledRequest, StepRecord, snapshot
from toolkit.kv_cache_manager import CacheGroupKind
from toolkit.models import load_model
from toolkit.request import CompletionOutput, Request, RequestOutput
from toolkit.runner.model_runner import ModelRunner
from toolkit.sampling import SamplingParams
from toolkit.scheduler import Scheduler
from toolkit.tokenizer import load_tokenizer

Prompt = str | dict


class LLM:
    """`LLM("tiny-bamba")` or `LLM("/path/to/hf_folder")`; see README for every argument."""

    def __init__(self, model: str, *, device: str | torch.device = "auto",
                 dtype: str | torch.dtype = "auto", max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, block_size: int = 16,
                 max_model_len: int | None = None, num_kv_blocks: int | None = None, seed: int = 0):
        dev, dt = resolve_device_dtype(device, dtype)
        loaded = load_model(model, dtype=dt, device=dev, seed=seed)
        hf_config = loaded.config
        limit = getattr(hf_config, "max_position_embeddings", None)
        if max_model_len is None:
            max_model_len = min(limit or 2048, 2048)
        elif limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}")
        self.cfg = RunnerConfig(device=dev, dtype=dt, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                                max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, seed=seed)
        self.hf_config = hf_config
        self.model_name = model
        self.vocab_size = int(hf_config.vocab_size)
        self.tokenizer_dir = loaded.tokenizer_dir       # save_hf_folder(llm, ...) copies it
        self.tokenizer = load_tokenizer(loaded.tokenizer_dir, self.vocab_size)
        eos = getattr(hf_config, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.model_runner = ModelRunner(loaded.model, self.cfg)
        groups = self.model_runner.kv_cache_groups
        attn = [g for g in groups if g.kind == "attention"]
        self.scheduler = Scheduler(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, groups=[CacheGroupKind(g.kind, g.block_size) for g in groups],
            num_kv_blocks=attn[0].num_blocks if attn else 0, seed=seed)
        self._carried_outputs: list[RequestOutput] = []   # finished inside generate(), not its own
        self._next_request_id = 0
        self._arrivals = 0
        self._step_index = 0
        self._closed = False

    @property
    def model(self) -> torch.nn.Module:
        return self.model_runner.model

    # ---- requests -----------------------------------------------------------------------------
    def _make_request(self, prompt: Prompt, params: SamplingParams | None,
                      request_id: str | None) -> Request:
        self._check_open()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.__post_init__()            # values may have been changed after construction
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = None, prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError("prompt_token_ids must be a list of ints")
            ids = list(ids)
        else:
            raise InvalidRequestError("a prompt is a string or {'prompt_token_ids': [...]}, "
                                      f"got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are out of range [0, {self.vocab_size})")
        if len(ids) >= self.cfg.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens; max_model_len="
                                      f"{self.cfg.max_model_len} leaves no room for an output token")
        kv_total = self.scheduler.kv.kv_pool.num_total
        if any(g.kind == "attention" for g in self.scheduler.kv.groups):
            need = -(-min(len(ids) + params.max_tokens, self.cfg.max_model_len) // self.cfg.block_size)
            if need > kv_total:
                raise InvalidRequestError(f"the request can need {need} KV blocks but the cache "
                                          f"has {kv_total} (num_kv_blocks)")
        if request_id is None:
            request_id = str(self._next_request_id)
            self._next_request_id += 1
        elif request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        return Request(request_id, ids, params, self.eos_token_id, prompt=text)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; returns its id. Invalid input raises and queues nothing."""
        request = self._make_request(prompt, params, request_id)
        self._enqueue(request)
        return request.request_id

    def _enqueue(self, request: Request) -> None:
        request.arrival_index = self._arrivals
        self._arrivals += 1
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its blocks and state slot are freed. Unknown ids are ignored."""
        self._check_open()
        self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        """Run one scheduler step and return what happened, as the runner saw it."""
        self._check_open()
        return self._step(record=True)

    def _step(self, record: bool) -> StepRecord | list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        state = self.model_runner.execute_model(sched_out)
        sampled = self.model_runner.sample_tokens()
        finished, kept = self.scheduler.update_from_output(sched_out, sampled)
        outputs = [self._output(r) for r in finished]
        self._step_index += 1
        if not record:
            return outputs
        outputs, self._carried_outputs = self._carried_outputs + outputs, []
        scheduled = []
        if state is not None:
            b = state.input_batch
            scheduled = [ScheduledRequest(r, int(n), int(c), bool(p)) for r, n, c, p in zip(
                b.req_ids, b.num_scheduled_tokens, b.num_computed_tokens_np, b.is_prefilling_np)]
        return StepRecord(
            step_index=self._step_index - 1, scheduled=scheduled,
            preempted_request_ids=list(sched_out.preempted_req_ids),
            input_batch=snapshot(state.input_batch) if state else None,
            attn_metadata=snapshot(state.attn_metadata.groups) if state else [],
            logits=snapshot(state.logits) if state else None,
            sampled_token_ids=sampled, kept_token_ids=kept, outputs=outputs)

    def _output(self, req: Request) -> RequestOutput:
        text = self.tokenizer.decode(req.output_token_ids)
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids),
                             [CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason())],
                             finished=True)

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. All prompts are validated before
        any is queued, so a bad one raises and leaves the engine as it was."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError(f"{len(sampling_params)} sampling params for "
                                          f"{len(prompts)} prompts")
            params_list = sampling_params
        else:
            params_list = [sampling_params] * len(prompts)
        requests = [self._make_request(p, sp, None) for p, sp in zip(prompts, params_list)]
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise InvalidRequestError("duplicate request ids")
        for r in requests:
            self._enqueue(r)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        wanted = set(ids)
        while wanted - done.keys():
            for out in self._step(record=False):
                if out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
                else:                   # a request from add_request(): the next step() reports it
                    self._carried_outputs.append(out)
        bar.close()
        return [done[i] for i in ids]

    # ---- lifecycle ----------------------------------------------------------------------------
    def warmup(self, progress: bool = True) -> dict[str, float]:
        """vLLM's startup sequence: (1) a profile run with no metadata, (2) dummy batches whose
        metadata goes through the real prepare_attn path (a field that is not forwarded fails
        here), (3) real requests: prefill, decode steps, finish. Returns seconds per stage."""
        self._check_open()
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() needs an idle engine: requests are still running")
        cfg, timings = self.cfg, {}
        dummy_shapes = [(1, 1), (cfg.max_num_seqs, cfg.max_num_seqs),
                        (min(cfg.max_num_seqs, 4), cfg.max_num_batched_tokens)]
        stages = [("profile run", self.model_runner.profile_run)]
        stages += [(f"dummy batch {r} reqs x {t} tokens",
                    lambda r=r, t=t: self.model_runner.dummy_run(r, t)) for r, t in dummy_shapes]
        stages += [("real prefill + decode", self._warmup_requests)]
        for name, fn in tqdm(stages, desc="warmup", disable=not progress):
            start = time.perf_counter()
            fn()
            timings[name] = time.perf_counter() - start
        return timings

    def _warmup_requests(self) -> None:
        """Warmup steps do not count: the user's first step() is still step 0."""
        first_step = self._step_index
        n = min(self.cfg.max_num_seqs, 4)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        ids = [self.add_request({"prompt_token_ids": [1, 3 + i]}, params, request_id=f"warmup-{i}")
               for i in range(n)]
        while any(i in self.scheduler.requests for i in ids):
            self._step(record=False)
        self._step(record=False)        # lets the runner drop the finished rows
        self._step_index = first_step

    def stats(self) -> dict[str, Any]:
        """Pool and queue counts. `runner_rows_in_use`: persistent request rows the runner holds; a
        finished request's row is released at the start of the next step, when the runner learns
        of it from the scheduler output (as in vLLM)."""
        kv = self.scheduler.kv
        return {"kv_blocks_total": kv.kv_pool.num_total, "kv_blocks_free": kv.kv_pool.num_free,
                "state_slots_total": kv.state_pool.num_total, "state_slots_free": kv.state_pool.num_free,
                "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "runner_rows_in_use": self.model_runner.req_states.num_reqs if not self._closed else 0,
                "model_state": type(self.model_runner.model_state).__name__ if not self._closed else None}

    def shutdown(self) -> None:
        """Free the runner (graphs, caches, model state, model). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.model_runner.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM has been shut down")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Iterable) -> None:
        self.shutdown()
