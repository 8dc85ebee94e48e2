"""LFM2 (`Lfm2ForCausalLM`) and its gated short conv reproduce HF transformers (fp32, atol 1e-4):
one shot, chunked prefill + decode (chunks shorter than the conv state included), mixed
decode/prefill steps, an attention-free config, config variants; plus the short conv's state
handling on its own and the shape-true preset's shapes."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Lfm2Config

from model_helpers import SeqChunk, allocate_caches, build_metadata, one_seq_metadata, short_conv_metadata
from toolkit.layers.short_conv import ShortConv
from toolkit.models import PRESETS, get_model_class, load_model, save_hf_folder
from toolkit.models.lfm2 import Lfm2ForCausalLM, lfm2_ffn_dim
from toolkit.runner.kv_cache_spec import AttentionSpec, MambaSpec

ATOL = 1e-4
PROMPT_LEN = 37
CHUNKS = [10, 17, 10]
DECODE_STEPS = 5
VOCAB = 320


def _assert_close(got: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (got - ref).abs().max().item()
    assert diff <= ATOL, f"max |logit diff| {diff:.3e} > {ATOL}"
    return diff


def _prompt(seed: int, n: int = PROMPT_LEN) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g)


@torch.no_grad()
def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None], position_ids=torch.arange(ids.numel())[None], use_cache=False).logits[0].float()


@torch.no_grad()
def _hf_generate(hf, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """prompt + HF's greedy tokens from its own cached `generate` (needs an attention layer)."""
    out = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=steps,
                      min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0]


@torch.no_grad()
def _hf_greedy_uncached(hf, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    seq = prompt.clone()
    for _ in range(steps):
        seq = torch.cat([seq, _hf_logits(hf, seq)[-1].argmax()[None]])
    return seq


@torch.no_grad()
def _run_steps(ours, seq: torch.Tensor, steps: list[int | tuple[int, bool]], *, slot: int = 2) -> torch.Tensor:
    """Feed `seq` as one request in the given steps (q or (q, is_decode)); logits of every token."""
    allocate_caches(ours)
    done, outs = 0, []
    for st in steps:
        q, is_decode = st if isinstance(st, tuple) else (st, None)
        md = one_seq_metadata(ours, done, q, [4, 2, 7, 6], state_slot=slot, is_decode=is_decode)
        outs.append(ours.compute_logits(ours(seq[done : done + q], torch.arange(done, done + q), md)))
        done += q
    assert done == seq.numel()
    return torch.cat(outs)


@pytest.fixture(scope="module", params=["preset", "hf-init"])
def pair(request, tmp_path_factory):
    """(our model, HF model) with identical weights: our preset saved for HF, or an HF-initialised
    random model saved for us."""
    folder = tmp_path_factory.mktemp(f"lfm2-{request.param}")
    if request.param == "preset":
        ours = load_model("tiny-lfm2", dtype=torch.float32, device="cpu").model
        save_hf_folder(ours, folder)
        hf = AutoModelForCausalLM.from_pretrained(folder)
    else:
        torch.manual_seed(1234)
        hf = AutoModelForCausalLM.from_config(PRESETS["tiny-lfm2"]())
        hf.save_pretrained(folder)
        ours = load_model(str(folder), dtype=torch.float32, device="cpu").model
    assert type(hf).__name__ == "Lfm2ForCausalLM" and isinstance(ours, Lfm2ForCausalLM)
    return ours, hf.to(torch.float32).eval()


def test_class_facts_and_cache_specs():
    assert Lfm2ForCausalLM.is_hybrid and not Lfm2ForCausalLM.is_attention_free
    cfg = PRESETS["tiny-lfm2"]()
    assert get_model_class(cfg) is Lfm2ForCausalLM
    m = Lfm2ForCausalLM(cfg)
    assert m.is_tied                       # LFM2 ties lm_head to the embedding by default
    specs = m.kv_cache_specs()
    assert list(specs) == ["model.layers.0.conv", "model.layers.1.self_attn",
                           "model.layers.2.conv", "model.layers.3.self_attn"]
    assert specs["model.layers.0.conv"] == MambaSpec(shapes=((2, 64),), dtypes=(torch.float32,), mamba_type="short_conv")
    assert specs["model.layers.1.self_attn"] == AttentionSpec(num_kv_heads=2, head_dim=16, dtype=torch.float32)


@torch.no_grad()
def test_full_prompt(pair):
    ours, hf = pair
    ids = _prompt(0)
    allocate_caches(ours)
    md = one_seq_metadata(ours, 0, PROMPT_LEN, [3, 1, 5], state_slot=1)
    got = ours.compute_logits(ours(ids, torch.arange(PROMPT_LEN), md))
    assert got.dtype == torch.float32 and got.shape == (PROMPT_LEN, VOCAB)
    _assert_close(got, _hf_logits(hf, ids))


@torch.no_grad()
def test_chunked_prefill_then_decode(pair):
    ours, hf = pair
    seq = _hf_generate(hf, _prompt(1), DECODE_STEPS)
    _assert_close(_run_steps(ours, seq, CHUNKS + [1] * DECODE_STEPS), _hf_logits(hf, seq))


@torch.no_grad()
def test_chunks_shorter_than_conv_state(pair):
    """conv_L_cache 3 keeps 2 values; 1-token steps as prefill rows (from zero and continuing a
    state) and as decode rows, and a 2-token chunk, interleaved."""
    ours, hf = pair
    seq = _prompt(7, 14)
    steps = [(1, False), (1, False), 1, 2, (1, False), 1, 5, 1, 1]
    _assert_close(_run_steps(ours, seq, steps), _hf_logits(hf, seq))


@torch.no_grad()
def test_mixed_decode_prefill_batch(pair):
    """Decode rows and (continuing) prefill rows share a step; each matches its own HF run."""
    ours, hf = pair
    a = _hf_generate(hf, _prompt(2, 21), 2)   # A: 21-token prompt, then decodes
    b = _prompt(3, 30)                        # B: prefilled in two chunks (20 | 10)
    c = _prompt(4, 5)                         # C: short prompt prefilled while A and B run
    d = _prompt(5, 3)                         # D: 1-token prefill chunks next to decodes
    ref_a, ref_b, ref_c, ref_d = (_hf_logits(hf, s) for s in (a, b, c, d))
    allocate_caches(ours, num_slots=6)
    A, B, C, D = (dict(blocks=bl, slot=sl) for bl, sl in (([5, 9], 3), ([1, 6], 1), ([8], 4), ([10], 5)))

    def step(rows, ids, pos):
        md = build_metadata(ours, rows)
        return ours.compute_logits(ours(torch.cat(ids), torch.cat(pos), md))

    out = step(
        [SeqChunk(0, 21, A["blocks"], A["slot"]), SeqChunk(0, 20, B["blocks"], B["slot"]),
         SeqChunk(0, 1, D["blocks"], D["slot"])],
        [a[:21], b[:20], d[:1]], [torch.arange(21), torch.arange(20), torch.arange(1)],
    )
    _assert_close(out[:21], ref_a[:21])
    _assert_close(out[21:41], ref_b[:20])
    _assert_close(out[41:], ref_d[:1])
    out = step(
        [SeqChunk(21, 1, A["blocks"], A["slot"]), SeqChunk(20, 10, B["blocks"], B["slot"]),
         SeqChunk(0, 5, C["blocks"], C["slot"]), SeqChunk(1, 1, D["blocks"], D["slot"], is_decode=False)],
        [a[21:22], b[20:], c, d[1:2]],
        [torch.arange(21, 22), torch.arange(20, 30), torch.arange(5), torch.arange(1, 2)],
    )
    _assert_close(out[:1], ref_a[21:22])
    _assert_close(out[1:11], ref_b[20:])
    _assert_close(out[11:16], ref_c)
    _assert_close(out[16:], ref_d[1:2])
    out = step(
        [SeqChunk(22, 1, A["blocks"], A["slot"]), SeqChunk(2, 1, D["blocks"], D["slot"])],
        [a[22:23], d[2:3]], [torch.arange(22, 23), torch.arange(2, 3)],
    )
    _assert_close(out[:1], ref_a[22:23])
    _assert_close(out[1:], ref_d[2:3])


@torch.no_grad()
def test_profile_run_touches_no_cache(pair):
    ours, _ = pair
    caches = allocate_caches(ours, fill=0.5)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else tuple(t.clone() for t in v)) for k, v in caches.items()}
    hidden = ours(_prompt(5, 40), torch.arange(40), None)
    assert hidden.shape == (40, 64) and torch.isfinite(hidden).all()
    for k, v in caches.items():
        now = v if isinstance(v, tuple) else (v,)
        old = before[k] if isinstance(before[k], tuple) else (before[k],)
        assert all(torch.equal(x, y) for x, y in zip(now, old)), k


