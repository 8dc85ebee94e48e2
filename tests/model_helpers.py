"""Test helpers that drive models/layers directly, without the runner, and the parity suite.

They build the per-layer metadata the contract files describe (toolkit/attention/paged_attn.py,
toolkit/attention/mamba2.py, mamba1.py, short_conv.py, mlstm.py) for a few sequence chunks, and
allocate/bind caches; `ModelParitySuite` holds the model-vs-HF-transformers checks every
architecture family's test class (tests/test_parity_<family>.py) inherits, with its mixins
`ConfigVariantChecks` (config variants) and `RunnerParityChecks` (the engine, LLM(...), vs HF).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from toolkit import LLM
from toolkit.attention.mamba1 import Mamba1AttentionMetadata
from toolkit.attention.mamba2 import Mamba2AttentionMetadata, compute_chunk_metadata
from toolkit.attention.mlstm import MLSTMAttentionMetadata
from toolkit.attention.paged_attn import PagedAttentionMetadata
from toolkit.attention.short_conv import ShortConvAttentionMetadata
from toolkit.config import RunnerConfig
from toolkit.kv_cache_spec import AttentionSpec, MambaSpec
from toolkit.models import PRESETS, get_model_class, load_model, save_hf_folder
from toolkit.runner.kv_cache import make_kv_cache_groups

from harness import BATCH_LIMITS, F32, check_chunked_mixed_queued_batch_matches_hf, check_single_request_matches_hf

# metadata class of each Mamba-family layer that reads only the base Mamba fields
BASE_MAMBA_METADATA = {"mamba1": Mamba1AttentionMetadata, "short_conv": ShortConvAttentionMetadata,
                       "mlstm": MLSTMAttentionMetadata}


@dataclass
class SeqChunk:
    """One row of a step: `query_len` new tokens after `num_computed` cached ones.

    block_ids: the row's KV blocks (enough for num_computed + query_len tokens);
    state_slot: its Mamba state page; is_decode: defaults to query_len == 1 and num_computed > 0.
    """
    num_computed: int
    query_len: int
    block_ids: list[int]
    state_slot: int
    is_decode: bool | None = None

    @property
    def decode(self) -> bool:
        return self.is_decode if self.is_decode is not None else (self.query_len == 1 and self.num_computed > 0)


def allocate_caches(
    model, *, num_blocks: int = 16, block_size: int = 16, num_slots: int = 4,
    device: torch.device | str = "cpu", fill: float = float("nan"),
) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
    """Allocate every cache the model's specs ask for (filled with NaN so stray reads show) and bind."""
    caches: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    for name, spec in model.kv_cache_specs().items():
        if isinstance(spec, AttentionSpec):
            caches[name] = torch.full(
                (num_blocks, spec.kv_parts, block_size, spec.num_kv_heads, spec.head_dim), fill, dtype=spec.dtype,
                device=device,
            )
        elif isinstance(spec, MambaSpec):
            caches[name] = tuple(
                torch.full((num_slots, *shape), fill, dtype=dt, device=device)
                for shape, dt in zip(spec.shapes, spec.dtypes)
            )
        else:  # pragma: no cover
            raise TypeError(spec)
    model.bind_kv_cache(caches)
    return caches


