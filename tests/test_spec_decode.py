"""Speculative decoding (issue 26): a run with drafts yields the tokens of a run without them.

The sampler is keyed on (seed, position, token), so verification accepts a draft exactly when it
equals the token plain decoding samples at that position; every test below compares a speculative
run with a plain run of the same engine settings, token for token (greedy and seeded rows mixed).

Drafts come from two proposers:
- `ScriptedProposer` (tests only): the plain run's own continuation, wrong at chosen positions, so
  every verify step accepts a known number of drafts (all, some, none). Random-weight presets
  rarely repeat themselves, so prompt lookup alone would leave the verify path idle on them.
- the real n-gram proposer, on the trained demo model and a repetitive prompt.
A wrong state column, a stale `num_accepted_tokens` or a wrong rollback changes the tokens.
"""
from __future__ import annotations

import re
from functools import cache
from html import unescape

import numpy as np
import pytest

from toolkit import LLM, SamplingParams
from toolkit.config import SpeculativeConfig, resolve_speculative_config
from toolkit.errors import NotSupportedYetError
from toolkit.inspect.prefix_views import prefix_cache_step_html
from toolkit.inspect.record_views import step_record_html
from toolkit.inspect.spec_views import spec_step_html
from toolkit.kv_cache_manager import CacheGroupKind, KVCacheManager
from toolkit.runner.spec_decode import NgramProposer
from toolkit.widgets.views import view_names

from harness import ScriptedProposer

FAMILY_PRESETS = ["tiny-llama", "tiny-mamba", "tiny-falcon-mamba", "tiny-mamba2", "tiny-bamba", "tiny-jamba",
                  "tiny-lfm2", "tiny-nemotron-h", "tiny-granite-hybrid", "tiny-qwen3-next", "tiny-zamba2",
                  "tiny-falcon-h1", "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-olmo-hybrid",
                  "tiny-kimi-linear", "tiny-lfm2-moe", "tiny-minimax", "tiny-lfm3", "tiny-xlstm"]
# one preset per recurrent family (and attention alone) for the k sweep
K_SWEEP = ["tiny-llama", "tiny-mamba", "tiny-mamba2", "tiny-lfm2", "tiny-qwen3-next"]

_rng = np.random.default_rng(26)
PROMPTS = [_rng.integers(3, 200, n).tolist() for n in (30, 17, 9)]
PARAMS = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=18, temperature=0.9, seed=7, ignore_eos=True),
          SamplingParams(max_tokens=14, temperature=0.7, top_k=20, ignore_eos=True)]
ENGINE = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=24)    # the 30-token prompt is chunked
CACHED = dict(enable_prefix_caching=True, block_size=8)       # prefix caching: k < block size


def generate(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@cache
def plain_tokens(preset: str) -> tuple[tuple[int, ...], ...]:
    llm = LLM(preset, inspect="off", **ENGINE)
    out = tuple(tuple(t) for t in generate(llm))
    llm.shutdown()
    return out


def spec_run(preset: str, k: int, references, inspect: str = "off", **engine) -> tuple[list[list[int]], LLM]:
    llm = LLM(preset, inspect=inspect, speculative_config={"method": "ngram", "num_speculative_tokens": k},
              **{**ENGINE, **engine})
    llm.model_runner.proposer = ScriptedProposer(references, k)
    return generate(llm), llm


def references(preset: str) -> list[list[int]]:
    return [p + list(o) for p, o in zip(PROMPTS, plain_tokens(preset))]


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_tokens_equal_plain_decoding(preset):
    """k = 3, chunked prefill, greedy + seeded rows in one batch, the runtime checks on."""
    got, llm = spec_run(preset, 3, references(preset), inspect="metadata")
    assert got == [list(t) for t in plain_tokens(preset)]
    stats = llm.stats()
    # the scripted drafts make rows accept all, some and none: all three paths ran
    assert stats["spec_verify_rows"] > 5 and 0 < stats["spec_accepted_drafts"] < stats["spec_draft_tokens"]
    llm.shutdown()


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("preset", K_SWEEP)
def test_tokens_equal_for_k(preset, k):
    got, llm = spec_run(preset, k, references(preset))
    assert got == [list(t) for t in plain_tokens(preset)]
    assert llm.stats()["spec_accepted_drafts"] > 0
    llm.shutdown()


def test_preemption_mid_speculation():
    """A pool too small for all three requests: some are preempted (their drafts dropped, their
    state recomputed from scratch, num_accepted reset) and the tokens still equal plain decoding."""
    preset = "tiny-bamba"
    got, llm = spec_run(preset, 3, references(preset), inspect="metadata", block_size=4, num_kv_blocks=14)
    assert got == [list(t) for t in plain_tokens(preset)]
    assert any(rec.preempted_request_ids for rec in llm.trace)
    llm.shutdown()


def test_slot_reuse_starts_from_column_zero():
    """vLLM #48132: a request row's num_accepted_tokens must be reset to 1 when a new request takes
    the row. Two requests accept drafts and finish, leaving counts > 1 in both rows; then an n = 2
    request forks, and a child whose row was not used by its parent runs its first step -- the last
    prompt token on the parent's copied state, a decode -- from column num_accepted - 1: column 0
    after a reset, a stale column without one."""
    preset = "tiny-mamba2"
    forked = SamplingParams(n=2, max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
    # 16 = 1 (the prefill's token) + 3 steps of 4 + a last step keeping 3: both rows end at count 3
    first_params = [SamplingParams(**{**vars(p), "max_tokens": 16}) for p in PARAMS[:2]]

    def run(spec: bool) -> list[list[int]]:
        llm = LLM(preset, inspect="off", **{**ENGINE, "max_num_seqs": 2},
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3} if spec else None)
        if spec:
            llm.model_runner.proposer = ScriptedProposer(references(preset)[:2], 3, wrong_every=None)
        first = generate(llm, PROMPTS[:2], first_params)
        if spec:
            rows = llm.model_runner.model_state.num_accepted_tokens
            assert (rows > 1).all(), f"both rows should end with accepted drafts, got {rows.tolist()}"
        children = llm.generate([{"prompt_token_ids": PROMPTS[2]}], forked)[0].outputs
        llm.shutdown()
        return first + [list(c.token_ids) for c in children]

    assert run(True) == run(False)


def test_stop_token_inside_accepted_drafts():
    """A stop id among a verify row's accepted drafts ends the request there: the tokens after it
    are dropped, as plain decoding never samples them."""
    preset = "tiny-lfm2"
    full = list(plain_tokens(preset)[0])
    stop = full[6]
    params = [SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop])]
    llm = LLM(preset, inspect="off", **ENGINE)
    want = generate(llm, PROMPTS[:1], params)
    llm.shutdown()
    got, llm = spec_run(preset, 5, references(preset))
    llm.model_runner.proposer = ScriptedProposer([PROMPTS[0] + full], 5, wrong_every=None)
    assert generate(llm, PROMPTS[:1], params) == want and want[0][-1] == stop and len(want[0]) <= 7
    llm.shutdown()


