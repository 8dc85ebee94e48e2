"""Continuous batching with chunked prefill, preemption by recompute, and abort (vLLM v1 style).

Each step: running requests first (in order), then waiting ones while the token budget, the row
limit (`max_num_seqs`) and the pools allow. A request gets `min(tokens it still lacks, budget)`
tokens, so long prompts are prefilled in chunks alongside other requests' decodes. When KV blocks
run out, the most recently admitted running request is preempted: its blocks and state page are
freed and it goes back to the front of the queue, to be recomputed from its prompt + outputs.

`n` > 1 (a fork, not n independent requests): the parent is scheduled up to its last prompt token
only, then (`_fork`) leaves the running set, keeping its KV blocks and state page, and its n
children join the front of the queue with that many tokens computed. Each child admitted but the
last gets fresh blocks and a fresh state page and, in its NewRequestData, `fork_src`: the parent's ids
that the runner copies into its own before the forward (KV blocks and the recurrent state: a
copy, no sharing). The last child takes the parent's ids over (`inherits_state`: nothing copied,
its slot not zeroed), so a fork needs one slot more than its children only while two or more
wait; the runner's copies of the same step run before any forward writes. Each child then runs
the last prompt token and samples with its own seed. If the queue stalls behind parents that hold
ids (nothing running, nothing admissible), the parents let go and their waiting children prefill
from scratch instead.

Stop conditions after each kept token (`update_from_output`): EOS, stop ids (both only from
`min_tokens` output tokens on), max_tokens / max_model_len, and stop strings on the detokenized
text (`decode`, stop_strings.py's `check_stop_strings`).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from toolkit.config import default_state_pages
from toolkit.kv_cache_manager import (
    CacheGroupKind,
    KVCacheManager,
    PrefixLookup,
    StateMoves,
)
from toolkit.prefix_policy import PrefixPolicy
from toolkit.request import Request, RequestStatus, TokenLogprobs, make_children
from toolkit.sampling import SamplingParams
from toolkit.stop_strings import check_stop_strings


@dataclass
class NewRequestData:
    """A request the runner has not seen (new, or resumed after preemption)."""
    req_id: str
    prefill_token_ids: list[int]        # prompt (+ outputs so far, when resumed)
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]    # per KV-cache group; for a Mamba group: [state page]
    num_computed_tokens: int
    sampling_seed: int                  # the request's seed, or the one derived at its arrival
    num_prompt_tokens: int = 0          # the prompt alone (prefill_token_ids also hold outputs when resumed)
    min_tokens_stop_ids: tuple[int, ...] = ()   # ids masked until min_tokens outputs (EOS, stop ids)
    num_prompt_logprobs: int | None = None      # top-k of prompt logprobs to compute (None: none)
    fork_src: tuple[list[int], ...] | None = None   # an n > 1 child: per group, the parent's ids
                                                    # that the runner copies into the first of its own
    inherits_state: bool = False        # an n > 1 child that took its parent's ids over: its state page
                                        # holds its computed tokens' state (not zeroed)
    num_cached_tokens: int = 0          # prefix caching: the computed tokens it took from the cache
    prefix_lookup: PrefixLookup | None = None   # what the prefix cache held for it at this admission
                                                # (the Request's `prefix_lookup`, the same object)


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
    # speculative decoding (vLLM's name): req_id -> the drafts its row verifies this step, after
    # its last sampled token (num_scheduled_tokens = 1 + len(drafts)); decode rows with drafts only
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    state_moves: StateMoves = field(default_factory=StateMoves)    # prefix caching: see StateMoves


@dataclass
class ModelRunnerOutput:
    """What one step's sampling gives the scheduler's books (vLLM's `ModelRunnerOutput`, keyed by
    request id rather than by row): the tokens each row keeps, their logprobs, and the drafts the
    runner proposed for the next step."""
    # req_id -> the row's kept tokens: its sample, or a verify row's accepted drafts then the target's
    # own token (batch order). A partial prefill chunk's sample is here too; the books drop it.
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)          # rows that asked
    prompt_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)   # the step's prefill chunks
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)       # speculative decoding
    # prefix caching with speculative decoding: req_id -> the state column, counted from the row's
    # running column, that holds the state after its kept tokens (kept - 1, or 0 where the step's
    # boundary copy put a checkpoint in the running column); rows not listed: 0. The scheduler plans
    # the row's next move from it (StateMoves).
    state_offsets: dict[str, int] = field(default_factory=dict)

    @classmethod
    def one_token_a_row(cls, sampled: dict[str, int]) -> ModelRunnerOutput:
        """req_id -> its one sampled token (no speculation, no logprobs)."""
        return cls({rid: [token] for rid, token in sampled.items()})

    @property
    def last_kept(self) -> dict[str, int]:
        """req_id -> the last token its row keeps."""
        return {rid: tokens[-1] for rid, tokens in self.sampled_token_ids.items()}


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 groups: list[CacheGroupKind], num_kv_blocks: int,
                 decode: Callable[[list[int]], str] | None = None,
                 enable_prefix_caching: bool = False, num_state_pages: int | None = None,
                 prefill_checkpoints: bool = False, num_speculative_tokens: int = 0,
                 num_lookahead_tokens: int = 0):
        self.decode = decode                # token ids -> text, for stop strings
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # speculative decoding: a decode row verifies up to k drafts, and a request holds 1 + k state
        # columns, the state after each verified position
        self.num_speculative_tokens = num_speculative_tokens
        state_columns = 1 + num_speculative_tokens
        if num_state_pages is None:     # the engine passes RunnerConfig.state_pages: the same formula
            num_state_pages = default_state_pages(max_num_seqs, num_speculative_tokens, enable_prefix_caching)
        self.kv = KVCacheManager(groups, num_kv_blocks, num_state_pages,
                                 enable_prefix_caching=enable_prefix_caching, state_columns=state_columns,
                                 num_lookahead_tokens=num_lookahead_tokens, max_model_len=max_model_len)
        self.caching = enable_prefix_caching
        self.block_size = groups[0].block_size if groups else 1
        # "align": prefill chunks end on block boundaries, so Mamba states land on checkpoints;
        # "all" (prefill_checkpoints): the layers save the states at the boundaries inside a chunk
        has_mamba = any(g.kind == "mamba" for g in groups)
        self.prefill_checkpoints = enable_prefix_caching and has_mamba and prefill_checkpoints
        self.align = enable_prefix_caching and has_mamba and not self.prefill_checkpoints
        self.prefix = PrefixPolicy(self.kv, self.block_size, self.caching, self.align, self.prefill_checkpoints)
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
        if request.forks and len(request.prompt_token_ids) == 1:
            self._fork(request, queue=False)     # nothing to share: the children prefill the one token
            return
        self.waiting.append(request)

    def abort_request(self, req_id: str) -> Request | None:
        """Abort a request; an n > 1 parent's id aborts its unfinished children too."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        if req.children:
            for child in req.children:
                if not child.status.is_finished:
                    self.abort_request(child.request_id)
            self._release_parent(req)
            self.requests.pop(req_id, None)
            req.status = RequestStatus.FINISHED_ABORTED
            return req
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
        parent = req.parent
        if parent is not None and all(c.status.is_finished for c in parent.children):
            self._release_parent(parent)
            if self.requests.get(parent.request_id) is parent:
                del self.requests[parent.request_id]

    # ---- n > 1: fork ------------------------------------------------------------------------------
    def _fork(self, parent: Request, queue: bool = True) -> None:
        """The parent computed all but its last prompt token: its n children take its place at
        the front of the queue, each with those tokens computed and the parent's ids to copy
        (`queue=False`: a one-token prompt, nothing computed: the children start from scratch).
        The parent keeps its ids until its last child is admitted."""
        children = make_children(parent)
        parent.children = children
        parent.status = RequestStatus.FORKED
        if parent in self.running:
            self.running.remove(parent)
        self._tell_runner_to_drop(parent.request_id)
        copy = queue and not self.caching     # with prefix caching the children hit the parent's prefix
        for child in children:
            self.requests[child.request_id] = child
            if copy:
                child.num_computed_tokens = parent.num_computed_tokens
                child.fork_from = parent.request_id
        if queue:
            self.waiting.extendleft(reversed(children))
        else:
            self.waiting.extend(children)
        if not copy:
            self.kv.free(parent.request_id)

    def _release_parent(self, parent: Request) -> None:
        """A parent's ids go back to the pools; children still waiting for them prefill from
        scratch instead."""
        for child in parent.children:
            if child.fork_from is not None:
                child.fork_from = None
                child.num_computed_tokens = 0
        self.kv.free(parent.request_id)

    def _holding_parents(self) -> list[Request]:
        return [r for r in self.requests.values()
                if r.status is RequestStatus.FORKED and any(self.kv.block_ids(r.request_id))]

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
        req.spec_token_ids = []
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

        spec: dict[str, list[int]] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            drafts = self._drafts_to_verify(req, n, budget)
            n += len(drafts)
            new_ids = self.kv.allocate(req.request_id, req.num_computed_tokens, req.num_computed_tokens + n,
                                       len(drafts))
            while new_ids is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                new_ids = self.kv.allocate(req.request_id, req.num_computed_tokens, req.num_computed_tokens + n,
                                           len(drafts))
            if new_ids is None:
                break
            num_scheduled[req.request_id] = n
            if drafts:
                spec[req.request_id] = drafts
            budget -= n
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append(new_ids)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            i += 1

        budget = self._admit_waiting(budget, num_scheduled, new_reqs, preempted)
        if not num_scheduled and not self.running and self.waiting:
            # stalled: only parents waiting for their children hold ids, and the queue's head needs them
            stalled = self._holding_parents()
            for parent in stalled:
                self._release_parent(parent)
            if stalled:
                budget = self._admit_waiting(budget, num_scheduled, new_reqs, preempted)

        if self.prefill_checkpoints:
            self._give_checkpoint_pages(num_scheduled, cached)
        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        for req_id in preempted:           # a preempted request's drafts are stale
            spec.pop(req_id, None)
        return SchedulerOutput(new_reqs, cached, num_scheduled, sum(num_scheduled.values()),
                               finished, preempted, spec, self.kv.take_state_moves(num_scheduled))

    def _drafts_to_verify(self, req: Request, n: int, budget: int) -> list[int]:
        """The drafts a decode row verifies this step (speculative decoding): its proposed drafts,
        cut so that every token the step can produce fits max_tokens and max_model_len (a verify
        row of 1 + d tokens yields up to 1 + d) and the row fits the token budget."""
        drafts = req.spec_token_ids
        req.spec_token_ids = []
        if (not drafts or n != 1 or req.num_computed_tokens != req.num_tokens - 1
                or req.num_computed_tokens < len(req.prompt_token_ids)):     # the prompt's last token: a prefill
            return []
        room = min(req.sampling_params.max_tokens - len(req.output_token_ids),
                   self.max_model_len - req.num_tokens) - 1
        return list(drafts[:max(min(room, budget - 1, self.num_speculative_tokens), 0)])

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        """The drafts the runner proposed after this step, for the running requests' next verify
        step (vLLM's `update_draft_token_ids`)."""
        for req_id, ids in drafts.items():
            req = self.requests.get(req_id)
            if req is not None and req.status is RequestStatus.RUNNING:
                req.spec_token_ids = list(ids)

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData],
                       preempted: list[str]) -> int:
        """Admit waiting requests in order while the budget, the rows and the pools allow; returns
        the budget left. A forked child gets its parent's ids to copy (`fork_src`), or takes them
        over when it is the parent's last child waiting (`inherits_state`)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            parent = self.requests.get(req.fork_from) if req.fork_from is not None else None
            inherits = parent is not None and not any(c.fork_from for c in parent.children if c is not req)
            if inherits:
                self.kv.transfer(parent.request_id, req.request_id)
            hit = self.prefix.adopt_hit(req)
            n = self._num_new_tokens(req, budget)
            if self.kv.allocate(req.request_id, req.num_computed_tokens, req.num_computed_tokens + n) is None:
                if inherits:
                    self.kv.transfer(req.request_id, parent.request_id)
                if hit is not None:
                    self.kv.free(req.request_id)
                    req.num_computed_tokens = 0
                break
            req.num_cached_tokens = hit.num_tokens if hit else 0
            if self.caching and req.fork_from is None:
                self.kv.count_lookup(req.num_tokens, hit)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_scheduled[req.request_id] = n
            budget -= n
            fork_src = None
            if parent is not None and not inherits:
                fork_src = self.kv.ids_covering(parent.request_id, req.num_computed_tokens)
            req.fork_from = None
            params = req.sampling_params
            stop_ids = ()
            if params.min_tokens:
                eos = set() if params.ignore_eos else set(req.eos_token_ids)
                stop_ids = tuple(sorted(eos | set(params.stop_token_ids)))
            want_prompt_logprobs = params.prompt_logprobs is not None and not req.has_all_prompt_logprobs
            new_reqs.append(NewRequestData(
                req_id=req.request_id, prefill_token_ids=list(req.all_token_ids),
                sampling_params=params, block_ids=self.kv.block_ids(req.request_id),
                num_computed_tokens=req.num_computed_tokens,
                sampling_seed=req.sampling_seed, num_prompt_tokens=len(req.prompt_token_ids),
                min_tokens_stop_ids=stop_ids,
                num_prompt_logprobs=params.prompt_logprobs if want_prompt_logprobs else None,
                fork_src=fork_src, inherits_state=inherits, num_cached_tokens=req.num_cached_tokens,
                prefix_lookup=req.prefix_lookup))
            self._known_to_runner.add(req.request_id)
        return budget

    # ---- prefix caching ------------------------------------------------------------------------
    def _give_checkpoint_pages(self, num_scheduled: dict[str, int], cached: CachedRequestData) -> None:
        """Cache mode "all", once every scheduled row has its pages: free state pages go to the block
        boundaries inside this step's prefill chunks, in batch order while the pool has any, and the
        layers save the states there (checkpoints; a boundary left without a page saves nothing)."""
        for req_id, n in num_scheduled.items():
            columns = self.prefix.checkpoint_columns(self.requests[req_id].num_computed_tokens, n)
            if columns and self.kv.add_state_pages(req_id, columns) and req_id in cached.req_ids:
                i = cached.req_ids.index(req_id)        # a new request's rows are the manager's own lists
                cached.new_block_ids[i] = tuple(self.kv.row_tail(req_id, g, since=ids.start) if self.kv.aligned(g)
                                                else ids for g, ids in enumerate(cached.new_block_ids[i]))
                self.kv.row_delivered(req_id)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens the request runs this step: what it still lacks, within the budget; in "align"
        mode a prefill chunk ends where the prefix policy says (`PrefixPolicy.aligned_chunk_end`)."""
        start = req.num_computed_tokens
        total = req.num_tokens_to_compute
        end = start + min(total - start, budget)
        if self.align and end - start > 1:
            end = self.prefix.aligned_chunk_end(req, start, end, total)
        return end - start

    def update_from_output(self, sched_out: SchedulerOutput, output: ModelRunnerOutput
                           ) -> tuple[list[Request], dict[str, int]]:
        """Append each row's sampled token where the row consumed all its known tokens (a partial
        prefill chunk's sample is dropped), with its logprobs when the request asked; keep the
        prompt logprobs of the step's prefill chunks; fork an n > 1 parent that reached its last
        prompt token. Returns (requests finished now, the last token kept per request).

        Speculative decoding: a verify row's tokens are its accepted drafts then the target's own
        token at the first rejection (or after the last draft); they are appended one by one, each
        checked for a stop, and the rejected drafts' positions are given back (num_computed_tokens
        moves back; their KV slots are overwritten later, as in vLLM). The next step's drafts go to
        the requests still running (vLLM's `update_draft_token_ids`)."""
        finished, kept = [], {}
        kept_tokens, logprobs = output.sampled_token_ids, output.logprobs    # req_id -> tokens the row keeps
        for req_id, drafts in sched_out.scheduled_spec_decode_tokens.items():
            req = self.requests.get(req_id)
            if req is not None:
                req.num_computed_tokens -= len(drafts) + 1 - len(kept_tokens[req_id])
        if self.caching:
            self.kv.set_state_offsets(sched_out.num_scheduled_tokens, output.state_offsets)
            self.prefix.cache_computed(self.requests, sched_out.num_scheduled_tokens,
                                       sched_out.scheduled_spec_decode_tokens, kept_tokens)
        if self.kv.window_pools:        # sliding windows: between steps a row holds its window only
            for req_id in sched_out.num_scheduled_tokens:
                req = self.requests.get(req_id)
                if req is not None:
                    self.kv.trim_windows(req_id, req.num_computed_tokens)
        for req_id, chunk in output.prompt_logprobs.items():
            req = self.requests.get(req_id)
            if req is not None:
                req.add_prompt_logprobs(chunk)
        for req_id in sched_out.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is not None and req.forks and req.num_computed_tokens == req.num_tokens_to_compute:
                self._fork(req)
                continue
            if req is None or req.num_computed_tokens < req.num_tokens:
                continue
            tokens = kept_tokens[req_id]
            lps = logprobs.get(req_id) if req.sampling_params.logprobs is not None else None
            for i, token in enumerate(tokens):
                req.output_token_ids.append(token)
                kept[req_id] = token
                if lps is not None:
                    req.logprobs.append(lps if len(tokens) == 1 else lps.row(i))
                status = self._stop_status(req, token)
                if status is not None:
                    self.running.remove(req)
                    self._finish(req, status)
                    finished.append(req)
                    break
        self.update_draft_token_ids(output.draft_token_ids)
        return finished, kept

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        """EOS and stop ids (from `min_tokens` outputs on; vLLM's `check_stop`), the length limits,
        then stop strings (which win over the others, as in vLLM's output processor)."""
        params = req.sampling_params
        status = None
        if len(req.output_token_ids) >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
        if status is None and (len(req.output_token_ids) >= params.max_tokens
                               or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if params.stop and self.decode is not None:
            drop_last = status is RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output
            stop_str = check_stop_strings(req, self.decode, drop_last)
            if stop_str is not None:
                status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop_str
        return status
