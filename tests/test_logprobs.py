"""SamplingParams' logprobs, prompt_logprobs, stop strings, min_tokens and n (vLLM's names and
meanings), as the user gets them back and as the inspector shows them. Parity with HF's logprobs is
in the runner parity checks (harness.assert_logprobs_match_hf, every preset); one host sync per step
with all of them on is in test_host_syncs.py."""
from __future__ import annotations

import pytest
import torch

from toolkit import LLM, SamplingParams
from toolkit.inspect import Trace, check_logprobs_close, html, record_views
from toolkit.outputs import Logprob

from harness import TINY_PRESETS, small_llm

PROMPT = list(range(5, 45))          # 40 tokens: three KV blocks of 16


@pytest.fixture(scope="module")
def bamba():
    """tiny-bamba (Mamba2 + attention), 16 tokens a step: a 40-token prompt prefills in 3 chunks."""
    with small_llm("tiny-bamba", max_num_batched_tokens=16) as llm:
        yield llm


def lone(llm: LLM, prompt: list[int], **params):
    """The CompletionOutput of one request run alone (no other request in the engine)."""
    assert not llm.has_unfinished_requests()
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**params))[0]


# ---- logprobs ------------------------------------------------------------------------------------------
def test_logprobs_are_raw_log_softmax_of_the_logits_the_runner_sampled_from(bamba):
    """Sampled (temperature 0.7, top-k 3) with logprobs=4: each token's dict holds the sampled
    token (first, with its rank) and the 4 most likely, of log_softmax(fp32 logits) before
    temperature and top-k (vLLM's default); cumulative_logprob sums the sampled ones. The step
    records show the same values per row."""
    rid = bamba.add_request({"prompt_token_ids": PROMPT},
                            SamplingParams(max_tokens=6, temperature=0.7, top_k=3, seed=5, logprobs=4, ignore_eos=True))
    raw = []
    out = None
    while bamba.has_unfinished_requests():
        rec = bamba.step()
        if rid in rec.kept_token_ids:
            lp = torch.log_softmax(rec.logits_of(rid), dim=-1)
            raw.append((rec.kept_token_ids[rid], lp))
            row = rec.logprob_of(rid)
            assert row.token_ids[0, 0] == rec.kept_token_ids[rid] and row.first_position == len(PROMPT) + len(raw) - 1
        out = next((o for o in rec.outputs if o.request_id == rid), out)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6 and out.prompt_logprobs is None
    total = 0.0
    for (tok, lp), d in zip(raw, c.logprobs, strict=True):
        assert list(d)[0] == tok and all(isinstance(v, Logprob) for v in d.values())
        top = lp.topk(4)
        assert set(d) == {tok, *top.indices.tolist()} and len(d) in (4, 5)
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert d[tid].logprob == pytest.approx(value, abs=1e-6)
            assert d[tid].rank == rank or tid == tok
            assert d[tid].decoded_token == bamba.tokenizer.decode([tid])
        assert d[tok].logprob == pytest.approx(lp[tok].item(), abs=1e-6)
        assert d[tok].rank == int((lp >= lp[tok]).sum())       # vLLM: tokens at least as likely
        total += lp[tok].item()
    assert any(d[t].rank > 1 for d, t in zip(c.logprobs, c.token_ids, strict=True)), "top-k 3 sampling left rank 1"
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_logprobs_change_no_token_and_zero_gives_the_chosen_token_only(bamba):
    plain = lone(bamba, PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True).outputs[0]
    with_lp = lone(bamba, PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0).outputs[0]
    explicit_n1 = lone(bamba, PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, n=1).outputs[0]
    assert with_lp.token_ids == plain.token_ids == explicit_n1.token_ids
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert [list(d) for d in with_lp.logprobs] == [[t] for t in with_lp.token_ids]
    assert all(d[t].rank == 1 for d, t in zip(with_lp.logprobs, with_lp.token_ids, strict=True))   # greedy


