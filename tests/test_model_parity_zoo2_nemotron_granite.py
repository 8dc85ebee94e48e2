"""NemotronH and GraniteMoeHybrid reproduce HF transformers (fp32 logits within 1e-4, greedy tokens
equal): model level (ModelParitySuite: presets and HF-initialised checkpoints, one shot, chunked
prefill + decode, mixed decode/prefill steps, profile run; config variants), runner level (a single
request and a chunked, mixed, queued batch against HF's generate), the checkpoint layouts on disk
(NemotronH's `backbone.` + per-expert tensors, Granite's block_sparse_moe.input_linear / ...),
the routing facts, and `inspect="full"` recording their Mamba2 states (continuity and HF's cache)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig, NemotronHConfig

from harness import (BATCH_LIMITS, F32, check_chunked_mixed_queued_batch_matches_hf, check_single_request_matches_hf,
                     load_hf, save_model_pair)
from model_helpers import (ConfigVariantChecks, ModelParitySuite, assert_close, random_prompt,
                           run_steps)
from test_inspect_states import Workload, check_against_hf, run_workload
from toolkit import LLM
from toolkit.layers.mamba2_mixer import Mamba2Mixer
from toolkit.models import PRESETS, get_model_class, load_model, save_hf_folder
from toolkit.models.granite_hybrid import GraniteMoeHybridForCausalLM
from toolkit.models.nemotron_h import (NemotronHForCausalLM, NemotronHTopkRouter, merge_nemotron_h_experts,
                                       split_nemotron_h_experts)
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.runner.model_states import MambaHybridModelState

ARCHS = ("tiny-nemotron-h", "tiny-granite-hybrid")


def _rebuilt(arch: str, **changes):
    """The preset's config rebuilt with `changes` (through __init__, so derived fields follow)."""
    cfg = PRESETS[arch]()
    return type(cfg)(**{**cfg.to_dict(), **changes})


def _nemotron_h_variant() -> NemotronHConfig:
    """Attention first, biases everywhere they exist (Mamba in/out_proj via use_bias, MLPs, shared
    expert, latent projections), no conv bias, a latent MoE (experts on 24 channels), two expert
    groups with one kept, un-normalised top-k weights, a larger dt floor."""
    cfg = _rebuilt("tiny-nemotron-h", layers_block_type=["full_attention", "moe", "linear_attention", "mlp",
                                                         "linear_attention", "moe"])
    cfg.use_bias = True
    cfg.mlp_bias = True
    cfg.use_conv_bias = False
    cfg.moe_latent_size = 24
    cfg.n_group, cfg.topk_group = 2, 1
    cfg.norm_topk_prob = False
    cfg.time_step_min = 0.02
    cfg.n_groups = 4
    return cfg


def _granite_variant() -> GraniteMoeHybridConfig:
    """No position embedding ("nope", as Granite 4.0-H ships), attention first, biases, no conv
    bias, top-3, one Mamba group, untied."""
    return _rebuilt("tiny-granite-hybrid", position_embedding_type="nope",
                    layer_types=["attention", "mamba", "attention", "mamba"], attention_bias=True,
                    mamba_proj_bias=True, mamba_conv_bias=False, num_experts_per_tok=3, mamba_n_groups=1,
                    tie_word_embeddings=False)


def _granite_dense() -> GraniteMoeHybridConfig:
    """num_local_experts == 0: the shared MLP alone (HF's dense variant)."""
    return _rebuilt("tiny-granite-hybrid", num_local_experts=0)


class TestNemotronHGraniteHybrid(ModelParitySuite, ConfigVariantChecks):
    ARCHS = ARCHS
    # HF-initialised with N(0, 0.1) biases; references are full forwards without cache
    VARIANTS = {"nemotron-h": _nemotron_h_variant, "granite-nope": _granite_variant,
                "granite-dense": _granite_dense}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
            {k: tuple(v.shape) for k, v in hf.state_dict().items()}

    def check_variant(self, variant: str, ours) -> None:
        if variant == "nemotron-h":
            moe = ours.model.layers[1].mixer
            assert moe.fc1_latent_proj.weight.shape == (24, 64) and moe.experts.up_proj.shape == (4, 32, 24)
            assert ours.model.layers[2].mixer.time_step_limit == (0.02, float("inf"))
        elif variant == "granite-nope":
            assert ours.model.layers[0].self_attn.rotary is None and not ours.is_tied
        else:
            assert all(b.block_sparse_moe is None for b in ours.model.layers)


# ---- routing facts, cache specs, names -------------------------------------------------------

