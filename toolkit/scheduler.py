"""Continuous batching with chunked prefill, preemption by recompute, and abort (vLLM v1 style).

Each step: running requests first (in order), then waiting ones while the token budget, the row
limit (`max_num_seqs`) and the pools allow. A request gets `min(tokens it still lacks, budget)`
tokens, so long prompts are prefilled in chunks alongside other requests' decodes. When KV blocks
run out, the most recently admitted running request is preempted: its blocks and state slot are
freed and it goes back to the front of the queue, to be recomputed from its prompt + outputs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from toolkit.kv_cache_manager import CacheGroupKind, KVCacheManager
from toolkit.request import Request, RequestStatus
from toolkit.sampling import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (new, or resumed after preemption)."""
    req_id: str
    prefill_token_ids: list[int]        # prompt (+ outputs so far, when resumed)
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]    # per KV-cache group; for a Mamba group: [state slot]
    num_computed_tokens: int
    sampling_seed: int                  # the request's seed, or the one derived at its arrival


@dataclass
class CachedRequestData:
    """Requests the runner already holds: their new block ids and computed-token counts."""
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]       # req_id -> tokens this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]                 # finished, aborted or preempted since the last step
    preempted_req_ids: list[str]


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 groups: list[CacheGroupKind], num_kv_blocks: int):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(groups, num_kv_blocks, num_state_slots=max_num_seqs)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self._known_to_runner: set[str] = set()

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, req_id: str) -> Request | None:
        req = self.requests.get(req_id)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._tell_runner_to_drop(req.request_id)

    def _tell_runner_to_drop(self, req_id: str) -> None:
        """The next SchedulerOutput lists the request in finished_req_ids (if the runner has it)."""
        if req_id in self._known_to_runner:
            self._finished_since_last_step.add(req_id)
            self._known_to_runner.discard(req_id)

    def _preempt(self, req: Request) -> None:
        self._release_for_recompute(req)
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release_for_recompute(self, req: Request) -> None:
        """Free the request's blocks and slot and forget its computed tokens: it will be prefilled
        again from its prompt + outputs. The runner drops its row at the next step."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self._tell_runner_to_drop(req.request_id)

    def recover_from_failed_step(self, sched_out: SchedulerOutput) -> list[str]:
        """A step raised after `schedule()` returned it. Its requests may have half-written KV
        blocks and Mamba states, so each still running goes back to the front of the queue (in
        its running order) to be recomputed, as a preemption does; their tokens so far are kept and,
        sampling being keyed on position, their outputs do not change. Requests outside the step
        are untouched. Returns the ids put back."""
        in_step = [r for r in self.running if r.request_id in sched_out.num_scheduled_tokens]
        for req in in_step:
            self._release_for_recompute(req)
        self.waiting.extendleft(reversed(in_step))
        # the runner may not have dropped the rows this step told it to drop
        self._finished_since_last_step |= sched_out.finished_req_ids
        return [r.request_id for r in in_step]

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new_ids = self.kv.allocate(req.request_id, req.num_computed_tokens + n)
            while new_ids is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                new_ids = self.kv.allocate(req.request_id, req.num_computed_tokens + n)
            if new_ids is None:
                break
            num_scheduled[req.request_id] = n
            budget -= n
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append(new_ids)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.kv.allocate(req.request_id, req.num_computed_tokens + n) is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_scheduled[req.request_id] = n
            budget -= n
            new_reqs.append(NewRequestData(
                req_id=req.request_id, prefill_token_ids=list(req.all_token_ids),
                sampling_params=req.sampling_params, block_ids=self.kv.block_ids(req.request_id),
                num_computed_tokens=req.num_computed_tokens,
                sampling_seed=req.sampling_seed))
            self._known_to_runner.add(req.request_id)

        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        return SchedulerOutput(new_reqs, cached, num_scheduled, sum(num_scheduled.values()),
                               finished, preempted)

    def update_from_output(self, sched_out: SchedulerOutput, sampled: dict[str, int]
                           ) -> tuple[list[Request], dict[str, int]]:
        """Append each row's sampled token where the row consumed all its known tokens (a partial
        prefill chunk's sample is dropped). Returns (requests finished now, tokens kept)."""
        finished, kept = [], {}
        for req_id in sched_out.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.num_computed_tokens < req.num_tokens:
                continue
            token = sampled[req_id]
            req.output_token_ids.append(token)
            kept[req_id] = token
            status = self._stop_status(req, token)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return finished, kept

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if not params.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
