"""LFM3 (`Lfm3ForCausalLM`: short convs, full and sliding-window attention with per-head output gates,
sandwich norms) reproduces HF transformers 5.24, for the preset and an HF-initialised checkpoint: the
model (`ModelParitySuite`: its prompts run far past the 4-token window), config variants, the engine
against HF's generate (`RunnerParityChecks`), the window's effect, the proportional RoPE's frequencies,
and the checkpoint layout save_pretrained writes (g_proj as gate_proj) both ways.
"""
from __future__ import annotations

import torch

from toolkit.layers.attention import PagedAttention
from toolkit.models import PRESETS, get_model_class, load_model
from toolkit.models.lfm3 import HeadGatedAttention, Lfm3ForCausalLM

from model_helpers import (
    ConfigVariantChecks,
    ModelParitySuite,
    RunnerParityChecks,
    random_prompt,
    run_steps,
    saved_both_ways,
    shapes,
)

ARCH = "tiny-lfm3"
KINDS = ["conv", "conv", "full_attention", "conv", "sliding_attention", "conv"]


def _variant_plain_window_1():
    """No sandwich norms, no attention gate, a window of 1 (a token sees itself only), conv L_cache 3."""
    cfg = PRESETS[ARCH]()
    cfg.use_sandwich_norm = False
    cfg.use_attention_gate = False
    cfg.sliding_window = 1
    cfg.conv_L_cache = 3
    return cfg


def _variant_two_sliding_layers():
    """Sliding layers 1 and 4, window 9 (longer than the chunks, shorter than the prompt)."""
    cfg = PRESETS[ARCH]()
    cfg.layer_types = ["conv", "sliding_attention", "full_attention", "conv", "sliding_attention", "conv"]
    cfg.sliding_window = 9
    return cfg


class TestLfm3(ModelParitySuite, ConfigVariantChecks, RunnerParityChecks):
    ARCHS = (ARCH,)
    HF_POSITION_IDS = True
    VARIANTS = {"plain-window-1": _variant_plain_window_1, "two-sliding-layers": _variant_two_sliding_layers}
    VARIANT_PROMPT_SEED = 7

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert [b.layer_type for b in ours.model.layers] == KINDS
        assert sorted(ours.state_dict()) == sorted(hf.state_dict())

    def hf_continue(self, hf, prompt: torch.Tensor, steps: int) -> torch.Tensor:
        out = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=steps,
                          min_new_tokens=steps, do_sample=False, pad_token_id=0)
        return out[0]

    def check_variant(self, variant: str, ours) -> None:
        if variant == "plain-window-1":
            attn = ours.model.layers[4].self_attn
            assert type(attn) is PagedAttention and attn.sliding_window == 1
            assert isinstance(ours.model.layers[0].post_operator_norm, torch.nn.Identity)
        else:
            assert ours.model.layers[1].self_attn.sliding_window == 9


def test_layer_kinds_windows_and_rope():
    cfg = PRESETS[ARCH]()
    assert get_model_class(cfg) is Lfm3ForCausalLM
    m = load_model(ARCH, dtype=torch.float32, device="cpu").model
    full, sliding = m.model.layers[2].self_attn, m.model.layers[4].self_attn
    assert isinstance(full, HeadGatedAttention) and full.sliding_window is None and sliding.sliding_window == 4
    assert m.model.layers[0].conv.state_shapes() == ((6, 64),)
    # proportional RoPE, partial 0.5: 4 of the 8 frequency pairs rotate (theta 1e6), the rest stand still
    f = full.rotary.inv_freq(torch.device("cpu"))
    assert f.shape == (8,) and (f[:4] > 0).all() and (f[4:] == 0).all()
    torch.testing.assert_close(f[:4], 1.0 / 1e6 ** (torch.arange(0, 8, 2) / 16))
    torch.testing.assert_close(sliding.rotary.inv_freq(torch.device("cpu")), 1.0 / 1e4 ** (torch.arange(0, 16, 2) / 16))


@torch.no_grad()
def test_the_window_changes_what_a_sliding_layer_sees():
    """Past the window the logits depend on it: the preset with sliding_window 4 against the same weights
    with a window longer than the prompt (then equal to full attention there); equal before it."""
    ours = load_model(ARCH, dtype=torch.float32, device="cpu").model
    seq = random_prompt(3, 12)
    windowed = run_steps(ours, seq, [12])
    ours.model.layers[4].self_attn.sliding_window = 64
    wide = run_steps(ours, seq, [12])
    assert torch.equal(windowed[:4], wide[:4])
    assert (windowed[4:] - wide[4:]).abs().amax(dim=-1).min() > 1e-4


def test_checkpoint_layout_matches_save_pretrained(tmp_path):
    """On disk both ways: the head gate as self_attn.gate_proj, the sandwich norms."""
    hf, ours, on_disk_hf, on_disk_ours = saved_both_ways(ARCH, tmp_path)
    assert sorted(on_disk_ours) == sorted(on_disk_hf)
    assert on_disk_hf["model.layers.4.self_attn.gate_proj.weight"].shape == (4, 64)
    assert "model.layers.0.post_ffn_norm.weight" in on_disk_hf
    assert shapes(ours) == shapes(hf)
