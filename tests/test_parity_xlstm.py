"""xLSTM (`xLSTMForCausalLM`: attention-free mLSTM blocks, a SwiGLU FFN, soft-capped gates and logits)
reproduces HF transformers 5.24, for the preset and an HF-initialised checkpoint: the model
(`ModelParitySuite`), config variants (with the gate projections HF zero-initialises made random), the
engine against HF's generate (`RunnerParityChecks`) and with a request preempted and recomputed, the
mLSTM ops against HF's own kernels (chunkwise and recurrent, from non-zero initial states) and
token by token (verify rows, checkpoints), the state after a prefill against HF's xLSTMCache,
speculative decoding, cache mode "all", tensor parallelism by heads, the Triton backend (its mLSTM
kernels, kernels/mlstm.py: the same tokens, logits within 1e-4) and the checkpoint layout both ways.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.xlstm import modeling_xlstm as hf_xlstm

from toolkit import LLM, SamplingParams
from toolkit.distributed import SINGLE, TPGroup
from toolkit.errors import UnsupportedArchitectureError
from toolkit.inspect.compare_hf import compare_with_hf
from toolkit.kernels.mlstm_ref import mlstm_prefill_at_slots, mlstm_step, mlstm_update_at_slots
from toolkit.kernels.state_slots_ref import Checkpoints
from toolkit.kv_cache_spec import MambaSpec
from toolkit.layers.mlstm import MLSTMLayer
from toolkit.models import PRESETS, get_model_class, load_model, save_hf_folder
from toolkit.models.tensor_parallel import shard_model
from toolkit.models.xlstm import xLSTMForCausalLM

from harness import (
    BATCH_LIMITS,
    BATCH_PROMPT_LENS,
    DEVICE,
    F32,
    MAX_TOKENS,
    ScriptedProposer,
    hf_greedy,
    load_hf,
    prompts_of,
    run_by_hand,
)
from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    allocate_caches,
    assert_close,
    check_bf16_load_runs,
    one_seq_metadata,
    random_prompt,
    run_steps,
    save_bf16_checkpoint,
    saved_both_ways,
)

ARCH = "tiny-xlstm"
LAYERS = ["backbone.blocks.0.mlstm_layer", "backbone.blocks.1.mlstm_layer"]
STATE_TOL = dict(atol=1e-5, rtol=1e-5)


def hf_random_gates(cfg, folder, seed: int = 11) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(HF model (eval), our model loaded from its save_pretrained folder): HF-initialised, then every
    projection HF zeroes ("gate" in its name) N(0, 0.1), input gate biases N(0, 1), forget gate biases
    2 + N(0, 0.5), other biases N(0, 0.1)."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "gate" in name and name.endswith(".weight"):
                p.normal_(0.0, 0.1)
            elif name.endswith("igate_preact.bias"):
                p.normal_(0.0, 1.0)
            elif name.endswith("fgate_preact.bias"):
                p.normal_(2.0, 0.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    hf.save_pretrained(folder)
    return hf, load_model(str(folder), dtype=torch.float32, device="cpu").model


def _variant_hf_caps_square_qk():
    """HF's default soft caps (gates 15, logits 30) and qk_dim_factor 1.0 (q/k heads as wide as v's)."""
    cfg = PRESETS[ARCH]()
    cfg.gate_soft_cap, cfg.output_logit_soft_cap, cfg.qk_dim_factor = 15.0, 30.0, 1.0
    return cfg


def _variant_biases_tie_flag_4_heads():
    """use_bias (every projection and norm), norms reducing in the input dtype, tie_word_embeddings
    (which HF does not honour: its lm_head stays its own), 4 heads, v_dim_factor 0.5, eps 1e-3."""
    cfg = PRESETS[ARCH]()
    cfg.use_bias, cfg.norm_reduction_force_float32, cfg.tie_word_embeddings = True, False, True
    cfg.num_heads, cfg.v_dim_factor, cfg.eps = 4, 0.5, 1e-3
    return cfg


class TestXLSTM(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (ARCH,)
    VARIANTS = {"hf-caps-square-qk": _variant_hf_caps_square_qk,
                "biases-tie-flag-4-heads": _variant_biases_tie_flag_4_heads}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert set(ours.state_dict()) == set(hf.state_dict())        # HF's names, nothing derived
        assert not ours.is_tied and ours.is_attention_free
        assert [b.layer_type for b in ours.backbone.layers] == ["mlstm", "mlstm"]

    def check_variant(self, variant: str, ours) -> None:
        layer = ours.backbone.blocks[0].mlstm_layer
        if variant == "hf-caps-square-qk":
            assert layer.state_shapes() == ((2, 64, 64), (2, 64), (2,)) and layer.gate_soft_cap == 15.0
        else:
            assert layer.state_shapes() == ((4, 16, 16), (4, 16), (4,)) and layer.multihead_norm.bias is not None
            assert not ours.is_tied

    @torch.no_grad()
    def test_config_variants_match_hf(self, variant, tmp_path):
        """ConfigVariantChecks' check on a checkpoint whose gate projections are random (HF's init zeroes
        them, under which the FFN and the gates' inputs add nothing)."""
        hf, ours = hf_random_gates(self.VARIANTS[variant](), tmp_path)
        self.check_variant(variant, ours)
        seq = self.hf_continue(hf, random_prompt(self.VARIANT_PROMPT_SEED), 2)
        assert_close(run_steps(ours, seq, [10, 17, 10, 1, 1]), self.hf_logits(hf, seq))


