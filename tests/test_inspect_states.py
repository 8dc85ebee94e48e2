"""Acceptance of `LLM(inspect="full")`: the recurrent states recorded in `StepRecord.states`.

One mixed workload per model (chunked prefill, decode and prefill rows in one step, a one-token
prompt, a prompt shorter than the conv window, a one-token prompt chunk run as a decode, a state
slot reused after its request finished), stepped by hand with `llm.step()`. Checked:

1. shape of the records: every recurrent layer, every row, batch order, the ledger's slots;
2. continuity: a request's "after" state at one step is bit-identical to its "before" state at
   its next step, and its "before" state at its first step is all zeros (a reused slot too);
3. the "after" state equals the state HF transformers' cache holds after a forward over the same
   tokens (prompt + outputs up to `num_computed_before + num_tokens`), fp32, atol 1e-5;
4. a preempted request restarts from a zeroed slot (and still matches HF);
5. `generate()` leaves the same records (schedule and states) in `llm.trace`.

HF transformers 5.x keeps every model's recurrent state in one `DynamicCache(config=...)`: each
Mamba / short-conv layer is a `LinearAttentionLayer` (`cache.layers[i]`, i = block index) whose
state is read with `cache.get_conv_state(i)` and `cache.get_recurrent_state(i)`:
- conv state `[batch, conv_dim, K]`: the last K inputs of the causal conv, oldest first, left
  zero-padded when fewer than K tokens were seen. Ours is `(K-1, conv_dim)`, the last K-1 inputs
  (the oldest of HF's K columns never reaches an output again): ours == hf[0, :, 1:].T.
- ssm state: Mamba2 / Bamba `[batch, H, P, N]`, Mamba1 / Falcon-Mamba / Jamba `[batch, d_inner,
  N]`: ours without the batch dimension. LFM2's short conv has no recurrent state.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from toolkit import LLM, SamplingParams
from toolkit.inspect.step_record import StepRecord
from toolkit.layers.state_mixer import StateSlotMixer
from toolkit.models import PRESETS as PRESET_CONFIGS
from toolkit.models import save_hf_folder

from harness import NO_ATTENTION

# ids that say which presets are run: the four asked for, then the three cheap extras, then the
# hybrids built without any attention layer (HF-initialised folders, see harness.NO_ATTENTION)
MODELS = ["tiny-mamba2", "tiny-mamba", "tiny-lfm2", "tiny-bamba", "tiny-jamba", "tiny-falcon-mamba",
          "tiny-lfm2-moe", "no-attention:tiny-jamba", "no-attention:tiny-lfm2"]
MAMBA_TYPES = {"tiny-mamba2": "mamba2", "tiny-mamba": "mamba1", "tiny-lfm2": "short_conv",
               "tiny-bamba": "mamba2", "tiny-jamba": "mamba1", "tiny-falcon-mamba": "mamba1",
               "tiny-lfm2-moe": "short_conv"}
STATE_NAMES = {"mamba1": ["conv_state", "ssm_state"], "mamba2": ["conv_state", "ssm_state"],
               "short_conv": ["conv_state"]}
STATE_ATOL = 1e-5
# HF hybrids get explicit position_ids, and, when the config has no attention layer at all, a
# precomputed mask mapping ({layer type: None}; batch 1, no padding). Without both, transformers
# 5.x's Jamba and LFM2 forwards with a cache raise "ValueError: `get_seq_length` can only be
# called on Attention layers, and the current Cache seem to only contain LinearAttention layers."
# (JambaModel/Lfm2Model.forward -> cache.get_seq_length() for the positions, and
# create_causal_mask -> cache.get_query_offset -> get_seq_length for the masks).
HF_HYBRIDS = ("bamba", "jamba", "lfm2", "lfm2_moe")
# with max_num_seqs=3 and max_num_batched_tokens=8 (scheduled as `test_workload_covers_the_cases`
# asserts): "1" (11 tokens) is prefilled in chunks 5 + 6 beside decode rows; "2" is a one-token
# prompt, shorter than any conv window; "3" waits for a slot, takes the finished "0"'s slot and
# runs its last prompt token as a one-token chunk on existing state (a decode row)
PROMPT_LENS = (3, 11, 1, 7)
MAX_TOKENS = 6
ENGINE = dict(device="cpu", dtype="float32", inspect="full", max_num_seqs=3, max_num_batched_tokens=8)


def prompt_of(i: int, n: int, vocab: int) -> list[int]:
    return [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(n)]


def block_index(layer_name: str) -> int:
    """'model.layers.2.mamba' -> 2."""
    return int(layer_name.split("layers.")[1].split(".")[0])


@dataclass
class Workload:
    model: str
    folder: str                                         # HF folder holding the same weights
    records: list[StepRecord]
    tokens: dict[str, list[int]]                        # request id -> prompt + outputs
    prompt_lens: dict[str, int]
    recurrent_layers: dict[str, StateSlotMixer]         # layer name -> our mixer
    conv_widths: dict[str, int]                         # layer name -> K (conv kernel size)
    seconds: float = 0.0                                # engine wall time

    def steps_of(self, rid: str) -> list[tuple[StepRecord, int]]:
        """(record, row of the request in it) for every step that scheduled the request."""
        return [(r, r.request_ids.index(rid)) for r in self.records if rid in r.request_ids]


def build_folder(model: str, folder) -> str | None:
    """The HF folder a `no-attention:` model is loaded from (None for a preset)."""
    if not model.startswith("no-attention:"):
        return None
    preset = model.split(":", 1)[1]
    cfg = PRESET_CONFIGS[preset]()
    cfg = type(cfg)(**{**cfg.to_dict(), **NO_ATTENTION[preset]})
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return str(folder)


def conv_kernel_size(mixer: StateSlotMixer) -> int:
    return mixer.state_shapes()[0][0] + 1


def serve_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list, dict[str, list[int]]]:
    """Serve `prompts` greedily to the end: every step's record, and each request's prompt + tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [llm.add_request({"prompt_token_ids": p}, params) for p in prompts]
    tokens = {rid: list(p) for rid, p in zip(ids, prompts)}
    records = []
    while llm.has_unfinished_requests():
        rec = llm.step()
        records.append(rec)
        for rid, tok in rec.kept_token_ids.items():
            tokens[rid].append(tok)
    return records, tokens


