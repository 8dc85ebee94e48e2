"""Property-based tests (hypothesis): random programs of add / abort / step / generate / failing
step / warmup on each tiny preset of harness.ENGINE_PRESETS, run on tight engines (few rows, a small token
budget, a KV cache small enough to force preemption), checked after every step and, at the end,
against each request run alone.

What is checked
- after every step: the token budget and row limit; the block/slot ledger (pool owners are live
  requests, the null id 0 is never held, no id is shared, free list + owners = the pool, a running
  request holds exactly the KV blocks its computed tokens need and one state page, a waiting one
  nothing); the runner's rows are exactly the running requests, with the scheduler's tokens and
  computed counts, and block-table rows equal to the ledger (released rows zeroed); the step's
  metadata puts no real row on the null slot / block and no two tokens on one KV slot; decode rows
  lead the batch; every step with work schedules tokens; the engine's own runtime checks (default
  inspect="metadata": a reused slot not zeroed, state indices vs ledger, ...) never raise
  `InvariantError`;
- add / generate: refused (`InvalidRequestError`, nothing queued) exactly when a request id is in
  use or was used, or a request can never fit the KV cache; automatic ids are "0", "1", ...
  skipping used ones; generate's requests that finish are returned in order, add_request ones that
  finish inside generate() come out of the next step();
- abort: returns True exactly for a request still queued or running, which then never produces an
  output;
- a step that raises (in the forward, the sampler or the scheduler update; an error or an
  interrupt) leaves the ledger consistent and changes no output (all-or-nothing step); an
  interrupted generate() drops its own requests only;
- warmup(): refused while requests are unfinished; otherwise it leaves every pool free and changes
  no output;
- at the end: every pool free, no runner row, and every finished request's tokens and finish
  reason equal to the same request run alone on a roomy engine (max_num_seqs=4,
  max_num_batched_tokens=512, default num_kv_blocks): greedy, seeded and unseeded random requests
  alike (an unseeded request's seed is `derive_seed(llm seed, arrival index)`; its alone run gets
  that seed explicitly, so the arrival counter is checked too). Chunked prefill and batching change
  logits in the last bits, so a sampler decision at a near-tie (two logits 1 ulp apart at an
  argmax, a top-k or a top-p boundary) may go the other way: a request may part from its alone run
  only where both runs' logits agree within LOGIT_ATOL and the sampler, given each run's own logits
  with the same seed and position, picks each run's token (the pinned tiny-mamba example below).

Profiles (registered here, chosen with HYPOTHESIS_PROFILE): "runnerscope-ci" (the default: 100
examples per preset, 700 in all, about a minute), "long" (1000 per preset, about 10 minutes) and
"replay" (only the @example pins and the saved failures, no shrinking). Failing examples persist
in tests/.hypothesis/ (commit it); bugs found are pinned with @example below.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, event, example, given, settings, target
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from toolkit import LLM, InvalidRequestError, SamplingParams
from toolkit.kv_cache_spec import PAD_SLOT_ID
from toolkit.runner.sampler import LogitsRows, Sampler
from toolkit.sampling import derive_seed

from harness import ENGINE_PRESETS


# ---- profiles ---------------------------------------------------------------------------------
class FailuresOnlyDatabase(ExampleDatabase):
    """tests/.hypothesis (commit it): the failing examples hypothesis replays first, and the
    formerly failing ones it re-checks (".secondary"). The ".pareto" examples that `target()`
    keeps are dropped: every passing run would otherwise add files to the repository."""

    def __init__(self, path: Path):
        super().__init__()
        self._db = DirectoryBasedExampleDatabase(str(path))

    def fetch(self, key: bytes):
        return [] if key.endswith(b".pareto") else self._db.fetch(key)

    def save(self, key: bytes, value: bytes) -> None:
        if not key.endswith(b".pareto"):
            self._db.save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        self._db.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        if dest.endswith(b".pareto"):
            self._db.delete(src, value)
        else:
            self._db.move(src, dest, value)

    def __repr__(self) -> str:
        return f"FailuresOnlyDatabase({str(self._db.path)!r})"


DATABASE = FailuresOnlyDatabase(Path(__file__).parent / ".hypothesis")
_COMMON = dict(deadline=None, database=DATABASE, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# CI draws the same examples every run (derandomize): a run that passed keeps passing, and new
# programs are explored by the "long" profile, whose failures land in tests/.hypothesis.
settings.register_profile("runnerscope-ci", max_examples=100, derandomize=True,
                          **(_COMMON | dict(database=None)))
settings.register_profile("long", max_examples=1000, **_COMMON)
# only the pinned examples and the failures saved in tests/.hypothesis, without shrinking
settings.register_profile("replay", phases=[Phase.explicit, Phase.reuse], **_COMMON)
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "runnerscope-ci"))

VOCAB = 320                 # every tiny preset (checked in the test)
MAX_MODEL_LEN = 64
MAX_PROMPT = 40
MAX_TOKENS = 8
LLM_SEED = 0                # tight and roomy engines: the same weights, the same derived seeds
F32 = dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, seed=LLM_SEED)


# ---- the program ------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int      # including the null block 0 (ignored by attention-free models)
    cudagraph_mode: str = "none"   # "padded_eager": decode batches padded to capture sizes (1, 2, 4)
    enable_prefix_caching: bool = False
    cache_mode: str = "align"      # with prefix caching: "align" or "all" (internal checkpoints)
    spec_k: int = 0                # speculative decoding: drafts per row; 0: off
    spec_method: str = "ngram"     # "ngram" (1- to 3-grams) or "draft_model" (tiny-mamba2 drafting)


@dataclass(frozen=True)
class Params:
    kind: str               # "greedy", "seeded" or "unseeded"
    max_tokens: int = 4
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # stop at the token this request emits at output index `stop_at % n` when run without stop
    # ids (random stop ids almost never hit on these models); None: no such stop id
    stop_at: int | None = None


@dataclass(frozen=True)
class Add:
    prompt: tuple[int, ...]
    params: Params
    request_id: str | None = None   # None: automatic


@dataclass(frozen=True)
class Abort:
    target: str             # "live", "finished" or "unknown"
    pick: int = 0           # index (mod count) into the sorted live / finished ids


@dataclass(frozen=True)
class Step:
    n: int = 1


@dataclass(frozen=True)
class Generate:
    prompts: tuple[tuple[int, ...], ...]
    params: Params
    fail_at: int | None = None      # its fail_at-th forward raises an interrupt; None: no failure


@dataclass(frozen=True)
class FailStep:
    where: str              # "forward", "sample" or "update": the next step raises there
    interrupt: bool = False  # a BaseException (as Ctrl-C) rather than a RuntimeError


@dataclass(frozen=True)
class Warmup:
    drain: bool = True      # first step until every request is delivered (else: refused if busy)


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt (which would stop hypothesis itself if it escaped)."""


