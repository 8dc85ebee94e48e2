"""Golden metadata from vLLM's own Mamba-family builders (issue #23), for tests/test_vllm_builder_goldens.py.

    python3 scripts/vllm_reference.py                      # scratch venv in ~/.cache, then the goldens
    python3 scripts/vllm_reference.py --venv /tmp/vref     # another scratch folder
    python3 scripts/vllm_reference.py --batches 500 --seed 23 --out tests/data/vllm_builder_goldens.json
    python3 scripts/vllm_reference.py --mode align         # prefix caching: tests/data/vllm_builder_goldens_align.json
    python3 scripts/vllm_reference.py --mode spec          # speculative decoding: ..._spec.json
    python3 scripts/vllm_reference.py --mode align-spec    # speculative decoding + prefix caching: ..._align_spec.json

Two stages, one file per cache mode (MODES):

1. The scratch venv (outside the repository; never the project's .venv; not part of `make test`).
   `pip install torch==2.13.0` (the CPU wheel: pip's config on this machine finds it on disk), then the
   vllm wheel with `--no-deps` (installing vllm *with* its dependencies pulls a CUDA torch and several GB),
   then the pure-Python packages `import vllm` and its builders need (PURE_DEPS) and three packages with
   `--no-deps` (NO_DEPS: their declared dependencies would pull torch again). A constraints file pins
   torch to the CPU build throughout, and the script refuses a venv that holds an `nvidia-*` package.
   It prints every package it installed. A venv that already imports vllm at VLLM_VERSION is reused.

2. The goldens (the script re-runs itself with the venv's python, `--generate`). For seeded random
   common metadata (mixed batches: decodes, one-token prefill chunks on top of saved state, fresh
   one-token prompts, first chunks, chunks that continue a state, lengths and offsets on chunk-size
   edges, the runner's padded decode batches) it records the input and the output of every builder in
   BUILDERS -- vLLM's `Mamba1AttentionMetadataBuilder`, `Mamba2AttentionMetadataBuilder` (one per
   Mamba2 chunk size), `ShortConvAttentionMetadataBuilder`, `GDNAttentionMetadataBuilder` (from the
   configs of Qwen3-Next, OLMo Hybrid and Kimi Linear, whose KDA runs on it), `LinearAttentionMetadataBuilder`
   (MiniMax's lightning attention; EXPLICIT_ALIGN, NOT_SPECULATIVE) -- each built
   from a real `VllmConfig` (a tiny local config.json per architecture, `HF_HUB_OFFLINE=1`,
   `VLLM_TARGET_DEVICE=cpu`) in the cache mode of MODES, fed the same CommonAttentionMetadata (CPU tensors).
   "align" builds each builder once per block size of ALIGN_BLOCK_SIZES (names `<builder>_bs<size>`),
   on position-indexed block tables (`block_table_for`); the batches are the "none" file's (same seed).
   Every field of vLLM's metadata dataclass is written, as a column over the batches: ints and None as
   they are, tensors as nested lists (bools as 0/1, dtypes once per builder), the launch metadata of
   vLLM's Triton causal_conv1d (SUMMARISED) as `true` = present, values not recorded; a column equal to
   one already written is a reference to it. The file also holds the vLLM and torch versions, the seed,
   the builders' configs and what the batches cover. The same seed gives the same file, byte for byte.

Cache modes (MODES), a golden file each:
  - "none": prefix caching off; block table [B, 1], column 0 = the state slot.
  - "spec": speculative decoding (issue 26), prefix caching off (mamba_cache_mode "none"; this project
    refuses prefix caching + spec). Each builder once per k of SPEC_KS (names `<builder>_k<k>`), from a
    VllmConfig with `SpeculativeConfig(method="ngram", num_speculative_tokens=k)` -- what makes
    `vllm_config.num_speculative_tokens` k, hence the builders' `use_spec_decode`, their reorder
    threshold 1 + k and their [D, 1 + k] decode state indices -- and a MambaSpec with k spec blocks, on
    its own batches (`draw_spec_batch`, SPEC_ROW_KINDS; `batch_range` per builder): verify rows ("spec
    decode", 1 + d tokens, d in 0..k, num_accepted_tokens 1..k+1) mixed with one-token prefill chunks on
    saved state, fresh one-token prompts, first / continuing / (2..k+1)-token prefill chunks and the
    runner's padded decode batches, in this project's row order or MRV2's; block tables [B, 1 + k] of
    distinct slots. `build_kwargs` passes `num_accepted_tokens` and `num_decode_draft_tokens_cpu` as
    MRV2's MambaHybridModelState.prepare_attn builds them (`mrv2_decode_draft_tokens`: -1 for every row
    that is not a decode; num_accepted_tokens 1 for those rows). Left out (SPEC_LEFT_OUT, recorded with
    a check on every batch in `speculative.left_out`): vLLM's Mamba1 builder, which has no spec path
    (its build() drops the spec kwargs; MRV2 passes it none). Also left out: MRV2's "padded prompt
    tail" rows (a one-token prompt tail padded with placeholder drafts: MRV2 clears their
    is_prefilling first, so a builder sees a plain verify row), and CUDA-graph padding of spec batches
    (cudagraph_mode NONE on this CPU config).
  - "align": vLLM's mode when prefix caching is on (`CacheConfig(enable_prefix_caching=True,
    block_size=bs)`; vLLM then sets mamba_cache_mode = "align" and mamba_block_size = block_size, and
    requires chunked prefill, on by default). Block table [B, cdiv(max_model_len, bs)], position-indexed;
    state index = the page in the column of the row's last scheduled token (vLLM
    `mamba_get_block_table_tensor`). Left out, as nowhere in this project: prefill checkpoints (vLLM's
    Mamba2 / Qwen GDN layers declare `num_prefill_checkpoint_blocks=1` and, once an engine has resolved
    `hash_block_size`, export block-boundary states from inside a prefill, splitting Mamba2's chunks
    there). The MambaSpec here keeps vLLM's default of 0 checkpoint blocks and a bare VllmConfig
    leaves `hash_block_size` None, so vLLM builds no checkpoint metadata (the file records both).
  - "align-spec": speculative decoding WITH prefix caching: a VllmConfig with both
    `CacheConfig(enable_prefix_caching=True, block_size=bs)` (mamba_cache_mode "align") and the spec
    mode's `SpeculativeConfig(method="ngram", num_speculative_tokens=k)`, and a MambaSpec with k spec
    blocks, as vLLM's Mamba layers declare it (`MambaBase.get_kv_cache_spec`: num_speculative_blocks =
    num_speculative_tokens). Each builder once per k of SPEC_KS and bs of ALIGN_BLOCK_SIZES (names
    `<builder>_bs<bs>_k<k>`), on the spec mode's batch drawing (`draw_spec_batch`, the batches of each
    k in turn, `batch_range` per builder) with ALIGN_SPEC_CROSS of the verify rows with drafts placed
    so that their drafts cross a block boundary (the first token in one block, the last draft in the
    next: the running column is the last draft's). Block tables position-indexed as in "align" but
    cdiv(max_model_len, bs) + k columns wide (vLLM `MambaSpec.max_num_blocks_per_req` in align mode),
    so that a row's running column (seq_len - 1) // bs and the k spec columns after it exist; vLLM's
    `mamba_get_block_table_tensor` gathers those 1 + k columns for every row, the decode rows keep all
    of them ([D, 1 + k]), the prefill rows the first. The generator checks that layout on every batch
    against the tables (`align_spec_layout`, recorded under `speculative.layout_check`). Mamba1 is left
    out as in "spec" (the same check, on these batches). The kwargs are the spec mode's; note that MRV2
    in align mode resets a request's num_accepted_tokens to 1 when its running column moved since the
    last step (vllm/v1/worker/mamba_utils.py `preprocess_mamba_align_fused_kernel`), a history this
    single-batch drawing does not model: num_accepted_tokens stays drawn in 1..k+1 (a superset).

"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.33.0"
TORCH_VERSION = "2.13.0"
DEFAULT_VENV = Path.home() / ".cache" / "runnerscope" / f"vllm-{VLLM_VERSION}-venv"
DEFAULT_OUT = {"none": REPO / "tests" / "data" / "vllm_builder_goldens.json",
               "align": REPO / "tests" / "data" / "vllm_builder_goldens_align.json",
               "spec": REPO / "tests" / "data" / "vllm_builder_goldens_spec.json",
               "align-spec": REPO / "tests" / "data" / "vllm_builder_goldens_align_spec.json"}
DEFAULT_SEED = 23
DEFAULT_BATCHES = {"none": 500, "align": 500, "spec": 700, "align-spec": 600}

# What `import vllm`, VllmConfig/ModelConfig and the Mamba-family builders import on a CPU machine
# (found by importing them in an empty venv, one missing module at a time). Bounds copied from vllm's
# own metadata where it gives them.
PURE_DEPS = [
    "numpy", "transformers>=5.16.1,<5.21.0", "huggingface_hub>=1.31.0", "tokenizers>=0.23.2",
    "safetensors>=0.6.2", "protobuf", "pydantic>=2.12.0", "msgspec", "cloudpickle", "pyzmq>=25.0.0",
    "psutil", "cachetools", "regex", "blake3", "py-cpuinfo", "sentencepiece", "requests>=2.33.0", "tqdm",
    "pyyaml", "einops", "cbor2", "aiohttp>=3.14.4", "openai>=2.25.0", "openai-harmony", "pillow>=13.0.0",
    "pybase64", "uvloop", "prometheus_client>=0.18.0", "fastapi<0.137.0,>=0.133.0", "partial-json-parser",
    "llguidance<1.8.0,>=1.7.0", "loguru",
]
# Imported by vllm at import time, but their declared dependencies include torch (a CUDA build).
NO_DEPS = ["xgrammar==0.2.8", "apache-tvm-ffi==0.1.11", "compressed-tensors==0.17.0"]


# --------------------------------------------------------------------------------------------------
# Stage 1: the scratch venv
# --------------------------------------------------------------------------------------------------

def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("  $", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def pip_freeze(py: Path) -> dict[str, str]:
    out = subprocess.run([str(py), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                         check=True, capture_output=True, text=True).stdout
    return {p["name"].lower(): p["version"] for p in json.loads(out)}


def venv_ready(py: Path) -> bool:
    if not py.exists():
        return False
    probe = ("import os; os.environ.setdefault('VLLM_TARGET_DEVICE', 'cpu'); import torch, vllm; "
             f"assert vllm.__version__ == {VLLM_VERSION!r}, vllm.__version__; "
             "assert torch.__version__.endswith('+cpu'), torch.__version__")
    return subprocess.run([str(py), "-c", probe], check=False, capture_output=True).returncode == 0


def ensure_venv(venv: Path, wheel: str | None, torch_index: str | None) -> Path:
    """The scratch venv's python, building the venv first if it does not import vllm VLLM_VERSION."""
    py = venv / "bin" / "python"
    if venv.resolve().is_relative_to(REPO):
        sys.exit(f"the scratch venv must live outside the repository, not in {venv}")
    if venv_ready(py):
        print(f"scratch venv {venv}: reusing it (vllm {VLLM_VERSION} and a CPU torch import)")
        return py
    t0 = time.time()
    print(f"scratch venv {venv}: building it")
    if not py.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    before = pip_freeze(py)
    constraints = venv / "constraints-cpu-torch.txt"
    constraints.write_text(f"torch=={TORCH_VERSION}\n")
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-c", str(constraints)]
    print("  (pip will say that vllm's declared dependencies -- torch==2.14.0, CUDA kernels, servers -- are missing "
          "or conflict: expected, they are left out on purpose)")
    run(pip + [f"torch=={TORCH_VERSION}"] + (["--index-url", torch_index] if torch_index else []))
    run(pip + ["--no-deps", wheel or f"vllm=={VLLM_VERSION}"])
    run(pip + ["--no-deps", *NO_DEPS])
    run(pip + PURE_DEPS)
    after = pip_freeze(py)
    cuda = sorted(n for n in after if n.startswith("nvidia-") or n in ("triton", "flashinfer-python"))
    if cuda or not after.get("torch", "").endswith("+cpu"):
        sys.exit(f"scratch venv {venv} holds CUDA packages {cuda} / torch {after.get('torch')}: "
                 "delete it and run again")
    if not venv_ready(py):
        sys.exit(f"scratch venv {venv}: `import vllm` still fails; run {py} -c 'import vllm' to see why")
    added = {n: v for n, v in after.items() if before.get(n) != v}
    print(f"installed {len(added)} packages in {time.time() - t0:.0f} s "
          f"(venv {du(venv)}): " + ", ".join(f"{n}=={v}" for n, v in sorted(added.items())))
    return py


