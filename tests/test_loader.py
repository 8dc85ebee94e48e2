"""load_model / save_hf_folder: round trips with transformers, sharded and bf16 checkpoints, and
every error case with its type and message."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from toolkit.errors import CheckpointError, UnknownModelError, UnsupportedArchitectureError
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.models import MODEL_REGISTRY, PRESETS, get_model_class, load_model, save_hf_folder
from toolkit.models.presets import is_shape_preset

# shape-true presets (is_shape_preset: real model dimensions, hundreds of MB to GB) are for benchmarks
ARCHS = [p for p in PRESETS if not is_shape_preset(p)]
F32 = dict(dtype=torch.float32, device="cpu")


def _ids(n: int = 23) -> torch.Tensor:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def _our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Whole prompt as one step; the profile path is exact for Mamba, so use real metadata."""
    from model_helpers import allocate_caches, one_seq_metadata

    allocate_caches(model)
    md = one_seq_metadata(model, 0, ids.numel(), [1, 2], state_slot=1)
    return model.compute_logits(model(ids, torch.arange(ids.numel()), md))


@torch.no_grad()
def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None], use_cache=False).logits[0].float()


def _assert_same_weights(ours, hf) -> None:
    ref = hf.state_dict()
    for k, v in ours.state_dict().items():
        assert torch.equal(v, ref[k].to(v.dtype)), k


@pytest.mark.parametrize("arch", ARCHS)
def test_save_hf_folder_roundtrip_with_transformers(arch, tmp_path):
    loaded = load_model(arch, **F32)
    assert loaded.source is None and loaded.tokenizer_dir is None
    assert loaded.config.architectures == [MODEL_REGISTRY[loaded.config.architectures[0]].hf_architecture]
    save_hf_folder(loaded, tmp_path)          # a LoadedModel is accepted too
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == arch_cls(arch)
    _assert_same_weights(loaded.model, hf)
    ids = _ids()
    diff = (_our_logits(loaded.model, ids) - _hf_logits(hf, ids)).abs().max().item()
    assert diff <= 1e-4
    # and back through our loader
    again = load_model(str(tmp_path), **F32)
    assert again.source == str(tmp_path)
    for (k, v), (k2, v2) in zip(loaded.model.state_dict().items(), again.model.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def arch_cls(arch: str) -> str:
    return PRESETS[arch]().architectures[0]


def test_save_accepts_llm_like_object(tmp_path):
    m = load_model("tiny-llama", **F32).model
    save_hf_folder(SimpleNamespace(model_runner=SimpleNamespace(model=m)), tmp_path)
    back = load_model(str(tmp_path), **F32).model
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), back.parameters()))
    with pytest.raises(TypeError):
        save_hf_folder(object(), tmp_path)


def test_tied_embeddings(tmp_path):
    cfg = PRESETS["tiny-llama"]()
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    m = load_model(str(tmp_path), **F32).model
    assert m.lm_head.weight is m.model.embed_tokens.weight
    ids = _ids()
    assert (_our_logits(m, ids) - _hf_logits(hf, ids)).abs().max().item() <= 1e-4
    # our writer stores a tied model the HF way too
    out = tmp_path / "ours"
    save_hf_folder(m, out)
    hf2 = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(hf2.lm_head.weight, m.lm_head.weight)


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_checkpoint(arch, tmp_path):
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(PRESETS[arch]()).eval()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    m = load_model(str(tmp_path), **F32).model
    _assert_same_weights(m, hf)