def _make_config(max_num_seqs: int, budget: int, block_size: int, room: int, mode: str,
                 caching: bool = False, cache_mode: str = "align", spec_k: int = 0,
                 spec_method: str = "ngram") -> EngineConfig:
    """`room` (tokens, shrinks towards 0): the cache holds the largest possible request (40
    prompt + 8 output tokens) plus `room` tokens; below 0 the largest requests are refused (a
    valid outcome), a little above it two mid-sized requests running together preempt."""
    largest = -(-(MAX_PROMPT + MAX_TOKENS - 1) // block_size)
    return EngineConfig(max_num_seqs, budget, block_size, max(2, largest + 1 + room // block_size), mode,
                        caching, cache_mode, min(spec_k, block_size - 1) if caching else spec_k, spec_method)


# small budgets are favoured: with a large one a request is admitted whole, and rarely preempted
# padded_eager engines get up to 6 rows, so decode batches of 3 and 5 rows are padded (to 4 and 6)
engine_configs = st.sampled_from(["none", "padded_eager"]).flatmap(lambda mode: st.integers(
    1, 6 if mode == "padded_eager" else 4).flatmap(lambda seqs: st.builds(
        _make_config, st.just(seqs), st.integers(seqs, 8) | st.integers(seqs, 24),
        st.sampled_from([2, 4, 8]), st.integers(-12, 24), st.just(mode), st.booleans(),
        st.sampled_from(["align", "all"]), st.sampled_from([0, 0, 1, 3]),
        st.sampled_from(["ngram", "ngram", "draft_model"]))))
# Mamba2's internal checkpoints sit on chunk ends (chunk 16 in these presets): "all" needs a block
# size that 16 divides, which the drawn sizes are not; those engines run "align"
CHUNK_16 = {"tiny-mamba2", "tiny-bamba", "tiny-minimax"}    # MiniMax: its lightning layers run the SSD scan


def speculative_config(config: EngineConfig) -> dict | None:
    if not config.spec_k:
        return None
    if config.spec_method == "draft_model":
        return {"method": "draft_model", "model": "tiny-mamba2", "num_speculative_tokens": config.spec_k}
    return {"method": "ngram", "num_speculative_tokens": config.spec_k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def mamba_cache_mode(preset: str, config: EngineConfig) -> str | None:
    if not config.enable_prefix_caching:
        return None
    if config.spec_k:           # speculative decoding has no "all" path (as vLLM 0.33 has no "all")
        return "align"
    if config.cache_mode == "all" and preset in CHUNK_16 and config.block_size % 16:
        return "align"
    return config.cache_mode


@st.composite
def sampling_params(draw) -> Params:
    kind = draw(st.sampled_from(["greedy", "seeded", "unseeded"]))
    common = dict(max_tokens=draw(st.integers(1, MAX_TOKENS)), ignore_eos=draw(st.booleans()),
                  stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))),
                  stop_at=draw(st.none() | st.integers(0, MAX_TOKENS - 1)))
    if kind == "greedy":
        return Params(kind, **common)
    return Params(kind, temperature=draw(st.floats(0.5, 1.5)),
                  top_k=draw(st.just(0) | st.integers(1, 40)),
                  top_p=draw(st.just(1.0) | st.floats(0.2, 0.99)),
                  seed=draw(st.integers(0, 2**64 - 1)) if kind == "seeded" else None, **common)