def run_workload(model: str, source: str, folder: str, prompt_lens=PROMPT_LENS, max_tokens=MAX_TOKENS,
                 **engine) -> Workload:
    """Step `prompt_lens` requests (greedy, `max_tokens` each) through `LLM(source, **ENGINE,
    **engine)` until done; save the weights as an HF folder at `folder`."""
    start = time.perf_counter()
    with LLM(source, **{**ENGINE, **engine}) as llm:
        prompts = [prompt_of(i, n, llm.vocab_size) for i, n in enumerate(prompt_lens)]
        records, tokens = serve_greedy(llm, prompts, max_tokens)
        mixers = {m.layer_name: m for m in llm.model_runner.model.modules() if isinstance(m, StateSlotMixer)}
        save_hf_folder(llm, folder)
    assert all(len(t) == len(p) + max_tokens for t, p in zip(tokens.values(), prompts))
    return Workload(model, folder, records, tokens, {rid: len(p) for rid, p in zip(tokens, prompts)}, mixers,
                    {n: conv_kernel_size(m) for n, m in mixers.items()}, time.perf_counter() - start)


@pytest.fixture(scope="module", params=MODELS)
def workload(request, tmp_path_factory) -> Workload:
    model = request.param
    source = build_folder(model, tmp_path_factory.mktemp("src")) or model
    return run_workload(model, source, str(tmp_path_factory.mktemp("hf")))


# ---- 1. what is recorded ---------------------------------------------------------------------