def test_missing_shard_is_reported(tmp_path):
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(PRESETS["tiny-llama"]()).save_pretrained(tmp_path, max_shard_size="40KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_model(str(tmp_path), **F32)


@pytest.mark.parametrize("stored_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_weights_load_into_fp32_and_back(arch, stored_dtype, tmp_path):
    torch.manual_seed(2)
    hf = AutoModelForCausalLM.from_config(PRESETS[arch]()).to(stored_dtype)
    hf.save_pretrained(tmp_path)
    stored = {}
    for f in tmp_path.glob("*.safetensors"):
        stored.update(load_file(str(f)))
    assert all(t.dtype == stored_dtype for t in stored.values())
    m = load_model(str(tmp_path), **F32).model
    for k, v in m.state_dict().items():
        assert v.dtype == torch.float32, k
    _assert_same_weights(m, hf)                                  # exact: half -> fp32 is lossless
    half = load_model(str(tmp_path), dtype=stored_dtype, device="cpu").model
    _assert_same_weights(half, hf)                               # and loaded as stored
    back = tmp_path / "back"
    save_hf_folder(m, back)                                      # fp32 copy written, read by HF
    _assert_same_weights(m, AutoModelForCausalLM.from_pretrained(back).to(stored_dtype).float())


def test_dtype_is_applied_and_reported_in_specs():
    m = load_model("tiny-bamba", dtype=torch.bfloat16, device="cpu").model
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert not any(p.requires_grad for p in m.parameters()) and not m.training
    specs = m.kv_cache_specs()
    assert list(specs) == ["model.layers.0.mamba", "model.layers.1.self_attn",
                           "model.layers.2.mamba", "model.layers.3.self_attn"]
    assert isinstance(specs["model.layers.1.self_attn"], AttentionSpec)
    assert specs["model.layers.1.self_attn"].dtype == torch.bfloat16
    ms = specs["model.layers.0.mamba"]
    assert isinstance(ms, MambaSpec) and ms.dtypes == (torch.bfloat16, torch.float32)
    assert ms.shapes == ((3, 128 + 2 * 16), (8, 16, 16)) and ms.chunk_size == 16 and ms.mamba_type == "mamba2"


def test_random_init_is_deterministic_and_seeded():
    a = load_model("tiny-mamba2", **F32).model
    b = load_model("tiny-mamba2", **F32).model
    c = load_model("tiny-mamba2", seed=1, **F32).model
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.backbone.embeddings.weight, c.backbone.embeddings.weight)
    mixer = a.backbone.layers[0].mixer
    assert (mixer.A_log.exp() >= 1).all() and (mixer.A_log.exp() <= 16).all()
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert (dt >= 1e-3 * 0.999).all() and (dt <= 1e-1 * 1.001).all()
    assert not torch.equal(a.backbone.norm_f.weight, torch.ones(64))


def test_a_preset_skips_torch_default_init_and_puts_it_back(monkeypatch):
    """A preset's layers are built without torch's default draws (init_random_weights redraws every
    parameter): the initializers are torch's own again afterwards, also when the build raises."""
    from toolkit.models import loader
    original = torch.nn.init.kaiming_uniform_
    model = load_model("tiny-bamba", **F32).model
    assert torch.nn.init.kaiming_uniform_ is original
    assert torch.nn.Linear(8, 8).weight.std() > 0         # a layer built after it is initialised
    assert all(torch.isfinite(p).all() for p in model.parameters())

    class Boom(Exception):
        pass

    def raising(config):
        raise Boom
    monkeypatch.setattr(loader, "get_model_class", lambda config: raising)
    with pytest.raises(Boom):
        load_model("tiny-bamba", **F32)
    assert torch.nn.init.kaiming_uniform_ is original and torch.nn.init.normal_.__module__ == "torch.nn.init"


def test_tokenizer_dir_detected(tmp_path):
    save_hf_folder(load_model("tiny-llama", **F32), tmp_path)
    assert load_model(str(tmp_path), **F32).tokenizer_dir is None
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert load_model(str(tmp_path), **F32).tokenizer_dir == str(tmp_path)


# ---------------------------------------------------------------------------------------- errors

def test_unknown_model_lists_presets(tmp_path):
    with pytest.raises(UnknownModelError) as e:
        load_model(str(tmp_path / "nope"), **F32)
    for p in PRESETS:
        assert p in str(e.value)
    with pytest.raises(ValueError):  # errors keep their builtin base
        load_model("tiny-gpt", **F32)


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(str(tmp_path), **F32)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(str(tmp_path), **F32)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and all(a in msg for a in MODEL_REGISTRY)
    cfg = LlamaConfig(architectures=["LlamaForSequenceClassification"])
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForSequenceClassification"):
        get_model_class(cfg)
    cfg.architectures = None
    assert get_model_class(cfg).__name__ == "LlamaForCausalLM"   # model_type fallback


def _saved(tmp_path: Path) -> Path:
    save_hf_folder(load_model("tiny-llama", **F32), tmp_path)
    return tmp_path / "model.safetensors"


def _rewrite(path: Path, fn) -> None:
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path), metadata={"format": "pt"})


def test_missing_tensor(tmp_path):
    _rewrite(_saved(tmp_path), lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(str(tmp_path), **F32)


def test_untied_lm_head_missing(tmp_path):
    _rewrite(_saved(tmp_path), lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(str(tmp_path), **F32)


def test_unexpected_tensor(tmp_path):
    _rewrite(_saved(tmp_path), lambda t: t.__setitem__("model.layers.9.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.9\.extra\.weight"):
        load_model(str(tmp_path), **F32)


def test_misshapen_tensor(tmp_path):
    _rewrite(_saved(tmp_path), lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    misshapen = r"misshapen tensors: model\.norm\.weight \(checkpoint \(65,\), model \(64,\)\)"
    with pytest.raises(CheckpointError, match=misshapen):
        load_model(str(tmp_path), **F32)


def test_pickle_only_weights(tmp_path):
    path = _saved(tmp_path)
    torch.save(load_file(str(path)), tmp_path / "pytorch_model.bin")
    path.unlink()
    with pytest.raises(CheckpointError, match="safetensors only") as e:
        load_model(str(tmp_path), **F32)
    assert "pytorch_model.bin" in str(e.value)


def test_no_weights(tmp_path):
    _saved(tmp_path).unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_model(str(tmp_path), **F32)


def test_mamba2_legacy_embedding_name(tmp_path):
    save_hf_folder(load_model("tiny-mamba2", **F32), tmp_path)
    _rewrite(tmp_path / "model.safetensors",
             lambda t: t.__setitem__("backbone.embedding.weight", t.pop("backbone.embeddings.weight")))
    m = load_model(str(tmp_path), **F32).model
    ref = load_model("tiny-mamba2", **F32).model
    assert torch.equal(m.backbone.embeddings.weight, ref.backbone.embeddings.weight)
