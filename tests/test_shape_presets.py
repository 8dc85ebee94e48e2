"""The shape-true presets (`is_shape_preset`: real per-layer dimensions, random weights) build the
same tensors as transformers' class for the same config, and their layers are the kinds their
docstrings name. On the meta device: nothing is allocated, so the multi-GB presets cost nothing here.
(tests/test_compile_for_gpus.py compiles their kernels, cut to one layer of each kind.)"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolkit.models import PRESETS, get_model_class
from toolkit.models.minimax import DECAY_TABLES  # HF's lightning decay tables: derived here, not kept
from toolkit.models.presets import is_shape_preset

SHAPE_PRESETS = sorted(p for p in PRESETS if is_shape_preset(p))

# preset -> (layer kinds in order, parameters): the figures the presets' docstrings give
ZOO_III = {
    "qwen3.5-9b-shape-4l": (["linear_attention"] * 3 + ["full_attention"], 2_899_186_752),
    "qwen3.5-35b-a3b-shape-2l": (["linear_attention", "full_attention"], 2_696_067_776),
    "olmo-hybrid-7b-shape-4l": (["linear_attention"] * 3 + ["full_attention"], 1_603_227_636),
    "kimi-linear-48b-a3b-shape-2l": (["linear_attention", "full_attention"], 2_706_923_424),
    "lfm2-8b-a1b-shape-4l": (["conv", "conv", "full_attention", "conv"], 987_926_656),
    "minimax-text-01-shape-2l": (["linear_attention", "full_attention"], 13_695_358_976),
    "xlstm-7b-shape-4l": (["mlstm"] * 4, 1_218_760_768),
}
# whole-model shape presets (no layer cut): preset -> parameters
WHOLE = {"lfm3-1.7b-shape": 1_728_801_536}


def _meta_models(name: str):
    cfg = PRESETS[name]()
    with torch.device("meta"):
        return cfg, get_model_class(cfg)(cfg), AutoModelForCausalLM.from_config(cfg)


def test_whole_shape_presets_keep_every_layer():
    for name, params in WHOLE.items():
        cfg, ours, _ = _meta_models(name)
        assert len(ours.model.layers) == cfg.num_hidden_layers == type(cfg)().num_hidden_layers
        assert sum(p.numel() for p in ours.parameters()) == params


def test_shape_presets_are_named_so():
    assert set(ZOO_III) <= set(SHAPE_PRESETS)
    assert not any(is_shape_preset(p) for p in PRESETS if p.startswith("tiny-"))


@pytest.mark.parametrize("name", SHAPE_PRESETS)
def test_shape_preset_builds_hf_tensors(name):
    cfg, ours, hf = _meta_models(name)
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf.state_dict().items() if not k.endswith(DECAY_TABLES)}


@pytest.mark.parametrize("name", sorted(ZOO_III))
def test_zoo_iii_shape_preset_layers_and_size(name):
    kinds, params = ZOO_III[name]
    cfg, ours, _ = _meta_models(name)
    assert [layer.layer_type for layer in ours.body.layers] == kinds
    assert sum(p.numel() for p in ours.parameters()) == params
    assert f"-shape-{len(kinds)}l" in name                 # the name says how many layers were kept