def test_cache_specs_and_builder():
    assert get_model_class(PRESETS[ARCH]()) is xLSTMForCausalLM
    m = load_model(ARCH, dtype=torch.bfloat16, device="cpu").model
    spec = MambaSpec(shapes=((2, 32, 64), (2, 32), (2,)), dtypes=(torch.float32,) * 3, mamba_type="mlstm")
    assert m.kv_cache_specs() == dict.fromkeys(LAYERS, spec)
    layer = m.backbone.blocks[0].mlstm_layer
    assert isinstance(layer, MLSTMLayer) and layer.state_names == ("C_state", "n_state", "m_state")
    assert layer.prefill_checkpoint_alignment() == 1
    with LLM(ARCH, **F32, max_num_seqs=2) as llm:
        runner = llm.model_runner
        assert [(g.kind, type(a.builder).__name__) for g, a in zip(runner.kv_cache_groups, runner.attn_groups)] == [
            ("mamba", "MLSTMMetadataBuilder")]


def test_fused_weight_mode_and_mismatched_embedding_dim_are_refused():
    cfg = PRESETS[ARCH]()
    cfg.weight_mode = "fused"
    with pytest.raises(UnsupportedArchitectureError, match="weight_mode 'fused' is not supported"):
        xLSTMForCausalLM(cfg)
    cfg = PRESETS[ARCH]()
    cfg.embedding_dim = 64
    with pytest.raises(ValueError, match="embedding_dim"):
        xLSTMForCausalLM(cfg)


# ---- the ops ------------------------------------------------------------------------------------
def _inputs(t: int, h: int = 2, dk: int = 8, dv: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, h, dk, generator=g), torch.randn(t, h, dk, generator=g)
    v = torch.randn(t, h, dv, generator=g)
    i, f = 2 * torch.randn(t, h, generator=g), 2 + torch.randn(t, h, generator=g)
    return q, k, v, i, f