def test_workload_covers_the_cases(workload):
    """The schedule this file's checks rely on (if the scheduler changes, pick new PROMPT_LENS)."""
    rows = [(r, s) for r in workload.records for s in r.scheduled]
    assert all(len(t) == workload.prompt_lens[rid] + MAX_TOKENS for rid, t in workload.tokens.items())
    assert any(s.is_prefill and s.num_computed_before > 0 and s.num_tokens > 1 for _, s in rows), \
        "no continuing prefill chunk"
    assert any(r.num_decodes and r.num_prefills for r in workload.records), "no mixed decode+prefill step"
    assert any(s.is_prefill and s.runs_as_decode for _, s in rows), "no one-token prompt chunk on state"
    assert any(s.is_prefill and s.num_computed_before == 0 and s.num_tokens == 1 for _, s in rows), \
        "no one-token prompt"
    first_slots = {}
    for r in workload.records:
        for rid, slot in zip(r.states[0].request_ids, r.states[0].slots):
            first_slots.setdefault(rid, slot)
    assert len(set(first_slots.values())) < len(first_slots), f"no state page reused: {first_slots}"


def test_states_cover_every_recurrent_layer_and_row(workload):
    names = list(workload.recurrent_layers)
    assert names, "model has no recurrent layer"
    for rec in workload.records:
        assert [s.layer_name for s in rec.states] == names, f"step {rec.step_index}"
        for st in rec.states:
            mixer = workload.recurrent_layers[st.layer_name]
            want_type = MAMBA_TYPES.get(workload.model.split(":")[-1])
            assert st.mamba_type == want_type
            assert st.state_names == STATE_NAMES[want_type] == list(mixer.state_names)
            assert st.request_ids == rec.request_ids == rec.input_batch.req_ids
            assert len(st.slots) == len(st.request_ids) and 0 not in st.slots
            for rid, slot in zip(st.request_ids, st.slots):
                if rid not in rec.finished_request_ids:   # a finished request's slot is freed
                    assert rec.ledger.state_page(rid) == slot, (rec.step_index, rid)
            for when in ("before", "after"):
                tensors = getattr(st, when)
                assert len(tensors) == len(st.state_names)
                for t, shape in zip(tensors, mixer.state_shapes()):
                    assert tuple(t.shape) == (len(st.request_ids), *shape)
                    assert t.dtype == torch.float32 and torch.isfinite(t).all()
                for row, rid in enumerate(st.request_ids):
                    got = st.of(rid, when)
                    assert list(got) == st.state_names
                    assert all(torch.equal(got[n], t[row]) for n, t in zip(st.state_names, tensors))


# ---- 2. continuity ---------------------------------------------------------------------------

def check_continuity(workload: Workload) -> int:
    """Per request: one state page per run; 'before' is zero at each step that starts from no
    cached token (its first step, or its first after a preemption), else bit-identical to the
    'after' of its previous step, which covered exactly the tokens before this one; every step
    changes the conv state (but layer 0's over a window of the same token ids). Returns the number of
    state tensors checked."""
    checked = 0
    for rid in workload.tokens:
        steps = workload.steps_of(rid)
        assert steps, rid
        prev = None
        for rec, row in steps:
            s = rec.scheduled[row]
            for st in rec.states:
                before, after = st.of(rid, "before"), st.of(rid, "after")
                for n in st.state_names:
                    where = f"request {rid} step {rec.step_index} {st.layer_name} {n}"
                    if s.num_computed_before == 0:
                        assert not before[n].any(), f"{where}: 'before' at a fresh start is not zero"
                    else:
                        assert prev is not None, f"{where}: first step with {s.num_computed_before} cached"
                        p_rec, p_row = prev
                        p_s = p_rec.scheduled[p_row]
                        assert p_s.num_computed_before + p_s.num_tokens == s.num_computed_before
                        assert p_rec.states[0].slots[p_row] == st.slots[row], f"{where}: slot changed"
                        p_after = p_rec.state(st.layer_name).of(rid, "after")[n]
                        assert torch.equal(p_after, before[n]), (
                            f"{where}: 'before' != 'after' at step {p_rec.step_index} "
                            f"(max diff {(p_after - before[n]).abs().max().item():.3e})")
                    checked += 1
                # layer 0's conv state is a function of its window's token ids alone: the same ids
                # (a greedy model repeating a token) give the same state, rightly
                k, c, n = workload.conv_widths[st.layer_name], s.num_computed_before, s.num_tokens
                ids = workload.tokens[rid]
                same_window = block_index(st.layer_name) == 0 and c >= k - 1 and \
                    ids[c - (k - 1):c] == ids[c + n - (k - 1):c + n]
                assert same_window or not torch.equal(before["conv_state"], after["conv_state"]), \
                    f"request {rid} step {rec.step_index} {st.layer_name}: conv state unchanged"
            prev = (rec, row)
    return checked


