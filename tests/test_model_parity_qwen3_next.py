"""Qwen3-Next (Gated DeltaNet + gated full attention + MoE with a shared expert) reproduces HF
transformers (fp32, logits atol 1e-4).

1. GDN math: the chunked prefill against the token-by-token recurrence (lengths 1, chunk-1, chunk,
   chunk+1 and longer, with and without initial state, several sequences in one call, two chunk
   layouts), both against HF's torch fallbacks, the in-place-at-state-indices forms, the norms;
2. the GDN metadata builder (split, FLA chunk layout);
3. `ModelParitySuite` for tiny-qwen3-next and an HF-initialised checkpoint, plus config variants
   and small GDN chunks inside the model;
4. runner level: LLM(...) against HF generate (single request; a chunked, mixed, queued batch);
5. routing facts, the checkpoint layout (per-expert tensors on disk, `mtp.*` dropped), bf16
   checkpoints, the warmup's field check naming the GDN builder, a GDN-only config;
6. `LLM(inspect="full")` records both GDN layers' states, and they equal HF's cache.

HF's cached generation works for the preset and its variants in transformers 5.24 (greedy
`generate` agrees with full forwards), so the runner-level references use `generate`
(use_cache=True). It raises on a config without any attention layer, which is therefore compared
with use_cache=False (`test_all_linear_attention_config_...`).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.qwen3_next import modeling_qwen3_next as hf_q3n

from harness import (BATCH_LIMITS, F32, assert_matches_hf, check_chunked_mixed_queued_batch_matches_hf,
                     check_single_request_matches_hf, load_hf, prompts_of, run_by_hand, save_model_pair)
from model_helpers import ConfigVariantChecks, ModelParitySuite, assert_close, random_prompt, run_steps
from test_metadata_builders import common
from toolkit import LLM, MetadataContractError, SamplingParams
from toolkit.attention.gdn import GDN_CHUNK_SIZE, GDNAttentionMetadata, GDNMetadataBuilder, compute_gdn_chunk_metadata
from toolkit.attention.mamba2 import compute_chunk_metadata
from toolkit.layers.gdn import GatedDeltaNet
from toolkit.kernels.gated_delta_rule_ref import (gdn_chunk_varlen,
                                                  gdn_prefill_at_slots,
                                                  gdn_recurrent_varlen,
                                                  gdn_update_at_slots)
from toolkit.layers.moe import merge_expert_checkpoint_tensors
from toolkit.layers.norms import RMSNormThenGate
from toolkit.models import PRESETS, get_model_class, load_model, save_hf_folder
from toolkit.models.qwen3_next import OffsetRMSNorm, Qwen3NextForCausalLM
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.runner.model_states import MambaHybridModelState

ARCH = "tiny-qwen3-next"
GDN_LAYERS = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
# tiny-qwen3-next's GDN: 2 key heads x 8, 4 value heads x 16, conv 4 -> conv_dim 2*2*8 + 4*16 = 96
HK, HV, KD, VD, CONV_DIM = 2, 4, 8, 16, 96
MATH_ATOL = 1e-5
C = 16                                         # chunk size of the math tests
LENGTHS = [1, C - 1, C, C + 1, 3 * C + 5]
STATE_ATOL = 1e-5


# ---- 1. GDN math ------------------------------------------------------------------------------

def gdn_inputs(seed: int, t: int, hk: int = HK, hv: int = HV, kd: int = KD, vd: int = VD):
    """Random q, k [T, Hk, K], v [T, Hv, V], g (log decay <= 0) and beta [T, Hv], as the mixer
    produces them (q, k unnormalised: the ops l2-normalise)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, kd, generator=g), torch.randn(t, hk, kd, generator=g)
    v = torch.randn(t, hv, vd, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(t, hv, generator=g))
    beta = torch.sigmoid(torch.randn(t, hv, generator=g))
    return q, k, v, decay, beta


def initial(seed: int, s: int, hv: int = HV, vd: int = VD, kd: int = KD) -> torch.Tensor:
    return 0.5 * torch.randn(s, hv, vd, kd, generator=torch.Generator().manual_seed(seed))


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def chunk_layout(lengths, chunk_size: int, num_computed=None):
    """FLA's layout (each sequence chunked from its first token), or Mamba2's (a sequence with
    num_computed tokens tops up to the next chunk boundary first)."""
    arrays = (compute_gdn_chunk_metadata(np.array(lengths), chunk_size) if num_computed is None
              else compute_chunk_metadata(np.array(lengths), np.array(num_computed), chunk_size))
    return tuple(torch.from_numpy(a) for a in arrays)