def du(path: Path) -> str:
    out = subprocess.run(["du", "-sh", str(path)], check=False, capture_output=True, text=True).stdout.split()
    return out[0] if out else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="scratch venv (outside the repository)")
    ap.add_argument("--wheel", help="a downloaded vllm wheel to install instead of vllm==VLLM_VERSION")
    ap.add_argument("--torch-index", help="where pip finds torch's CPU build when it is not on disk "
                    "(e.g. https://download.pytorch.org/whl/cpu); PyPI's Linux torch is a CUDA build")
    ap.add_argument("--out", type=Path, help="golden file (default: DEFAULT_OUT of the mode)")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--batches", type=int, help="batches (default: DEFAULT_BATCHES of the mode; spec, "
                    "align-spec: split over SPEC_KS by SPEC_K_SHARE)")
    ap.add_argument("--mode", default="none", choices=sorted(MODES), help="vLLM mamba cache mode (MODES)")
    ap.add_argument("--generate", action="store_true", help="(internal) run inside the scratch venv")
    args = ap.parse_args()
    args.out = args.out or DEFAULT_OUT[args.mode]
    args.batches = args.batches or DEFAULT_BATCHES[args.mode]
    if args.generate:
        generate(args)
        return
    t0 = time.time()
    venv = args.venv.expanduser()
    py = ensure_venv(venv, args.wheel, args.torch_index)
    # vLLM caches its model-class inspection under VLLM_CACHE_ROOT: keep that in the scratch folder too
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_LOGGING_LEVEL="WARNING", VLLM_CACHE_ROOT=str(venv / "vllm-cache"), PYTHONPATH="")
    cmd = [str(py), str(Path(__file__).resolve()), "--generate", "--out", str(args.out.resolve()),
           "--seed", str(args.seed), "--batches", str(args.batches), "--mode", args.mode]
    run(cmd, env=env, cwd=str(venv))
    print(f"done in {time.time() - t0:.0f} s")


# --------------------------------------------------------------------------------------------------
# Stage 2: the goldens (inside the scratch venv)
# --------------------------------------------------------------------------------------------------

MAX_MODEL_LEN = 4096                  # "none" mode: mamba_block_size = max_model_len, one state block per request
MAMBA2_CHUNK_SIZES = (16, 64, 256)    # the project's tiny presets use 16; real Mamba2 / Bamba checkpoints 256
GDN_CHUNK = 64                        # FLA_CHUNK_SIZE, fixed in vLLM
EDGE_SIZES = tuple(sorted({*MAMBA2_CHUNK_SIZES, GDN_CHUNK}))
MAX_ROWS = 12
CAPTURE_SIZES = (1, 2, 4, 8, 16)      # the runner pads a decode batch to one of these (toolkit/runner/cudagraph.py)

# Cache modes: their CacheConfig (align: + block_size=bs for each bs of ALIGN_BLOCK_SIZES); a golden file each.
MODES = {"none": dict(enable_prefix_caching=False), "align": dict(enable_prefix_caching=True),
         "spec": dict(enable_prefix_caching=False), "align-spec": dict(enable_prefix_caching=True)}
SPEC_MODES = ("spec", "align-spec")         # modes with speculative decoding (builders per k of SPEC_KS)
ALIGN_MODES = ("align", "align-spec")       # modes with prefix caching (builders per block size)
# align: 16 = vLLM's default block size (the Mamba block size follows it); 64 = a larger one, so a builder
# that assumed one block size would be caught
ALIGN_BLOCK_SIZES = (16, 64)
# align block tables: page ids 1 + (A * (r * W + j) + C) % ALIGN_PAGE_PRIME, distinct within a batch
# (B * W <= 16 * cdiv(4096, 16) = 4096 < the prime); a column before the running one whose id is a
# multiple of ALIGN_NULL_EVERY is the null block 0 (as after a prefix-cache hit, or for skipped blocks)
ALIGN_PAGE_PRIME = 4099
ALIGN_NULL_EVERY = 4

_TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, tie_word_embeddings=False,
             torch_dtype="float32", max_position_embeddings=MAX_MODEL_LEN)