def _hf_random(cfg, folder, bias_std: float = 0.0):
    torch.manual_seed(99)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    if bias_std:
        with torch.no_grad():  # HF zero-inits biases; make them non-zero so their names matter
            for name, p in hf.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, bias_std)
    hf.save_pretrained(folder)
    return hf, load_model(str(folder), dtype=torch.float32, device="cpu").model


@torch.no_grad()
def test_config_without_attention_matches_hf(tmp_path):
    """All layers "conv". HF's cached generate crashes on such configs (`get_seq_length can only be
    called on Attention layers`, from create_causal_mask), so the reference is HF's forward with
    use_cache=False, and the greedy tokens come from re-running it."""
    cfg = PRESETS["tiny-lfm2"]()
    cfg.layer_types = ["conv"] * 4
    hf, ours = _hf_random(cfg, tmp_path)
    assert all(isinstance(s, MambaSpec) for s in ours.kv_cache_specs().values())
    seq = _hf_greedy_uncached(hf, _prompt(6), DECODE_STEPS)
    ref = _hf_logits(hf, seq)
    _assert_close(_run_steps(ours, seq, CHUNKS + [1] * DECODE_STEPS), ref)
    _assert_close(_run_steps(ours, seq, [1, (1, False), 2, 1, 30, 1, 1, 5]), ref)
    # with no attention layer the profile path (one sequence, zero state) is the real forward
    _assert_close(ours.compute_logits(ours(seq, torch.arange(seq.numel()), None)), ref)


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
    hf, ours = _hf_random(_variant(), tmp_path, bias_std=0.1)
    assert not ours.is_tied
    assert ours.model.layers[0].feed_forward.w1.out_features == 160
    assert ours.model.layers[1].conv.conv.bias is not None
    seq = _hf_generate(hf, _prompt(8), 3)
    ref = _hf_logits(hf, seq)
    _assert_close(_run_steps(ours, seq, [10, 17, 10, 1, 1, 1]), ref)
    _assert_close(_run_steps(ours, seq, [2, (1, False), 1, 3, 1, 30, 1, 1]), ref)


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
        md = {"conv": short_conv_metadata(chunks)}
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