def build_metadata(
    model, rows: list[SeqChunk], *, block_size: int = 16, device: torch.device | str = "cpu"
) -> dict[str, object]:
    """layer_name -> metadata for one step made of `rows` (decode rows must come first)."""
    kinds = [r.decode for r in rows]
    if kinds != sorted(kinds, reverse=True):
        raise ValueError("decode rows must come first")
    dev = torch.device(device)
    i32 = dict(dtype=torch.int32)
    qlens = [r.query_len for r in rows]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    seq_lens = [r.num_computed + r.query_len for r in rows]
    max_blocks = max(max(math.ceil(s / block_size) for s in seq_lens), 1)
    table = torch.zeros(len(rows), max_blocks, **i32)
    slots: list[int] = []
    for i, r in enumerate(rows):
        need = math.ceil(seq_lens[i] / block_size)
        if len(r.block_ids) < need:
            raise ValueError(f"row {i} needs {need} blocks, got {len(r.block_ids)}")
        table[i, :need] = torch.tensor(r.block_ids[:need], **i32)
        for p in range(r.num_computed, seq_lens[i]):
            slots.append(r.block_ids[p // block_size] * block_size + p % block_size)
    qsl_cpu = torch.tensor(qsl, **i32)
    paged = PagedAttentionMetadata(
        num_actual_tokens=qsl[-1], num_reqs=len(rows), max_query_len=max(qlens), max_seq_len=max(seq_lens),
        block_size=block_size, query_start_loc=qsl_cpu.to(dev), query_start_loc_cpu=qsl_cpu,
        seq_lens=torch.tensor(seq_lens, **i32).to(dev), seq_lens_cpu=torch.tensor(seq_lens, **i32),
        block_table=table.to(dev), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
    )

    pre = [r for r in rows if not r.decode]
    mamba_md: dict[int, Mamba2AttentionMetadata] = {}

    def mamba_for(chunk_size: int) -> Mamba2AttentionMetadata:
        if chunk_size in mamba_md:
            return mamba_md[chunk_size]
        chunk_fields: dict[str, torch.Tensor | None] = dict(seq_idx_p=None, cu_chunk_seqlen_p=None,
                                                            last_chunk_indices_p=None)
        if pre:
            cu, sidx, last = mamba2_chunk_layout([r.query_len for r in pre], [r.num_computed for r in pre],
                                                 chunk_size)
            chunk_fields = dict(
                seq_idx_p=torch.tensor(sidx, **i32).to(dev),
                cu_chunk_seqlen_p=torch.tensor(cu, **i32).to(dev),
                last_chunk_indices_p=torch.tensor(last, **i32).to(dev),
            )
        md = Mamba2AttentionMetadata(
            **base_mamba_fields(rows, device=dev), chunk_size=chunk_size,
            prep_initial_states=any(r.num_computed > 0 for r in pre), **chunk_fields,
        )
        mamba_md[chunk_size] = md
        return md

    out: dict[str, object] = {}
    for name, spec in model.kv_cache_specs().items():
        if isinstance(spec, AttentionSpec):
            out[name] = paged
        elif spec.mamba_type in BASE_MAMBA_METADATA:
            out[name] = base_mamba_metadata(BASE_MAMBA_METADATA[spec.mamba_type], rows, device=dev)
        else:
            out[name] = mamba_for(int(spec.chunk_size))
    return out


def base_mamba_fields(rows: list[SeqChunk], *, device: torch.device | str = "cpu") -> dict[str, object]:
    """The BaseMambaAttentionMetadata fields of one step made of `rows` (decode rows first)."""
    dev = torch.device(device)
    i32 = dict(dtype=torch.int32, device=dev)
    dec = [r for r in rows if r.decode]
    pre = [r for r in rows if not r.decode]
    pqsl = [0]
    for r in pre:
        pqsl.append(pqsl[-1] + r.query_len)
    return dict(
        num_prefills=len(pre), num_prefill_tokens=pqsl[-1], num_decodes=len(dec), num_decode_tokens=len(dec),
        num_reqs=len(rows),
        query_start_loc_p=torch.tensor(pqsl, **i32) if pre else None,
        has_initial_states_p=torch.tensor([r.num_computed > 0 for r in pre], device=dev) if pre else None,
        state_indices_tensor_p=torch.tensor([r.state_slot for r in pre], **i32) if pre else None,
        state_indices_tensor_d=torch.tensor([r.state_slot for r in dec], **i32) if dec else None,
        checkpoint_token_index_p=None, checkpoint_slots_p=None,
    )


def base_mamba_metadata(metadata_cls, rows: list[SeqChunk], *, device: torch.device | str = "cpu"):
    """Metadata of a layer reading the base Mamba fields only (Mamba1AttentionMetadata,
    ShortConvAttentionMetadata) for one step made of `rows` (decode rows first)."""
    return metadata_cls(**base_mamba_fields(rows, device=device))


def one_seq_metadata(
    model, num_computed: int, query_len: int, block_ids: list[int], state_slot: int, *,
    block_size: int = 16, device: torch.device | str = "cpu", is_decode: bool | None = None,
) -> dict[str, object]:
    """Metadata of a step holding a single sequence chunk (see `build_metadata`)."""
    return build_metadata(
        model, [SeqChunk(num_computed, query_len, block_ids, state_slot, is_decode)],
        block_size=block_size, device=device,
    )


def mamba2_chunk_layout(query_lens, num_computed, chunk_size):
    """`compute_chunk_metadata` as python lists: (cu_chunk_seqlens, seq_idx, last_chunk_indices)."""
    arrays = compute_chunk_metadata(np.asarray(query_lens), np.asarray(num_computed), chunk_size)
    return tuple(a.tolist() for a in arrays)


# ------------------------------------------------------------------------------------------
# model vs HF transformers parity
# ------------------------------------------------------------------------------------------

ATOL = 1e-4             # fp32 logits
VOCAB = 320             # vocab_size of every tiny preset
PROMPT_LEN = 37
CHUNKS = [10, 17, 10]   # 10 -> the 2nd chunk starts mid chunk_size (16); 27 -> so does the 3rd
DECODE_STEPS = 5
SOURCES = ("preset", "hf-init")


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (got - ref).abs().max().item()
    assert diff <= ATOL, f"max |logit diff| {diff:.3e} > {ATOL}"
    return diff


def random_prompt(seed: int, n: int = PROMPT_LEN) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g)


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor, *, position_ids: bool = False) -> torch.Tensor:
    """ids [T] -> HF's fp32 logits [T, V] from a full forward without cache (explicit
    position_ids 0..T-1 when asked)."""
    if position_ids:
        return hf(ids[None], position_ids=torch.arange(ids.numel())[None], use_cache=False).logits[0].float()
    return hf(ids[None], use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, prompt: torch.Tensor, steps: int, *, position_ids: bool = False) -> torch.Tensor:
    """prompt + `steps` greedy tokens from HF full forwards (use_cache=False), no `generate`."""
    seq = prompt.clone()
    for _ in range(steps):
        nxt = hf_logits(hf, seq, position_ids=position_ids)[-1].argmax()
        seq = torch.cat([seq, nxt[None]])
    return seq