# name -> (vLLM builder, MambaAttentionBackendEnum member, config.json of a tiny model of the family,
#          state shapes for the MambaSpec (only their existence matters to the builders, in both modes))
BUILDERS = {
    "mamba1": ("vllm.v1.attention.backends.mamba1_attn.Mamba1AttentionMetadataBuilder", "MAMBA1",
               dict(architectures=["MambaForCausalLM"], model_type="mamba", state_size=8, expand=2,
                    conv_kernel=4), ((3, 128), (128, 8))),
    **{f"mamba2_cs{cs}": ("vllm.v1.attention.backends.mamba2_attn.Mamba2AttentionMetadataBuilder", "MAMBA2",
                          dict(architectures=["Mamba2ForCausalLM"], model_type="mamba2", num_heads=8,
                               head_dim=16, expand=2, state_size=16, n_groups=1, conv_kernel=4,
                               chunk_size=cs), ((3, 160), (8, 16, 16)))
       for cs in MAMBA2_CHUNK_SIZES},
    "short_conv": ("vllm.v1.attention.backends.short_conv_attn.ShortConvAttentionMetadataBuilder", "SHORT_CONV",
                   dict(architectures=["Lfm2ForCausalLM"], model_type="lfm2", num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, conv_L_cache=3,
                        layer_types=["conv", "full_attention"]), ((2, 192),)),
    "gdn": ("vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadataBuilder", "GDN_ATTN",
            dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, head_dim=16, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                 layer_types=["linear_attention", "full_attention"]), ((3, 128), (4, 16, 16))),
    # Zoo III on the same builder (issue 37): OLMo Hybrid's GDN (4 key = 4 value heads, key dim 8, value
    # dim 16: conv 2*32 + 64 = 128 channels, state (Hv, Dv, Dk)); Kimi Linear's KDA, which vLLM runs on
    # the GDN builder (`KimiDeltaAttention.mamba_type`): conv 3 * 4 * 16 channels, state (H, D, D).
    # Qwen3.5 is left out: vLLM inspects its vision-language class, which imports torchvision, and
    # PyPI's torchvision does not import beside the CPU torch wheel; its GDN layers use this builder too.
    "gdn_olmo_hybrid": ("vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadataBuilder", "GDN_ATTN",
                        dict(architectures=["OlmoHybridForCausalLM"], model_type="olmo_hybrid",
                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                             linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=16, linear_conv_kernel_dim=4,
                             layer_types=["linear_attention", "full_attention"]), ((3, 128), (4, 16, 8))),
    "kda_kimi_linear": ("vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadataBuilder", "GDN_ATTN",
                        dict(architectures=["KimiLinearForCausalLM"], model_type="kimi_linear",
                             num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                             moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                             qk_nope_head_dim=16, v_head_dim=16, num_experts=8, num_experts_per_token=2,
                             linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "head_dim": 16,
                                                 "num_heads": 4, "short_conv_kernel_size": 4}),
                        ((3, 192), (4, 16, 16))),
    # MiniMax's lightning attention (issue 38): vLLM's linear-attention builder, state (H, D, D), no conv
    "linear_attn": ("vllm.v1.attention.backends.linear_attn.LinearAttentionMetadataBuilder", "LINEAR",
                    dict(architectures=["MiniMaxForCausalLM"], model_type="minimax", num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
                         num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"]),
                    ((4, 16, 16),)),
}
# builders whose model vLLM 0.33 does not switch to cache mode "align" with prefix caching (MiniMax is not
# among the models MambaModelConfig updates): the align files set mamba_cache_mode="align" and
# mamba_block_size=bs in their CacheConfig, vLLM's own settings, to build them as an align engine would
EXPLICIT_ALIGN = ("linear_attn",)
# builders with no speculative path in vLLM 0.33, so not in the spec files (named there, "not_speculative")
NOT_SPECULATIVE = {"linear_attn": "vLLM 0.33's LinearAttentionMetadataBuilder has no speculative path: its build() "
                                  "takes no spec kwargs and its reorder_batch_threshold is 1 (vLLM serves MiniMax "
                                  "without speculative decoding)"}
# Launch metadata of vLLM's Triton causal_conv1d (BLOCK_M tiling, 2048-long -1-filled pointers): stored
# as a shape summary, not values (this project's conv kernel has no such input; see the test's map).
SUMMARISED = ("nums_dict", "batch_ptr", "token_chunk_offset_ptr")
# Fields vLLM copies from CommonAttentionMetadata: stored as "=<field>" when equal to it (they are).
PASSTHROUGH = {"seq_lens": "seq_lens", "non_spec_query_start_loc": "query_start_loc"}
ROW_CODES = {"decode": "d", "prompt_tail_1": "t", "prompt_1": "p", "first_chunk": "f", "continue_chunk": "c",
             "padding": "x", "spec_decode": "v", "short_chunk": "k"}


def row_codes(kinds) -> str:
    return ", ".join(f"{ROW_CODES[k]}={k}" for k in (*kinds, "padding"))


# Row kinds: (weight, query length, tokens already in the state, is_prefilling)
ROW_KINDS = ("decode", "prompt_tail_1", "prompt_1", "first_chunk", "continue_chunk")
ROW_WEIGHTS = (0.35, 0.12, 0.08, 0.20, 0.25)
# "spec" mode (SPEC_ROW_KINDS): a decode-phase row of a speculative engine is a verify row, "spec_decode"
# (its last sampled token + d drafts, d in 0..k: a plain decode there is a verify row with d = 0), and
# "short_chunk" is a prefill chunk of 2..k+1 tokens (the size of a verify row, still a prefill)
SPEC_ROW_KINDS = ("spec_decode", "prompt_tail_1", "prompt_1", "first_chunk", "continue_chunk", "short_chunk")
SPEC_ROW_WEIGHTS = (0.40, 0.12, 0.06, 0.14, 0.18, 0.10)
SPEC_KS = (3, 1)                      # num_speculative_tokens of the spec file's engines (builders <name>_k<k>)
SPEC_K_SHARE = {3: 1, 1: 1}           # --batches is split over SPEC_KS in these proportions
# vLLM 0.33's Mamba1 has no speculative path: Mamba1AttentionMetadataBuilder.build drops the spec
# kwargs, MRV2's MambaHybridAttnMetadata.get_extra_attn_kwargs passes none to it, and mamba_mixer.py
# reads no num_accepted_tokens. The spec file leaves it out (`left_out`, with that checked on the batches).
SPEC_LEFT_OUT = ("mamba1",)
# "align-spec": the share of verify rows with d >= 1 drafts drawn across a block boundary (num_computed =
# m * unit - j, j in 1..d, unit in ALIGN_SPEC_CROSS_UNITS: the first token in one block, the last draft
# in the next; a multiple of 64 is a boundary at every block size of ALIGN_BLOCK_SIZES, 16 at the smaller)
ALIGN_SPEC_CROSS = 0.3
ALIGN_SPEC_CROSS_UNITS = (16, 64)

ALIGN_INPUT_FORMAT = (
    "per batch: q = query lengths, computed = tokens already in the state, prefilling = is_prefilling (0/1); "
    "seq_lens = seq_lens_cpu_upper_bound = computed + q; query_start_loc = [0, cumsum(q)]; num_actual_tokens = "
    "sum(q); int32 CPU tensors; rows = the kind of each row: " + row_codes(ROW_KINDS)
    + "; tables[bs][i] = [A, C]: the block_table_tensor of batch i for block size bs, int32 [B, W] with "
    "W = cdiv(max_model_len, bs), position-indexed: entry (r, j) = 1 + (A * (r * W + j) + C) % page_prime, "
    "except 0 (the null block) in every entry of a padding row and in a column j < (seq_len[r] - 1) // bs "
    "whose id % null_every == 0 (table_layout); table_sha256[bs][i] = the first 12 hex digits of the sha256 "
    "of that table's int32 little-endian bytes")

SPEC_INPUT_FORMAT = (
    "per batch: k = num_speculative_tokens of its engine (builders <name>_k<k>), q = query lengths, computed = "
    "tokens already in the state, prefilling = is_prefilling (0/1), slots = block_table_tensor [B, 1 + k] (a "
    "row's 1 + k state slots; 0 = the null slot, padded rows only), num_accepted_tokens = the num_accepted_tokens "
    "kwarg [B], num_decode_draft_tokens_cpu = that kwarg [B] (MRV2: the draft count of a decode row -- not "
    "prefilling, 0 < q <= 1 + k --, else -1); seq_lens = seq_lens_cpu_upper_bound = computed + q; "
    "query_start_loc = [0, cumsum(q)]; num_actual_tokens = sum(q); int32 CPU tensors; order = the row order "
    "drawn (by_len: decode-like rows by length; mrv2: rows with drafts first, then 1 + k-token rows); rows = "
    "the kind of each row: " + row_codes(SPEC_ROW_KINDS))

