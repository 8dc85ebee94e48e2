"""LFM2 (`Lfm2ForCausalLM`: gated short convs and attention layers) reproduces HF transformers,
for the preset and an HF-initialised checkpoint: the model (`ModelParitySuite`: fp32 logits within
1e-4 in one shot, in chunked prefill + decode, chunks shorter than the conv state, mixed
decode/prefill steps, a profile run touching no cache), an attention-free config, a config variant,
the engine against HF's generate (`RunnerParityChecks`, the shipped demo-hybrid too) and, on the
config without attention layers, against HF's uncached forward; the routing facts and cache specs,
the FFN width rule, the released configs' legacy keys, the shape-true preset's shapes; and the short
conv alone (fed in pieces, against HF's module)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Lfm2Config

from toolkit.attention.short_conv import ShortConvAttentionMetadata
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.layers.short_conv import ShortConv
from toolkit.models import PRESETS, get_model_class
from toolkit.models.lfm2 import Lfm2ForCausalLM, lfm2_ffn_dim

from harness import check_no_attention_llm_matches_hf_uncached
from model_helpers import (
    CHUNKS,
    DECODE_STEPS,
    MixedRequest,
    ModelParitySuite,
    RunnerParityChecks,
    SeqChunk,
    assert_close,
    base_mamba_metadata,
    hf_greedy,
    hf_logits,
    hf_random,
    random_prompt,
    run_steps,
)


@torch.no_grad()
def _hf_generate(hf, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """prompt + HF's greedy tokens from its own cached `generate` (needs an attention layer)."""
    out = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=steps,
                      min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0]


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf_logits(hf, ids, position_ids=True)


class TestLfm2(ModelParitySuite, RunnerParityChecks):
    ARCHS = ("tiny-lfm2",)
    DEMO_MODELS = ("demo-hybrid",)
    HF_POSITION_IDS = True
    MIXED_REQUESTS = {
        "A": MixedRequest(2, 21, 2, blocks=[5, 9], slot=3),   # 21-token prompt, then decodes
        "B": MixedRequest(3, 30, 0, blocks=[1, 6], slot=1),   # prefilled in two chunks (20 | 10)
        "C": MixedRequest(4, 5, 0, blocks=[8], slot=4),       # short prompt prefilled while A and B run
        "D": MixedRequest(5, 3, 0, blocks=[10], slot=5),      # 1-token prefill chunks next to decodes
    }
    MIXED_STEPS = [
        [("A", 0, 21), ("B", 0, 20), ("D", 0, 1)],
        [("A", 21, 1), ("B", 20, 10), ("C", 0, 5), ("D", 1, 1, False)],
        [("A", 22, 1), ("D", 2, 1)],
    ]
    PROFILE_PROMPT_SEED = 5

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        assert type(hf).__name__ == "Lfm2ForCausalLM" and isinstance(ours, Lfm2ForCausalLM)

    def hf_continue(self, hf, prompt: torch.Tensor, steps: int) -> torch.Tensor:
        return _hf_generate(hf, prompt, steps)

    @torch.no_grad()
    def test_chunks_shorter_than_conv_state(self, pair):
        """conv_L_cache 3 keeps 2 values; 1-token steps as prefill rows (from zero and continuing a
        state) and as decode rows, and a 2-token chunk, interleaved."""
        ours, hf = pair
        seq = random_prompt(7, 14)
        steps = [(1, False), (1, False), 1, 2, (1, False), 1, 5, 1, 1]
        assert_close(run_steps(ours, seq, steps), self.hf_logits(hf, seq))


def test_routing_facts_and_cache_specs():
    assert Lfm2ForCausalLM.is_hybrid and not Lfm2ForCausalLM.is_attention_free
    cfg = PRESETS["tiny-lfm2"]()
    assert get_model_class(cfg) is Lfm2ForCausalLM
    m = Lfm2ForCausalLM(cfg)
    assert m.is_tied                       # LFM2 ties lm_head to the embedding by default
    specs = m.kv_cache_specs()
    assert list(specs) == ["model.layers.0.conv", "model.layers.1.self_attn",
                           "model.layers.2.conv", "model.layers.3.self_attn"]
    assert specs["model.layers.0.conv"] == MambaSpec(shapes=((2, 64),), dtypes=(torch.float32,),
                                                     mamba_type="short_conv")
    assert specs["model.layers.1.self_attn"] == AttentionSpec(num_kv_heads=2, head_dim=16, dtype=torch.float32)