def test_logprobs_equal_plain_decoding():
    preset = "tiny-jamba"
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)]
    llm = LLM(preset, inspect="off", **ENGINE)
    want = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)[0].outputs[0]
    llm.shutdown()
    llm = LLM(preset, inspect="off", speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **ENGINE)
    llm.model_runner.proposer = ScriptedProposer([PROMPTS[0] + list(want.token_ids)], 3)
    got = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)[0].outputs[0]
    assert llm.stats()["spec_accepted_drafts"] > 0
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs)
    for mine, theirs in zip(got.logprobs, want.logprobs):
        assert mine.keys() == theirs.keys()
        for tok in mine:
            assert mine[tok].rank == theirs[tok].rank
            assert mine[tok].logprob == pytest.approx(theirs[tok].logprob, abs=1e-4)
    llm.shutdown()


def test_ngram_drafts_on_the_demo_model():
    """The real proposer on a trained model and a repetitive prompt: drafts are proposed and
    accepted, and the tokens equal plain decoding."""
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"
    params = SamplingParams(max_tokens=40, temperature=0.0)
    llm = LLM("demo-hybrid", device="cpu", inspect="off")
    want = llm.generate([prompt], params)[0].outputs[0].token_ids
    llm.shutdown()
    llm = LLM("demo-hybrid", device="cpu", inspect="off",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                  "prompt_lookup_max": 4})
    got = llm.generate([prompt], params)[0].outputs[0].token_ids
    stats = llm.stats()
    llm.shutdown()
    assert got == want
    assert stats["spec_accepted_drafts"] > 0 and stats["spec_mean_accepted_length"] > 1


# ---- the proposer and the config ------------------------------------------------------------------

def test_ngram_proposer_longest_match_earliest_occurrence():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    ctx = np.array([1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3])
    # "1 2 3" (n = 3) occurred at 0: the 3 tokens after it
    assert p.propose(ctx) == [9, 2, 3]
    # only "3" matches for n = 1 ("x 3" never occurred): the earliest "3" is at 2
    assert p.propose(np.array([7, 3, 5, 6, 8, 3])) == [5, 6, 8]
    assert p.propose(np.array([1, 2, 3, 4])) == []                    # nothing repeats
    assert NgramProposer(3, 2, 2).propose(np.array([5, 5])) == []     # too short for a 2-gram match
    assert NgramProposer(3, 1, 1).propose(np.array([4, 6, 4])) == [6, 4]   # fewer than k follow