ALIGN_SPEC_INPUT_FORMAT = (
    "per batch: k = num_speculative_tokens of its engine (builders <name>_bs<bs>_k<k>), q = query lengths, "
    "computed = tokens already in the state, prefilling = is_prefilling (0/1), num_accepted_tokens = the "
    "num_accepted_tokens kwarg [B], num_decode_draft_tokens_cpu = that kwarg [B] (MRV2: the draft count of a "
    "decode row -- not prefilling, 0 < q <= 1 + k --, else -1); seq_lens = seq_lens_cpu_upper_bound = "
    "computed + q; query_start_loc = [0, cumsum(q)]; num_actual_tokens = sum(q); int32 CPU tensors; order = "
    "the row order drawn (by_len / mrv2, as in the spec file); rows = the kind of each row: "
    + row_codes(SPEC_ROW_KINDS) + "; tables[bs][i] = [A, C]: the block_table_tensor of batch i for block size "
    "bs, int32 [B, W] with W = cdiv(max_model_len, bs) + k (table_layout.width), position-indexed: entry "
    "(r, j) = 1 + (A * (r * W + j) + C) % page_prime, except 0 (the null block) in every entry of a padding "
    "row and in a column j < (seq_len[r] - 1) // bs whose id % null_every == 0 (table_layout); the running "
    "column and the k after it are never null; table_sha256[bs][i] = the first 12 hex digits of the sha256 "
    "of that table's int32 little-endian bytes")


def edge(rng, lo: int, ks=(1, 1, 1, 2, 3)) -> int:
    """k * C + d for a chunk size C the builders use and d in {-1, 0, +1}."""
    return max(lo, rng.choice(ks) * rng.choice(EDGE_SIZES) + rng.choice((-1, 0, 1)))


def draw_query_len(rng) -> int:       # a prefill chunk of >= 2 tokens
    r = rng.random()
    if r < 0.55:
        return rng.randint(2, 40)
    if r < 0.85:
        return edge(rng, 2)
    return rng.randint(41, 300)


def draw_computed(rng) -> int:        # tokens already in a row's state, >= 1
    r = rng.random()
    if r < 0.4:
        return rng.randint(1, 64)
    if r < 0.8:
        return edge(rng, 1, ks=(1, 2, 3, 4))
    return rng.randint(65, 1500)


def draw_row(rng, kind: str) -> tuple[int, int, bool]:
    """(query_len, num_computed, is_prefilling) of one row."""
    if kind == "decode":
        return 1, draw_computed(rng), False
    if kind == "prompt_tail_1":       # a one-token prefill chunk on top of saved state (runs as a decode)
        return 1, draw_computed(rng), True
    if kind == "prompt_1":            # a one-token prompt: a prefill without state
        return 1, 0, True
    if kind == "first_chunk":
        return draw_query_len(rng), 0, True
    return draw_query_len(rng), draw_computed(rng), True     # continue_chunk


def runs_as_decode(q: int, computed: int, prefilling: bool) -> bool:
    return q == 1 and (not prefilling or computed > 0)


def draw_batch(rng) -> dict:
    """One batch in the runner's order: decode rows first, then the rest by ascending query length
    (toolkit/runner/input_batch.py `sort_batch`, vLLM's `sort_batch_req_ids` for non-spec rows)."""
    kind = rng.choices(("mixed", "decode_only", "prefill_only", "single", "one_token", "padded_decode"),
                       weights=(0.55, 0.10, 0.12, 0.13, 0.05, 0.05))[0]
    n = 1 if kind == "single" else rng.randint(1 if kind == "padded_decode" else 2, MAX_ROWS)
    pool = {"decode_only": ("decode", "prompt_tail_1"), "padded_decode": ("decode",),
            "prefill_only": ("prompt_1", "first_chunk", "continue_chunk"),
            "one_token": ("decode", "prompt_tail_1", "prompt_1")}.get(kind, ROW_KINDS)
    weights = [ROW_WEIGHTS[ROW_KINDS.index(k)] for k in pool]
    rows = [(k, *draw_row(rng, k)) for k in rng.choices(pool, weights=weights, k=n)]
    rows.sort(key=lambda r: (0 if runs_as_decode(*r[1:]) else 1, r[1]))
    slots = rng.sample(range(1, 4 * MAX_ROWS + 8), n)          # state slot 0 is the null slot
    batch = dict(kind=kind, q=[r[1] for r in rows], computed=[r[2] for r in rows],
                 prefilling=[int(r[3]) for r in rows], slots=slots, row_kinds=[r[0] for r in rows])
    if kind == "padded_decode":       # padded rows: one token at position 0, seq_len 1, the null slot
        size = min(s for s in CAPTURE_SIZES if s >= n)
        pad = size - n
        batch.update(q=batch["q"] + [1] * pad, computed=batch["computed"] + [0] * pad,
                     prefilling=batch["prefilling"] + [0] * pad, slots=batch["slots"] + [0] * pad,
                     row_kinds=batch["row_kinds"] + ["padding"] * pad)
    return batch


def mrv2_decode_draft_tokens(q: list[int], prefilling: list[int], drafts: list[int], k: int,
                              num_real: int) -> list[int]:
    """num_decode_draft_tokens_cpu as vLLM 0.33's MRV2 builds it (MambaHybridModelState.prepare_attn,
    vllm/v1/worker/gpu/model_states/mamba_hybrid.py): -1 for every row, then, for the real rows that are
    decodes (not prefilling, 0 < query <= k + 1), the row's draft count (0 or more). Padded rows
    (past the real ones) keep -1."""
    out = [-1] * len(q)
    for r in range(num_real):
        if not prefilling[r] and 0 < q[r] <= k + 1:
            out[r] = drafts[r]
    return out


def spec_runs_as_decode(q: int, computed: int, prefilling: bool, k: int) -> bool:
    """Where a row of a speculative engine sorts: a verify row (not prefilling, query <= 1 + k) or a
    one-token prefill chunk on saved state; the rest are prefills. (Both vLLM's base builder and this
    project's split classify the rows so; vLLM's GDN regroups them by draft counts.)"""
    return (not prefilling and q <= k + 1) or (prefilling and q == 1 and computed > 0)


def draw_spec_row(rng, kind: str, k: int, drafts: int | None = None,
                  cross: float = 0.0) -> tuple[int, int, bool, int, int]:
    """spec mode: (query_len, num_computed, is_prefilling, drafts, num_accepted_tokens) of one row.
    A verify row's num_accepted_tokens (what its request kept at its last step, MRV2's per-slot
    num_accepted_tokens_gpu) is 1..k+1; every other row's is 1 (MRV2 resets it to 1 in add_request
    and stores max(num_sampled, 1) after a step, so a prefilling request holds 1). `cross` (align-spec,
    ALIGN_SPEC_CROSS): the share of verify rows with drafts whose drafts cross a block boundary (0: the
    spec mode's draws, the same random calls)."""
    if kind == "spec_decode":
        d = drafts if drafts is not None else (k if rng.random() < 0.4 else rng.randint(0, k))
        if cross and d and rng.random() < cross:
            computed = rng.randint(1, 24) * rng.choice(ALIGN_SPEC_CROSS_UNITS) - rng.randint(1, d)
        else:
            computed = draw_computed(rng)
        return 1 + d, computed, False, d, rng.randint(1, k + 1)
    if kind == "short_chunk":
        return rng.randint(2, k + 1), (draw_computed(rng) if rng.random() < 0.6 else 0), True, 0, 1
    q, c, p = draw_row(rng, kind)
    return q, c, p, 0, 1