def assert_math_close(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got - want).abs().max().item()
    assert diff <= MATH_ATOL, f"max |diff| {diff:.3e} > {MATH_ATOL}"


@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("length", LENGTHS)
def test_chunked_prefill_matches_token_by_token(length, with_initial_state):
    q, k, v, g, beta = gdn_inputs(length, length)
    init = initial(length, 1) if with_initial_state else None
    cu = cu_of([length])
    y_ref, final_ref = gdn_recurrent_varlen(q, k, v, g, beta, cu, init)
    y, final = gdn_chunk_varlen(q, k, v, g, beta, *chunk_layout([length], C), C, init)
    assert y.shape == (length, HV, VD) and final.shape == (1, HV, VD, KD)
    assert y.dtype == final.dtype == torch.float32
    assert_math_close(y, y_ref)
    assert_math_close(final, final_ref)
    if with_initial_state:      # the state matters (else a dropped initial state would pass)
        assert (gdn_recurrent_varlen(q, k, v, g, beta, cu)[0] - y_ref).abs().max() > 1e-2


@pytest.mark.parametrize("layout", ["fla", "mamba2-top-up"])
def test_chunked_prefill_over_varlen_sequences(layout):
    """All lengths back to back in one call, some from an initial state: each sequence equals its
    own recurrence, for either chunk layout."""
    t = sum(LENGTHS)
    q, k, v, g, beta = gdn_inputs(1, t)
    init = initial(2, len(LENGTHS))
    init[1] = 0.0
    computed = None if layout == "fla" else [0, 0, 5, 16, 9]
    y, final = gdn_chunk_varlen(q, k, v, g, beta, *chunk_layout(LENGTHS, C, computed), C, init)
    y_ref, final_ref = gdn_recurrent_varlen(q, k, v, g, beta, cu_of(LENGTHS), init)
    assert_math_close(y, y_ref)
    assert_math_close(final, final_ref)


def test_references_match_hf_torch_fallbacks():
    """Ours vs HF's `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule` (chunk 16),
    GVA (Hv = 2 Hk), key dim != value dim; HF's state is [B, Hv, K, V], ours [S, Hv, V, K]."""
    t = 2 * C + 3
    q, k, v, g, beta = gdn_inputs(3, t)
    init = initial(4, 1)
    hf_args = dict(initial_state=init.transpose(-1, -2), output_final_state=True, use_qk_l2norm_in_kernel=True)
    y_ref, final_ref = gdn_recurrent_varlen(q, k, v, g, beta, cu_of([t]), init)
    for fn, kw in ((hf_q3n.torch_recurrent_gated_delta_rule, {}),
                   (hf_q3n.torch_chunk_gated_delta_rule, dict(chunk_size=C))):
        y_hf, state_hf = fn(q[None], k[None], v[None], g[None], beta[None], **hf_args, **kw)
        assert_math_close(y_hf[0], y_ref)
        assert_math_close(state_hf.transpose(-1, -2), final_ref)


def test_at_slots_read_and_write_only_their_slots():
    """Prefill two sequences into slots 4 (from its state) and 1 (fresh: its old content is
    ignored), then two decode steps with a padded row: every output and state equals the
    recurrence over the whole sequences; other slots are untouched; the padded row outputs 0."""
    lens, slots, dec = [C + 3, 5], [4, 1], 2
    p = sum(lens)
    q, k, v, g, beta = gdn_inputs(5, p + 2 * dec)
    cache = torch.randn(6, HV, VD, KD)
    before = cache.clone()
    y_p = gdn_prefill_at_slots(q[:p], k[:p], v[:p], g[:p], beta[:p], *chunk_layout(lens, C), C, cache,
                               torch.tensor(slots, dtype=torch.int32), torch.tensor([True, False]))
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)   # the padded row repeats sequence 0's token
    y_d = []
    for step in range(dec):
        rows = [p + 2 * step, p + 2 * step, p + 2 * step + 1]
        y_d.append(gdn_update_at_slots(cache, q[rows], k[rows], v[rows], g[rows], beta[rows], idx))
    assert all(torch.equal(cache[s], before[s]) for s in (0, 2, 3, 5))
    assert all(not y[1].any() for y in y_d)
    refs = [([*range(lens[0]), p, p + 2], before[4:5]), ([*range(lens[0], p), p + 1, p + 3], None)]
    for seq, (toks, init) in enumerate(refs):
        y_ref, final_ref = gdn_recurrent_varlen(q[toks], k[toks], v[toks], g[toks], beta[toks],
                                                cu_of([len(toks)]), init)
        off = sum(lens[:seq])
        assert_math_close(y_p[off : off + lens[seq]], y_ref[: lens[seq]])
        for step in range(dec):
            assert_math_close(y_d[step][2 * seq], y_ref[lens[seq] + step])
        assert_math_close(cache[slots[seq]], final_ref[0])


