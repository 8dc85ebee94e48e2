"""Runner-level checks across the model zoo: routing of every preset, hybrids without attention
layers against HF without cache, and the unforwarded-field warmup check for every Mamba builder."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness import F32, NO_ATTENTION, PRESETS, assert_matches_hf, load_hf, prompts_of, run_by_hand
from toolkit import LLM, MetadataContractError
from toolkit.config import RunnerConfig
from toolkit.models import PRESETS as PRESET_CONFIGS
from toolkit.models import get_model_class
from toolkit.runner.model_states import DefaultModelState, MambaHybridModelState, init_model_state

EXPECTED_STATE = {"tiny-llama": DefaultModelState}


def no_attention_folder(preset: str, folder) -> str:
    cfg = PRESET_CONFIGS[preset]()
    cfg = type(cfg)(**{**cfg.to_dict(), **NO_ATTENTION[preset]})
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("preset", sorted(PRESET_CONFIGS))
def test_every_preset_routes_by_its_class_facts(preset):
    """All presets, the shape-true ones too (built on the meta device: no memory, no weights)."""
    config = PRESET_CONFIGS[preset]()
    with torch.device("meta"):
        model = get_model_class(config)(config)
    cfg = RunnerConfig(device=torch.device("cpu"), dtype=torch.float32, max_num_seqs=2,
                       max_num_batched_tokens=16, block_size=16, max_model_len=64,
                       num_kv_blocks=None, seed=0)
    want = EXPECTED_STATE.get(preset, MambaHybridModelState)
    assert type(init_model_state(model, cfg)) is want
    assert (want is MambaHybridModelState) == (model.is_hybrid or model.is_attention_free)
    if preset in PRESETS:
        with LLM(preset, **F32, max_num_seqs=2) as llm:
            assert type(llm.model_runner.model_state) is want


@pytest.mark.parametrize("preset", sorted(NO_ATTENTION))
def test_hybrid_without_attention_layers_matches_hf_uncached(preset, tmp_path):
    """HF's cached generate crashes on these configs, so HF runs with use_cache=False."""
    folder = no_attention_folder(preset, tmp_path)
    hf = load_hf(folder)
    with LLM(folder, **F32, max_num_seqs=2, max_num_batched_tokens=16) as llm:
        assert [g.kind for g in llm.model_runner.kv_cache_groups] == ["mamba"]
        assert type(llm.model_runner.model_state) is MambaHybridModelState
        prompts = prompts_of([1, 23, 9], llm.vocab_size, seed=4)
        res = run_by_hand(llm, prompts, 5)
        for rid, prompt in zip(res.tokens, prompts):
            assert_matches_hf(hf, prompt, res.tokens[rid], res.logits[rid], 5, use_cache=False)


def _forget_upper_bound(monkeypatch):
    original = MambaHybridModelState.attn_metadata_kwargs

    def forgets(self, input_batch, for_capture):
        kwargs = original(self, input_batch, for_capture)
        kwargs.pop("seq_lens_cpu_upper_bound")
        return kwargs
    monkeypatch.setattr(MambaHybridModelState, "attn_metadata_kwargs", forgets)


@pytest.mark.parametrize("model, builder", [
    ("tiny-mamba", "Mamba1MetadataBuilder"), ("tiny-falcon-mamba", "Mamba1MetadataBuilder"),
    ("tiny-mamba2", "Mamba2MetadataBuilder"), ("no-attention:tiny-lfm2", "ShortConvMetadataBuilder"),
    ("no-attention:tiny-jamba", "Mamba1MetadataBuilder"),
    ("tiny-jamba", "PagedAttentionMetadataBuilder"), ("tiny-lfm2", "PagedAttentionMetadataBuilder")])
def test_warmup_names_field_and_builder_for_every_builder(monkeypatch, tmp_path, model, builder):
    if model.startswith("no-attention:"):
        model = no_attention_folder(model.split(":")[1], tmp_path)
    with LLM(model, **F32, max_num_seqs=2, max_num_batched_tokens=16) as llm:
        _forget_upper_bound(monkeypatch)
        with pytest.raises(MetadataContractError) as err:
            llm.warmup(progress=False)
        assert (err.value.field, err.value.builder) == ("seq_lens_cpu_upper_bound", builder)
        assert builder in str(err.value) and "MambaHybridModelState" in str(err.value)