def draw_spec_batch(rng, k: int, cross: float = 0.0) -> dict:
    """spec mode: one batch of an engine with k speculative tokens. Verify rows and one-token prefill
    chunks on saved state first -- in this project's order (`sort_batch`: by query length) or in
    MRV2's (`sort_batch_req_ids`: rows with drafts first, 1 + k-token rows first, then by length),
    drawn per batch -- then the prefills by query length. Block table [B, 1 + k], distinct slot ids
    (the null slot 0 only in padded rows); num_decode_draft_tokens_cpu from `mrv2_decode_draft_tokens`.
    `cross`: see draw_spec_row (align-spec, whose block tables are `block_table_for`'s, not these slots)."""
    kind = rng.choices(("mixed", "decode_only", "prefill_only", "single", "one_token", "padded_decode",
                        "uniform_verify", "no_verify"), weights=(0.44, 0.10, 0.07, 0.09, 0.06, 0.06, 0.10, 0.08))[0]
    n = 1 if kind == "single" else rng.randint(1 if kind in ("padded_decode", "uniform_verify") else 2, MAX_ROWS)
    pool = {"decode_only": ("spec_decode", "prompt_tail_1"), "padded_decode": ("spec_decode",),
            "uniform_verify": ("spec_decode",),
            # decode-like rows but no verify row (one-token prefill chunks on saved state): vLLM GDN's non-spec path
            "no_verify": ("prompt_tail_1", "prompt_1", "first_chunk", "continue_chunk", "short_chunk"),
            "prefill_only": ("prompt_1", "first_chunk", "continue_chunk", "short_chunk"),
            "one_token": ("spec_decode", "prompt_tail_1", "prompt_1")}.get(kind, SPEC_ROW_KINDS)
    weights = [SPEC_ROW_WEIGHTS[SPEC_ROW_KINDS.index(x)] for x in pool]
    # one-token batches (and the runner's padded decode batches) hold verify rows without drafts
    forced = {"one_token": 0, "padded_decode": 0, "uniform_verify": k}.get(kind)
    rows = [(x, *draw_spec_row(rng, x, k, forced, cross)) for x in rng.choices(pool, weights=weights, k=n)]
    order = rng.choice(("by_len", "mrv2"))
    if order == "by_len":
        key = lambda r: (0 if spec_runs_as_decode(r[1], r[2], r[3], k) else 1, r[1])  # noqa: E731
    else:
        key = lambda r: ((0, r[4] == 0, r[1] != k + 1, r[1]) if spec_runs_as_decode(r[1], r[2], r[3], k)  # noqa: E731
                         else (1, 0, 0, r[1]))
    rows.sort(key=key)
    width = 1 + k
    ids = rng.sample(range(1, width * (4 * MAX_ROWS + 8)), n * width)   # state slot 0 is the null slot
    batch = dict(kind=kind, k=k, order=order, q=[r[1] for r in rows], computed=[r[2] for r in rows],
                 prefilling=[int(r[3]) for r in rows], slots=[ids[i * width:(i + 1) * width] for i in range(n)],
                 accepted=[r[5] for r in rows], drafts=[r[4] for r in rows], row_kinds=[r[0] for r in rows])
    if kind == "padded_decode":       # padded rows: one token at position 0, seq_len 1, the null slot
        size = min(s for s in CAPTURE_SIZES if s >= n)
        pad = size - n
        batch.update(q=batch["q"] + [1] * pad, computed=batch["computed"] + [0] * pad,
                     prefilling=batch["prefilling"] + [0] * pad, slots=batch["slots"] + [[0] * width] * pad,
                     accepted=batch["accepted"] + [1] * pad, drafts=batch["drafts"] + [0] * pad,
                     row_kinds=batch["row_kinds"] + ["padding"] * pad)
    batch["num_decode_draft_tokens"] = mrv2_decode_draft_tokens(batch["q"], batch["prefilling"], batch["drafts"],
                                                                k, num_real=n)
    return batch