@torch.no_grad()
def test_config_without_attention_matches_hf(tmp_path):
    """All layers "conv". HF's cached generate crashes on such configs (`get_seq_length can only be
    called on Attention layers`, from create_causal_mask), so the reference is HF's forward with
    use_cache=False, and the greedy tokens come from re-running it."""
    cfg = PRESETS["tiny-lfm2"]()
    cfg.layer_types = ["conv"] * 4
    hf, ours = hf_random(cfg, tmp_path)
    assert all(isinstance(s, MambaSpec) for s in ours.kv_cache_specs().values())
    seq = hf_greedy(hf, random_prompt(6), DECODE_STEPS, position_ids=True)
    ref = _hf_logits(hf, seq)
    assert_close(run_steps(ours, seq, CHUNKS + [1] * DECODE_STEPS), ref)
    assert_close(run_steps(ours, seq, [1, (1, False), 2, 1, 30, 1, 1, 5]), ref)
    # with no attention layer the profile path (one sequence, zero state) is the real forward
    assert_close(ours.compute_logits(ours(seq, torch.arange(seq.numel()), None)), ref)


def test_llm_without_attention_layers_matches_hf_uncached(tmp_path):
    check_no_attention_llm_matches_hf_uncached("tiny-lfm2", tmp_path)


def _variant() -> Lfm2Config:
    cfg = PRESETS["tiny-lfm2"]()
    cfg.layer_types = ["full_attention", "conv", "conv", "full_attention"]
    cfg.conv_bias = True
    cfg.conv_L_cache = 4
    cfg.tie_word_embeddings = False
    cfg.block_auto_adjust_ff_dim = True       # 144 -> int(2*144/3) = 96 -> *1.5 = 144 -> up to 160
    cfg.intermediate_size = 144
    cfg.block_ffn_dim_multiplier = 1.5
    cfg.block_multiple_of = 32
    cfg.head_dim = 24                         # head_dim != hidden / heads
    cfg.norm_eps = 1e-3
    cfg.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    return cfg


@torch.no_grad()
def test_config_variant_matches_hf(tmp_path):
    """Conv/projection biases, conv_L_cache 4, FFN auto-adjust, untied, explicit head_dim, other
    eps, scaled RoPE, attention first."""
    hf, ours = hf_random(_variant(), tmp_path, bias_std=0.1)
    assert not ours.is_tied
    assert ours.model.layers[0].feed_forward.w1.out_features == 160
    assert ours.model.layers[1].conv.conv.bias is not None
    seq = _hf_generate(hf, random_prompt(8), 3)
    ref = _hf_logits(hf, seq)
    assert_close(run_steps(ours, seq, [10, 17, 10, 1, 1, 1]), ref)
    assert_close(run_steps(ours, seq, [2, (1, False), 1, 3, 1, 30, 1, 1]), ref)


@pytest.mark.parametrize("ff, auto, mult, multiple", [
    (128, False, 1.0, 256), (128, True, 1.0, 256), (6656, True, 1.0, 256), (12288, True, 1.0, 256),
    (300, True, 1, 256), (144, True, 1.5, 32), (1000, True, 0.7, 64),
])
def test_ffn_dim_matches_hf(ff, auto, mult, multiple):
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP as HFLfm2MLP

    cfg = Lfm2Config(hidden_size=8, intermediate_size=ff, block_auto_adjust_ff_dim=auto,
                     block_ffn_dim_multiplier=mult, block_multiple_of=multiple)
    with torch.device("meta"):
        assert lfm2_ffn_dim(cfg) == HFLfm2MLP(cfg).w1.out_features


def test_legacy_config_keys():
    """Released LFM2 config.json files use full_attn_idxs / tie_embedding / block_ff_dim;
    Lfm2Config maps them, and we build what HF builds from them."""
    cfg = Lfm2Config(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, full_attn_idxs=[1], tie_embedding=False, block_ff_dim=384)
    with torch.device("meta"):
        ours = Lfm2ForCausalLM(cfg)
        hf = AutoModelForCausalLM.from_config(cfg)
    assert [layer.layer_type for layer in ours.model.layers] == ["conv", "full_attention", "conv"]
    assert not ours.is_tied
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}