def build_pair(arch: str, source: str, folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(our model, HF model) with identical weights: our preset `arch` saved for HF (source
    "preset"), or an HF-initialised random model (seed 1234) saved for us ("hf-init")."""
    if source == "preset":
        ours = load_model(arch, dtype=torch.float32, device="cpu").model
        save_hf_folder(ours, folder)
        hf = AutoModelForCausalLM.from_pretrained(folder)
    else:
        torch.manual_seed(1234)
        hf = AutoModelForCausalLM.from_config(PRESETS[arch]())
        hf.save_pretrained(folder)
        ours = load_model(str(folder), dtype=torch.float32, device="cpu").model
    return ours, hf


def hf_random(cfg, folder, *, bias_std: float = 0.0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(HF model (eval), our model loaded from it) for an HF-initialised random model of `cfg`
    (seed 99); bias_std > 0: biases drawn from N(0, bias_std) (HF zero-inits them)."""
    torch.manual_seed(99)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    if bias_std:
        with torch.no_grad():  # make the biases non-zero so their names matter
            for name, p in hf.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, bias_std)
    hf.save_pretrained(folder)
    return hf, load_model(str(folder), dtype=torch.float32, device="cpu").model


@torch.no_grad()
def run_steps(ours, seq: torch.Tensor, steps: list[int | tuple[int, bool]], *, slot: int = 2) -> torch.Tensor:
    """Feed `seq` [T] as one request in the given steps (q, or (q, is_decode)) on fresh caches;
    returns the fp32 logits of every token [T, V]."""
    allocate_caches(ours)
    done, outs = 0, []
    for st in steps:
        q, is_decode = st if isinstance(st, tuple) else (st, None)
        md = one_seq_metadata(ours, done, q, [4, 2, 7, 6], state_slot=slot, is_decode=is_decode)
        outs.append(ours.compute_logits(ours(seq[done : done + q], torch.arange(done, done + q), md)))
        done += q
    assert done == seq.numel()
    return torch.cat(outs)