def _caches(slots: int, h: int = 2, dk: int = 8, dv: int = 16, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Random states (m anywhere: a running state's stabiliser is any real)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, h, dk, dv, generator=g), torch.randn(slots, h, dk, generator=g),
            torch.randn(slots, h, generator=g))


@torch.no_grad()
def test_prefill_op_matches_hfs_kernels_from_initial_states():
    """mlstm_prefill over 3 sequences (two from their slots' states, one fresh) equals HF's inference
    path per sequence (chunks of 4 by `mlstm_chunkwise_native_autograd`, the tail by the recurrent
    kernels): outputs and final states."""
    lens, slots, has_init = [11, 2, 17], [3, 1, 4], [True, False, True]
    q, k, v, i, f = _inputs(sum(lens))
    caches = _caches(6)
    before = tuple(c.clone() for c in caches)
    cu = torch.tensor([0, 11, 13, 30], dtype=torch.int32)
    h = mlstm_prefill_at_slots(q, k, v, i, f, cu, *caches, torch.tensor(slots, dtype=torch.int32),
                               torch.tensor(has_init), eps=1e-6)
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        init = {}
        if has_init[s]:
            c0, n0, m0 = (x[slots[s]][None] for x in before)
            init = dict(c_initial=c0, n_initial=n0, m_initial=m0[..., None])
        ref_h, (c, n, m) = hf_xlstm.wrap_chunkwise_arbitrary_sequence_length(
            mlstm_chunkwise_kernel=hf_xlstm.mlstm_chunkwise_native_autograd,
            mlstm_sequence_kernel=hf_xlstm.mlstm_recurrent_sequence_native,
            mlstm_step_kernel=hf_xlstm.mlstm_recurrent_step_native,
            query=q[a:b].transpose(0, 1)[None], key=k[a:b].transpose(0, 1)[None],
            value=v[a:b].transpose(0, 1)[None], igate=i[a:b].T[None], fgate=f[a:b].T[None],
            chunk_size=4, eps=1e-6, **init)
        torch.testing.assert_close(h[a:b], ref_h[0].transpose(0, 1), **STATE_TOL)
        for ours, ref in zip((x[slots[s]] for x in caches), (c[0], n[0], m[0, :, 0])):
            torch.testing.assert_close(ours, ref, **STATE_TOL)
    assert all(torch.equal(x[[0, 2, 5]], y[[0, 2, 5]]) for x, y in zip(caches, before))   # other slots untouched


@torch.no_grad()
def test_decode_op_matches_hfs_step_and_skips_padded_rows():
    q, k, v, i, f = _inputs(3, seed=2)
    caches = _caches(5, seed=3)
    before = tuple(c.clone() for c in caches)
    h = mlstm_update_at_slots(*caches, q, k, v, i, f, torch.tensor([2, -1, 0], dtype=torch.int32))
    assert torch.equal(h[1], torch.zeros_like(h[1]))
    for row, slot in ((0, 2), (2, 0)):
        c0, n0, m0 = (x[slot][None] for x in before)
        ref_h, (c, n, m) = hf_xlstm.mlstm_recurrent_step_native(
            q[row][None], k[row][None], v[row][None], i[row][None, :, None], f[row][None, :, None], c0, n0,
            m0[..., None])
        torch.testing.assert_close(h[row], ref_h[0], **STATE_TOL)
        for ours, ref in zip((x[slot] for x in caches), (c[0], n[0], m[0, :, 0])):
            torch.testing.assert_close(ours, ref, **STATE_TOL)
    assert all(torch.equal(x[[1, 3, 4]], y[[1, 3, 4]]) for x, y in zip(caches, before))


@torch.no_grad()
def test_verify_rows_equal_token_by_token_steps():
    """Verify rows (state columns [R, 1 + k]): row 0 starts from column 1 and runs 3 tokens, row 1 from
    column 0 with 2 tokens, row 2 is padding; the state after token j lands in column j."""
    cols = torch.tensor([[1, 2, 3], [4, 5, 6], [-1, -1, -1]], dtype=torch.int32)
    qsl, accepted = torch.tensor([0, 3, 5, 6], dtype=torch.int32), torch.tensor([2, 1, 1], dtype=torch.int32)
    q, k, v, i, f = _inputs(6, seed=4)
    caches = _caches(8, seed=5)
    before = tuple(c.clone() for c in caches)
    h = mlstm_update_at_slots(*caches, q, k, v, i, f, cols, query_start_loc=qsl, num_accepted_tokens=accepted)
    assert torch.equal(h[5], torch.zeros_like(h[5]))
    for start, tokens, targets in ((2, range(0, 3), (1, 2, 3)), (4, range(3, 5), (4, 5))):
        state = tuple(x[start][None] for x in before)
        for t, slot in zip(tokens, targets):
            y, state = mlstm_step(state, q[t][None], k[t][None], v[t][None], i[t][None], f[t][None])
            torch.testing.assert_close(h[t], y[0], atol=1e-6, rtol=1e-6)
            for ours, ref in zip((x[slot] for x in caches), state):
                torch.testing.assert_close(ours, ref[0], atol=1e-6, rtol=1e-6)
    assert all(torch.equal(x[[0, 6, 7]], y[[0, 6, 7]]) for x, y in zip(caches, before))


@torch.no_grad()
def test_prefill_checkpoints_hold_the_states_after_their_tokens():
    """Checkpoints after token 3 (sequence 0, from its slot's state) and token 9 (sequence 1's 4th,
    from zeros) hold the states the one-token steps reach there; a checkpoint slot of -1 writes nothing."""
    q, k, v, i, f = _inputs(14, seed=6)
    caches = _caches(8, seed=7)
    init = tuple(c.clone() for c in caches)
    cps = Checkpoints(torch.tensor([3, 5, 9]), torch.tensor([5, -1, 6], dtype=torch.int32))
    mlstm_prefill_at_slots(q, k, v, i, f, torch.tensor([0, 6, 14], dtype=torch.int32), *caches,
                           torch.tensor([1, 2], dtype=torch.int32), torch.tensor([True, False]), checkpoints=cps)

    def after(tokens: range, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for t in tokens:
            _, state = mlstm_step(state, q[t][None], k[t][None], v[t][None], i[t][None], f[t][None])
        return state
    for slot, want in ((5, after(range(0, 4), tuple(x[1][None] for x in init))),
                       (6, after(range(6, 10), tuple(torch.zeros_like(x[:1]) for x in init)))):
        for ours, ref in zip((x[slot] for x in caches), want):
            torch.testing.assert_close(ours, ref[0], atol=1e-6, rtol=1e-6)
    assert all(torch.equal(x[[0, 3, 4, 7]], y[[0, 3, 4, 7]]) for x, y in zip(caches, init))


# ---- the model and the engine against HF ------------------------------------------------------------
@torch.no_grad()
def test_state_after_a_prefill_is_hfs_xlstm_cache(tmp_path):
    """C, n and m at the request's slot after its prompt equal HF's xLSTMCache (C, n as they are, m
    without its trailing 1) in both blocks: prompts shorter than HF's chunk of 8, of 2 chunks, and
    of a chunk plus a recurrent tail."""
    hf, _ = hf_random_gates(PRESETS[ARCH](), tmp_path)
    # HF on the engine's device, as the harness runs it (on an H200 our CUDA states were 2.9e-5 from
    # HF's on the CPU, 8e-6 from HF's on CUDA: the two devices round differently)
    hf = hf.to(DEVICE)
    with LLM(str(tmp_path), **F32, inspect="full") as llm:
        for length in (5, 16, 13):
            ids = random_prompt(length, length)
            cache = hf(ids[None].to(DEVICE), use_cache=True).cache
            llm.add_request({"prompt_token_ids": ids.tolist()}, SamplingParams(max_tokens=1))
            rec = llm.step()
            for b, layer in enumerate(LAYERS):
                ours = rec.state(layer).of(rec.request_ids[0], "after")
                c, n, m = cache.rnn_state[b]
                torch.testing.assert_close(ours["C_state"], c[0].cpu(), **STATE_TOL)
                torch.testing.assert_close(ours["n_state"], n[0].cpu(), **STATE_TOL)
                torch.testing.assert_close(ours["m_state"], m[0, :, 0].cpu(), **STATE_TOL)
            while llm.has_unfinished_requests():
                llm.step()


def test_compare_with_hf_maps_every_block():
    """The inspector's layer-by-layer comparison finds HF's block outputs under the same paths
    (backbone.blocks.{i}, backbone.out_norm) and no divergence."""
    with LLM(ARCH, **F32, max_num_seqs=2, max_num_batched_tokens=8) as llm:
        rep = compare_with_hf(llm, prompts_of([13, 6], llm.vocab_size, seed=5))
    assert not rep.diverged, str(rep)
    assert set(rep.per_layer_max_diff) == {"backbone.blocks.0", "backbone.blocks.1", "backbone.out_norm", "logits"}
    assert all(v <= 1e-4 for v in rep.per_layer_max_diff.values()), rep.per_layer_max_diff


def test_a_preempted_request_is_recomputed_and_still_matches_hf(hf_folders):
    """The runner-level batch (chunked, mixed, queued); a request that has decoded is preempted (an
    attention-free model has no KV blocks to run out of: the scheduler is made to) and recomputed
    from its prompt and outputs on a fresh slot; every request's tokens are HF's greedy ones."""
    model, folder = hf_folders(f"hf-random-{ARCH}")
    hf = load_hf(folder)                      # its generate ignores EOS, as the engine's requests do
    with LLM(model, **F32, **BATCH_LIMITS) as llm:
        prompts = prompts_of(BATCH_PROMPT_LENS, llm.vocab_size, seed=1)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        ids = [llm.add_request({"prompt_token_ids": p}, params) for p in prompts]
        outs, victim = {}, None
        while llm.has_unfinished_requests():
            rec = llm.step()
            outs.update({o.request_id: list(o.outputs[0].token_ids) for o in rec.outputs})
            decoding = [r for r in llm.scheduler.running if 0 < len(r.output_token_ids) < MAX_TOKENS - 1]
            if victim is None and decoding:
                victim = decoding[0]
                llm.scheduler._preempt(victim)
        assert victim is not None and victim.num_preemptions == 1
        starts = [s for r in llm.trace for s in r.scheduled
                  if s.request_id == victim.request_id and s.num_computed_before == 0]
        assert len(starts) == 2                     # its first prefill, and its recompute
        assert llm.stats()["state_pages_free"] == llm.stats()["state_pages_total"]
    for rid, prompt in zip(ids, prompts):
        assert outs[rid] == hf_greedy(hf, prompt, MAX_TOKENS), rid


@pytest.mark.parametrize("graphs", ["none", "padded_eager"])
def test_speculative_decoding_equals_plain_decoding(graphs):
    """Verify rows through the engine (scripted drafts, some wrong): the three states advance per
    position, the accepted one is kept (the runtime checks compare each step's states with a cold
    replay); tokens equal a plain run's. "padded_eager": the decode batches padded as a CUDA graph
    runs them (the checks skip the padded rows: on an H200 they once read past the batch's rows)."""
    prompts = prompts_of([30, 17, 9], 320, seed=26)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]
    engine = dict(F32, max_num_seqs=4, max_num_batched_tokens=24, cudagraph_mode=graphs)

    def run(llm: LLM) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    with LLM(ARCH, **engine) as llm:
        plain = run(llm)
    with LLM(ARCH, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, inspect="full", checks=True,
             **engine) as llm:
        llm.model_runner.proposer = ScriptedProposer([p + o for p, o in zip(prompts, plain)], 3)
        assert run(llm) == plain
        stats = llm.stats()
        assert 0 < stats["spec_accepted_drafts"] < stats["spec_draft_tokens"]


def test_cache_mode_all_checkpoints_inside_a_chunk_are_hit():
    """Cache mode "all", blocks of 4, pages enough to evict none: a 25-token prompt prefilled in one chunk
    saves the states after tokens 4, 8, ..., 24 from inside it; a prompt sharing its first 24 tokens
    hits all six blocks (each saved state checked against a cold replay), and every output equals an
    engine without prefix caching."""
    first = prompts_of([25], 320, seed=4)[0]
    second = first[:24] + [7, 8, 9]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = dict(F32, block_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    with LLM(ARCH, **engine) as cold:
        want = [list(cold.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids) for p in (first, second)]
    with LLM(ARCH, enable_prefix_caching=True, mamba_cache_mode="all", num_state_pages=16, inspect="full",
             checks=True, **engine) as warm:
        a = warm.generate({"prompt_token_ids": first}, params)[0]
        b = warm.generate({"prompt_token_ids": second}, params)[0]
    assert [list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)] == want
    assert b.num_cached_tokens == 24


def test_bf16_checkpoint_loads_and_runs(tmp_path):
    hf, stored = save_bf16_checkpoint(ARCH, tmp_path)
    assert stored["backbone.blocks.0.mlstm_layer.q.weight"].dtype == torch.bfloat16
    check_bf16_load_runs(tmp_path)
    m16 = load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu").model
    assert all(d == torch.float32 for spec in m16.kv_cache_specs().values() for d in spec.dtypes)


def test_checkpoint_layout_matches_save_pretrained(tmp_path):
    """HF's names on disk both ways (backbone.blocks.{i}.mlstm_layer / ffn ..., lm_head stored)."""
    hf, ours, on_disk_hf, on_disk_ours = saved_both_ways(ARCH, tmp_path)
    assert sorted(on_disk_ours) == sorted(on_disk_hf)
    assert {k: v.shape for k, v in on_disk_ours.items()} == {k: v.shape for k, v in on_disk_hf.items()}
    assert on_disk_hf["backbone.blocks.1.ffn.proj_up_gate.weight"].shape == (384, 128)
    assert on_disk_hf["backbone.blocks.0.mlstm_layer.q.weight"].shape == (64, 128)
    assert "lm_head.weight" in on_disk_ours
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"))
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in ours.state_dict().items())


