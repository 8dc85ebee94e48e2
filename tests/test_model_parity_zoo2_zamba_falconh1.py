"""Zamba2 and Falcon-H1 reproduce HF transformers (fp32 logits within 1e-4, greedy tokens equal):
model-level (`ModelParitySuite`: one shot, chunked prefill + decode, mixed decode/prefill steps,
profile run; config variants) for the presets and HF-initialised checkpoints; runner-level (LLM vs
HF, a single request and a chunked, mixed, queued batch); routing and cache-layout facts (Zamba2's
shared blocks: tied Parameters, one KV cache per hybrid layer; Falcon-H1: an attention and a Mamba
cache in every layer); the checkpoint layout of tied shared blocks; bf16 checkpoints; the Triton
backend; and `LLM(inspect="full")` recording every Mamba2 mixer's states (matching HF's cache).

HF quirk (transformers 5.x `Zamba2MambaMixer`): dt is clamped below at `time_step_min` (1e-3) in the
chunked (prefill / uncached) path only; the cached one-token decode path skips the clamp, so HF's
own cached `generate` drifts from its uncached forward (by ~5e-3 on tiny-zamba2). The toolkit
applies the clamp everywhere, i.e. follows HF's uncached forward, which is the logit reference of
every parity check here (`test_zamba2_hf_cached_decode_skips_the_dt_clamp` pins the quirk;
greedy tokens still equal HF's cached `generate`).
Falcon-H1's decode path skips its `time_step_limit` clamp the same way, but the default limit
(0, inf) never bites.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from harness import (BATCH_LIMITS, BATCH_PROMPT_LENS, F32, check_chunked_mixed_queued_batch_matches_hf,
                     check_single_request_matches_hf, hf_logits as hf_logits_uncached, load_hf, prompts_of,
                     run_by_hand, save_model_pair)
from model_helpers import ConfigVariantChecks, ModelParitySuite, random_prompt, run_steps
from test_inspect_states import check_against_hf, check_continuity, run_workload
from toolkit import LLM
from toolkit.config import RunnerConfig
from toolkit.layers.mamba2_mixer import Mamba2Mixer, RMSNormThenGate
from toolkit.layers.norms import RMSNormGated
from toolkit.models import PRESETS, get_model_class, load_model, save_hf_folder
from toolkit.models.falcon_h1 import FalconH1ForCausalLM
from toolkit.models.zamba2 import Zamba2ForCausalLM, zamba2_shared_block_ties
from toolkit.runner.kv_cache import make_kv_cache_groups
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.runner.model_states import MambaHybridModelState, init_model_state

ARCHS = ("tiny-zamba2", "tiny-falcon-h1")


# Zamba2Config fields derived in __post_init__; passed back as kwargs they would override the
# recomputed values (a stale hybrid_layer_ids makes HF's adapter lookup fail)
ZAMBA2_DERIVED = ("hybrid_layer_ids", "attention_hidden_size", "attention_head_dim", "mamba_headdim",
                  "kv_channels", "num_query_groups")


def _rebuilt(arch: str, **overrides):
    """The preset's config rebuilt with `overrides` (derived fields recomputed by __post_init__)."""
    cfg = PRESETS[arch]()
    kwargs = {k: v for k, v in cfg.to_dict().items() if k not in ZAMBA2_DERIVED}
    return type(cfg)(**{**kwargs, **overrides})