def test_prompt_logprobs_are_the_same_in_one_chunk_and_in_three(bamba):
    """prompt_logprobs=3: None for the first prompt token, then per token its logprob given the
    tokens before it, the top 3 beside it; computed per prefill chunk from the logits of every token
    of the chunk (the records show each chunk's), so 16-token chunks give what one prefill gives."""
    start = len(bamba.trace)
    chunked = lone(bamba, PROMPT, max_tokens=2, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
    rid = chunked.request_id
    chunks = [r.prompt_logprobs[rid] for r in bamba.trace[start:] if rid in r.prompt_logprobs]
    # chunks of 16, 16 and 8 tokens predict prompt tokens 1..16, 17..32 and 33..39 (the last token
    # of the prompt predicts the first output token)
    assert [(c.first_position, len(c)) for c in chunks] == [(1, 16), (17, 16), (33, 7)]
    assert all(c.token_ids.shape[1] == 4 for c in chunks)
    with small_llm("tiny-bamba", max_num_batched_tokens=64) as whole_llm:
        whole = lone(whole_llm, PROMPT, max_tokens=2, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
        first = whole_llm.trace[-2]
        assert [(c.first_position, len(c)) for c in first.prompt_logprobs.values()] == [(1, 39)]
    for out in (chunked, whole):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        a, b = chunked.prompt_logprobs[p], whole.prompt_logprobs[p]
        assert list(a)[0] == PROMPT[p] and list(a) == list(b), p
        assert a[PROMPT[p]].rank == b[PROMPT[p]].rank
        for tid in a:
            assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-5)
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids


def test_prompt_logprobs_survive_preemption():
    """A request preempted during its prefill and recomputed keeps one prompt logprob per token,
    equal to a run without preemption."""
    params = SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 43 + i))} for i in range(3)]
    with small_llm("tiny-llama", max_num_batched_tokens=16, block_size=16, num_kv_blocks=8) as tight:
        outs = tight.generate(prompts, params)
        assert any(r.preempted_request_ids for r in tight.trace.user_steps())
    with small_llm("tiny-llama") as roomy:
        refs = roomy.generate(prompts, params)
    for out, ref in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == 40
        for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
            assert list(a) == list(b) and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)


# ---- the inspector ---------------------------------------------------------------------------------------
def test_records_and_the_batch_table_show_each_rows_logprob_and_rank(tmp_path):
    """While recording, every row's sampled token has its logprob and rank in the StepRecord
    (`logprob_of`: the rows that asked from the runner, with their top k; the others from the
    recorded logits, on demand) and in the Batch table; with inspect="off" only the rows that
    asked. A trace whose outputs hold logprobs saves and loads, and its records still answer."""
    with small_llm("tiny-mamba2", max_num_batched_tokens=16) as llm:
        llm.add_request({"prompt_token_ids": PROMPT[:9]}, SamplingParams(max_tokens=3, temperature=0.0, logprobs=2))
        llm.add_request({"prompt_token_ids": PROMPT[:20]}, SamplingParams(max_tokens=3, temperature=0.0))
        records = [llm.step() for _ in range(3)]
        while llm.has_unfinished_requests():
            records.append(llm.step())
        for rec in records:
            assert set(rec.logprobs) == {"0"} & set(rec.request_ids)     # the runner computed only these
            for rid in rec.request_ids:
                row = rec.logprob_of(rid)
                assert row.first_position == rec.input_batch.seq_lens_cpu_upper_bound[
                    rec.input_batch.req_ids.index(rid)]
                lp = torch.log_softmax(rec.logits_of(rid), dim=-1)
                tok = rec.sampled_token_ids[rid]
                assert row.token_ids[0, 0] == tok and row.logprob == pytest.approx(lp[tok].item(), abs=1e-6)
                assert row.rank == int((lp >= lp[tok]).sum())
                assert row.token_ids.shape[1] == (3 if rid == "0" else 1)
        h = records[1]._repr_html_()
        assert ">logprob<" in h and ">rank<" in h
        for rid in records[1].request_ids:
            row = records[1].logprob_of(rid)
            assert f"<td style=\"{html.TD}\">{row.logprob:.4f}</td><td style=\"{html.TD}\">{row.rank}</td>" in h
        assert record_views.BATCH_COLUMNS.index("logprob") == record_views.BATCH_COLUMNS.index("sampled") + 1
        llm.trace.save(tmp_path / "t")
        again = Trace.load(tmp_path / "t")
        assert again.equals(llm.trace)
        for a, b in zip(again, llm.trace, strict=True):
            for rid in b.request_ids:
                assert a.logprob_of(rid).logprob == b.logprob_of(rid).logprob
        outs = [o for r in again for o in r.outputs]
        assert outs and all(isinstance(k, int) for o in outs if o.request_id == "0"
                            for d in o.outputs[0].logprobs for k in d)
    with small_llm("tiny-mamba2", inspect="off", checks=False) as off:
        off.add_request({"prompt_token_ids": PROMPT[:9]}, SamplingParams(max_tokens=2, logprobs=1))
        off.add_request({"prompt_token_ids": PROMPT[:5]}, SamplingParams(max_tokens=2))
        rec = off.step()
        assert set(rec.logprobs) == {"0"}
        lp = torch.log_softmax(rec.logits_of("1"), dim=-1)      # the step's own record holds its logits
        assert rec.logprob_of("1").logprob == pytest.approx(lp[rec.sampled_token_ids["1"]].item(), abs=1e-6)
        with pytest.raises(KeyError, match="its row was not in this step"):
            rec.logprob_of("2")