def test_ngram_index_proposes_what_the_scan_proposes_from_the_new_tokens_only(monkeypatch):
    """With request ids, each request's NgramIndex grows with its new tokens (1 to 4 a step, as kept
    tokens arrive) and proposes exactly what scanning the whole context proposes, step after step,
    for two requests side by side; it never scans (sliding_window_view is not called); a forgotten
    request, or an id reused for another context, starts a new index."""
    import toolkit.runner.spec_decode as sd
    rng = np.random.default_rng(0)
    scan, indexed = NgramProposer(k=3, min_n=1, max_n=3), NgramProposer(k=3, min_n=1, max_n=3)
    streams = {rid: rng.integers(0, 6, size=300) for rid in ("a", "b")}     # small vocabulary: many repeats
    lengths = {"a": 1, "b": 5}
    with monkeypatch.context() as m:
        expected = {}
        while min(lengths.values()) < 300:
            contexts = [streams[r][:lengths[r]] for r in ("a", "b")]
            m.undo()
            expected = scan.propose_many(contexts)
            m.setattr(sd, "sliding_window_view", lambda *a: pytest.fail("the index scanned the context"))
            assert indexed.propose_many(contexts, ["a", "b"]) == expected
            for r in lengths:
                lengths[r] = min(300, lengths[r] + int(rng.integers(1, 5)))
        assert sum(map(bool, expected)) and set(indexed.indexes) == {"a", "b"}
    indexed.forget(["a"])
    assert set(indexed.indexes) == {"b"}
    other = np.array([4, 4, 4, 4])                                   # "b" reused for a shorter context
    assert indexed.propose(other, "b") == scan.propose(other) == [4]          # "4 4 4" at 0: one token follows