def test_norms_match_hf_modules():
    """The (1 + weight) RMSNorm and the norm-before-gate GDN norm equal HF's modules, in fp32 and
    bf16 (same dtype handling)."""
    torch.manual_seed(0)
    x, z = torch.randn(5, 16), torch.randn(5, 16)
    ours_n, hf_n = OffsetRMSNorm(16, eps=1e-6), hf_q3n.Qwen3NextRMSNorm(16, eps=1e-6)
    ours_g, hf_g = RMSNormThenGate(16, eps=1e-6, cast_normed=True), hf_q3n.Qwen3NextRMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        for a, b in ((ours_n, hf_n), (ours_g, hf_g)):
            a.weight.normal_(0.0, 0.3)
            b.weight.copy_(a.weight)
    for dtype in (torch.float32, torch.bfloat16):
        xs, zs = x.to(dtype), z.to(dtype)
        for a, b in ((ours_n, hf_n), (ours_g, hf_g)):
            a.to(dtype), b.to(dtype)
        assert torch.equal(ours_n(xs), hf_n(xs))
        assert torch.equal(ours_g(xs, zs), hf_g(xs, zs))


# ---- 2. metadata builder -------------------------------------------------------------------------

def test_gdn_builder_splits_and_chunks_each_row_from_its_start():
    md = GDNMetadataBuilder(16).build(
        common([1, 1, 5, 40], computed=[7, 9, 0, 20], prefilling=[False, True, True, True], slots=[4, 6, 1, 3]),
        producer="test")
    assert isinstance(md, GDNAttentionMetadata) and md.chunk_size == 16
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == (2, 2, 2, 45)
    assert md.state_indices_tensor_d.tolist() == [4, 6] and md.state_indices_tensor_p.tolist() == [1, 3]
    assert md.has_initial_states_p.tolist() == [False, True]
    assert md.query_start_loc_p.tolist() == [0, 5, 45]
    # row 1 continues at token 20: FLA chunks it from its first scheduled token (no top-up to 32)
    assert md.cu_chunk_seqlen_p.tolist() == [0, 5, 21, 37, 45]
    assert md.seq_idx_p.tolist() == [0, 1, 1, 1] and md.last_chunk_indices_p.tolist() == [0, 3]
    decode_only = GDNMetadataBuilder().build(common([1], [3], [False], [2]), producer="test")
    assert decode_only.num_prefills == 0 and decode_only.cu_chunk_seqlen_p is None
    assert GDNMetadataBuilder().chunk_size == GDN_CHUNK_SIZE == 64


# ---- 3. model parity -----------------------------------------------------------------------------

def _variant_dense_layers_plain_topk():
    """Dense MLPs on layers 0 and 3, top-3 without renormalisation, attention biases."""
    cfg = PRESETS[ARCH]()
    cfg.mlp_only_layers = [0, 3]
    cfg.norm_topk_prob = False
    cfg.num_experts_per_tok = 3
    cfg.attention_bias = True
    return cfg


def _variant_no_gva_full_rope():
    """Hv == Hk (no grouped values), key dim > value dim, full RoPE, attention first, MoE only on
    every 2nd layer (decoder_sparse_step 2), conv kernel 3."""
    cfg = PRESETS[ARCH]()
    cfg.layer_types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    cfg.linear_num_value_heads = 2
    cfg.linear_key_head_dim = 16
    cfg.linear_value_head_dim = 8
    cfg.linear_conv_kernel_dim = 3
    cfg.decoder_sparse_step = 2
    cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": 1.0}
    return cfg