# ---- stop strings and min_tokens ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo():
    """The trained demo model: greedy after "The " it writes
    'interpreter prompt appears\\n\\n* **PEP 634** – Structural Pattern' (one token per byte)."""
    with LLM("demo-hybrid", device="cpu", dtype="float32") as llm:
        yield llm


@pytest.mark.parametrize("stop, include, text, num_tokens, reason", [
    (["prompt"], False, "interpreter ", 18, "prompt"),     # over 6 tokens; cut before it, its tokens kept
    (["prompt"], True, "interpreter prompt", 18, "prompt"),
    (["zzz", "app"], False, "interpreter prompt ", 22, "app"),
    (["– S"], False, "interpreter prompt appears\n\n* **PEP 634** ", 47, "– S"),   # "–" is 3 bytes: 3 tokens
    (["– S"], True, "interpreter prompt appears\n\n* **PEP 634** – S", 47, "– S"),
    ("\n\n", False, "interpreter prompt appears", 28, "\n\n"),    # a str is one stop string
    (["ears", "pears"], False, "interpreter prompt app", 26, "ears"),   # both end at token 26: the first
    (["pears", "ears"], False, "interpreter prompt ap", 26, "pears"),   # listed wins (vLLM)
])
def test_stop_strings_cut_the_text_where_vllm_cuts_it(demo, stop, include, text, num_tokens, reason):
    out = demo.generate("The ", SamplingParams(max_tokens=64, temperature=0.0, stop=stop,
                                                include_stop_str_in_output=include))[0].outputs[0]
    assert (out.text, len(out.token_ids), out.finish_reason, out.stop_reason) == (text, num_tokens, "stop", reason)
    free = demo.generate("The ", SamplingParams(max_tokens=num_tokens, temperature=0.0))[0].outputs[0]
    assert free.token_ids == out.token_ids      # a stop string changes no token, it ends the request


def test_min_tokens_delays_stop_strings(demo):
    """Stop strings are searched only once more than min_tokens tokens are out, and only where they
    end in text the later tokens added (vLLM): "in" ends at token 2, "pr" at token 7."""
    early = demo.generate("The ", SamplingParams(max_tokens=64, temperature=0.0, stop=["in", "pr"]))[0].outputs[0]
    assert (early.text, early.stop_reason, len(early.token_ids)) == ("", "in", 2)
    late = demo.generate("The ", SamplingParams(max_tokens=64, temperature=0.0, stop=["in", "pr"],
                                                min_tokens=5))[0].outputs[0]
    assert (late.text, late.stop_reason, len(late.token_ids)) == ("inter", "pr", 7)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    """With min_tokens=m the EOS ids and stop_token_ids get logit -inf for the first m outputs (a
    logits mask: the greedy row takes the runner-up; the logprobs stay raw, so the masked token is
    still the top-1 entry), and stop the request from then on."""
    with small_llm("tiny-bamba") as llm:
        free = lone(llm, PROMPT, max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True).outputs[0]
        first = free.token_ids[0]
        stopped = lone(llm, PROMPT, max_tokens=8, temperature=0.0, stop_token_ids=[first]).outputs[0]
        assert (stopped.token_ids, stopped.finish_reason, stopped.stop_reason) == ([first], "stop", first)
        held = lone(llm, PROMPT, max_tokens=8, temperature=0.0, stop_token_ids=[first], min_tokens=3,
                    logprobs=1).outputs[0]
        assert first not in held.token_ids[:3] and held.token_ids[0] != first
        d = held.logprobs[0]
        assert d[held.token_ids[0]].rank == 2 and list(d)[1] == first and d[first].rank == 1
        assert held.finish_reason == "length" or held.token_ids[-1] == first
        # EOS: the same, through the engine's EOS ids (here the first greedy token stands in for EOS)
        llm.eos_token_ids = (first,)
        eos_stop = lone(llm, PROMPT, max_tokens=8, temperature=0.0).outputs[0]
        assert (eos_stop.token_ids, eos_stop.finish_reason, eos_stop.stop_reason) == ([first], "stop", None)
        eos_held = lone(llm, PROMPT, max_tokens=8, temperature=0.0, min_tokens=4).outputs[0]
        assert first not in eos_held.token_ids[:4] and len(eos_held.token_ids) >= 4
        sampled = lone(llm, PROMPT, max_tokens=8, temperature=5.0, seed=3, min_tokens=8).outputs[0]
        assert first not in sampled.token_ids and len(sampled.token_ids) == 8