# ---- tensor parallelism: by heads ---------------------------------------------------------------------
@torch.no_grad()
def test_two_head_shards_sum_to_the_whole_layer():
    """In one process: each rank's half of an mLSTM layer (its head, out_proj's columns), run on its own
    state shards (no all-reduce), sums to the whole layer's output over a prefill then a decode, and
    its states are the whole layer's states of its head."""
    full = load_model(ARCH, dtype=torch.float32, device="cpu").model
    ranks = [shard_model(load_model(ARCH, dtype=torch.float32, device="cpu").model, TPGroup(r, 2)) for r in range(2)]
    layer = full.backbone.blocks[1].mlstm_layer
    halves = [m.backbone.blocks[1].mlstm_layer for m in ranks]
    for half in halves:
        half.tp = SINGLE                      # the all-reduce is the sum below
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(0))
    caches = [allocate_caches(m) for m in (full, *ranks)]
    for done, n in ((0, 11), (11, 1)):
        md = one_seq_metadata(full, done, n, [1], state_slot=2)
        want = layer(x[done:done + n], md)
        got = sum(half(x[done:done + n], md) for half in halves)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    name = "backbone.blocks.1.mlstm_layer"
    for r, half in enumerate(halves):
        assert half.num_heads == 1 and half.state_shards[0].index.tolist() == [r]
        for ours, whole in zip(caches[1 + r][name], caches[0][name]):
            torch.testing.assert_close(ours[2], whole[2][r:r + 1])