class TestQwen3Next(ModelParitySuite, ConfigVariantChecks):
    ARCHS = (ARCH,)
    VARIANTS = {"dense-layers-plain-topk": _variant_dense_layers_plain_topk,
                "no-gva-full-rope": _variant_no_gva_full_rope}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert [b.layer_type for b in ours.model.layers] == ["linear_attention", "full_attention"] * 2
        assert sorted(ours.state_dict()) == sorted(hf.state_dict())

    def check_variant(self, variant: str, ours) -> None:
        mlps = [type(b.mlp).__name__ for b in ours.model.layers]
        if variant == "dense-layers-plain-topk":
            assert mlps == ["SwiGLUMLP", "SharedExpertMoeBlock", "SharedExpertMoeBlock", "SwiGLUMLP"]
            assert ours.model.layers[1].mlp.top_k == 3 and not ours.model.layers[1].mlp.renormalize
        else:
            assert mlps == ["SwiGLUMLP", "SharedExpertMoeBlock", "SwiGLUMLP", "SharedExpertMoeBlock"]
            gdn = ours.model.layers[1].linear_attn
            assert gdn.state_shapes() == ((2, 2 * 2 * 16 + 2 * 8), (2, 8, 16))
            assert ours.model.layers[0].self_attn.rotary.rotary_dim == 16

    @torch.no_grad()
    def test_small_gdn_chunks_match_hf(self, pair):
        """GDN chunk size 8 (the spec, hence the metadata, follows): prefill rows span several
        chunks inside the model, and chunks start mid-sequence."""
        ours, hf = pair
        mixers = [m for m in ours.modules() if isinstance(m, GatedDeltaNet)]
        assert len(mixers) == 2 and all(m.chunk_size == GDN_CHUNK_SIZE for m in mixers)
        try:
            for m in mixers:
                m.chunk_size = 8
            assert all(s.chunk_size == 8 for s in ours.kv_cache_specs().values() if isinstance(s, MambaSpec))
            seq = self.hf_continue(hf, random_prompt(11), 2)
            assert_close(run_steps(ours, seq, [10, 17, 10, 1, 1]), self.hf_logits(hf, seq))
        finally:
            for m in mixers:
                m.chunk_size = GDN_CHUNK_SIZE