def meta_model_specs_and_groups(preset: str):
    """(model on the meta device, its cache specs, the runner's cache groups of them, the
    RunnerConfig: 2 rows, 16 tokens a step, 64 a request, fp32) for a preset, with no memory."""
    config = PRESETS[preset]()
    with torch.device("meta"):
        model = get_model_class(config)(config)
    cfg = RunnerConfig(device=torch.device("cpu"), dtype=torch.float32, max_num_seqs=2,
                       max_num_batched_tokens=16, block_size=16, max_model_len=64, num_kv_blocks=None, seed=0)
    return model, model.kv_cache_specs(), make_kv_cache_groups(model.kv_cache_specs(), cfg), cfg


def rebuilt_config(arch: str, *, drop: tuple[str, ...] = (), **changes):
    """The preset's config rebuilt through __init__ with `changes` (so derived fields follow);
    `drop`: fields left out of the preset's to_dict(), recomputed rather than passed back."""
    cfg = PRESETS[arch]()
    kwargs = {k: v for k, v in cfg.to_dict().items() if k not in drop}
    return type(cfg)(**{**kwargs, **changes})


def save_bf16_checkpoint(arch: str, folder) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """(HF model, the tensors it stored) of an HF-initialised (seed 3) `arch` saved in bf16 to `folder`."""
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(PRESETS[arch]()).to(torch.bfloat16)
    hf.save_pretrained(folder)
    return hf, load_file(str(Path(folder) / "model.safetensors"))


@torch.no_grad()
def check_bf16_load_runs(folder) -> None:
    """Our model loaded in bf16 from `folder` runs a 22-token request in steps 10, 10, 1, 1:
    finite fp32 logits."""
    m16 = load_model(str(folder), dtype=torch.bfloat16, device="cpu").model
    out = run_steps(m16, random_prompt(8, 22), [10, 10, 1, 1])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


@dataclass(frozen=True)
class MixedRequest:
    """A request of the mixed-step check: random_prompt(seed, prompt_len) plus `generated` greedy
    tokens of HF's (`ModelParitySuite.hf_continue`), kept in KV blocks `blocks` and state page `slot`."""
    seed: int
    prompt_len: int
    generated: int
    blocks: list[int]
    slot: int


