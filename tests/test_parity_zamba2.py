"""Zamba2 (`Zamba2ForCausalLM`: Mamba2 layers and hybrid layers sharing transformer blocks)
reproduces HF transformers, for the preset and an HF-initialised checkpoint: the model
(`ModelParitySuite`: fp32 logits within 1e-4 in one shot, in chunked prefill + decode, in mixed
decode/prefill steps, a profile run touching no cache; shared blocks tied as in HF), config variants
(untied blocks with GQA and without adapters or RoPE; one block shared by every hybrid layer), and
the engine against HF's generate (`RunnerParityChecks`); the routing facts and cache layout (one KV
cache per hybrid layer although blocks share weights), the checkpoint layout of tied shared blocks
(stored once, under their first hybrid layer), a tied config whose stored copies differ, and bf16
checkpoints.

HF quirk (transformers 5.x `Zamba2MambaMixer`): dt is clamped below at `time_step_min` (1e-3) in the
chunked (prefill / uncached) path only; the cached one-token decode path skips the clamp, so HF's
own cached `generate` drifts from its uncached forward (by ~5e-3 on tiny-zamba2). The toolkit
applies the clamp everywhere, i.e. follows HF's uncached forward, which is the logit reference of
every parity check here (`test_hf_cached_decode_skips_the_dt_clamp` pins the quirk; greedy tokens
still equal HF's cached `generate`).
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from toolkit import LLM
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.models import PRESETS, get_model_class, load_model, save_hf_folder
from toolkit.models.zamba2 import Zamba2ForCausalLM, zamba2_shared_block_ties
from toolkit.runner.model_states import MambaHybridModelState, init_model_state

from harness import F32, load_hf, prompts_of, run_by_hand
from harness import hf_logits as hf_logits_uncached
from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    check_bf16_load_runs,
    meta_model_specs_and_groups,
    random_prompt,
    rebuilt_config,
    run_steps,
    save_bf16_checkpoint,
    shapes,
)

ARCH = "tiny-zamba2"
# Zamba2Config fields derived in __post_init__; passed back as kwargs they would override the
# recomputed values (a stale hybrid_layer_ids makes HF's adapter lookup fail)
ZAMBA2_DERIVED = ("hybrid_layer_ids", "attention_hidden_size", "attention_head_dim", "mamba_headdim",
                  "kv_channels", "num_query_groups")


def _rebuilt(**changes):
    return rebuilt_config(ARCH, drop=ZAMBA2_DERIVED, **changes)


VARIANTS = {
    # independent blocks per hybrid layer (HF ties them only with tie_word_embeddings), GQA, no
    # attention adapters, no RoPE, biases, silu MLP, one group
    "zamba2-untied-gqa-no-rope": lambda: _rebuilt(
        tie_word_embeddings=False, num_key_value_heads=2, use_shared_attention_adapter=False,
        use_mem_rope=False, add_bias_linear=True, hidden_act="silu", mamba_ngroups=1),
    # one shared block for all three hybrid layers, a hybrid first layer, scaled RoPE
    "zamba2-one-block": lambda: _rebuilt(
        num_mem_blocks=1, layers_block_type=["hybrid", "mamba", "hybrid", "hybrid"],
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
}


class TestZamba2(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (ARCH,)
    VARIANTS = VARIANTS
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert shapes(ours) == shapes(hf)
        for model in (ours, hf):   # layers 1 and 3 share block 0 (tied config), in HF too
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
        else:
            w = [layers[i].shared_transformer.feed_forward.gate_up_proj.weight for i in (0, 2, 3)]
            assert w[0] is w[1] is w[2]


def test_routing_facts_and_cache_layout():
    """One KV cache per hybrid layer although layers 1 and 3 share block 0's weights."""
    assert Zamba2ForCausalLM.is_hybrid and not Zamba2ForCausalLM.is_attention_free
    assert get_model_class(PRESETS[ARCH]()) is Zamba2ForCausalLM
    z, specs, groups, cfg = meta_model_specs_and_groups(ARCH)
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


def test_llm_binds_an_attention_and_a_mamba_cache_group():
    """The runner allocates and binds both groups; the engine routes to MambaHybridModelState."""
    with LLM(ARCH, **F32, max_num_seqs=2) as llm:
        assert type(llm.model_runner.model_state) is MambaHybridModelState
        assert [g.kind for g in llm.model_runner.kv_cache_groups] == ["attention", "mamba"]
        assert set(llm.model_runner.kv_caches) == set(llm.model.kv_cache_specs())


@pytest.mark.parametrize("tie", [True, False])
def test_shared_block_checkpoint_layout(tie, tmp_path):
    """On disk, a tied config stores each shared block once (under its first hybrid layer), as
    save_pretrained does; an untied config stores every hybrid layer's block. Both directions."""
    cfg = _rebuilt(tie_word_embeddings=tie)
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
    pre = load_model(ARCH, dtype=torch.float32, device="cpu").model
    save_hf_folder(pre, tmp_path / "preset")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "preset")
    assert hf.model.layers[3].shared_transformer.self_attn.q_proj.weight is \
        hf.model.layers[1].shared_transformer.self_attn.q_proj.weight
    assert torch.equal(hf.model.layers[3].shared_transformer.feed_forward.gate_up_proj.weight,
                       pre.model.layers[1].shared_transformer.feed_forward.gate_up_proj.weight)


@torch.no_grad()
def test_tied_config_with_differing_stored_copies_stays_untied(tmp_path):
    """A tied config whose checkpoint stores a block's copy with other values: HF's from_pretrained
    leaves that pair untied (with a warning), and so do we; logits still match, and saving keeps
    both copies."""
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(PRESETS[ARCH]()).save_pretrained(tmp_path / "src")
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


def test_bf16_checkpoint_loads_exactly_and_runs(tmp_path):
    _, stored = save_bf16_checkpoint(ARCH, tmp_path)
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    m32 = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    for k, t in stored.items():
        assert torch.equal(m32.state_dict()[k], t.float()), k
    check_bf16_load_runs(tmp_path)


@torch.inference_mode()
def test_hf_cached_decode_skips_the_dt_clamp(hf_folders):
    """The HF quirk of the module docstring: HF's cached generate drifts from HF's uncached
    forward past the tolerance only because its decode path skips the time_step_min clamp; our
    runner's logits match the uncached forward."""
    name, folder = hf_folders(ARCH)
    with LLM(name, **F32) as llm:
        prompt = prompts_of([23], llm.vocab_size)[0]
        res = run_by_hand(llm, [prompt], 8)
    ours = next(iter(res.logits.values()))
    hf = load_hf(folder)

    def cached_vs_uncached() -> tuple[float, list[int]]:
        ids = torch.tensor([prompt], device=hf.device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0].tolist()
        ref = hf_logits_uncached(hf, tokens)[len(prompt) - 1:-1]
        return max((got[0].cpu() - r).abs().max().item() for got, r in zip(out.logits, ref)), tokens[len(prompt):]

    drift, hf_tokens = cached_vs_uncached()
    assert drift > 1e-3
    assert next(iter(res.tokens.values())) == hf_tokens
    ref = hf_logits_uncached(hf, prompt + hf_tokens)[len(prompt) - 1:-1]
    assert max((o - r).abs().max().item() for o, r in zip(ours, ref)) <= 1e-4
    for m in hf.modules():                       # without the clamp HF agrees with itself
        if hasattr(m, "time_step_limit"):
            m.time_step_limit = (0.0, float("inf"))
    assert cached_vs_uncached()[0] <= 1e-4