# ---- 4. runner level -----------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[ARCH, f"hf-random-{ARCH}"])
def model_pair(request, tmp_path_factory):
    """(LLM model argument, HF folder with the same weights)."""
    return save_model_pair(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def hf_model(model_pair):
    return load_hf(model_pair[1])


def test_single_request_matches_hf(model_pair, hf_model):
    with LLM(model_pair[0], **F32) as llm:
        check_single_request_matches_hf(llm, hf_model)


def test_batch_with_chunked_prefill_and_queueing_matches_hf(model_pair, hf_model):
    with LLM(model_pair[0], **F32, **BATCH_LIMITS) as llm:
        check_chunked_mixed_queued_batch_matches_hf(llm, hf_model)


# ---- 5. routing, checkpoint layout, warmup contract ------------------------------------------------

def test_routing_facts_and_specs():
    assert Qwen3NextForCausalLM.is_hybrid and not Qwen3NextForCausalLM.is_attention_free
    assert get_model_class(PRESETS[ARCH]()) is Qwen3NextForCausalLM
    m = load_model(ARCH, dtype=torch.bfloat16, device="cpu").model
    assert not m.is_tied
    specs = m.kv_cache_specs()
    assert list(specs) == [GDN_LAYERS[0], "model.layers.1.self_attn", GDN_LAYERS[1], "model.layers.3.self_attn"]
    assert specs[GDN_LAYERS[0]] == MambaSpec(shapes=((3, CONV_DIM), (HV, VD, KD)),
                                             dtypes=(torch.bfloat16, torch.float32), mamba_type="gdn",
                                             chunk_size=GDN_CHUNK_SIZE)
    assert specs["model.layers.1.self_attn"] == AttentionSpec(num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    attn = m.model.layers[1].self_attn
    assert attn.q_proj.weight.shape == (4 * 16 * 2, 64) and attn.rotary.rotary_dim == 4   # gate; RoPE 0.25
    with LLM(ARCH, **F32, max_num_seqs=2) as llm:
        assert type(llm.model_runner.model_state) is MambaHybridModelState
        assert [(g.kind, type(a.builder).__name__) for g, a in
                zip(llm.model_runner.kv_cache_groups, llm.model_runner.attn_groups)] == [
            ("attention", "PagedAttentionMetadataBuilder"), ("mamba", "GDNMetadataBuilder")]


def test_checkpoint_layout(tmp_path):
    """In memory: HF 5.x's fused experts (our state_dict keys and shapes equal HF's); on disk:
    per-expert tensors both ways; a checkpoint's `mtp.*` tensors are ignored, as HF does."""
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(PRESETS[ARCH]())
    ours = load_model(ARCH, dtype=torch.float32, device="cpu").model
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    assert theirs["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 64)
    assert theirs["model.layers.0.linear_attn.in_proj_qkvz.weight"] == (2 * 2 * 8 + 2 * 4 * 16, 64)
    hf.save_pretrained(tmp_path / "hf")
    save_hf_folder(ours, tmp_path / "ours")
    on_disk_hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    on_disk_ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert sorted(on_disk_ours) == sorted(on_disk_hf)
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in on_disk_ours
    with_mtp = dict(on_disk_hf, **{"mtp.fc.weight": torch.zeros(64, 128), "mtp.norm.weight": torch.zeros(64)})
    save_file(with_mtp, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(str(tmp_path / "hf"), dtype=torch.float32, device="cpu").model
    want = merge_expert_checkpoint_tensors(on_disk_hf)
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


@torch.no_grad()
def test_bf16_checkpoint_loads_and_runs(tmp_path):
    """A bf16 HF checkpoint loads exactly and runs in bf16: conv state in bf16, recurrent state
    fp32, finite fp32 logits that pick HF-fp32's greedy token on most positions."""
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(PRESETS[ARCH]()).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    m16 = load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu").model
    want = merge_expert_checkpoint_tensors(stored)
    assert all(torch.equal(v, want[k]) for k, v in m16.state_dict().items())
    spec = m16.kv_cache_specs()[GDN_LAYERS[0]]
    assert spec.dtypes == (torch.bfloat16, torch.float32)
    seq = random_prompt(8, 22)
    out = run_steps(m16, seq, [10, 10, 1, 1])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    ref = hf.float()(seq[None], use_cache=False).logits[0]
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_warmup_names_the_gdn_builder_for_a_field_it_requires(monkeypatch):
    """The hybrid state forgets `is_prefilling` (the paged builder does not need it, the GDN
    builder does): warmup names the field, GDNMetadataBuilder and the producer."""
    original = MambaHybridModelState.attn_metadata_kwargs

    def forgets(self, input_batch, for_capture):
        kwargs = original(self, input_batch, for_capture)
        kwargs.pop("is_prefilling")
        return kwargs

    with LLM(ARCH, **F32, max_num_seqs=2, max_num_batched_tokens=16) as llm:
        monkeypatch.setattr(MambaHybridModelState, "attn_metadata_kwargs", forgets)
        with pytest.raises(MetadataContractError) as err:
            llm.warmup(progress=False)
        assert (err.value.field, err.value.builder) == ("is_prefilling", "GDNMetadataBuilder")
        assert "MambaHybridModelState" in str(err.value)
        monkeypatch.undo()
        llm.warmup(progress=False)


def test_all_linear_attention_config_matches_hf_uncached_and_warmup_names_gdn_builder(monkeypatch, tmp_path):
    """A Qwen3-Next with GDN layers only (no attention layer, hence no KV blocks): routed to the
    hybrid state with one Mamba group, matches HF, and a forgotten seq_lens_cpu_upper_bound is
    named with the GDN builder at warmup. HF's cached `generate` raises on this config in
    transformers 5.24 ("`get_seq_length` can only be called on Attention layers"), so HF runs
    with use_cache=False."""
    cfg = PRESETS[ARCH]()
    cfg = type(cfg)(**{**cfg.to_dict(), "layer_types": ["linear_attention"] * 4})
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    hf = load_hf(tmp_path)
    with LLM(str(tmp_path), **F32, max_num_seqs=2, max_num_batched_tokens=16) as llm:
        assert [g.kind for g in llm.model_runner.kv_cache_groups] == ["mamba"]
        assert type(llm.model_runner.model_state) is MambaHybridModelState
        prompts = prompts_of([1, 23, 9], llm.vocab_size, seed=4)
        res = run_by_hand(llm, prompts, 5)
        for rid, prompt in zip(res.tokens, prompts):
            assert_matches_hf(hf, prompt, res.tokens[rid], res.logits[rid], 5, use_cache=False)
        original = MambaHybridModelState.attn_metadata_kwargs

        def forgets(self, input_batch, for_capture):
            kwargs = original(self, input_batch, for_capture)
            kwargs.pop("seq_lens_cpu_upper_bound")
            return kwargs

        monkeypatch.setattr(MambaHybridModelState, "attn_metadata_kwargs", forgets)
        with pytest.raises(MetadataContractError) as err:
            llm.warmup(progress=False)
        assert (err.value.field, err.value.builder) == ("seq_lens_cpu_upper_bound", "GDNMetadataBuilder")


# ---- 6. inspect="full" ---------------------------------------------------------------------------

def hf_gdn_states(hf, tokens: list[int]) -> dict[str, dict[str, torch.Tensor]]:
    """HF's cache after one fresh forward over `tokens`, in our layout: conv [K-1, conv_dim] (HF
    keeps K columns [1, conv_dim, K]), ssm [Hv, V, K] (HF: [1, Hv, K, V])."""
    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(torch.tensor([tokens]), cache=cache, use_cache=True)
    out = {}
    for name in GDN_LAYERS:
        i = int(name.split(".")[2])
        out[name] = {"conv_state": cache.get_conv_state(i)[0, :, 1:].transpose(0, 1),
                     "ssm_state": cache.get_recurrent_state(i)[0].transpose(-1, -2)}
    return out


def test_inspect_full_records_gdn_states_matching_hf(tmp_path):
    """Chunked prefill beside decode rows, a one-token prompt, a short prompt: every step records
    both GDN layers' states for every row; a request's 'after' is its next 'before', its first
    'before' is zero, and every 'after' equals HF's cache over the same tokens."""
    prompt_lens, max_tokens = (3, 11, 1, 7), 4
    engine = dict(F32, inspect="full", max_num_seqs=3, max_num_batched_tokens=8)
    with LLM(ARCH, **engine) as llm:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompts = [[(7 * i + 13 * j) % 317 + 3 for j in range(n)] for i, n in enumerate(prompt_lens)]
        ids = [llm.add_request({"prompt_token_ids": p}, params) for p in prompts]
        tokens = {rid: list(p) for rid, p in zip(ids, prompts)}
        records = []
        while llm.has_unfinished_requests():
            rec = llm.step()
            records.append(rec)
            for rid, tok in rec.kept_token_ids.items():
                tokens[rid].append(tok)
        save_hf_folder(llm, tmp_path)
    assert any(s.is_prefill and s.num_computed_before > 0 for r in records for s in r.scheduled)
    assert any(r.num_decodes and r.num_prefills for r in records)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    prev_after: dict[str, dict] = {}
    compared = 0
    for rec in records:
        assert [s.layer_name for s in rec.states] == GDN_LAYERS
        for st in rec.states:
            assert st.mamba_type == "gdn" and st.state_names == ["conv_state", "ssm_state"]
            assert st.request_ids == rec.request_ids and 0 not in st.slots
            n = len(st.request_ids)
            for t, shape in zip(st.after, ((3, CONV_DIM), (HV, VD, KD))):
                assert tuple(t.shape) == (n, *shape) and t.dtype == torch.float32
        for row, s in enumerate(rec.scheduled):
            rid = s.request_id
            n_tokens = s.num_computed_before + s.num_tokens
            ref = hf_gdn_states(hf, tokens[rid][:n_tokens])
            for st in rec.states:
                before, after = st.of(rid, "before"), st.of(rid, "after")
                for name in st.state_names:
                    if s.num_computed_before == 0:
                        assert not before[name].any(), (rec.step_index, rid, st.layer_name, name)
                    else:
                        assert torch.equal(before[name], prev_after[rid][st.layer_name][name])
                    diff = (after[name] - ref[st.layer_name][name]).abs().max().item()
                    assert diff <= STATE_ATOL, (rec.step_index, rid, st.layer_name, name, diff)
                    compared += 1
                prev_after.setdefault(rid, {})[st.layer_name] = after
    assert compared >= 2 * 2 * sum(1 for r in records for _ in r.scheduled)