# prompt length uniform in 1..40 (a plain st.lists would favour short prompts: little preemption)
# a third of the prompts start with a shared prefix (prefix caching's hits; block sizes 2, 4, 8)
SHARED_PREFIX = tuple(range(40, 40 + 24))
prompts = st.integers(1, MAX_PROMPT).flatmap(
    lambda n: st.lists(st.integers(3, VOCAB - 1), min_size=n, max_size=n)).map(tuple) | st.builds(
    lambda k, tail: SHARED_PREFIX[:k] + tuple(tail), st.sampled_from([7, 8, 16, 24]),
    st.lists(st.integers(3, VOCAB - 1), min_size=0, max_size=MAX_PROMPT - 24))
adds = st.builds(Add, prompts, sampling_params(), st.none() | st.sampled_from(["a", "b", "0", "1", "2"]))
aborts = st.builds(Abort, st.sampled_from(["live", "live", "finished", "unknown"]), st.integers(0, 7))
steps = st.builds(Step, st.integers(1, 4))
generates = st.builds(Generate, st.lists(prompts, min_size=1, max_size=2).map(tuple), sampling_params(),
                      st.none() | st.integers(1, 6))
fail_steps = st.builds(FailStep, st.sampled_from(["forward", "sample", "update"]), st.booleans())
others = st.one_of(adds, steps, steps, aborts, generates, fail_steps, st.builds(Warmup, st.booleans()))
# a burst of arrivals first (so requests run together and the cache runs out), then anything
programs = st.tuples(st.lists(adds, min_size=2, max_size=6),
                     st.lists(others, max_size=20)).map(lambda t: t[0] + t[1])


# ---- the roomy "alone" reference --------------------------------------------------------------
_ROOMY: dict[str, LLM] = {}
_ALONE: dict[tuple, tuple[list[int], str, list[torch.Tensor]]] = {}
LOGIT_ATOL = 1e-4           # logits of the same token computed in other chunks / batches


def alone(preset: str, prompt: tuple[int, ...], sp: SamplingParams
          ) -> tuple[list[int], str, list[torch.Tensor]]:
    """(tokens, finish reason, the logits each token was sampled from) of the request run alone
    on a roomy engine, cached."""
    key = (preset, prompt, sp.max_tokens, sp.temperature, sp.top_k, sp.top_p, sp.seed,
           sp.ignore_eos, tuple(sp.stop_token_ids))
    if key not in _ALONE:
        if preset not in _ROOMY:
            _ROOMY[preset] = LLM(preset, max_num_seqs=4, max_num_batched_tokens=512, trace_capacity=64,
                                 **F32)
        roomy = _ROOMY[preset]
        out = roomy.generate({"prompt_token_ids": list(prompt)}, sp)[0]
        _ALONE[key] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason,
                       sampled_logits(roomy, out.request_id))
    return _ALONE[key]


def sampled_logits(llm: LLM, rid: str) -> list[torch.Tensor]:
    """The logits row each of the request's output tokens was sampled from (from llm.trace; a
    verify row's step keeps one per accepted draft and one more)."""
    return [row for rec in llm.trace if rid in rec.kept_token_ids for row in rec.kept_logits(rid)]


def sample_alone(logits: torch.Tensor, sp: SamplingParams, position: int) -> int:
    """The engine's sampler on one row: the token these logits give at this position."""
    sampler = Sampler(1, torch.device("cpu"))
    sampler.add_request(0, sp, sp.seed if sp.seed is not None else 0)
    rows = LogitsRows.of(np.zeros(1, dtype=np.int64), torch.tensor([position]), np.ones(1, dtype=bool))
    return int(sampler(logits[None].float(), rows)[0])


def assert_same_as_alone(rid: str, prompt, ref_params: SamplingParams, got: tuple, got_logits,
                         expected: tuple) -> bool:
    """Batched == alone; or they part at a numerical tie: the two runs' logits there agree within
    LOGIT_ATOL (chunked prefill and batching round differently) and the sampler, given each run's
    own logits (same seed, same position), picks each run's token; from there the sequences
    differ. Returns whether it was such a tie."""
    if got == expected[:2]:
        return False
    toks, ref_toks, ref_logits = got[0], expected[0], expected[2]
    k = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), None)
    assert k is not None, f"{rid!r}: batched {got[:2]}, alone {expected[:2]}"
    where = f"{rid!r} ({ref_params}) parts at output {k}: batched {toks}, alone {ref_toks}"
    diff = float((got_logits[k] - ref_logits[k]).abs().max())
    assert diff <= LOGIT_ATOL, f"{where}; the logits there differ by {diff:.3g}"
    position = len(prompt) + k
    assert sample_alone(got_logits[k], ref_params, position) == toks[k], f"{where}: not the sampler's token"
    assert sample_alone(ref_logits[k], ref_params, position) == ref_toks[k], f"{where}: not the sampler's token"
    return True