def test_routing_facts_and_specs():
    for arch, cls in zip(ARCHS, (NemotronHForCausalLM, GraniteMoeHybridForCausalLM)):
        assert cls.is_hybrid and not cls.is_attention_free
        assert get_model_class(PRESETS[arch]()) is cls
    n = load_model("tiny-nemotron-h", dtype=torch.float32, device="cpu").model
    assert [b.layer_type for b in n.model.layers] == ["mamba", "mlp", "mamba", "moe", "mamba", "attention", "moe"]
    specs = n.kv_cache_specs()
    assert list(specs) == [f"model.layers.{i}.mixer" for i in (0, 2, 4, 5)]
    assert specs["model.layers.0.mixer"] == MambaSpec(shapes=((3, 192), (8, 16, 16)),
                                                      dtypes=(torch.float32, torch.float32),
                                                      mamba_type="mamba2", chunk_size=16)
    assert isinstance(specs["model.layers.5.mixer"], AttentionSpec)
    attn = n.model.layers[5].mixer
    assert attn.rotary is None and attn.scale == 16 ** -0.5 and attn.q_proj.bias is None
    assert n.model.layers[0].mixer.time_step_limit == (0.001, float("inf"))   # time_step_min, not time_step_limit
    assert not n.is_tied
    router = n.model.layers[3].mixer.gate
    assert isinstance(router, NemotronHTopkRouter) and router.e_score_correction_bias.abs().sum() > 0
    g = load_model("tiny-granite-hybrid", dtype=torch.float32, device="cpu").model
    assert g.is_tied
    assert list(g.kv_cache_specs()) == ["model.layers.0.mamba", "model.layers.1.self_attn",
                                        "model.layers.2.mamba", "model.layers.3.mamba"]
    ga = g.model.layers[1].self_attn
    assert ga.scale == 0.2 and ga.rotary is not None