def block_table_for(batch: dict, mode: str, block_size: int | None = None, table: list[int] | None = None):
    """int32 block table of a batch. "none": [B, 1], one state block per request (column 0 = its state
    slot). "align": [B, cdiv(MAX_MODEL_LEN, block_size)], position-indexed, from the batch's drawn
    `table` = [A, C] (ALIGN_PAGE_PRIME): entry (r, j) = 1 + (A * (r * W + j) + C) % ALIGN_PAGE_PRIME,
    except the null block 0 in every entry of a padded row (as the runner pads) and in a column before
    the row's running one, (seq_len - 1) // block_size, whose id is a multiple of ALIGN_NULL_EVERY.
    The running column is never null, and columns after it hold ids too: any column but the running
    one reads an id other than the running one's. "align-spec": the same, cdiv(MAX_MODEL_LEN, block_size)
    + k columns (vLLM `MambaSpec.max_num_blocks_per_req`, align: the running column's k spec columns
    exist for any seq_len <= max_model_len), k = the batch's."""
    import torch
    if mode == "none":
        return torch.tensor(batch["slots"], dtype=torch.int32).view(-1, 1)
    if mode == "spec":                # [B, 1 + k]: a row's 1 + k state slots
        return torch.tensor(batch["slots"], dtype=torch.int32).view(len(batch["q"]), 1 + batch["k"])
    a, c = table
    rows, width = len(batch["q"]), -(-MAX_MODEL_LEN // block_size) + (batch["k"] if mode == "align-spec" else 0)
    flat = torch.arange(rows * width, dtype=torch.int64).view(rows, width)
    pages = 1 + (a * flat + c) % ALIGN_PAGE_PRIME
    seq_lens = torch.tensor(batch["q"], dtype=torch.int64) + torch.tensor(batch["computed"], dtype=torch.int64)
    running = ((seq_lens - 1) // block_size).clamp(min=0).view(-1, 1)
    null = (torch.arange(width).view(1, -1) < running) & (pages % ALIGN_NULL_EVERY == 0)
    null |= torch.tensor([k == "padding" for k in batch["row_kinds"]]).view(-1, 1)
    return torch.where(null, 0, pages).to(torch.int32)


def table_digest(table) -> str:
    """First 12 hex digits of the sha256 of a block table's int32 little-endian bytes (the test
    rebuilds each table from its [A, C] and checks it against this)."""
    import hashlib

    import numpy as np
    return hashlib.sha256(np.ascontiguousarray(table.numpy(), dtype="<i4").tobytes()).hexdigest()[:12]


def draw_tables(rng, batches: list[dict]) -> dict[str, list[list[int]]]:
    """align, align-spec: per block size, per batch, [A, C] of its block table (`block_table_for`)."""
    return {str(bs): [[rng.randrange(1, ALIGN_PAGE_PRIME), rng.randrange(ALIGN_PAGE_PRIME)] for _ in batches]
            for bs in ALIGN_BLOCK_SIZES}


def common_metadata(batch: dict, mode: str, block_size: int | None = None, table: list[int] | None = None):
    """vLLM's CommonAttentionMetadata for a batch, CPU tensors, as MRV2's build_attn_metadata fills it."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    q = torch.tensor(batch["q"], dtype=torch.int32)
    seq_lens = torch.tensor(batch["computed"], dtype=torch.int32) + q
    qsl = torch.zeros(len(q) + 1, dtype=torch.int32)
    torch.cumsum(q, 0, out=qsl[1:])
    t = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq_lens.clone(), num_reqs=len(q),
        num_actual_tokens=t, max_query_len=int(q.max()), max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table_for(batch, mode, block_size, table),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64),
        is_prefilling=torch.tensor(batch["prefilling"], dtype=torch.bool), seq_lens_cpu_upper_bound=seq_lens.clone())


def build_kwargs(batch: dict) -> dict:
    """Extra keyword arguments of builder.build(): spec mode's speculative-decoding inputs, as MRV2's
    MambaHybridAttnMetadata.get_extra_attn_kwargs hands them to the Mamba2 / ShortConv / GDN builders
    (`num_accepted_tokens` [B] int32 on the device -- the CPU here --, `num_decode_draft_tokens_cpu` [B]
    int32 on the CPU, -1 for the rows that are not decodes); none in the other modes."""
    import torch
    if "accepted" not in batch:
        return {}
    return dict(num_accepted_tokens=torch.tensor(batch["accepted"], dtype=torch.int32),
                num_decode_draft_tokens_cpu=torch.tensor(batch["num_decode_draft_tokens"], dtype=torch.int32))


def make_builder(name: str, mode: str, workdir: Path, block_size: int | None = None, k: int = 0):
    """vLLM's builder `name` from a real VllmConfig in cache mode `mode`; spec and align-spec modes (k > 0):
    with an n-gram SpeculativeConfig of k tokens (what sets vllm_config.num_speculative_tokens, the
    builders' spec path, their reorder threshold 1 + k and [D, 1 + k] decode state indices) and a
    MambaSpec with k spec blocks; align and align-spec: CacheConfig(enable_prefix_caching=True,
    block_size=block_size)."""
    import importlib

    import torch
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec
    cls_path, backend, hf_config, shapes = BUILDERS[name]
    folder = workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**_TINY, **hf_config}))
    model_config = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32",
                               max_model_len=MAX_MODEL_LEN)
    extra = {}
    if k:
        parallel = ParallelConfig()
        extra = dict(parallel_config=parallel, speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3,
            target_model_config=model_config, target_parallel_config=parallel))
    explicit = (dict(mamba_cache_mode="align", mamba_block_size=block_size)
                if name in EXPLICIT_ALIGN and mode in ALIGN_MODES else {})
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(**MODES[mode], **({"block_size": block_size} if block_size else {}), **explicit),
        **extra)
    cache = vllm_config.cache_config
    want_mode = {"spec": "none", "align-spec": "align"}.get(mode, mode)
    assert cache.mamba_cache_mode == want_mode, (name, cache.mamba_cache_mode)
    assert vllm_config.num_speculative_tokens == k, (name, vllm_config.num_speculative_tokens)
    if mode in ALIGN_MODES:
        assert cache.mamba_block_size == cache.block_size == block_size, (name, cache.mamba_block_size)
        assert vllm_config.scheduler_config.enable_chunked_prefill, name
    spec = MambaSpec(block_size=cache.mamba_block_size, shapes=shapes, dtypes=(torch.float32,) * len(shapes),
                     mamba_type=MambaAttentionBackendEnum[backend], mamba_cache_mode=cache.mamba_cache_mode,
                     num_speculative_blocks=k)
    module, cls_name = cls_path.rsplit(".", 1)
    builder = getattr(importlib.import_module(module), cls_name)(spec, [f"{name}.layer"], vllm_config,
                                                                 torch.device("cpu"))
    info = dict(vllm_class=cls_path, architecture=hf_config["architectures"][0],
                chunk_size=hf_config.get("chunk_size"), mamba_cache_mode=cache.mamba_cache_mode,
                mamba_block_size=cache.mamba_block_size,
                cudagraph_mode=str(vllm_config.compilation_config.cudagraph_mode),
                use_v2_model_runner=bool(vllm_config.use_v2_model_runner))
    if explicit:
        info["cache_config_set_explicitly"] = explicit
    if hasattr(builder, "gdn_prefill_backend"):
        info["gdn_prefill_backend"] = builder.gdn_prefill_backend
    if k:
        assert builder.use_spec_decode and builder.reorder_batch_threshold == 1 + k, (name, k)
        info.update(num_speculative_tokens=k, speculative_method=vllm_config.speculative_config.method,
                    num_speculative_blocks=spec.num_speculative_blocks,
                    reorder_batch_threshold=builder.reorder_batch_threshold)
    if mode in ALIGN_MODES:
        info.update(block_size=cache.block_size, hash_block_size=cache.hash_block_size,
                    num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
                    enable_chunked_prefill=bool(vllm_config.scheduler_config.enable_chunked_prefill))
    if mode == "align-spec":    # vLLM's block-table width in align mode: the tables here are that wide
        width = spec.max_num_blocks_per_req(vllm_config, MAX_MODEL_LEN)
        assert width == -(-MAX_MODEL_LEN // block_size) + k, (name, width)
        info["max_num_blocks_per_req"] = width
    return builder, info


def encode(field: str, value, common):
    """A metadata field as JSON: ints and None as they are; tensors as nested lists (bools as 0/1);
    SUMMARISED fields as `true` (present; values not recorded); a PASSTHROUGH field equal to its input
    as "=<input field>"."""
    import torch
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if field in SUMMARISED:
        return True
    if isinstance(value, torch.Tensor):
        source = PASSTHROUGH.get(field)
        if source and torch.equal(value, getattr(common, source)):
            return f"={source}"
        return value.int().tolist() if value.dtype == torch.bool else value.tolist()
    raise TypeError(f"{field}: unexpected {type(value).__name__} (checkpoint or spec metadata?)")


def dtype_of(value) -> str | None:
    import torch
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    return None


def columns(records: list[dict]) -> dict:
    """Per field, the list over batches; a field equal in every batch is stored once as {"const": v}."""
    out = {}
    for f in records[0]:
        col = [r[f] for r in records]
        out[f] = {"const": col[0]} if all(v == col[0] for v in col) else col
    return out


def dedupe(outputs: dict) -> None:
    """A column equal to one already written (another builder's, or another field's) becomes
    {"same_as": "<builder>.<field>"}: the builders share most of their code, so most columns repeat."""
    seen = {}
    for name, cols in outputs.items():
        for f, col in cols.items():
            if isinstance(col, dict):
                continue
            key = json.dumps(col, separators=(",", ":"))
            if key in seen:
                cols[f] = {"same_as": seen[key]}
            else:
                seen[key] = f"{name}.{f}"


def coverage(batches: list[dict]) -> dict:
    """What the batches exercise (also a check that the generator draws every case)."""
    rows = [k for b in batches for k in b["row_kinds"]]
    cov = {f"rows_{k}": rows.count(k) for k in (*ROW_KINDS, "padding")}
    cov.update({f"batches_{k}": sum(b["kind"] == k for b in batches)
                for k in ("mixed", "decode_only", "prefill_only", "single", "one_token", "padded_decode")})
    for cs in EDGE_SIZES:
        cov[f"prefill_rows_not_starting_on_a_{cs}_boundary"] = sum(
            1 for b in batches for q, c, p in zip(b["q"], b["computed"], b["prefilling"], strict=True)
            if not runs_as_decode(q, c, bool(p)) and c % cs)
        cov[f"prefill_rows_with_len_multiple_of_{cs}"] = sum(
            1 for b in batches for q, c, p in zip(b["q"], b["computed"], b["prefilling"], strict=True)
            if not runs_as_decode(q, c, bool(p)) and q % cs == 0)
    return cov


def spec_coverage(batches: list[dict]) -> dict:
    """spec mode: per k, the rows, batches and inputs on the edges of the speculative split."""
    cov = {}
    for k in SPEC_KS:
        bk = [b for b in batches if b["k"] == k]
        rows = [x for b in bk for x in b["row_kinds"]]
        c = {f"rows_{x}": rows.count(x) for x in (*SPEC_ROW_KINDS, "padding")}
        c.update({f"batches_{x}": sum(b["kind"] == x for b in bk)
                  for x in ("mixed", "decode_only", "prefill_only", "single", "one_token", "padded_decode",
                            "uniform_verify", "no_verify")})
        c.update({f"batches_order_{x}": sum(b["order"] == x for b in bk) for x in ("by_len", "mrv2")})
        verify = [(q, a) for b in bk for q, a, x in zip(b["q"], b["accepted"], b["row_kinds"], strict=True)
                  if x == "spec_decode"]
        c.update({f"verify_rows_with_{d}_drafts": sum(q == 1 + d for q, _ in verify) for d in range(k + 1)})
        c.update({f"verify_rows_with_num_accepted_{a}": sum(v == a for _, v in verify) for a in range(1, k + 2)})
        c["short_chunks_of_1_plus_k_tokens"] = sum(
            1 for b in bk for q, x in zip(b["q"], b["row_kinds"], strict=True) if x == "short_chunk" and q == k + 1)
        spec_rows = [[d >= 0 for d in b["num_decode_draft_tokens"]]
                     for b in bk]
        c["batches_with_spec_rows"] = sum(any(m) for m in spec_rows)
        c["batches_with_decode_rows_but_no_spec_rows"] = sum(
            1 for b, m in zip(bk, spec_rows, strict=True) if not any(m) and any(
                spec_runs_as_decode(q, cc, bool(p), k) for q, cc, p in zip(b["q"], b["computed"], b["prefilling"],
                                                                           strict=True)))
        c["batches_with_spec_rows_and_one_token_non_spec_rows"] = sum(
            1 for b, m in zip(bk, spec_rows, strict=True) if any(m) and any(
                not s and q == 1 for s, q in zip(m, b["q"], strict=True)))
        c["batches_with_a_non_spec_row_between_spec_rows"] = sum(
            1 for m in spec_rows if any(not m[r] and any(m[:r]) and any(m[r + 1:]) for r in range(len(m))))
        c["batches_with_spec_rows_and_prefills"] = sum(
            1 for b, m in zip(bk, spec_rows, strict=True) if any(m) and any(
                not spec_runs_as_decode(q, cc, bool(p), k) for q, cc, p in zip(b["q"], b["computed"], b["prefilling"],
                                                                               strict=True)))
        c["batches_all_spec_rows"] = sum(all(m) for m in spec_rows)
        for cs in EDGE_SIZES:
            c[f"prefill_rows_not_starting_on_a_{cs}_boundary"] = sum(
                1 for b in bk for q, cc, p in zip(b["q"], b["computed"], b["prefilling"], strict=True)
                if not spec_runs_as_decode(q, cc, bool(p), k) and cc % cs)
        cov.update({f"k{k}_{key}": v for key, v in c.items()})
    return cov


def spec_left_out(batches: list[dict], ranges: dict, workdir: Path, outputs: dict, mode: str = "spec",
                  tables: dict | None = None) -> dict:
    """spec, align-spec modes: why SPEC_LEFT_OUT are not in the file, checked on its batches: vLLM's Mamba1
    builder, built with the speculative config, gives the same metadata with MRV2's spec kwargs as
    without them, and its decode/prefill split then differs from the spec-aware base builder's
    (ShortConv's). align-spec: per block size too (entries <name>_bs<bs>_k<k>)."""
    out = {}
    sizes = ALIGN_BLOCK_SIZES if mode == "align-spec" else (None,)
    for name in SPEC_LEFT_OUT:
        for k, bs in ((k, bs) for k in SPEC_KS for bs in sizes):
            suffix = f"_bs{bs}_k{k}" if bs else f"_k{k}"
            builder, _ = make_builder(name, mode, workdir, bs, k)
            lo, hi = ranges[k]
            same, differs = 0, 0
            base = outputs[f"short_conv{suffix}"]["num_decodes"]
            for i in range(lo, hi):
                common = common_metadata(batches[i], mode, bs, tables[str(bs)][i] if bs else None)
                with_kw = builder.build(0, common, **build_kwargs(batches[i]))
                without = builder.build(0, common)
                a = {f: encode(f, v, common) for f, v in vars(with_kw).items()}
                same += a == {f: encode(f, v, common) for f, v in vars(without).items()}
                nd = base["const"] if isinstance(base, dict) else base[i - lo]
                differs += a["num_decodes"] != nd
            out[f"{name}{suffix}"] = {
                "reason": "vLLM 0.33's Mamba1 has no speculative path: Mamba1AttentionMetadataBuilder.build "
                          "calls _compute_common_metadata without num_accepted_tokens, MRV2's "
                          "MambaHybridAttnMetadata.get_extra_attn_kwargs passes it no spec kwargs, and "
                          "mamba_mixer.py reads no num_accepted_tokens",
                "batches": hi - lo, "batches_where_spec_kwargs_change_nothing": same,
                "batches_where_its_num_decodes_differs_from_short_conv": differs}
    return out


def align_coverage(batches: list[dict], tables: dict[str, list[list[int]]]) -> dict:
    """align: per block size, the rows on the edges of the state-index rule."""
    cov = {}
    for bs in ALIGN_BLOCK_SIZES:
        counts = dict.fromkeys(("seq_len_multiple_of_bs", "seq_len_multiple_of_bs_plus_1", "running_column_past_0",
                                "decodes_entering_a_new_block", "prefills_crossing_a_block",
                                "null_column_before_running", "seq_len_1"), 0)
        for b, table in zip(batches, tables[str(bs)], strict=True):
            bt = block_table_for(b, "align", bs, table)
            for r, (q, c, kind) in enumerate(zip(b["q"], b["computed"], b["row_kinds"], strict=True)):
                if kind == "padding":
                    continue
                s, col = q + c, (q + c - 1) // bs
                counts["seq_len_multiple_of_bs"] += s % bs == 0
                counts["seq_len_multiple_of_bs_plus_1"] += s % bs == 1 and s > 1
                counts["running_column_past_0"] += col > 0
                counts["decodes_entering_a_new_block"] += q == 1 and c > 0 and s % bs == 1
                counts["prefills_crossing_a_block"] += q > 1 and c // bs != col
                counts["null_column_before_running"] += col > 0 and int(bt[r, col - 1]) == 0
                counts["seq_len_1"] += s == 1
        cov.update({f"bs{bs}_rows_{k}": v for k, v in counts.items()})
    return cov


def align_spec_coverage(batches: list[dict], tables: dict[str, list[list[int]]]) -> dict:
    """align-spec: per k and block size, the rows on the edges of the align + spec state-index rule."""
    cov = {}
    for k in SPEC_KS:
        for bs in ALIGN_BLOCK_SIZES:
            c = dict.fromkeys((
                "verify_rows_crossing_a_block", "verify_rows_with_last_draft_first_in_its_block",
                "verify_rows_with_seq_len_multiple_of_bs", "verify_rows_running_column_past_0",
                "verify_rows_with_drafts_within_one_block", "one_token_rows_entering_a_new_block",
                "short_chunks_crossing_a_block", "prefills_crossing_a_block", "null_column_before_running",
                "seq_len_1"), 0)
            for b, table in zip(batches, tables[str(bs)], strict=True):
                if b["k"] != k:
                    continue
                bt = block_table_for(b, "align-spec", bs, table)
                for r, (q, cc, p, kind) in enumerate(zip(b["q"], b["computed"], b["prefilling"], b["row_kinds"],
                                                         strict=True)):
                    if kind == "padding":
                        continue
                    s, col = q + cc, (q + cc - 1) // bs
                    crossing = cc // bs != col
                    verify = kind == "spec_decode"
                    c["verify_rows_crossing_a_block"] += verify and crossing
                    c["verify_rows_with_last_draft_first_in_its_block"] += verify and q > 1 and (s - 1) % bs == 0
                    c["verify_rows_with_seq_len_multiple_of_bs"] += verify and s % bs == 0
                    c["verify_rows_running_column_past_0"] += verify and col > 0
                    c["verify_rows_with_drafts_within_one_block"] += verify and q > 1 and not crossing
                    c["one_token_rows_entering_a_new_block"] += q == 1 and cc > 0 and s % bs == 1
                    c["short_chunks_crossing_a_block"] += kind == "short_chunk" and crossing
                    c["prefills_crossing_a_block"] += not spec_runs_as_decode(q, cc, bool(p), k) and crossing
                    c["null_column_before_running"] += col > 0 and int(bt[r, col - 1]) == 0
                    c["seq_len_1"] += s == 1
            cov.update({f"k{k}_bs{bs}_rows_{key}": v for key, v in c.items()})
    return cov


def align_spec_layout(name: str, md, common, batch: dict, bs: int, k: int) -> dict:
    """align-spec: whether vLLM's state indices are the block table gathered at each row's running column
    c = max(seq_len - 1, 0) // bs and the k after it (the file's speculative.layout_check.what), computed
    here from the table and the input lengths, independently of vLLM's mamba_get_block_table_tensor."""
    table = common.block_table_tensor.tolist()
    cols = [max(q + c - 1, 0) // bs for q, c in zip(batch["q"], batch["computed"], strict=True)]
    full = [row[col:col + 1 + k] for row, col in zip(table, cols, strict=True)]
    crossing = [c // bs != col for c, col in zip(batch["computed"], cols, strict=True)]

    def rows(t):
        return [] if t is None else t.tolist()
    if BUILDERS[name][0].endswith(".GDNAttentionMetadataBuilder"):   # spec rows by mask (spec path), else non-spec
        mask = [d >= 0 for d in batch["num_decode_draft_tokens"]]
        spec_rows = [r for r, m in enumerate(mask) if m]
        other = [r for r, m in enumerate(mask) if not m] if spec_rows else list(range(len(mask)))
        got_d, got_p = rows(md.spec_state_indices_tensor), rows(md.non_spec_state_indices_tensor)
    else:
        spec_rows = list(range(md.num_decodes))
        other = list(range(md.num_decodes, len(cols)))
        got_d, got_p = rows(md.state_indices_tensor_d), rows(md.state_indices_tensor_p)
    want_d, want_p = [full[r] for r in spec_rows], [full[r][0] for r in other]
    good = (sum(g == w for g, w in zip(got_d, want_d)) + sum(g == w for g, w in zip(got_p, want_p))
            - abs(len(got_d) - len(want_d)) - abs(len(got_p) - len(want_p)))
    return {"rows": len(want_d) + len(want_p), "rows_as_designed": good, "decode_rows": len(want_d),
            "decode_rows_crossing_a_block": sum(crossing[r] for r in spec_rows)}


def dump(doc: dict, path: Path) -> None:
    """JSON with one line per column (readable diffs, no whitespace inside the lists)."""
    def enc(v):
        return json.dumps(v, separators=(",", ":"))
    lines = ["{"]
    items = list(doc.items())
    for i, (k, v) in enumerate(items):
        end = "," if i < len(items) - 1 else ""
        if k in ("builders", "outputs", "inputs") and isinstance(v, dict):
            lines.append(f" {enc(k)}: {{")
            sub = list(v.items())
            for j, (k2, v2) in enumerate(sub):
                end2 = "," if j < len(sub) - 1 else ""
                if isinstance(v2, dict) and k == "outputs":
                    lines.append(f"  {enc(k2)}: {{")
                    cols = list(v2.items())
                    for m, (k3, v3) in enumerate(cols):
                        lines.append(f"   {enc(k3)}: {enc(v3)}{',' if m < len(cols) - 1 else ''}")
                    lines.append(f"  }}{end2}")
                else:
                    lines.append(f"  {enc(k2)}: {enc(v2)}{end2}")
            lines.append(f" }}{end}")
        else:
            lines.append(f" {enc(k)}: {enc(v)}{end}")
    lines.append("}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def generate(args) -> None:
    import random
    import tempfile

    import torch
    import vllm
    t0 = time.time()
    rng = random.Random(args.seed)
    spec = args.mode in SPEC_MODES
    align = args.mode in ALIGN_MODES
    align_spec = args.mode == "align-spec"
    if spec:     # the batches of each k in turn (SPEC_KS), a builder per k over its own range of them
        share = sum(SPEC_K_SHARE.values())
        per_k = {k: args.batches * SPEC_K_SHARE[k] // share for k in SPEC_KS}
        per_k[SPEC_KS[0]] += args.batches - sum(per_k.values())
        cross = ALIGN_SPEC_CROSS if align_spec else 0.0
        batches = [draw_spec_batch(rng, k, cross) for k in SPEC_KS for _ in range(per_k[k])]
        ranges = {k: [i for i, b in enumerate(batches) if b["k"] == k] for k in SPEC_KS}
        ranges = {k: (r[0], r[-1] + 1) for k, r in ranges.items()}
    else:
        batches = [draw_batch(rng) for _ in range(args.batches)]
    # align: the tables are drawn after the batches, so the batches are the "none" file's (align-spec: the
    # batches are drawn as the spec file's, with verify rows across block boundaries, ALIGN_SPEC_CROSS)
    tables = draw_tables(rng, batches) if align else {}
    runs = ([(name, name, None, 0) for name in BUILDERS] if args.mode == "none" else
            [(f"{name}_bs{bs}_k{k}", name, bs, k) for k in SPEC_KS for bs in ALIGN_BLOCK_SIZES
             for name in BUILDERS if name not in (*SPEC_LEFT_OUT, *NOT_SPECULATIVE)] if align_spec else
            [(f"{name}_k{k}", name, None, k) for k in SPEC_KS for name in BUILDERS
             if name not in (*SPEC_LEFT_OUT, *NOT_SPECULATIVE)]
            if spec else
            [(f"{name}_bs{bs}", name, bs, 0) for bs in ALIGN_BLOCK_SIZES for name in BUILDERS])
    layout = {}          # align-spec: the state-index layout, checked against the tables (align_spec_layout)
    workdir = Path(tempfile.mkdtemp(prefix="vllm-ref-configs-"))
    builders, outputs = {}, {}
    for full_name, name, bs, k in runs:
        builder, info = make_builder(name, args.mode, workdir, bs, k)
        lo, hi = ranges[k] if spec else (0, len(batches))
        if spec:
            info["batch_range"] = [lo, hi]
        records, dtypes = [], {}
        checked = dict.fromkeys(("rows", "rows_as_designed", "decode_rows", "decode_rows_crossing_a_block"), 0)
        for i in range(lo, hi):
            b = batches[i]
            common = common_metadata(b, args.mode, bs, tables[str(bs)][i] if bs else None)
            md = builder.build(common_prefix_len=0, common_attn_metadata=common, **build_kwargs(b))
            if align_spec:
                for key, v in align_spec_layout(name, md, common, b, bs, k).items():
                    checked[key] += v
            rec = {}
            for f, v in vars(md).items():
                rec[f] = encode(f, v, common)
                if dtype_of(v):
                    dtypes.setdefault(f, set()).add(dtype_of(v))
            records.append(rec)
        info["fields"] = list(records[0])
        info["dtypes"] = {f: "/".join(sorted(d)) for f, d in dtypes.items()}
        builders[full_name] = info
        outputs[full_name] = columns(records)
        if align_spec:
            layout[full_name] = checked
            if checked["rows_as_designed"] != checked["rows"]:
                print(f"  {full_name}: vLLM's state indices differ from the align-spec layout in "
                      f"{checked['rows'] - checked['rows_as_designed']} of {checked['rows']} rows", flush=True)
        print(f"  {full_name}: {len(records)} batches ({time.time() - t0:.0f} s)", flush=True)
    left_out = spec_left_out(batches, ranges, workdir, outputs, args.mode, tables) if spec else None
    dedupe(outputs)
    keys = ("kind", "q", "computed", "prefilling") + (("slots",) if args.mode in ("none", "spec") else ())
    inputs = {k: [b[k] for b in batches] for k in keys}
    inputs["rows"] = ["".join(ROW_CODES[k] for k in b["row_kinds"]) for b in batches]
    if spec:
        inputs.update(k=[b["k"] for b in batches], order=[b["order"] for b in batches],
                      num_accepted_tokens=[b["accepted"] for b in batches],
                      num_decode_draft_tokens_cpu=[b["num_decode_draft_tokens"] for b in batches])
    if align:
        inputs["tables"] = tables
        inputs["table_sha256"] = {str(bs): [table_digest(block_table_for(b, args.mode, bs, t))
                                            for b, t in zip(batches, tables[str(bs)], strict=True)]
                                  for bs in ALIGN_BLOCK_SIZES}
    doc = {
        "about": "Inputs and outputs of vLLM's Mamba-family metadata builders, for "
                 "tests/test_vllm_builder_goldens.py. Regenerate: python3 scripts/vllm_reference.py"
                 + (f" --mode {args.mode}" if args.mode != "none" else ""),
        "vllm_version": vllm.__version__, "torch_version": torch.__version__, "seed": args.seed,
        "mode": args.mode, "num_batches": len(batches), "max_model_len": MAX_MODEL_LEN,
    }
    if spec:
        doc["not_speculative"] = NOT_SPECULATIVE
    if align:
        doc["block_sizes"] = list(ALIGN_BLOCK_SIZES)
        doc["table_layout"] = {"page_prime": ALIGN_PAGE_PRIME, "null_every": ALIGN_NULL_EVERY}
        doc["cache_config"] = (
            "CacheConfig(enable_prefix_caching=True, block_size=bs) for each bs of block_sizes (builder "
            + ("<name>_bs<bs>_k<k>" if align_spec else "<name>_bs<bs>")
            + "): mamba_cache_mode 'align', mamba_block_size = block_size = bs, chunked prefill on; "
            "MambaSpec with vLLM's default num_prefill_checkpoint_blocks=0 and hash_block_size unresolved "
            "(None): no prefill checkpoints")
    if align_spec:
        doc["table_layout"]["width"] = "cdiv(max_model_len, bs) + k"
        doc["speculative"] = {
            "num_speculative_tokens": list(SPEC_KS), "batch_range": {str(k): list(r) for k, r in ranges.items()},
            "config": "VllmConfig(..., cache_config=CacheConfig(enable_prefix_caching=True, block_size=bs) "
                      "(mamba_cache_mode 'align'), speculative_config=SpeculativeConfig(method='ngram', "
                      "num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)), "
                      "MambaSpec(block_size=bs, mamba_cache_mode='align', num_speculative_blocks=k); builder "
                      "<name>_bs<bs>_k<k> reads the batches of batch_range[k]",
            "cross_block_share": ALIGN_SPEC_CROSS,
            "layout_check": {
                "what": "per builder, over its batches: rows = rows whose state indices were checked, "
                        "rows_as_designed = those where vLLM's equal the table gathered at the row's running "
                        "column c = max(seq_len - 1, 0) // bs: Mamba2 / ShortConv state_indices_tensor_d[r] = "
                        "table[r, c .. c + k] for its decode rows, state_indices_tensor_p = table[r, c] for the "
                        "rest; GDN spec_state_indices_tensor = table[r, c .. c + k] for its spec rows "
                        "(num_decode_draft_tokens_cpu >= 0), non_spec_state_indices_tensor = table[r, c] for "
                        "the others; decode_rows(_crossing_a_block) = the [D, 1 + k] rows among them (whose "
                        "first token is in an earlier block than the running column)",
                **layout},
            "left_out": left_out}
    elif spec:
        doc["speculative"] = {
            "num_speculative_tokens": list(SPEC_KS), "batch_range": {str(k): list(r) for k, r in ranges.items()},
            "config": "VllmConfig(..., speculative_config=SpeculativeConfig(method='ngram', "
                      "num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)), CacheConfig("
                      "enable_prefix_caching=False) (mamba_cache_mode 'none'), MambaSpec(num_speculative_blocks=k); "
                      "builder <name>_k<k> reads the batches of batch_range[k]",
            "left_out": left_out}
    doc.update({
        "input_format": ALIGN_SPEC_INPUT_FORMAT if align_spec else SPEC_INPUT_FORMAT if spec else
                        ALIGN_INPUT_FORMAT if align else
                        "per batch: q = query lengths, computed = tokens already in the state, prefilling = "
                        "is_prefilling (0/1), slots = block_table_tensor[:, 0] (the state slot; block table "
                        "[B, 1]); seq_lens = seq_lens_cpu_upper_bound = computed + q; query_start_loc = "
                        "[0, cumsum(q)]; num_actual_tokens = sum(q); int32 CPU tensors; rows = the kind of "
                        "each row: " + row_codes(ROW_KINDS),
        "output_format": "per builder and field, the list over batches, or {'const': v} (equal in every "
                         "batch) or {'same_as': 'builder.field'} (equal to that column); tensors as nested "
                         "lists (bool as 0/1; dtypes under builders), None as null, '=<field>' = equal to "
                         "that CommonAttentionMetadata field; " + ", ".join(SUMMARISED)
                         + ": true = present (values not recorded)",
        "coverage": {**spec_coverage(batches), **align_spec_coverage(batches, tables)} if align_spec else
                    spec_coverage(batches) if spec else
                    {**coverage(batches), **(align_coverage(batches, tables) if align else {})},
        "builders": builders,
        "inputs": inputs,
        "outputs": outputs,
    })
    dump(doc, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1024:.0f} KiB): {len(batches)} batches x {len(builders)} builders, "
          f"vllm {vllm.__version__}, seed {args.seed}, mode {args.mode!r} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
