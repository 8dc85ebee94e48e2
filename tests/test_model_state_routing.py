"""Which model state runs a model (toolkit/runner/model_states.py): every preset, the shape-true
ones too, is routed by its class facts (attention-only: DefaultModelState; hybrid or
attention-free: MambaHybridModelState), in the engine as well; a model may name its own state
class; model kinds not supported yet, and a Mamba model given the default state, fail loudly."""
from __future__ import annotations

import pytest
import torch

from toolkit import LLM, ModelStateError
from toolkit.config import RunnerConfig
from toolkit.errors import NotSupportedYetError
from toolkit.models import PRESETS as PRESET_CONFIGS
from toolkit.models import get_model_class
from toolkit.runner.model_states import DefaultModelState, MambaHybridModelState, init_model_state

from harness import ENGINE_PRESETS, F32

SMALL = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)
EXPECTED_STATE = {"tiny-llama": DefaultModelState}


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
    if preset in ENGINE_PRESETS:
        with LLM(preset, **F32, max_num_seqs=2) as llm:
            assert type(llm.model_runner.model_state) is want


@pytest.mark.parametrize("preset, state", [("tiny-llama", DefaultModelState),
                                           ("tiny-mamba2", MambaHybridModelState),
                                           ("tiny-bamba", MambaHybridModelState),
                                           ("tiny-nemotron-h", MambaHybridModelState),
                                           ("tiny-granite-hybrid", MambaHybridModelState),
                                           ("tiny-qwen3-next", MambaHybridModelState),
                                           ("tiny-zamba2", MambaHybridModelState),
                                           ("tiny-falcon-h1", MambaHybridModelState)])
def test_llm_runs_the_model_state_of_its_preset(preset, state):
    with LLM(preset, **SMALL) as llm:
        assert type(llm.model_runner.model_state) is state
        assert type(init_model_state(llm.model, llm.cfg)) is state
        if preset == "tiny-mamba2":
            assert llm.model.is_attention_free and not llm.model.is_hybrid


def test_model_provided_state_class_wins():
    class MyState(DefaultModelState):
        pass
    with LLM("tiny-llama", **SMALL) as llm:
        llm.model.get_model_state_cls = lambda: MyState
        assert type(init_model_state(llm.model, llm.cfg)) is MyState


def test_unsupported_model_kinds_raise_not_supported_yet():
    with LLM("tiny-llama", **SMALL) as llm:
        llm.model.model.layers[0].self_attn.attn_type = "encoder_only"
        with pytest.raises(NotSupportedYetError, match="encoder-only"):
            init_model_state(llm.model, llm.cfg)
        llm.model.model.layers[0].self_attn.attn_type = "encoder_decoder"
        with pytest.raises(NotSupportedYetError, match="encoder-decoder"):
            init_model_state(llm.model, llm.cfg)


def test_mamba_model_routed_to_default_state_fails_loudly(monkeypatch):
    import toolkit.runner.model_runner as mr
    monkeypatch.setattr(mr, "init_model_state", lambda model, cfg: DefaultModelState(model, cfg))
    with pytest.raises(ModelStateError, match="MambaHybridModelState"):
        LLM("tiny-mamba2", **SMALL)