class ModelParitySuite:
    """The checks every architecture's model passes against HF transformers (fp32, atol ATOL) on
    identical weights, for each preset in ARCHS, built as our preset or as an HF-initialised
    checkpoint (`pair`): the whole prompt in one step, chunked prefill then decode, steps mixing
    decode and prefill rows, and a profile run (no metadata) that leaves every cache as it was.

    A subclass named Test* is a test class; it sets the class attributes below and may override
    `hf_continue` / `check_pair` and add its own tests (which can use `pair` too).
    """

    ARCHS: ClassVar[tuple[str, ...]]
    # requests of test_mixed_decode_prefill_batch, and its steps: rows (request, start, query_len
    # [, is_decode]), decode rows first; each row's logits must match its request's HF logits
    # (default: four requests over three steps, two of them decoding in step 2)
    MIXED_REQUESTS: ClassVar[dict[str, MixedRequest]] = {
        "A": MixedRequest(2, 21, 2, blocks=[5, 9], slot=3),   # 21-token prompt, then decodes
        "B": MixedRequest(3, 30, 0, blocks=[1, 6], slot=1),   # prefilled in two chunks (20 | 10)
        "C": MixedRequest(4, 5, 0, blocks=[8], slot=4),       # short prompt prefilled while A and B run
        "D": MixedRequest(5, 9, 1, blocks=[10], slot=5),      # a second decode row in step 2
    }
    MIXED_STEPS: ClassVar[list[list[tuple]]] = [
        [("A", 0, 21), ("B", 0, 20), ("D", 0, 9)],                 # three prefills
        [("A", 21, 1), ("D", 9, 1), ("B", 20, 10), ("C", 0, 5)],   # A and D decode, B continues, C starts
        [("A", 22, 1)],                                            # A decodes alone
    ]
    PROFILE_PROMPT_SEED: ClassVar[int] = 6
    HF_POSITION_IDS: ClassVar[bool] = False   # pass explicit position_ids to HF's forward

    def pytest_generate_tests(self, metafunc):
        if "pair" in metafunc.fixturenames:
            params = [(a, s) for a in self.ARCHS for s in SOURCES]
            metafunc.parametrize("pair", params, ids=[f"{a}-{s}" for a, s in params], indirect=True, scope="class")
        if "variant" in metafunc.fixturenames:   # ConfigVariantChecks
            metafunc.parametrize("variant", list(self.VARIANTS))
        if "model_pair" in metafunc.fixturenames:   # RunnerParityChecks (the fixture: conftest.py)
            metafunc.parametrize("model_pair", self.runner_models(), indirect=True, scope="class")

    @pytest.fixture(scope="class")
    @classmethod
    def pair(cls, request, tmp_path_factory):
        """(our model, HF model) with identical weights (see `build_pair`), once per class and param."""
        arch, source = request.param
        ours, hf = build_pair(arch, source, tmp_path_factory.mktemp(f"{arch}-{source}"))
        cls.check_pair(ours, hf)
        return ours, hf.to(torch.float32).eval()

    @classmethod
    def check_pair(cls, ours, hf) -> None:
        """Architecture-specific facts of a freshly built pair."""

    def hf_logits(self, hf, ids: torch.Tensor) -> torch.Tensor:
        return hf_logits(hf, ids, position_ids=self.HF_POSITION_IDS)

    def hf_continue(self, hf, prompt: torch.Tensor, steps: int) -> torch.Tensor:
        """prompt + HF's `steps` greedy tokens."""
        return hf_greedy(hf, prompt, steps, position_ids=self.HF_POSITION_IDS)

    @torch.no_grad()
    def test_full_prompt(self, pair):
        ours, hf = pair
        ids = random_prompt(0)
        allocate_caches(ours)
        md = one_seq_metadata(ours, 0, PROMPT_LEN, [3, 1, 5], state_slot=1)
        got = ours.compute_logits(ours(ids, torch.arange(PROMPT_LEN), md))
        assert got.dtype == torch.float32 and got.shape == (PROMPT_LEN, VOCAB)
        assert_close(got, self.hf_logits(hf, ids))

    @torch.no_grad()
    def test_chunked_prefill_then_decode(self, pair):
        ours, hf = pair
        seq = self.hf_continue(hf, random_prompt(1), DECODE_STEPS)
        assert_close(run_steps(ours, seq, CHUNKS + [1] * DECODE_STEPS), self.hf_logits(hf, seq))

    @torch.no_grad()
    def test_mixed_decode_prefill_batch(self, pair):
        """Decode rows and (continuing) prefill rows share a step; each matches its own HF run."""
        ours, hf = pair
        reqs = self.MIXED_REQUESTS
        seqs = {}
        for name, r in reqs.items():
            seqs[name] = random_prompt(r.seed, r.prompt_len)
            if r.generated:
                seqs[name] = self.hf_continue(hf, seqs[name], r.generated)
        refs = {name: self.hf_logits(hf, s) for name, s in seqs.items()}
        allocate_caches(ours, num_slots=max(r.slot for r in reqs.values()) + 1)
        for rows in self.MIXED_STEPS:
            chunks = [SeqChunk(start, n, reqs[name].blocks, reqs[name].slot, *dec) for name, start, n, *dec in rows]
            ids = torch.cat([seqs[name][start : start + n] for name, start, n, *_ in rows])
            pos = torch.cat([torch.arange(start, start + n) for _, start, n, *_ in rows])
            out = ours.compute_logits(ours(ids, pos, build_metadata(ours, chunks)))
            off = 0
            for name, start, n, *_ in rows:
                assert_close(out[off : off + n], refs[name][start : start + n])
                off += n

    @torch.no_grad()
    def test_profile_run_touches_no_cache(self, pair):
        ours, hf = pair
        caches = allocate_caches(ours, fill=0.5)
        before = {k: (v.clone() if isinstance(v, torch.Tensor) else tuple(t.clone() for t in v))
                  for k, v in caches.items()}
        ids = random_prompt(self.PROFILE_PROMPT_SEED, 40)
        hidden = ours(ids, torch.arange(40), None)
        assert hidden.shape == (40, ours.config.hidden_size) and torch.isfinite(hidden).all()
        for k, v in caches.items():
            now = v if isinstance(v, tuple) else (v,)
            old = before[k] if isinstance(before[k], tuple) else (before[k],)
            assert all(torch.equal(x, y) for x, y in zip(now, old)), k
        if ours.is_attention_free:
            # attention-free models compute the real thing in a profile run (one sequence, zero state)
            assert_close(ours.compute_logits(hidden), self.hf_logits(hf, ids))