# ---- n ---------------------------------------------------------------------------------------------------
def test_n_samples_fork_the_prefill_and_each_equals_a_lone_request_with_its_seed(bamba):
    """n=3, seed 7, beside another request: the parent prefills the first 39 of its 40 prompt
    tokens once (16-token chunks); its 3 children copy its KV blocks and state page and each runs
    the last prompt token; child i's tokens and logprobs are those of a lone request with seed 7 + i,
    and the prompt logprobs those of a lone request."""
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3, logprobs=2, prompt_logprobs=1,
                            ignore_eos=True)
    start = len(bamba.trace)
    outs = bamba.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:7]}],
                          [params, SamplingParams(max_tokens=4, temperature=0.0)])
    out = outs[0]
    parent = out.request_id
    assert [c.index for c in out.outputs] == [0, 1, 2] and len(outs[1].outputs) == 1
    records = bamba.trace[start:]
    parent_rows = [s for r in records for s in r.scheduled if s.request_id == parent]
    assert sum(s.num_tokens for s in parent_rows) == len(PROMPT) - 1          # prefilled once
    children = [f"{i}_{parent}" for i in range(3)]
    first = [next(s for r in records for s in r.scheduled if s.request_id == c) for c in children]
    assert all((s.num_computed_before, s.num_tokens, s.runs_as_decode) == (39, 1, True) for s in first)
    fork_step = next(r for r in records if children[0] in r.request_ids)
    held = [fork_step.ledger.holdings[c] for c in children]
    assert len({b for h in held for b in h[0]}) == 3 * 3 and parent not in fork_step.ledger.holdings
    lones = [lone(bamba, PROMPT, max_tokens=6, temperature=1.0, seed=7 + i, logprobs=2, prompt_logprobs=1,
                  ignore_eos=True) for i in range(3)]
    for c, ref in zip(out.outputs, lones, strict=True):
        assert c.token_ids == ref.outputs[0].token_ids
        for a, b in zip(c.logprobs, ref.outputs[0].logprobs, strict=True):
            assert list(a) == list(b) and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for a, b in zip(out.prompt_logprobs[1:], lones[0].prompt_logprobs[1:], strict=True):
        assert list(a) == list(b) and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)
    stats = bamba.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["runner_rows_in_use"] == 0


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_every_cache_layout_forks(preset):
    """Each architecture's caches (paged K/V, Mamba1 / Mamba2 / short-conv / Gated DeltaNet states,
    Zamba2's shared-attention K/V, ...) fork: n=3 after a 2-chunk prefill, child 0 and 1 copied,
    child 2 taking the parent's ids over; each child equals a lone request with its seed."""
    with small_llm(preset, max_num_batched_tokens=16, inspect="off") as llm:
        prompt = PROMPT[:25]
        out = lone(llm, prompt, max_tokens=4, temperature=1.0, seed=3, n=3, logprobs=0, ignore_eos=True)
        for c in out.outputs:
            ref = lone(llm, prompt, max_tokens=4, temperature=1.0, seed=3 + c.index, logprobs=0,
                       ignore_eos=True).outputs[0]
            assert c.token_ids == ref.token_ids, c.index
            for a, b, t in zip(c.logprobs, ref.logprobs, c.token_ids, strict=True):
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)