def resolve(preset: str, prompt: tuple[int, ...], p: Params, arrival: int
            ) -> tuple[SamplingParams, SamplingParams]:
    """(params given to the tight engine, params of the alone run: the same with the seed an
    unseeded request derives at its arrival)."""
    base = dict(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                ignore_eos=p.ignore_eos)
    ref_seed = derive_seed(LLM_SEED, arrival) if p.kind == "unseeded" else p.seed
    stops = list(p.stop_token_ids)
    if p.stop_at is not None:
        unstopped = alone(preset, prompt, SamplingParams(**base, seed=ref_seed))[0]
        stops.append(unstopped[p.stop_at % len(unstopped)])
    return (SamplingParams(**base, seed=p.seed, stop_token_ids=stops),
            SamplingParams(**base, seed=ref_seed, stop_token_ids=stops))


# ---- checks -----------------------------------------------------------------------------------
def check_ledger(llm: LLM) -> None:
    """Scheduler side: queues, pools and the ledger agree (holds after a failed step too)."""
    sched, kv = llm.scheduler, llm.scheduler.kv
    assert len(sched.running) <= llm.cfg.max_num_seqs
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    assert len(set(running)) == len(running) and len(set(waiting)) == len(waiting)
    assert not set(running) & set(waiting)
    assert set(sched.requests) == set(running) | set(waiting)
    holdings = kv.holdings()
    for req in sched.waiting:                    # a waiting request holds nothing, computes from 0
        assert req.num_computed_tokens == 0 and req.request_id not in holdings, req.request_id
    assert set(holdings) == set(running), f"ledger {sorted(holdings)} vs running {running}"
    for pool in kv.pools:
        free = list(pool._free)
        assert 0 not in pool.holders and 0 not in free, f"{pool.name}: the null id 0 handed out"
        assert len(set(free)) == len(free) and not set(free) & set(pool.holders), f"{pool.name}: double free"
        assert len(free) + len(pool.holders) == pool.num_total, f"{pool.name}: ids leaked"
        assert all(pool.holders.values()), f"{pool.name}: an id held by nobody is not free"
        assert set().union(*pool.holders.values()) <= set(running), f"{pool.name}: held by a request not running"
        assert all(pool.cached[h] == i for i, h in pool.hash_of.items()) and \
            len(pool.cached) == len(pool.hash_of), f"{pool.name}: the cache's two maps disagree"
    for g in range(len(kv.groups)):
        pool = kv.pool(g)
        seen: dict[int, set[str]] = {}
        for rid, held in holdings.items():
            for i in ([i for i in held[g] if i] if kv.has_gaps(g) else held[g]):
                assert i != 0, f"{rid} holds the null id in group {g}"
                assert kv.caching or i not in seen, f"id {i} of group {g} shared by {seen[i]} and {rid}"
                seen.setdefault(i, set()).add(rid)
        assert seen == pool.holders, f"group {g}: rows hold {seen}, the pool counts {pool.holders}"
    k = llm.cfg.num_speculative_tokens
    for req in sched.running:
        assert 0 < req.num_computed_tokens <= req.num_tokens
        for g, group in enumerate(kv.groups):
            ids = holdings[req.request_id][g]
            if group.kind == "attention" and k:   # rejected drafts' blocks stay allocated (as in vLLM)
                assert -(-req.num_computed_tokens // group.block_size) <= len(ids) \
                    <= -(-(req.num_computed_tokens + k) // group.block_size), (req.request_id, ids)
            elif kv.aligned(g) and k:   # the columns up to its last verify row's spec columns
                assert -(-req.num_computed_tokens // group.block_size) <= len(ids) \
                    <= -(-(req.num_computed_tokens + k) // group.block_size) + k, (req.request_id, ids)
            elif group.kind == "attention" or kv.aligned(g):   # the blocks (columns) its computed tokens fill
                assert len(ids) == -(-req.num_computed_tokens // group.block_size), (req.request_id, ids)
            if kv.aligned(g) and not sched.prefill_checkpoints and not k:    # the running page, and at
                assert ids[-1] and len([i for i in ids if i]) <= 2, f"{req.request_id}: row {ids}"   # most its source
            elif kv.aligned(g) and k:       # a verify row's 1 + d columns, the columns its last step's
                assert 0 < len([i for i in ids if i]) <= 3 + k, f"{req.request_id}: row {ids}"   # drafts wrote,
                # and the block a boundary copy reaches
            elif kv.aligned(g):                 # "all": the others hold checkpoints of its blocks
                pool = kv.pool(g)
                for c, i in enumerate(ids[:-1]):
                    assert not i or pool.hash_of.get(i) == req.block_hashes[c] or req.block_hashes[c] in pool.cached, \
                        f"{req.request_id}: page {i} in column {c} is neither its checkpoint nor a duplicate of one"
            elif group.kind == "mamba":
                assert len(ids) == 1 + k, f"{req.request_id}: 1 + k state pages per request, got {ids}"
            if kv.windowed(g):      # a sliding window: the blocks its next query reads, and nothing before
                first = max(req.num_computed_tokens - group.sliding_window + 1, 0) // group.block_size
                assert [c for c, i in enumerate(ids) if i] == list(range(first, len(ids))), \
                    f"{req.request_id}: window {group.sliding_window} from block {first}, row {ids}"


def check_books(llm: LLM, rec) -> None:
    """After a step: the ledger, the runner's rows and the step's metadata agree."""
    sched, runner, cfg = llm.scheduler, llm.model_runner, llm.cfg
    check_ledger(llm)
    assert rec.violations == []
    assert rec.num_tokens <= cfg.max_num_batched_tokens and len(rec.scheduled) <= cfg.max_num_seqs
    holdings = sched.kv.holdings()
    rs, bt = runner.req_states, runner.block_tables
    assert set(rs.req_id_to_index) == {r.request_id for r in sched.running}
    for req in sched.running:                    # each row mirrors its request and the ledger
        idx = rs.req_id_to_index[req.request_id]
        assert rs.index_to_req_id[idx] == req.request_id
        assert int(rs.num_computed_tokens[idx]) == req.num_computed_tokens
        assert int(rs.total_len[idx]) == req.num_tokens
        assert rs.all_token_ids[idx, :req.num_tokens].tolist() == req.all_token_ids
        for g, ids in enumerate(holdings[req.request_id]):
            row = bt.tables[g][idx, :bt.num_blocks[g][idx]].tolist()
            if sched.kv.has_gaps(g):    # released checkpoint or out-of-window columns: the runner may still
                behind = min(sched.kv.released_columns(req.request_id, g), len(row), len(ids))   # show their ids
                assert all(i == 0 for i in ids[:behind]), f"{req.request_id}: released columns hold {ids[:behind]}"
                row, ids = row[behind:], ids[behind:]
            assert row == ids, f"{req.request_id}: group {g} table {row} != ledger {ids}"
    for idx in set(range(cfg.max_num_seqs)) - set(rs.req_id_to_index.values()):
        assert rs.index_to_req_id[idx] is None
        for g in range(bt.num_groups):           # a released row is cleared
            assert bt.num_blocks[g][idx] == 0 and not bt.tables[g][idx].any(), f"row {idx} not cleared"
    if not rec.scheduled:
        return
    # the step as the layers saw it
    seq_lens = [s.num_computed_before + s.num_tokens for s in rec.scheduled]
    rows = len(rec.scheduled)
    padded = (rec.padded_size or rows) - rows     # a decode batch padded to a capture size
    assert padded == 0 or (rec.padded_size and llm.cudagraph_mode == "padded_eager"
                           and rec.num_prefills == 0), f"padded to {rec.padded_size}"
    for gm in rec.attn_metadata:
        if gm.kind == "mamba":
            md = gm.metadata
            d = md.state_indices_tensor_d       # speculative decoding: [D, 1 + k], the row's first slot first
            parts = [t for t in (d if d is None or d.dim() == 1 else d[:, 0], md.state_indices_tensor_p)
                     if t is not None]
            slots = torch.cat(parts).tolist()
            assert slots[rows:] == [0] * padded, f"padded rows off the null slot: {slots}"
            slots = slots[:rows]
            assert len(slots) == rows and 0 not in slots, f"state indices {slots}"
            assert len(set(slots)) == len(slots), f"two rows on one slot: {slots}"
            drafts = [len(rec.spec[s.request_id].drafts) if s.request_id in rec.spec else 0 for s in rec.scheduled]
            decode = [s.num_tokens - n == 1 and s.num_computed_before > 0 for s, n in zip(rec.scheduled, drafts)]
            assert decode == [True] * (md.num_decodes - padded) + [False] * md.num_prefills
        else:
            group = sched.kv.groups[gm.group_id]
            bs, window = group.block_size, group.sliding_window
            table = gm.common.block_table_tensor
            for row, n in enumerate(seq_lens):
                # a sliding window's queries read from the window of the row's first query on
                first = 0 if window is None else max(rec.scheduled[row].num_computed_before - window + 1, 0) // bs
                assert (table[row, first:-(-n // bs)] > 0).all(), f"row {row} reads the null block"
            slots = gm.common.slot_mapping[:rec.num_tokens]
            assert (slots >= bs).all(), f"a real token writes to the null block or PAD: {slots.tolist()}"
            assert len(set(slots.tolist())) == rec.num_tokens, "two tokens write one KV slot"
            assert (gm.common.slot_mapping[rec.num_tokens:] == PAD_SLOT_ID).all()


def check_output(llm: LLM, out, sp: SamplingParams) -> None:
    comp = out.outputs[0]
    toks = comp.token_ids
    stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(llm.eos_token_ids))
    assert out.finished and 1 <= len(toks) <= sp.max_tokens
    assert all(0 <= t < VOCAB for t in toks)
    assert not stops & set(toks[:-1]), f"{out.request_id} ran past a stop token: {toks}"
    if toks[-1] in stops:
        assert comp.finish_reason == "stop"
        assert comp.text == llm.tokenizer.decode(toks[:-1])
    else:
        assert comp.finish_reason == "length" and len(toks) == sp.max_tokens
        assert comp.text == llm.tokenizer.decode(toks)


def check_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["state_pages_free"] == stats["state_pages_total"]
    assert stats["runner_rows_in_use"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    for g in range(llm.model_runner.block_tables.num_groups):
        assert not llm.model_runner.block_tables.tables[g].any()
        assert not llm.model_runner.block_tables.num_blocks[g].any()


# ---- the model: what the test expects of the engine -------------------------------------------
@dataclass
class Books:
    prompts: dict[str, tuple[int, ...]] = field(default_factory=dict)   # every accepted request
    params: dict[str, SamplingParams] = field(default_factory=dict)
    ref_params: dict[str, SamplingParams] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)      # accepted, output not yet delivered
    carried: set[str] = field(default_factory=set)   # finished inside generate(), next step() delivers
    dropped: set[str] = field(default_factory=set)   # aborted, or of an interrupted generate()
    outputs: dict = field(default_factory=dict)
    next_auto: int = 0
    warmed: bool = False
    preempted: int = 0
    refused: int = 0
    failed_steps: int = 0
    ties: int = 0           # requests that parted from their alone run at a numerical tie

    def take_auto_id(self) -> str:
        while str(self.next_auto) in self.prompts:
            self.next_auto += 1
        self.next_auto += 1
        return str(self.next_auto - 1)

    def accept(self, rid: str, prompt, params, ref_params) -> None:
        self.prompts[rid], self.params[rid], self.ref_params[rid] = prompt, params, ref_params
        self.live.add(rid)

    def agrees_with(self, llm: LLM) -> None:
        assert set(llm.scheduler.requests) == self.live - self.carried
        assert llm.has_unfinished_requests() == bool(self.live)


def deliver(llm: LLM, books: Books, outs) -> None:
    for out in outs:
        rid = out.request_id
        assert rid in books.live, f"output for {rid!r}, which is not live (dropped or delivered)"
        assert list(out.prompt_token_ids) == list(books.prompts[rid])
        check_output(llm, out, books.params[rid])
        books.live.discard(rid)
        books.outputs[rid] = out


def do_step(llm: LLM, books: Books) -> None:
    had_work = llm.scheduler.has_unfinished_requests()
    rec = llm.step()
    check_books(llm, rec)
    if had_work:
        assert rec.num_tokens > 0, "a step with requests waiting or running scheduled nothing"
    books.preempted += len(rec.preempted_request_ids)
    delivered = {o.request_id for o in rec.outputs}
    assert books.carried <= delivered, f"finished inside generate() but not delivered: {books.carried - delivered}"
    deliver(llm, books, rec.outputs)
    books.carried = set()
    books.agrees_with(llm)


class failing:
    """While active, `obj.name` raises on its `at`-th call (instance attribute, removed after)."""

    def __init__(self, obj, name: str, exc: BaseException, at: int = 1):
        self.obj, self.name, self.exc, self.at, self.calls = obj, name, exc, at, 0

    def __enter__(self):
        original = getattr(self.obj, self.name)

        def wrapper(*args, **kwargs):
            self.calls += 1
            if self.calls == self.at:
                raise self.exc
            return original(*args, **kwargs)
        setattr(self.obj, self.name, wrapper)
        return self

    def __exit__(self, *exc):
        delattr(self.obj, self.name)


def add(llm: LLM, books: Books, preset: str, config: EngineConfig, op: Add, usable: int) -> None:
    params, ref_params = resolve(preset, op.prompt, op.params, len(books.prompts))
    too_big = usable_need(op.prompt, params, config) > usable
    id_taken = op.request_id is not None and op.request_id in books.prompts
    try:
        rid = llm.add_request({"prompt_token_ids": list(op.prompt)}, params, op.request_id)
    except InvalidRequestError as err:
        assert too_big or id_taken, f"refused a valid request: {err}"
        books.refused += 1
        return
    assert not (too_big or id_taken), "accepted a request that should be refused"
    assert rid == (op.request_id if op.request_id is not None else books.take_auto_id())
    books.accept(rid, op.prompt, params, ref_params)


def usable_need(prompt, params: SamplingParams, config: EngineConfig) -> int:
    """KV blocks the request can need: every token but the last sampled one enters the cache."""
    return -(-(min(len(prompt) + params.max_tokens, MAX_MODEL_LEN) - 1) // config.block_size)


def generate(llm: LLM, books: Books, preset: str, config: EngineConfig, op: Generate, usable: int) -> None:
    arrival = len(books.prompts)
    resolved = [resolve(preset, p, op.params, arrival + i) for i, p in enumerate(op.prompts)]
    too_big = any(usable_need(p, r[0], config) > usable for p, r in zip(op.prompts, resolved))
    before = set(llm.scheduler.requests)
    requests = [{"prompt_token_ids": list(p)} for p in op.prompts]
    try:
        with failing(llm.model_runner.model, "forward", Interrupt(), op.fail_at or 0) as hook:
            outs = llm.generate(requests, [r[0] for r in resolved])
    except InvalidRequestError as err:
        assert too_big, f"refused valid requests: {err}"
        books.refused += 1
        books.agrees_with(llm)
        return
    except Interrupt:
        assert not too_big and op.fail_at is not None
        books.failed_steps += 1
        ids = [books.take_auto_id() for _ in op.prompts]
        for rid, p, (params, ref) in zip(ids, op.prompts, resolved):
            books.accept(rid, p, params, ref)
        books.live -= set(ids)                  # aborted, or finished and never returned
        books.dropped |= set(ids)
    else:
        assert not too_big, "accepted a request that should be refused"
        assert op.fail_at is None or hook.calls < op.fail_at
        ids = [books.take_auto_id() for _ in op.prompts]
        assert [o.request_id for o in outs] == ids
        for rid, p, (params, ref) in zip(ids, op.prompts, resolved):
            books.accept(rid, p, params, ref)
        deliver(llm, books, outs)
    check_ledger(llm)
    books.carried |= books.live & (before - set(llm.scheduler.requests))
    books.agrees_with(llm)


def fail_step(llm: LLM, books: Books, op: FailStep) -> None:
    if not llm.scheduler.has_unfinished_requests():     # nothing would run: an idle step
        return do_step(llm, books)
    obj, name = {"forward": (llm.model_runner.model, "forward"),
                 "sample": (llm.model_runner, "sample_tokens"),
                 "update": (llm.scheduler, "update_from_output")}[op.where]
    exc = Interrupt() if op.interrupt else RuntimeError("injected")
    with pytest.raises(type(exc)), failing(obj, name, exc):
        llm.step()
    books.failed_steps += 1
    check_ledger(llm)                            # the runner catches up at the next step
    books.agrees_with(llm)


def warmup(llm: LLM, books: Books, op: Warmup) -> None:
    while op.drain and books.live:
        do_step(llm, books)
    if books.live:
        with pytest.raises(RuntimeError, match="idle"):
            llm.warmup(progress=False)
        return
    llm.warmup(progress=False)
    books.warmed = True
    check_idle(llm)
    books.agrees_with(llm)


def run_program(preset: str, config: EngineConfig, ops: list) -> Books:
    # no shutdown(): the engine is freed by reference counting; tests/test_llm_api.py and
    # scripts/soak.py cover shutdown
    llm = LLM(preset, max_num_seqs=config.max_num_seqs, block_size=config.block_size,
              max_num_batched_tokens=config.max_num_batched_tokens,
              num_kv_blocks=config.num_kv_blocks, cudagraph_mode=config.cudagraph_mode,
              enable_prefix_caching=config.enable_prefix_caching, mamba_cache_mode=mamba_cache_mode(preset, config),
              speculative_config=speculative_config(config),
              trace_capacity=None, **F32)   # logits, for ties
    assert llm.vocab_size == VOCAB
    usable = llm.stats()["kv_blocks_total"] or 10**9       # attention-free: no KV limit
    books = Books()
    for op in ops:
        if isinstance(op, Add):
            add(llm, books, preset, config, op, usable)
        elif isinstance(op, Abort):
            pool = {"live": sorted(books.live), "finished": sorted(books.outputs), "unknown": []}[op.target]
            rid = pool[op.pick % len(pool)] if pool else f"unknown-{op.pick}"
            queued = rid in books.live and rid not in books.carried
            assert llm.abort_request(rid) == queued
            if queued:
                books.live.discard(rid)
                books.dropped.add(rid)
            books.agrees_with(llm)
        elif isinstance(op, Step):
            for _ in range(op.n):
                do_step(llm, books)
        elif isinstance(op, Generate):
            generate(llm, books, preset, config, op, usable)
        elif isinstance(op, FailStep):
            fail_step(llm, books, op)
        elif isinstance(op, Warmup):
            warmup(llm, books, op)
        else:
            raise TypeError(op)
    for _ in range(5000):                        # run to completion
        if not llm.has_unfinished_requests():
            break
        do_step(llm, books)
    else:
        pytest.fail("requests still unfinished after 5000 steps")
    rec = llm.step()                             # an idle step: nothing to do, nothing left
    check_books(llm, rec)
    assert rec.num_tokens == 0 and not rec.outputs
    check_idle(llm)
    assert set(books.outputs) == set(books.prompts) - books.dropped
    for rid, out in books.outputs.items():
        expected = alone(preset, books.prompts[rid], books.ref_params[rid])
        got = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
        books.ties += assert_same_as_alone(rid, books.prompts[rid], books.ref_params[rid], got,
                                           sampled_logits(llm, rid), expected)
    return books


# ---- the tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ENGINE_PRESETS)
@pytest.mark.timeout(600 if PROFILE.max_examples <= 100 else 3600)   # long: shrinking may be slow
@PROFILE
@example(config=EngineConfig(1, 1, 2, 25),      # the two programs pinned below, on every preset
         ops=[Add((3,), Params("greedy", max_tokens=1)), Add((3,), Params("greedy", max_tokens=1)),
              Warmup(drain=True), Warmup(drain=False)])
@example(config=EngineConfig(1, 1, 2, 25),
         ops=[Add((3,), Params("greedy", max_tokens=1)), Add((3,), Params("greedy", max_tokens=1)),
              Generate(((3,),), Params("greedy", max_tokens=1), fail_at=1),
              Add((3,), Params("greedy", max_tokens=1), request_id="2")])
@example(config=EngineConfig(1, 4, 8, 4),       # a refused generate() used up an automatic id
         ops=[Add((3,), Params("greedy", max_tokens=1)), Add((3,), Params("greedy", max_tokens=1)),
              Generate(((3,), tuple(range(3, 43))), Params("greedy", max_tokens=8)),
              Add((4,), Params("greedy", max_tokens=1))])
@example(config=EngineConfig(1, 2, 2, 25),      # tiny-mamba: a top-p tie (logits 1 ulp apart) that
         ops=[Add((3,), Params("greedy", max_tokens=1))] * 6 + [   # chunked prefill flips
             Add((308, 118, 3, 204, 177, 87, 104, 147, 48, 122, 253, 93, 38, 152, 203, 88, 6, 87, 146,
                  61, 256, 291, 315, 21, 310, 34, 44, 306),
                 Params("unseeded", max_tokens=2, temperature=0.5, top_k=10, top_p=0.375))])
@example(config=EngineConfig(1, 1, 2, 25),      # a model bug of this test: outputs carried twice
         ops=[Add((3,), Params("greedy", max_tokens=1)), Add((3,), Params("greedy", max_tokens=1)),
              Generate(((3,),), Params("greedy", max_tokens=1)),
              Generate(((3,),), Params("greedy", max_tokens=1))])
@example(config=_make_config(2, 6, 2, 0, "none", True, "align", 1),   # speculation + prefix caching:
         ops=[Add((3,), Params("greedy", max_tokens=1)),            # a spec page left behind by a prefill
              Add(tuple(range(40, 64)), Params("greedy", max_tokens=1)),    # chunk was registered as a
              Add(tuple(range(40, 56)), Params("greedy", max_tokens=1))])   # checkpoint, and hit
@example(config=_make_config(1, 12, 4, 0, "none", True, "align", 3),     # spec + caching in a tight pool:
         ops=[Add((3,), Params("greedy", max_tokens=1)),       # prefill chunks kept spec pages they never
              Add((3,) * 25, Params("greedy", max_tokens=1))])     # use, and the request stalled
@example(config=_make_config(1, 1, 2, 0, "none", False, "align", 1),     # a 1-token budget below 1 + k:
         ops=[Add((3,), Params("greedy", max_tokens=1)), Add((3,), Params("greedy", max_tokens=1))])  # no graphs
@example(config=_make_config(4, 6, 2, 0, "padded_eager", False, "align", 1),   # padded verify batches:
         ops=[Add((3,), Params("greedy", max_tokens=1)), Add((3,), Params("greedy", max_tokens=1)),
              Warmup(drain=True)])          # 4 rows x 2 tokens overflowed a 6-token budget's buffers
@given(config=engine_configs, ops=programs)
def test_random_programs_keep_books_and_outputs(preset, config, ops):
    books = run_program(preset, config, ops)
    target(float(books.preempted), label="preemptions")      # steer generation towards them
    # what the examples exercised: pytest --hypothesis-show-statistics
    event(f"preempted: {bool(books.preempted)}")
    event(f"dropped (aborted): {bool(books.dropped)}")
    event(f"refused: {bool(books.refused)}")
    event(f"failed steps: {bool(books.failed_steps)}")
    event(f"warmed up: {books.warmed}")
    event(f"parted from the alone run at a numerical tie: {bool(books.ties)}")
    event(f"finished requests: {min(len(books.outputs), 5)}")
    event(f"stopped by a stop id: {any(o.outputs[0].finish_reason == 'stop' for o in books.outputs.values())}")


# Zoo III (the delta-rule hybrids, LFM2-MoE, MiniMax, LFM3): the same programs, each draw on one of them
# (one test's examples in all, not one test per preset: the suite's time stays flat as the zoo grows)
ZOO_III = ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-olmo-hybrid", "tiny-kimi-linear", "tiny-lfm2-moe",
           "tiny-minimax", "tiny-lfm3", "tiny-xlstm"]


@pytest.mark.timeout(600 if PROFILE.max_examples <= 100 else 3600)
@PROFILE
@given(preset=st.sampled_from(ZOO_III), config=engine_configs, ops=programs)
def test_random_programs_keep_books_and_outputs_on_zoo_iii(preset, config, ops):
    run_program(preset, config, ops)


# ---- programs pinned on one preset each: a second warmup() (its own request ids must not count as
# ---- used), an add_request reusing the id of a request that an interrupted generate() dropped ----
def _greedy(max_tokens: int = 1) -> Params:
    return Params("greedy", max_tokens=max_tokens)


@settings(PROFILE, phases=[Phase.explicit])
@example(preset="tiny-mamba", config=EngineConfig(1, 1, 2, 25),
         ops=[Add((3,), _greedy()), Add((3,), _greedy()), Warmup(drain=True), Warmup(drain=False)])
@example(preset="tiny-bamba", config=EngineConfig(2, 8, 4, 13), ops=[Warmup(), Warmup()])
@given(preset=st.sampled_from(ENGINE_PRESETS), config=engine_configs, ops=programs)
def test_second_warmup_keeps_books_and_outputs(preset, config, ops):
    run_program(preset, config, ops)


@settings(PROFILE, phases=[Phase.explicit])
@example(preset="tiny-llama", config=EngineConfig(1, 1, 2, 25),
         ops=[Add((3,), _greedy()), Add((3,), _greedy()), Generate(((3,),), _greedy(), fail_at=1),
              Add((3,), _greedy(), request_id="2")])
@given(preset=st.sampled_from(ENGINE_PRESETS), config=engine_configs, ops=programs)
def test_interrupted_generate_keeps_its_request_ids_used(preset, config, ops):
    run_program(preset, config, ops)