def test_nemotron_h_never_ties_and_reads_the_pattern(tmp_path):
    """tie_word_embeddings is ignored by HF's NemotronH (no tied weights); a config.json with the
    legacy hybrid_override_pattern (as NVIDIA's releases) loads with the same layer kinds."""
    cfg = _rebuilt("tiny-nemotron-h", tie_word_embeddings=True)
    torch.manual_seed(2)
    hf = AutoModelForCausalLM.from_config(cfg)
    assert hf.lm_head.weight is not hf.model.embeddings.weight
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["hybrid_override_pattern"] = NemotronHConfig._list_to_pattern(raw.pop("layers_block_type"))
    assert raw["hybrid_override_pattern"] == "M-MEM*E"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    assert not ours.is_tied and torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    assert [b.layer_type for b in ours.model.layers] == ["mamba", "mlp", "mamba", "moe", "mamba", "attention", "moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_layout_matches_save_pretrained(arch, tmp_path):
    """In memory: HF 5.x's state_dict names and shapes; on disk: what save_pretrained writes
    (NemotronH: backbone. + per-expert up/down_proj; Granite: block_sparse_moe.input_linear ...)."""
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(PRESETS[arch]())
    ours = load_model(arch, dtype=torch.float32, device="cpu").model
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    hf.save_pretrained(tmp_path / "hf")
    save_hf_folder(ours, tmp_path / "ours")
    on_disk_hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    on_disk_ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert {k: v.shape for k, v in on_disk_ours.items()} == {k: v.shape for k, v in on_disk_hf.items()}
    if arch == "tiny-nemotron-h":
        assert "backbone.layers.3.mixer.experts.2.up_proj.weight" in on_disk_ours
        assert "backbone.layers.3.mixer.gate.e_score_correction_bias" in on_disk_ours
        sd = ours.state_dict()
        back = merge_nemotron_h_experts(split_nemotron_h_experts(sd))
        assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
        dropped = "backbone.layers.6.mixer.experts.1.down_proj.weight"
        merged = merge_nemotron_h_experts({k: v for k, v in on_disk_ours.items() if k != dropped})
        assert "backbone.layers.6.mixer.experts.up_proj" not in merged
        assert "backbone.layers.3.mixer.experts.up_proj" in merged
    else:
        assert "model.layers.1.block_sparse_moe.input_linear.weight" in on_disk_ours
        assert "lm_head.weight" not in on_disk_ours                       # tied
    # our folder loads in HF with the same weights (and HF's in ours: the hf-init pairs)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_nemotron_h_group_routing_with_correction_bias(tmp_path):
    """Group-limited selection (2 groups of 2, one kept) on a non-zero e_score_correction_bias
    (HF initialises it to zero), top-1, routed_scaling_factor 2.5, un-normalised."""
    cfg = _rebuilt("tiny-nemotron-h", n_group=2, topk_group=1, num_experts_per_tok=1, norm_topk_prob=False)
    torch.manual_seed(11)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    assert ours.model.layers[3].mixer.gate.e_score_correction_bias.abs().sum() > 0
    seq = random_prompt(12, 30)
    with torch.no_grad():
        ref = hf(seq[None], use_cache=False).logits[0].float()
    assert_close(run_steps(ours, seq, [13, 16, 1]), ref)


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_bf16_checkpoint_loads_and_runs(arch, tmp_path):
    """bf16 HF checkpoints load exactly (as fp32) and run in bf16."""
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(PRESETS[arch]()).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    m = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    remap = type(m).remap_checkpoint_key
    want = {remap(k): v for k, v in stored.items()}
    if arch == "tiny-nemotron-h":
        want = merge_nemotron_h_experts(want)
    for k, v in m.state_dict().items():
        if k == "lm_head.weight" and m.is_tied:
            continue
        assert v.dtype == torch.float32 and torch.equal(v, want[k].float()), k
    m16 = load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu").model
    out = run_steps(m16, random_prompt(8, 22), [10, 10, 1, 1])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


# ---- runner level: LLM(...) against HF generate ------------------------------------------------

@pytest.fixture(scope="module", params=list(ARCHS) + [f"hf-random-{a}" for a in ARCHS])
def model_pair(request, tmp_path_factory):
    """(LLM model argument, HF folder with the same weights)."""
    return save_model_pair(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def hf_model(model_pair):
    """HF model whose generate ignores EOS (harness.load_hf says why: hf-random-tiny-nemotron-h's
    greedy token is EOS at step 1 of the 5-token prompt)."""
    return load_hf(model_pair[1])


def test_single_request_matches_hf(model_pair, hf_model):
    with LLM(model_pair[0], **F32) as llm:
        assert type(llm.model_runner.model_state) is MambaHybridModelState
        check_single_request_matches_hf(llm, hf_model)


def test_batch_with_chunked_prefill_and_queueing_matches_hf(model_pair, hf_model):
    with LLM(model_pair[0], **F32, **BATCH_LIMITS) as llm:
        check_chunked_mixed_queued_batch_matches_hf(llm, hf_model)


# ---- inspect="full" records the Mamba2 states ----------------------------------------------------

def check_continuity(work: Workload) -> int:
    """test_inspect_states.check_continuity without its "every step changes the conv state" clause:
    tiny-granite-hybrid's greedy outputs repeat one token (e.g. 29, 29, 29, ...), and layer 0's conv
    window then holds K equal inputs before and after a step. Per request: 'before' is zero at its
    fresh start, else bit-identical to its previous step's 'after', in the same slot. Returns the
    number of state tensors checked."""
    checked = 0
    for rid in work.tokens:
        prev = None
        for rec, row in work.steps_of(rid):
            s = rec.scheduled[row]
            for st in rec.states:
                before = st.of(rid, "before")
                for n in st.state_names:
                    where = f"request {rid} step {rec.step_index} {st.layer_name} {n}"
                    if s.num_computed_before == 0:
                        assert not before[n].any(), f"{where}: 'before' at a fresh start is not zero"
                    else:
                        p_rec, p_row = prev
                        assert p_rec.scheduled[p_row].num_computed_before + p_rec.scheduled[p_row].num_tokens \
                            == s.num_computed_before
                        assert p_rec.states[0].slots[p_row] == st.slots[row], f"{where}: slot changed"
                        assert torch.equal(p_rec.state(st.layer_name).of(rid, "after")[n], before[n]), where
                    checked += 1
            prev = (rec, row)
    return checked


@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_full_records_mamba2_states(arch, tmp_path):
    """Every step records a state for each Mamba2 mixer (and only those: no MLP / MoE / attention
    layer), for every row; 'after' continues into the next 'before'; each 'after' equals HF's cache
    after a forward over the same tokens (fp32, atol 1e-5)."""
    work = run_workload(arch, arch, str(tmp_path))
    with torch.device("meta"):
        model = get_model_class(PRESETS[arch]())(PRESETS[arch]())
    mamba_names = [n for n, m in model.named_modules() if isinstance(m, Mamba2Mixer)]
    assert list(work.recurrent_layers) == mamba_names and len(mamba_names) >= 3
    assert any(r.num_decodes and r.num_prefills for r in work.records)
    for rec in work.records:
        assert [s.layer_name for s in rec.states] == mamba_names
        for st in rec.states:
            assert st.mamba_type == "mamba2" and st.state_names == ["conv_state", "ssm_state"]
            assert st.request_ids == rec.request_ids
            for t, shape in zip(st.after, work.recurrent_layers[st.layer_name].state_shapes()):
                assert tuple(t.shape) == (len(st.request_ids), *shape) and torch.isfinite(t).all()
    assert check_continuity(work) > 0
    hf = AutoModelForCausalLM.from_pretrained(work.folder, dtype=torch.float32).eval()
    compared, _ = check_against_hf(work, hf)
    assert compared > 0