def test_greedy_n_and_one_token_prompts(bamba):
    greedy = lone(bamba, PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True).outputs[0].token_ids
    out = lone(bamba, PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True, n=2)
    assert [c.token_ids for c in out.outputs] == [greedy, greedy]
    one = lone(bamba, [9], max_tokens=4, temperature=1.0, seed=3, n=2, ignore_eos=True)     # nothing to share
    assert [c.token_ids for c in one.outputs] == [
        lone(bamba, [9], max_tokens=4, temperature=1.0, seed=3 + i, ignore_eos=True).outputs[0].token_ids
        for i in range(2)]


def test_a_fork_that_stalls_the_queue_lets_go_of_the_parent():
    """7 KV blocks, 2 rows and state pages, n=3: the parent keeps its 3 blocks and its slot while
    child 0 (a copy) runs and children 1 and 2 wait for a slot; child 0 grows to the last free
    block and preempts itself, and with nothing running the queue's head needs the parent's blocks:
    the parent lets go, and children 1 and 2 prefill from scratch. Every sample still equals a lone
    request with its seed, and nothing leaks."""
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=11, n=3, ignore_eos=True)
    with small_llm("tiny-bamba", max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=8) as llm:
        rid = llm.add_request({"prompt_token_ids": PROMPT}, params)
        outs, records = {}, []
        while llm.has_unfinished_requests():
            records.append(llm.step())
            outs.update({o.request_id: o for o in records[-1].outputs})
        first = {i: next(s for r in records for s in r.scheduled if s.request_id == f"{i}_{rid}") for i in range(3)}
        assert [first[i].num_computed_before for i in range(3)] == [39, 0, 0]     # forked; let go
        assert any(f"0_{rid}" in r.preempted_request_ids for r in records)
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["state_pages_free"] == stats["state_pages_total"]
    with small_llm("tiny-bamba") as roomy:
        for c in outs[rid].outputs:
            assert c.token_ids == lone(roomy, PROMPT, max_tokens=60, temperature=1.0, seed=11 + c.index,
                                       ignore_eos=True).outputs[0].token_ids


def test_aborting_an_n_request_aborts_its_samples(bamba):
    rid = bamba.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=20, n=3, seed=1))
    while f"0_{rid}" not in bamba.step().request_ids:
        pass
    assert bamba.abort_request(rid) is True
    assert not bamba.has_unfinished_requests()
    stats = bamba.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["runner_rows_in_use"] == 0
    assert bamba.abort_request(rid) is False and bamba.abort_request(f"1_{rid}") is False
    with pytest.raises(Exception, match="finished"):
        bamba.add_request({"prompt_token_ids": [5]}, request_id=rid)


# ---- check_logprobs_close ----------------------------------------------------------------------------------
def test_check_logprobs_close_follows_vllms_rule():
    def lp(*pairs):
        return {t: Logprob(v) for t, v in pairs}
    ref = ([1, 2, 3], [lp((1, -0.1), (5, -2.0)), lp((2, -0.5), (4, -0.6)), lp((3, -0.2), (6, -3.0))])
    same = check_logprobs_close([ref], [ref], k=2)
    assert same.ok and same.num_positions == 3 and not same.divergences
    # position 1: tokens part (2 vs 4) but each is in the other's top-2: accepted, comparison stops
    parted = ([1, 4, 9], [lp((1, -0.1), (5, -2.0)), lp((4, -0.5), (2, -0.55)), lp((9, -0.1))])
    report = check_logprobs_close([ref], [parted], name_0="hf", name_1="ours", k=2)
    assert report.ok and report.divergences == [(0, 1)] and "parted" in str(report)
    # token 4 is not in ours' top-1 at position 1: the first failure, named
    report = check_logprobs_close([ref], [parted], name_0="hf", name_1="ours", k=1)
    assert not report.ok and (report.failure.sequence, report.failure.position) == (0, 1)
    assert "ours's token 4 is not in hf's top-1 [2]" in str(report)
    with pytest.raises(AssertionError, match="position 1"):
        report.raise_if_failed()
    # tensors (logits or logprobs) and the atol comparison of the chosen tokens' logprobs
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.9]])
    lps = torch.log_softmax(logits, -1)
    near = ([0, 1], [{0: lps[0, 0].item() + 5e-5}, {1: lps[1, 1].item()}])
    assert check_logprobs_close([([0, 1], logits)], [near], k=2, atol=1e-4).ok
    off = check_logprobs_close([([0, 1], logits)], [near], k=2, atol=1e-5)
    assert not off.ok and off.failure.position == 0 and "5.0" in off.failure.message