def test_shape_preset_matches_hf_shapes():
    """lfm2-350m-shape builds the same tensors as HF (on the meta device: nothing is allocated)."""
    cfg = PRESETS["lfm2-350m-shape"]()
    with torch.device("meta"):
        ours = get_model_class(cfg)(cfg)
        hf = AutoModelForCausalLM.from_config(cfg)
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert mine == theirs
    attn = [i for i, layer in enumerate(ours.model.layers) if layer.layer_type == "full_attention"]
    assert attn == [2, 5, 8, 10, 12, 14]
    assert ours.model.layers[0].feed_forward.w1.out_features == 4608
    assert ours.is_tied
    assert sum(p.numel() for p in ours.parameters()) == 354_483_968


# ------------------------------------------------------------------------------------------
# the short conv alone
# ------------------------------------------------------------------------------------------


def _random_short_conv(kernel: int, bias: bool, d: int = 24) -> ShortConv:
    layer = ShortConv(layer_name="conv", hidden_size=d, conv_kernel=kernel, bias=bias)
    g = torch.Generator().manual_seed(kernel)
    with torch.no_grad():  # O(1) activations throughout, so an absolute tolerance means something
        for name, p in layer.named_parameters():
            scale = 0.3 if name.endswith("bias") else 1.0 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return layer


@pytest.mark.parametrize("kernel, bias", [(3, False), (4, True), (2, True)])
@torch.no_grad()
def test_short_conv_in_pieces_equals_one_call(kernel, bias):
    """Two sequences fed in pieces (1-token prefill rows, decode rows, chunks shorter and longer
    than the conv state, both sequences in one step) equal one call over each whole sequence,
    and the final conv states are the last kernel-1 values of B*x."""
    d = 24
    layer = _random_short_conv(kernel, bias, d)
    g = torch.Generator().manual_seed(100 + kernel)
    xs = [torch.randn(19, d, generator=g), torch.randn(11, d, generator=g)]
    whole = [layer(x, None) for x in xs]                      # one call each, zero initial state

    state = torch.full((4, kernel - 1, d), float("nan"))
    layer.bind_kv_cache((state,))
    slots = [2, 3]
    # per step: rows (seq, start, length, is_decode); decode rows first
    schedule = [
        [(0, 0, 1, False), (1, 0, 2, False)],
        [(0, 1, 1, False), (1, 2, 1, False)],
        [(0, 2, 1, True), (1, 3, 5, False)],
        [(1, 8, 1, True), (0, 3, 12, False)],
        [(0, 15, 1, True), (1, 9, 1, True)],
        [(1, 10, 1, True), (0, 16, 3, False)],
    ]
    got = [torch.full_like(x, float("nan")) for x in xs]
    for rows in schedule:
        chunks = [SeqChunk(start, n, [0], slots[s], is_decode=dec) for s, start, n, dec in rows]
        md = {"conv": base_mamba_metadata(ShortConvAttentionMetadata, chunks)}
        out = layer(torch.cat([xs[s][start : start + n] for s, start, n, _ in rows]), md)
        off = 0
        for s, start, n, _ in rows:
            got[s][start : start + n] = out[off : off + n]
            off += n
    for s in range(2):
        torch.testing.assert_close(got[s], whole[s], rtol=0, atol=1e-5)
        B, _, x = layer.in_proj(xs[s]).split(d, dim=-1)
        torch.testing.assert_close(state[slots[s]], (B * x)[-(kernel - 1):], rtol=0, atol=1e-6)
    assert torch.isnan(state[0]).all() and torch.isnan(state[1]).all()   # other slots untouched
    layer.unbind_kv_cache()
    assert layer.conv_state is None


@torch.no_grad()
def test_short_conv_matches_hf_module():
    """Our layer's one-shot forward equals HF `Lfm2ShortConv` (no cache) on the same weights."""
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    cfg = Lfm2Config(hidden_size=24, conv_L_cache=4, conv_bias=True, num_hidden_layers=1, layer_types=["conv"])
    theirs = Lfm2ShortConv(cfg, 0).eval()
    ours = _random_short_conv(4, True)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(13, 24, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours(x, None), theirs(x[None])[0], rtol=0, atol=1e-5)