class ConfigVariantChecks:
    """Mixin for a ModelParitySuite: each config in VARIANTS (name -> () -> config), as an
    HF-initialised model with N(0, 0.1) biases, matches HF over chunked prefill + 2 decodes."""

    VARIANTS: ClassVar[dict[str, Callable[[], object]]]
    VARIANT_PROMPT_SEED: ClassVar[int]

    def check_variant(self, variant: str, ours) -> None:
        """Architecture-specific facts of a variant's model."""

    @torch.no_grad()
    def test_config_variants_match_hf(self, variant, tmp_path):
        hf, ours = hf_random(self.VARIANTS[variant](), tmp_path, bias_std=0.1)
        self.check_variant(variant, ours)
        seq = self.hf_continue(hf, random_prompt(self.VARIANT_PROMPT_SEED), 2)
        assert_close(run_steps(ours, seq, [10, 17, 10, 1, 1]), self.hf_logits(hf, seq))


class RunnerParityChecks:
    """Mixin for a ModelParitySuite: the engine, LLM(...), reproduces HF transformers' greedy
    `generate` (tie rule, logits within harness.LOGIT_ATOL) on each model of `runner_models()`: the
    family's presets (ARCHS), the same architectures HF-initialised ("hf-random-<arch>") and its
    shipped DEMO_MODELS; for a single request, and for a batch that BATCH_LIMITS chunk, mix and
    queue. conftest.py's `model_pair` and `hf_model` build each model's pair once per class."""

    DEMO_MODELS: ClassVar[tuple[str, ...]] = ()

    def runner_models(self) -> list[str]:
        return [*self.ARCHS, *(f"hf-random-{a}" for a in self.ARCHS), *self.DEMO_MODELS]

    def check_llm(self, llm: LLM) -> None:
        """Architecture-specific facts of an engine built on one of the models."""

    def test_llm_single_request_matches_hf(self, model_pair, hf_model):
        with LLM(model_pair[0], **F32) as llm:
            self.check_llm(llm)
            check_single_request_matches_hf(llm, hf_model)

    def test_llm_chunked_mixed_queued_batch_matches_hf(self, model_pair, hf_model):
        with LLM(model_pair[0], **F32, **BATCH_LIMITS) as llm:
            check_chunked_mixed_queued_batch_matches_hf(llm, hf_model)


# ---- checkpoint layout -----------------------------------------------------------------------------
def shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """state_dict names -> shapes."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def saved_both_ways(arch: str, folder: Path, hf_only: tuple[str, ...] = ()):
    """A preset built by HF (seeded) and by this project, checked to hold the same state_dict names
    and shapes (but HF's names ending in `hf_only`: buffers this project derives instead of keeping),
    each saved the way its side saves (save_pretrained / save_hf_folder). Returns (hf, ours, HF's
    tensors on disk, ours on disk)."""
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(PRESETS[arch]())
    ours = load_model(arch, dtype=torch.float32, device="cpu").model
    assert shapes(ours) == {k: v for k, v in shapes(hf).items() if not (hf_only and k.endswith(hf_only))}
    hf.save_pretrained(folder / "hf")
    save_hf_folder(ours, folder / "ours")
    return hf, ours, load_file(str(folder / "hf" / "model.safetensors")), \
        load_file(str(folder / "ours" / "model.safetensors"))