def test_speculative_config_rules():
    assert resolve_speculative_config(None) is None
    cfg = resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 2})
    assert cfg == SpeculativeConfig("ngram", 2, 5, 5)                  # vLLM: both unset -> 5 and 5
    assert resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                       "prompt_lookup_max": 3}).prompt_lookup_min == 3
    for bad, match in [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "prompt_lookup_min=4 > prompt_lookup_max=2"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key")]:
        with pytest.raises(ValueError, match=match):
            resolve_speculative_config(bad)
    assert resolve_speculative_config({"method": "draft_model", "model": "tiny-mamba",
                                       "num_speculative_tokens": 2}).model == "tiny-mamba"
    with pytest.raises(ValueError, match="needs 'model'"):
        resolve_speculative_config({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'model' is for method='draft_model'"):
        resolve_speculative_config({"method": "ngram", "model": "tiny-mamba", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="a vocabulary of 320 tokens, the target 'demo-hybrid' 264"):
        LLM("demo-hybrid", device="cpu",
            speculative_config={"method": "draft_model", "model": "tiny-mamba", "num_speculative_tokens": 2})
    # prefix caching on recurrent layers: a verify row crosses at most one block boundary; no "all" path
    with pytest.raises(ValueError, match="needs block_size > 4"):
        LLM("tiny-bamba", device="cpu", enable_prefix_caching=True, block_size=4,
            speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    with pytest.raises(NotSupportedYetError, match="mamba_cache_mode='all'"):
        LLM("tiny-bamba", device="cpu", enable_prefix_caching=True, mamba_cache_mode="all", block_size=16,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    LLM("tiny-llama", device="cpu", enable_prefix_caching=True, block_size=4,       # attention alone: any k
        speculative_config={"method": "ngram", "num_speculative_tokens": 5}).shutdown()


@pytest.mark.slow          # Triton engines under the interpreter
@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-qwen3-next"])
def test_triton_kernels_verify_like_torch(preset):
    """backend="triton" (under TRITON_INTERPRET=1 on the CPU): each recurrent update kernel runs every
    verify row's positions in one launch; tokens equal plain decoding's. Two presets cover three of
    the four update kernels a verify row runs (conv and Mamba2 state update; conv and gated delta
    rule) at interpreter speed; Mamba1's equals its torch reference, and that the op token by token,
    in tests/test_verify_rows.py."""
    pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows")
    prompts, params = PROMPTS[:2], [SamplingParams(**{**vars(p), "max_tokens": 6}) for p in PARAMS[:2]]
    llm = LLM(preset, inspect="off", backend="triton", dtype="float32",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **ENGINE)
    llm.model_runner.proposer = ScriptedProposer(references(preset)[:2], 3)
    got = generate(llm, prompts, params)
    assert llm.stats()["spec_accepted_drafts"] > 0
    llm.shutdown()
    assert got == [list(t[:6]) for t in plain_tokens(preset)[:2]]


# ---- what a step shows: StepRecord.spec, the Speculation view, the trace ----------------------------
CHIP = re.compile(r'class="sd-pos sd-(\w+)" title="position (\d+) · input (\w+) · target sampled (\d+) \((\w+)\)')


@pytest.fixture(scope="module")
def recorded():
    preset = "tiny-bamba"
    got, llm = spec_run(preset, 3, references(preset), inspect="metadata")
    yield llm
    llm.shutdown()


def test_record_says_what_each_verify_row_did(recorded):
    rows = [(rec, rid, row) for rec in recorded.trace if not rec.is_warmup for rid, row in rec.spec.items()]
    assert rows and any(row.drafts for _, _, row in rows)
    outcomes = set()
    for rec, rid, row in rows:
        assert len(row.target) == len(row.drafts) + 1 and 1 <= row.num_accepted <= len(row.target)
        a = row.accepted_drafts
        assert row.drafts[:a] == row.target[:a]                     # accepted: equal to the target's token
        if a < len(row.drafts):                                     # rejected: differs, and is reported
            assert row.drafts[a] != row.target[a] and row.target_at_rejection == row.target[a]
        # the state columns: the request's 1 + k slots, started where its last step's count points
        if rid in rec.ledger.holdings:      # (a request that finished in the step holds nothing)
            assert row.columns == rec.ledger.holdings[rid][rec.ledger.group_kinds.index("mamba")]
        assert rec.kept_token_ids[rid] == row.target[row.num_accepted - 1]
        assert tuple(rec.kept_logits(rid).shape) == (row.num_accepted, recorded.vocab_size)
        outcomes.add("all" if a == len(row.drafts) and a else "some" if a else "none" if row.drafts else "no drafts")
    assert {"all", "some", "none"} <= outcomes
    # the start column is the next column of the request's previous step (its num_accepted - 1)
    last: dict[str, int] = {}
    for _, rid, row in rows:
        if rid in last:
            assert row.start_column == last[rid]
        last[rid] = row.next_column


def test_speculation_view_draws_each_position(recorded):
    rec = next(r for r in recorded.trace if any(0 < s.accepted_drafts < len(s.drafts) for s in r.spec.values()))
    page = spec_step_html(rec, enabled=True)
    for rid, row in rec.spec.items():
        assert f"request {rid!r}: {len(row.drafts)} draft" in unescape(page)
    chips = [(state, int(j), inp, int(t), kept) for state, j, inp, t, kept in CHIP.findall(unescape(page))]
    assert len(chips) == sum(len(r.target) for r in rec.spec.values())
    want = []
    for row in rec.spec.values():
        a = row.accepted_drafts
        for j, t in enumerate(row.target):
            state = "input" if j == 0 else "accepted" if j <= a else "rejected" if j == a + 1 else "unchecked"
            want.append((state, j, "last" if j == 0 else str(row.drafts[j - 1]), t,
                         "kept" if j < row.num_accepted else "dropped"))
    assert chips == want
    assert "Speculation" in step_record_html(rec) and "target at rejection" in step_record_html(rec)
    assert "speculative decoding is off" in spec_step_html(rec, enabled=False)
    plain = LLM("tiny-bamba", device="cpu", max_num_seqs=2)
    plain.generate([{"prompt_token_ids": PROMPTS[2]}], PARAMS[0])
    assert "no speculative decode rows" in spec_step_html(plain.trace[-1])
    plain.shutdown()


def test_inspector_tab_and_saved_trace(recorded, tmp_path):
    from toolkit.inspect.trace import Trace
    from toolkit.widgets import StepInspector
    inspector = StepInspector(recorded)
    inspector.tabs.selected_index = list(view_names()).index("Speculation")
    assert "Verify rows of this step" in inspector.speculation.html.value or \
        "no row of this step was a decode" in inspector.speculation.html.value
    recorded.trace.save(tmp_path / "t")
    loaded = Trace.load(tmp_path / "t")
    mine = [r for r in recorded.trace if r.spec]
    theirs = [r for r in loaded if r.spec]
    assert [r.spec for r in mine] == [r.spec for r in theirs]


def test_diff_traces_lines_a_speculative_run_up_with_a_plain_one():
    """inspect="full": a verify row's states are recorded at the column it kept (before: the one it
    started from); `diff_traces` keys a verify row's kept tokens on their positions, so a speculative
    run agrees with a plain one token by token, logits row by logits row and state by state, and a
    verify step that starts from the wrong column (checks off) is found where it first changes a state."""
    from toolkit.inspect import diff_traces, faults
    preset = "tiny-mamba2"
    plain = LLM(preset, inspect="full", **ENGINE)
    generate(plain)
    got, spec = spec_run(preset, 3, references(preset), inspect="full")
    diff = diff_traces(plain.trace, spec.trace)
    assert diff.identical and diff.num_states_compared > 0 and diff.num_logits_compared > 20, diff
    for rec in spec.trace:
        for ls in rec.states:
            for rid, row in rec.spec.items():
                if rid in ls.request_ids:
                    assert ls.slots[ls.request_ids.index(rid)] == row.columns[row.start_column]
    with faults.inject("verify_starts_from_last_column"):
        broken = LLM(preset, inspect="full", checks=False,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **ENGINE)
        broken.model_runner.proposer = ScriptedProposer(references(preset), 3)
        generate(broken)
    diff = diff_traces(plain.trace, broken.trace)
    assert not diff.identical and diff.what.startswith("state "), diff
    for llm in (plain, spec, broken):
        llm.shutdown()


# ---- padded verify batches (the CUDA-graph path, run eagerly on the CPU) ------------------------------
@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "prefix-caching"])
@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-mamba", "tiny-lfm2", "tiny-qwen3-next"])
def test_padded_eager_verify_batches_equal_unpadded(preset, caching):
    """cudagraph_mode="padded_eager": decode batches whose rows all carry k drafts are padded to the
    next capture size with padded verify rows of 1 + k tokens on the null block and slot, as a graph
    captured for that size would run them. Tokens equal plain decoding's and each kept token's logits
    equal the unpadded speculative run's; with prefix caching too (position-indexed state rows)."""
    runs = {}
    for mode in ("none", "padded_eager"):
        got, llm = spec_run(preset, 3, references(preset), inspect="metadata", cudagraph_mode=mode,
                            **(CACHED if caching else {}))
        runs[mode] = (got, [(rec.step_index, rid, rec.kept_logits(rid)) for rec in llm.trace
                            if not rec.is_warmup for rid in rec.kept_token_ids], list(llm.trace))
        llm.shutdown()
    assert runs["none"][0] == runs["padded_eager"][0] == [list(t) for t in plain_tokens(preset)]
    padded = [r for r in runs["padded_eager"][2] if r.padded_size is not None and r.spec]
    verify = [r for r in padded if r.input_batch.num_draft_tokens is not None]
    assert verify, "no verify batch was padded"
    assert all(r.graph == "padded eager" for r in padded)
    # every row 1 + k tokens, or (a step where no row had a draft: the 1-token family) every row 1
    assert all(r.input_batch.num_tokens == (4 if r in verify else 1) * len(r.scheduled) for r in padded)
    for (step, rid, a), (step_b, rid_b, b) in zip(runs["none"][1], runs["padded_eager"][1], strict=True):
        assert (step, rid) == (step_b, rid_b)
        assert (a - b).abs().max().item() <= 1e-5, f"step {step}, request {rid}"


def test_ngram_pads_to_k_drafts_with_graphs():
    """With decode graphs (here padded_eager) the n-gram proposer gives every row of a batch k drafts
    once one row has a draft, the missing ones the last token repeated (MRV2's rule), so the verify
    batch stays uniform; a batch where no row matches gets none (its step runs 1-token rows)."""
    p = NgramProposer(k=3, min_n=1, max_n=2, pad=True)
    contexts = [np.array([1, 2, 3, 4]), np.array([7, 8, 9, 7]), np.array([5, 6, 5])]
    assert p.propose_many(contexts) == [[4, 4, 4],          # no match: all padding
                                        [8, 9, 7],
                                        [6, 5, 5]]          # one short: padded
    assert p.propose_many([contexts[0], np.array([9, 8, 7])]) == [[], []]      # no row matches: none
    assert NgramProposer(k=3, min_n=1, max_n=2).propose_many(contexts) == [[], [8, 9, 7], [6, 5]]


def test_ngram_steps_without_a_match_run_one_token_rows_under_graphs():
    """padded_eager, the real n-gram lookup: a step where no row found a match proposes nothing and
    runs its rows as 1-token rows padded to a capture size (the engine's second graph family), not as
    rows padded to k drafts; steps where a row matched run uniform 1 + k rows. Tokens equal plain."""
    preset = "tiny-bamba"
    llm = LLM(preset, inspect="metadata", cudagraph_mode="padded_eager", **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert llm.model_runner.cudagraph_manager.families == [4, 1]
    assert generate(llm) == [list(t) for t in plain_tokens(preset)]
    padded = [r for r in llm.trace if not r.is_warmup and r.padded_size is not None]
    one_token = [r for r in padded if r.input_batch.num_draft_tokens is None]
    assert one_token and all(r.input_batch.num_tokens == len(r.scheduled) for r in one_token)
    verify = [r for r in padded if r not in one_token]
    assert verify and all(r.input_batch.num_tokens == 4 * len(r.scheduled) for r in verify)
    llm.shutdown()


# ---- the draft-model proposer -------------------------------------------------------------------
@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "prefix-caching"])
@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_draft_model_tokens_equal_plain_decoding(preset, caching):
    """method "draft_model": an attention-free draft (tiny-mamba2, the tiny presets' vocabulary) runs
    inside the target's step (runner/draft_model.py) and proposes k greedy tokens; the target's
    tokens equal plain decoding's, greedy and seeded, with chunked prefill, and with the target's
    prefix caching off and on. At most k draft forwards per target step; shutdown releases it."""
    llm = LLM(preset, inspect="metadata", **ENGINE, **(CACHED if caching else {}),
              speculative_config={"method": "draft_model", "model": "tiny-mamba2", "num_speculative_tokens": 3})
    assert generate(llm) == [list(t) for t in plain_tokens(preset)]
    stats = llm.stats()
    assert stats["spec_verify_rows"] > 5 and stats["spec_draft_tokens"] > 0
    assert 0 < stats["draft_forwards"] <= 3 * stats["draft_steps"]
    assert 0 < stats["draft_forward_seconds"] < stats["draft_seconds"]
    runner = llm.model_runner
    llm.shutdown()
    assert runner.draft is None and "draft" in runner.release_log


def test_a_draft_equal_to_the_target_is_always_accepted_on_greedy_rows():
    llm = LLM("tiny-jamba", inspect="off", **ENGINE,
              speculative_config={"method": "draft_model", "model": "tiny-jamba", "num_speculative_tokens": 4})
    greedy = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 2
    assert generate(llm, PROMPTS[:2], greedy) == [list(t) for t in plain_tokens("tiny-jamba")[:1]] + \
        generate(LLM("tiny-jamba", inspect="off", **ENGINE), PROMPTS[1:2], greedy[:1])
    stats = llm.stats()
    assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] > 3
    llm.shutdown()


@pytest.mark.parametrize("target,draft,caching", [("tiny-bamba", "tiny-mamba2", False),
                                                  ("tiny-bamba", "tiny-jamba", False),
                                                  ("tiny-bamba", "tiny-jamba", True),
                                                  ("tiny-mamba2", "tiny-jamba", False)],
                         ids=["state-only-draft", "shared-kv-pool", "shared-kv-pool-prefix-hits", "dense-kv-pages"])
def test_the_draft_in_the_step_proposes_its_own_greedy_continuation(target, draft, caching):
    """Each row's k drafts are exactly what the draft model, run as an engine of its own, generates
    greedily from the request's tokens so far: its committed state pages hold the state of verified
    tokens only (a rejected guess never enters them), through chunked prefills, mixed batches and
    rows taken over by new requests. tiny-mamba2: state pages only; tiny-jamba: attention and Mamba1
    layers, its KV at the target's block ids (the scheduler holding k lookahead slots per request)
    or, for a target without attention layers, in dense pages of its own. With prefix caching the
    prompts run twice: the second time the target hits its cache and the draft, which has none,
    catches up over the hit prefix itself (rewriting the shared blocks' draft KV)."""
    llm = LLM(target, inspect="off", **ENGINE, **(CACHED if caching else {}),
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    shared = llm.model_runner.draft.target_kv_table is not None
    assert shared == (draft == "tiny-jamba" and target == "tiny-bamba")
    assert llm.scheduler.kv.num_lookahead_tokens == (3 if shared else 0)
    runner, seen = llm.model_runner, []
    propose = runner.proposer.propose_rows

    def recording(req_states, req_ids, rows, decode_next):
        drafts = propose(req_states, req_ids, rows, decode_next)
        for rid, idx in zip(req_ids, rows.tolist()):
            if rid in drafts:
                seen.append((req_states.all_token_ids[idx, :int(req_states.total_len[idx])].tolist(), drafts[rid]))
        return drafts
    runner.proposer.propose_rows = recording
    generate(llm)
    if caching:
        generate(llm)
        assert llm.stats()["prompt_tokens_skipped"] > 0
    llm.shutdown()
    assert len(seen) > 10
    alone = LLM(draft, inspect="off", **ENGINE)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    want = alone.generate([{"prompt_token_ids": context} for context, _ in seen], greedy)
    alone.shutdown()
    assert [d for _, d in seen] == [list(o.outputs[0].token_ids) for o in want]


def test_lookahead_slots_cover_a_draft_models_guesses_up_to_max_model_len():
    """vLLM's num_lookahead_tokens: with k = 3 a request holds KV slots for 3 tokens past its
    scheduled ones (where the draft writes its guesses), never past max_model_len."""
    kv = KVCacheManager([CacheGroupKind("attention", 4)], num_kv_blocks=32, num_state_pages=0,
                        num_lookahead_tokens=3, max_model_len=14)
    assert [len(ids) for ids in kv.allocate("a", 0, 5)] == [2]           # 5 + 3 tokens: 2 blocks
    assert [len(ids) for ids in kv.allocate("a", 5, 6)] == [1]           # 9 tokens: a third
    assert [len(ids) for ids in kv.allocate("a", 6, 13)] == [1]          # 16, capped to 14: a fourth
    plain = KVCacheManager([CacheGroupKind("attention", 4)], num_kv_blocks=32, num_state_pages=0)
    assert [len(ids) for ids in plain.allocate("a", 0, 5)] == [2] and plain.allocate("a", 5, 8) == ([],)


def test_a_draft_model_fits_a_budget_smaller_than_its_rows():
    """The draft's k state pages per row and its k forwards' buffers with the smallest budget (2
    tokens, 2 rows, k = 3): it builds and keeps plain decoding's tokens (found by the property
    suite: a draft RunnerConfig of k S rows once refused such a budget)."""
    engine = dict(device="cpu", max_num_seqs=2, max_num_batched_tokens=2)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = LLM("tiny-mamba", inspect="off", **engine)
    want = generate(plain, PROMPTS[1:], [greedy] * 2)
    plain.shutdown()
    llm = LLM("tiny-mamba", inspect="off", **engine,
              speculative_config={"method": "draft_model", "model": "tiny-mamba", "num_speculative_tokens": 3})
    assert generate(llm, PROMPTS[1:], [greedy] * 2) == want
    assert llm.stats()["spec_acceptance_rate"] == 1.0
    llm.shutdown()


@pytest.mark.slow          # Triton engines under the interpreter
@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "prefix-caching"])
def test_replaying_the_warmup_verify_forward_equals_eager(monkeypatch, caching):
    """The decode-graph path of verify batches, emulated on the CPU as tests/test_cudagraph.py does
    (a closure built from warmup's dummy verify batch stands in for the graph; Triton ops, which read
    only device tensors): every replayed step reads only what the step rewrote in place -- the
    persistent buffers and the builders' per-shape loop tensors -- so its tokens equal the eager run's."""
    pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows")
    from test_cudagraph import ClosureGraphs

    import toolkit.llm
    import toolkit.runner.model_runner as model_runner
    monkeypatch.setattr(toolkit.llm, "resolve_cudagraph_mode", lambda *a: "full_decode")
    monkeypatch.setattr(model_runner, "CudaGraphManager", ClosureGraphs)
    engine = dict(ENGINE, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, backend="triton",
                  dtype="float32")
    preset, k = "tiny-lfm2", 2
    prompts, params = PROMPTS[1:], [SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)] * 2
    llm = LLM(preset, inspect="metadata", speculative_config={"method": "ngram", "num_speculative_tokens": k},
              enable_prefix_caching=caching, **engine)
    llm.warmup(progress=False)
    # the verify rows' graphs (1 + k tokens a row), and the 1-token rows' of steps without drafts
    assert llm.cudagraph_report.sizes == [1, 2, 4] and llm.cudagraph_report.plain_sizes == [1, 2, 4]
    refs = [p + list(o) for p, o in zip(prompts, generate(LLM(preset, inspect="off", **ENGINE), prompts, params))]
    llm.model_runner.proposer = ScriptedProposer(refs, k, wrong_every=2)
    got = generate(llm, prompts, params)
    replayed = [r for r in llm.trace if r.graph == "graph" and r.spec]
    # every other step without drafts: a 1-token step right after a verify step starts from the column
    # the verify rows' accepted counts point at (its graph reads them from the persistent buffers)
    llm.model_runner.proposer = EveryOtherStepNoDrafts(refs, k, wrong_every=2)
    start = len(llm.trace)
    alternating = generate(llm, prompts, params)
    steps = [(r.graph, r.input_batch.num_tokens, len(r.scheduled)) for r in list(llm.trace)[start:]]
    llm.shutdown()
    assert got == alternating == [r[len(p):] for p, r in zip(prompts, refs)]
    assert replayed and all(r.padded_size == 2 and r.input_batch.num_tokens == 2 * (1 + k) for r in replayed)
    # a replayed 1-token step right after a replayed verify step
    assert any(a == ("graph", 2 * (1 + k), 2) and b == ("graph", 2, 2) for a, b in zip(steps, steps[1:])), steps