def test_sharded_load_reads_each_ranks_heads(tmp_path):
    """A checkpoint loaded for rank r of 2 (reading only its slices) is the whole model sharded for r."""
    from test_sharded_loading import assert_same_model
    folder = save_hf_folder(load_model(ARCH, dtype=torch.float32, device="cpu").model, tmp_path)
    for r in range(2):
        got = load_model(folder, dtype=torch.float32, device="cpu", tp=TPGroup(r, 2)).model
        assert_same_model(got, shard_model(load_model(folder, dtype=torch.float32, device="cpu").model, TPGroup(r, 2)))


# ---- backend="triton": the mLSTM kernels (kernels/mlstm.py) -------------------------------------------
@pytest.mark.slow
def test_triton_backend_equals_torch():
    pytest.importorskip("triton")
    from toolkit.kernels import mlstm
    res = {}
    for backend in ("torch", "triton"):
        with LLM(ARCH, **F32, backend=backend, **BATCH_LIMITS) as llm:
            res[backend] = run_by_hand(llm, prompts_of([23, 9], llm.vocab_size, seed=0), MAX_TOKENS)
            assert {r.backend for r in res[backend].records} == {backend}
            ops = llm.model_runner.model.backbone.blocks[0].mlstm_layer.ops
            want = ((mlstm.mlstm_update, mlstm.mlstm_prefill) if backend == "triton"
                    else (mlstm_update_at_slots, mlstm_prefill_at_slots))
            assert (ops.mlstm_update, ops.mlstm_prefill) == want
    assert res["torch"].tokens == res["triton"].tokens
    for rid, logits in res["triton"].logits.items():
        for a, b in zip(res["torch"].logits[rid], logits, strict=True):
            assert (a - b).abs().max().item() <= 1e-4