VARIANTS = {
    # independent blocks per hybrid layer (HF ties them only with tie_word_embeddings), GQA, no
    # attention adapters, no RoPE, biases, silu MLP, one group
    "zamba2-untied-gqa-no-rope": lambda: _rebuilt(
        "tiny-zamba2", tie_word_embeddings=False, num_key_value_heads=2, use_shared_attention_adapter=False,
        use_mem_rope=False, add_bias_linear=True, hidden_act="silu", mamba_ngroups=1),
    # one shared block for all three hybrid layers, a hybrid first layer, scaled RoPE
    "zamba2-one-block": lambda: _rebuilt(
        "tiny-zamba2", num_mem_blocks=1, layers_block_type=["hybrid", "mamba", "hybrid", "hybrid"],
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
    # no Mamba norm (y * silu(gate)), every bias on, no conv bias, the dt clamp bites, d_ssm from expand
    "falcon-h1-no-mamba-norm": lambda: _rebuilt(
        "tiny-falcon-h1", mamba_rms_norm=False, attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
        projectors_bias=True, mamba_conv_bias=False, time_step_limit=(0.01, 0.05), mamba_d_ssm=None),
    # gated norm gating first, one group, head_dim != hidden / heads, scaled RoPE
    "falcon-h1-gate-then-norm": lambda: _rebuilt(
        "tiny-falcon-h1", mamba_norm_before_gate=False, mamba_n_groups=1, head_dim=24,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
}


def _mixers(model) -> list[Mamba2Mixer]:
    return [m for m in model.modules() if isinstance(m, Mamba2Mixer)]


class TestZamba2FalconH1(ModelParitySuite, ConfigVariantChecks):
    ARCHS = ARCHS
    VARIANTS = VARIANTS
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
            {k: tuple(v.shape) for k, v in hf.state_dict().items()}
        if isinstance(ours, Zamba2ForCausalLM):   # layers 1 and 3 share block 0 (tied config), in HF too
            for model in (ours, hf):
                a, b, c = (model.model.layers[i].shared_transformer.self_attn.q_proj.weight for i in (1, 3, 2))
                assert a is b and a is not c

    def check_variant(self, variant: str, ours) -> None:
        layers = ours.model.layers
        if variant == "zamba2-untied-gqa-no-rope":
            assert not zamba2_shared_block_ties(ours.config)
            assert layers[1].shared_transformer.self_attn.q_proj.weight is not \
                layers[3].shared_transformer.self_attn.q_proj.weight
            assert layers[1].shared_transformer.self_attn.num_kv_heads == 2
            assert layers[1].shared_transformer.self_attn.rotary is None
        elif variant == "zamba2-one-block":
            w = [layers[i].shared_transformer.feed_forward.gate_up_proj.weight for i in (0, 2, 3)]
            assert w[0] is w[1] is w[2]
        elif variant == "falcon-h1-no-mamba-norm":
            assert all(m.norm is None and m.out_proj.bias is not None for m in _mixers(ours))
        else:
            assert all(type(m.norm) is RMSNormGated for m in _mixers(ours))
            assert layers[0].self_attn.head_dim == 24


# ---- routing and cache layout -------------------------------------------------------------------

def _specs_and_groups(preset: str):
    config = PRESETS[preset]()
    with torch.device("meta"):
        model = get_model_class(config)(config)
    cfg = RunnerConfig(device=torch.device("cpu"), dtype=torch.float32, max_num_seqs=2,
                       max_num_batched_tokens=16, block_size=16, max_model_len=64, num_kv_blocks=None, seed=0)
    return model, model.kv_cache_specs(), make_kv_cache_groups(model.kv_cache_specs(), cfg), cfg


def test_routing_facts_and_cache_layout():
    assert Zamba2ForCausalLM.is_hybrid and not Zamba2ForCausalLM.is_attention_free
    assert FalconH1ForCausalLM.is_hybrid and not FalconH1ForCausalLM.is_attention_free
    for arch, cls in zip(ARCHS, (Zamba2ForCausalLM, FalconH1ForCausalLM)):
        assert get_model_class(PRESETS[arch]()) is cls

    # Zamba2: one KV cache per hybrid layer although layers 1 and 3 share block 0's weights
    z, specs, groups, cfg = _specs_and_groups("tiny-zamba2")
    assert type(init_model_state(z, cfg)) is MambaHybridModelState
    attn = [f"model.layers.{i}.shared_transformer.self_attn" for i in (1, 2, 3)]
    mamba = ["model.layers.0.mamba"] + [f"model.layers.{i}.mamba_decoder.mamba" for i in (1, 2, 3)]
    assert sorted(specs) == sorted(attn + mamba)
    assert [(g.kind, g.layer_names) for g in groups] == [("attention", attn), ("mamba", mamba)]
    assert all(specs[n] == AttentionSpec(num_kv_heads=4, head_dim=32, dtype=torch.float32) for n in attn)
    assert all(specs[n] == MambaSpec(shapes=((3, 192), (8, 16, 16)), dtypes=(torch.float32, torch.float32),
                                     mamba_type="mamba2", chunk_size=16) for n in mamba)
    assert zamba2_shared_block_ties(z.config) == {3: 1}
    st = [z.model.layers[i].shared_transformer for i in (1, 2, 3)]
    assert st[0] is not st[2] and st[0].self_attn.o_proj.weight is st[2].self_attn.o_proj.weight
    assert st[1].self_attn.o_proj.weight is not st[0].self_attn.o_proj.weight
    assert [s.block_id for s in st] == [0, 1, 0]
    assert isinstance(st[0].self_attn.linear_q_adapter_list[1], torch.nn.Identity)   # block 1's slot

    # Falcon-H1: every layer holds an attention cache and a Mamba state, in the two groups
    f, specs, groups, cfg = _specs_and_groups("tiny-falcon-h1")
    assert type(init_model_state(f, cfg)) is MambaHybridModelState
    assert list(specs) == [f"model.layers.{i}.{p}" for i in range(4) for p in ("mamba", "self_attn")]
    assert [(g.kind, g.layer_names) for g in groups] == [
        ("attention", [f"model.layers.{i}.self_attn" for i in range(4)]),
        ("mamba", [f"model.layers.{i}.mamba" for i in range(4)])]
    assert specs["model.layers.0.self_attn"] == AttentionSpec(num_kv_heads=2, head_dim=16, dtype=torch.float32)
    mixer = f.model.layers[0].mamba
    assert type(mixer.norm) is RMSNormThenGate and mixer.proj_multipliers == (1.1, 0.9, 1.2, 0.8, 1.3)
    assert mixer.in_multiplier == 0.7
    assert f.model.layers[0].self_attn.scale == pytest.approx(16**-0.5 * 0.8)


def test_llm_runs_both_caches_per_layer():
    """The runner allocates and binds both groups; the engine routes to MambaHybridModelState."""
    for preset in ARCHS:
        with LLM(preset, **F32, max_num_seqs=2) as llm:
            assert type(llm.model_runner.model_state) is MambaHybridModelState
            assert [g.kind for g in llm.model_runner.kv_cache_groups] == ["attention", "mamba"]
            assert set(llm.model_runner.kv_caches) == set(llm.model.kv_cache_specs())


# ---- checkpoints ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False])
def test_zamba2_shared_block_checkpoint_layout(tie, tmp_path):
    """On disk, a tied config stores each shared block once (under its first hybrid layer), as
    save_pretrained does; an untied config stores every hybrid layer's block. Both directions."""
    cfg = _rebuilt("tiny-zamba2", tie_word_embeddings=tie)
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    on_disk_hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert any(k.startswith("model.layers.3.shared_transformer.") for k in on_disk_hf) == (not tie)
    ours = load_model(str(tmp_path / "hf"), dtype=torch.float32, device="cpu").model
    same = ours.model.layers[3].shared_transformer.self_attn.q_proj.weight is \
        ours.model.layers[1].shared_transformer.self_attn.q_proj.weight
    assert same == tie
    save_hf_folder(ours, tmp_path / "ours")
    on_disk_ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert sorted(on_disk_ours) == sorted(on_disk_hf)
    assert all(torch.equal(on_disk_ours[k], on_disk_hf[k]) for k in on_disk_hf)
    # the preset's seeded weights load in HF, tied the same way
    pre = load_model("tiny-zamba2", dtype=torch.float32, device="cpu").model
    save_hf_folder(pre, tmp_path / "preset")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "preset")
    assert hf.model.layers[3].shared_transformer.self_attn.q_proj.weight is \
        hf.model.layers[1].shared_transformer.self_attn.q_proj.weight
    assert torch.equal(hf.model.layers[3].shared_transformer.feed_forward.gate_up_proj.weight,
                       pre.model.layers[1].shared_transformer.feed_forward.gate_up_proj.weight)


@torch.no_grad()
def test_zamba2_tied_config_with_differing_stored_copies_stays_untied(tmp_path):
    """A tied config whose checkpoint stores a block's copy with other values: HF's from_pretrained
    leaves that pair untied (with a warning), and so do we; logits still match, and saving keeps
    both copies."""
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(PRESETS["tiny-zamba2"]()).save_pretrained(tmp_path / "src")
    shutil.copytree(tmp_path / "src", tmp_path / "edited")
    stored = load_file(str(tmp_path / "src" / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for k in list(stored):
        if k.startswith("model.layers.1.shared_transformer."):
            stored[k.replace("layers.1.", "layers.3.")] = stored[k] + 0.05 * torch.randn(stored[k].shape, generator=g)
    save_file(stored, str(tmp_path / "edited" / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "edited").eval()
    ours = load_model(str(tmp_path / "edited"), dtype=torch.float32, device="cpu").model
    for m in (hf, ours):
        assert m.model.layers[3].shared_transformer.self_attn.q_proj.weight is not \
            m.model.layers[1].shared_transformer.self_attn.q_proj.weight
    seq = random_prompt(1, 20)
    assert (run_steps(ours, seq, [10, 9, 1]) - hf_logits_uncached(hf, seq.tolist())).abs().max().item() <= 1e-4
    save_hf_folder(ours, tmp_path / "ours")
    assert sorted(load_file(str(tmp_path / "ours" / "model.safetensors"))) == sorted(stored)


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_bf16_checkpoint_loads_and_runs(arch, tmp_path):
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(PRESETS[arch]()).to(torch.bfloat16).save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    m32 = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    for k, t in stored.items():
        assert torch.equal(m32.state_dict()[k], t.float()), k
    m16 = load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu").model
    out = run_steps(m16, random_prompt(8, 22), [10, 10, 1, 1])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


# ---- runner level: LLM vs HF ---------------------------------------------------------------------

@pytest.fixture(scope="module", params=list(ARCHS) + [f"hf-random-{a}" for a in ARCHS])
def model_pair(request, tmp_path_factory):
    """(LLM model argument, HF folder with the same weights): the preset saved for HF, or an
    HF-initialised random model (seed 1234) loaded by the LLM from its folder."""
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


@pytest.mark.parametrize("arch", ARCHS)
def test_triton_backend_equals_torch(arch):
    """backend="triton" (TRITON_INTERPRET=1 on the CPU) gives the torch backend's tokens and logits
    (1e-4) on a single request and on the chunked, mixed, queued batch."""
    pytest.importorskip("triton", reason="triton has no wheels for macOS / Windows")
    from test_backend_triton import _assert_same, _run
    _assert_same(_run(arch, "torch", [23], 0), _run(arch, "triton", [23], 0))
    _assert_same(_run(arch, "torch", BATCH_PROMPT_LENS, 1, **BATCH_LIMITS),
                 _run(arch, "triton", BATCH_PROMPT_LENS, 1, **BATCH_LIMITS))


@torch.inference_mode()
def test_zamba2_hf_cached_decode_skips_the_dt_clamp(tmp_path):
    """The HF quirk of the module docstring: HF's cached generate drifts from HF's uncached
    forward past the tolerance only because its decode path skips the time_step_min clamp; our
    runner's logits match the uncached forward."""
    with LLM("tiny-zamba2", **F32) as llm:
        save_hf_folder(llm, tmp_path)
        prompt = prompts_of([23], llm.vocab_size)[0]
        res = run_by_hand(llm, [prompt], 8)
    ours = next(iter(res.logits.values()))
    hf = load_hf(tmp_path)

    def cached_vs_uncached() -> tuple[float, list[int]]:
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0].tolist()
        ref = hf_logits_uncached(hf, tokens)[len(prompt) - 1:-1]
        return max((l[0] - r).abs().max().item() for l, r in zip(out.logits, ref)), tokens[len(prompt):]

    drift, hf_tokens = cached_vs_uncached()
    assert drift > 1e-3
    assert next(iter(res.tokens.values())) == hf_tokens
    ref = hf_logits_uncached(hf, prompt + hf_tokens)[len(prompt) - 1:-1]
    assert max((o - r).abs().max().item() for o, r in zip(ours, ref)) <= 1e-4
    for m in hf.modules():                       # without the clamp HF agrees with itself
        if hasattr(m, "time_step_limit"):
            m.time_step_limit = (0.0, float("inf"))
    assert cached_vs_uncached()[0] <= 1e-4


# ---- inspect="full" ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_full_records_every_mamba2_state(arch, tmp_path):
    """Every Mamba2 mixer (Zamba2's hybrid layers' `mamba_decoder.mamba` too) is recorded for every
    row of every step, states are continuous across steps, and each step's 'after' state equals
    HF's cache after a forward over the same tokens."""
    work = run_workload(arch, arch, str(tmp_path))
    names = list(work.recurrent_layers)
    if arch == "tiny-zamba2":
        assert names == ["model.layers.0.mamba"] + [f"model.layers.{i}.mamba_decoder.mamba" for i in (1, 2, 3)]
    else:
        assert names == [f"model.layers.{i}.mamba" for i in range(4)]
    assert any(r.num_decodes and r.num_prefills for r in work.records)
    for rec in work.records:
        assert [s.layer_name for s in rec.states] == names
        for st in rec.states:
            assert st.mamba_type == "mamba2" and st.state_names == ["conv_state", "ssm_state"]
            assert st.request_ids == rec.request_ids
            for when in ("before", "after"):
                for t, shape in zip(getattr(st, when), work.recurrent_layers[st.layer_name].state_shapes()):
                    assert tuple(t.shape) == (len(st.request_ids), *shape) and torch.isfinite(t).all()
    assert check_continuity(work) > 0
    hf = AutoModelForCausalLM.from_pretrained(work.folder, dtype=torch.float32).eval()
    compared, _ = check_against_hf(work, hf)
    assert compared > 0