class EveryOtherStepNoDrafts(ScriptedProposer):
    """ScriptedProposer's drafts on every other step, none on the others."""

    def propose_many(self, contexts, req_ids=None):
        self.steps = getattr(self, "steps", 0) + 1
        return super().propose_many(contexts) if self.steps % 2 else [[] for _ in contexts]


@pytest.mark.parametrize("preset", ["tiny-mamba", "tiny-bamba"])
def test_no_drafts_after_a_partial_prefill_chunk(preset):
    """Found by the property suite: a prompt chunked so that one prompt token is left for the next
    step. The chunk's end repeats an earlier n-gram, but its next step runs the prompt's last token,
    a prefill: no drafts may ride on it (they would enter the recurrent state as if accepted)."""
    prompt = [261] + [3] * 8 + [40] + [3] * 4                  # 14 tokens, a budget of 13
    engine = dict(device="cpu", dtype="float32", max_num_seqs=1, max_num_batched_tokens=13, block_size=2)
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    want = LLM(preset, inspect="off", **engine).generate({"prompt_token_ids": prompt}, greedy)[0]
    llm = LLM(preset, **engine, speculative_config={"method": "ngram", "num_speculative_tokens": 1,
                                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    got = llm.generate({"prompt_token_ids": prompt}, greedy)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    first, second = [r for r in llm.trace if r.scheduled][:2]
    assert first.scheduled[0].num_tokens == 13 and not first.proposed_drafts
    assert second.scheduled[0].num_tokens == 1 and not any(row.drafts for row in second.spec.values())
    llm.shutdown()


# ---- with prefix caching ("align") -------------------------------------------------------------


def boundary_copies(llm: LLM) -> list:
    return [c for rec in llm.trace for c in rec.checkpoint_copies]


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_tokens_equal_plain_decoding_with_prefix_caching(preset):
    """Prefix caching on (block 8, k = 3): verify rows cross block boundaries, so checkpoints come
    from their state columns (the boundary copy); the tokens equal plain decoding's, and again in a
    second round that hits the first round's checkpoints (the seeded rows; the unseeded one draws
    anew). Every step's checks run (inspect="metadata")."""
    plain = [list(t) for t in plain_tokens(preset)]
    got, llm = spec_run(preset, 3, references(preset), inspect="metadata", **CACHED)
    assert got == plain
    assert generate(llm)[:2] == plain[:2]
    assert llm.stats()["prompt_tokens_skipped"] > 0
    if preset != "tiny-llama":
        assert boundary_copies(llm), "no verify row crossed a block boundary"
    llm.shutdown()


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("preset", K_SWEEP)
def test_tokens_equal_for_k_with_prefix_caching(preset, k):
    got, llm = spec_run(preset, k, references(preset), **CACHED)
    assert got == [list(t) for t in plain_tokens(preset)]
    llm.shutdown()


def test_preemption_mid_speculation_with_prefix_caching():
    preset = "tiny-bamba"
    got, llm = spec_run(preset, 3, references(preset), inspect="metadata", enable_prefix_caching=True,
                        block_size=4, num_kv_blocks=14)
    assert got == [list(t) for t in plain_tokens(preset)]
    assert any(rec.preempted_request_ids for rec in llm.trace)
    llm.shutdown()


@pytest.mark.parametrize("preset", ["tiny-bamba", "tiny-mamba", "tiny-lfm2", "tiny-qwen3-next"])
def test_a_hit_on_a_verify_step_checkpoint(preset):
    """vLLM #53912's reproducer ("poison, then re-probe"): A decodes with drafts (block 4, k = 3, every
    draft accepted: the boundaries fall inside verify rows, after position 1); B's prompt is A's first
    25 tokens, so B hits the checkpoint at 24, which a boundary copy wrote, and its only prompt token
    left runs as a decode row (vLLM #46424). In inspect="full" the state B starts from is compared
    with a cold prefill of those 24 tokens; B's tokens equal plain decoding's."""
    engine = dict(device="cpu", dtype="float32", max_num_seqs=1, max_num_batched_tokens=8, max_model_len=64)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a_prompt = list(range(20, 34))
    plain = LLM(preset, inspect="off", **engine)
    a_out = plain.generate([{"prompt_token_ids": a_prompt}], greedy)[0].outputs[0].token_ids
    b_prompt = (a_prompt + list(a_out))[:25]
    b_out = plain.generate([{"prompt_token_ids": b_prompt}], greedy)[0].outputs[0].token_ids
    plain.shutdown()
    llm = LLM(preset, inspect="full", enable_prefix_caching=True, block_size=4, num_state_pages=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **engine)
    llm.model_runner.proposer = ScriptedProposer([a_prompt + list(a_out), b_prompt + list(b_out)], 3,
                                                 wrong_every=None)
    assert llm.generate([{"prompt_token_ids": a_prompt}], greedy)[0].outputs[0].token_ids == a_out
    copies = {c.boundary: c for c in boundary_copies(llm)}
    assert 24 in copies and copies[24].position == 1 and copies[24].src_page != copies[24].dst_page
    saved = next(rec for rec in llm.trace if copies[24] in rec.checkpoint_copies)      # the views say so
    said = unescape(spec_step_html(saved))
    assert (f"checkpoint: the row reached token 24, a block boundary, at position 1; that column's state "
            f"(slot {copies[24].src_page}) was copied into page {copies[24].dst_page}") in said
    assert (f"the state after 24 tokens, left by verify position 1 in page {copies[24].src_page} -> page "
            f"{copies[24].dst_page}") in unescape(prefix_cache_step_html(saved))
    assert llm.generate([{"prompt_token_ids": b_prompt}], greedy)[0].outputs[0].token_ids == b_out
    admitted = next(rec for rec in llm.trace if rec.prefix_hits)
    assert admitted.prefix_hits == {admitted.scheduled[0].request_id: 24}
    assert admitted.scheduled[0].runs_as_decode and admitted.spec       # a decode row, spec metadata complete
    llm.shutdown()


def test_state_pages_per_request_with_prefix_caching():
    """A request holds at most 3 + k state pages (running, k spec, the source and the checkpoint a
    verify row reaches), and the default pool is max_num_seqs * (3 + k)."""
    preset = "tiny-mamba2"
    got, llm = spec_run(preset, 3, references(preset), inspect="metadata", **CACHED)
    assert llm.scheduler.kv.state_pool.num_total == ENGINE["max_num_seqs"] * 6
    most = max(len([i for i in rec.ledger.holdings[s.request_id][0] if i])
               for rec in llm.trace for s in rec.scheduled if s.request_id in rec.ledger.holdings)
    assert 4 <= most <= 6
    llm.shutdown()