def test_after_is_next_before_and_first_before_is_zero(workload):
    for rid in workload.tokens:    # no preemption here: a fresh start only at the first step
        assert [rec.scheduled[row].num_computed_before == 0 for rec, row in workload.steps_of(rid)
                ].count(True) == 1, rid
    assert check_continuity(workload) > 0


def test_short_prefix_conv_state_is_left_zero_padded(workload):
    """After n < K-1 tokens, the oldest K-1-n rows of the conv window are zeros (HF pads the same)."""
    seen = 0
    for rid in workload.tokens:
        for rec, row in workload.steps_of(rid):
            s = rec.scheduled[row]
            n = s.num_computed_before + s.num_tokens
            for st in rec.states:
                k = workload.conv_widths[st.layer_name]
                if n < k - 1:
                    conv = st.of(rid, "after")["conv_state"]
                    assert not conv[: k - 1 - n].any() and conv[k - 1 - n:].abs().sum(-1).all()
                    seen += 1
    assert seen > 0


# ---- 3. against HF transformers' cache ---------------------------------------------------------

def hf_states(hf, tokens: list[int], layer_idx: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """One fresh-cache forward over `tokens`; per block index, HF's conv and ssm state in our
    layout (conv [K-1, conv_dim]; ssm without the batch dimension; no ssm for a short conv)."""
    cache = DynamicCache(config=hf.config)
    kwargs = {}
    if hf.config.model_type in HF_HYBRIDS:
        kwargs["position_ids"] = torch.arange(len(tokens))[None]
        layer_types = list(hf.config.layer_types)
        if "full_attention" not in layer_types:   # no attention layer: precomputed (no) masks
            kwargs["attention_mask"] = dict.fromkeys(layer_types)
    with torch.inference_mode():
        out = hf(torch.tensor([tokens]), cache=cache, use_cache=True, **kwargs)
    assert out.cache is cache
    states = {}
    for i in layer_idx:
        layer = cache.layers[i]
        assert isinstance(layer, LinearAttentionCacheLayerMixin), f"layer {i}: {type(layer).__name__}"
        conv = cache.get_conv_state(i)                         # [1, conv_dim, K]
        assert conv is not None and conv.shape[0] == 1
        states[i] = {"conv_state": conv[0, :, 1:].transpose(0, 1), "conv_oldest": conv[0, :, 0]}
        ssm = cache.get_recurrent_state(i)
        if ssm is not None:
            states[i]["ssm_state"] = ssm[0]
    return states


@pytest.fixture(scope="module")
def hf_model(workload):
    hf = AutoModelForCausalLM.from_pretrained(workload.folder, dtype=torch.float32).eval()
    return hf


def check_against_hf(workload: Workload, hf) -> tuple[int, dict[str, float]]:
    """Every step's 'after' state of every request and layer vs HF's cache after a fresh forward
    over the same tokens. Returns (state tensors compared, worst |diff| per state name)."""
    idx = [block_index(n) for n in workload.recurrent_layers]
    worst: dict[str, float] = {}
    compared = 0
    for rid, tokens in workload.tokens.items():
        for rec, row in workload.steps_of(rid):
            s = rec.scheduled[row]
            n = s.num_computed_before + s.num_tokens
            ref = hf_states(hf, tokens[:n], idx)
            for st in rec.states:
                want = ref[block_index(st.layer_name)]
                got = st.of(rid, "after")
                k = workload.conv_widths[st.layer_name]
                assert set(st.state_names) == set(want) - {"conv_oldest"}, (st.layer_name, list(want))
                # HF keeps K columns; the oldest is input n-K (zero while n < K)
                assert want["conv_state"].shape == (k - 1, got["conv_state"].shape[1])
                if n < k:
                    assert not want["conv_oldest"].any()
                for name in st.state_names:
                    assert got[name].shape == want[name].shape, (name, got[name].shape, want[name].shape)
                    diff = (got[name] - want[name]).abs().max().item()
                    worst[name] = max(worst.get(name, 0.0), diff)
                    assert diff <= STATE_ATOL, (
                        f"request {rid} step {rec.step_index} ({n} tokens) {st.layer_name} {name}: "
                        f"max |ours - HF| {diff:.3e}")
                    compared += 1
    return compared, worst


def test_after_matches_hf_cache(workload, hf_model):
    start = time.perf_counter()
    compared, worst = check_against_hf(workload, hf_model)
    print(f"\n{workload.model}: {compared} state tensors match HF (worst {worst}); "
          f"engine {workload.seconds:.2f}s, HF {time.perf_counter() - start:.2f}s")
    assert compared > 0


# ---- 4. preemption (recompute) ---------------------------------------------------------------

def test_preempted_request_restarts_from_zero_state(tmp_path):
    """tiny-bamba with a KV cache too small for all three requests: a preempted request is
    recomputed from a zeroed slot ('before' all zeros at its restart), continuity holds within each
    run, and every step's 'after' still matches HF's cache."""
    work = run_workload("tiny-bamba", "tiny-bamba", str(tmp_path), prompt_lens=(6, 9, 5), max_tokens=8,
                        block_size=4, num_kv_blocks=8)
    preempted = {rid for rec in work.records for rid in rec.preempted_request_ids}
    restarted = {rid for rid in preempted
                 if sum(rec.scheduled[row].num_computed_before == 0 for rec, row in work.steps_of(rid)) > 1}
    assert restarted, f"no request was preempted and recomputed (preempted: {preempted})"
    assert check_continuity(work) > 0
    hf = AutoModelForCausalLM.from_pretrained(work.folder, dtype=torch.float32).eval()
    compared, _ = check_against_hf(work, hf)
    assert compared > 0


# ---- 5. generate() records the same states -----------------------------------------------------

def test_generate_records_the_same_states_in_the_trace(tmp_path):
    """`llm.generate()` puts full-mode records in `llm.trace` (stage "generate"); with the same
    requests they hold the same schedule and bit-identical states as stepping by hand."""
    work = run_workload("tiny-bamba", "tiny-bamba", str(tmp_path))
    with LLM("tiny-bamba", **ENGINE) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        prompts = [prompt_of(i, n, llm.vocab_size) for i, n in enumerate(PROMPT_LENS)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        records = list(llm.trace.by_stage("generate"))
    assert [o.prompt_token_ids + o.outputs[0].token_ids for o in outs] == list(work.tokens.values())
    assert [r.request_ids for r in records] == [r.request_ids for r in work.records]
    for got, want in zip(records, work.records):
        assert [s.layer_name for s in got.states] == [s.layer_name for s in want.states]
        for a, b in zip(got.states, want.states):
            assert a.slots == b.slots and a.state_names == b.state_names
            for when in ("before", "after"):
                assert all(torch.equal(x, y) for x, y in zip(getattr(a, when), getattr(b, when))), \
                    (got.step_index, a.layer_name, when)
