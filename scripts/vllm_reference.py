"""Golden metadata from vLLM's own Mamba-family builders (issue #23), for tests/test_vllm_builder_goldens.py.

    python3 scripts/vllm_reference.py                      # scratch venv in ~/.cache, then the goldens
    python3 scripts/vllm_reference.py --venv /tmp/vref     # another scratch folder
    python3 scripts/vllm_reference.py --batches 500 --seed 23 --out tests/data/vllm_builder_goldens.json

Two stages, one file:

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
   Mamba2 chunk size), `ShortConvAttentionMetadataBuilder`, `GDNAttentionMetadataBuilder` -- each built
   from a real `VllmConfig` (a tiny local config.json per architecture, `HF_HUB_OFFLINE=1`,
   `VLLM_TARGET_DEVICE=cpu`) in the cache mode of MODES, fed the same CommonAttentionMetadata (CPU tensors).
   Every field of vLLM's metadata dataclass is written, as a column over the batches: ints and None as
   they are, tensors as nested lists (bools as 0/1, dtypes once per builder), the launch metadata of
   vLLM's Triton causal_conv1d (SUMMARISED) as `true` = present, values not recorded; a column equal to
   one already written is a reference to it. The file also holds the vLLM and torch versions, the seed,
   the builders' configs and what the batches cover. The same seed gives the same file, byte for byte.

Extension points (not built: this project has no prefix caching or speculative decoding yet; nothing
here fakes them):
  - MODES: "none" only. "align" (vLLM's mode when prefix caching is on: `CacheConfig(
    enable_prefix_caching=True)`, block table `[B, cdiv(max_model_len, block_size)]`, state index =
    the column of the row's last scheduled token) gets its entry, a block-table layout in
    `block_table_for` and a golden file of its own once the project's prefix caching lands.
  - Speculative rows: a batch has no `num_accepted_tokens` / `num_decode_draft_tokens_cpu` yet;
    `build_kwargs` is the one place they reach `builder.build(...)` (vLLM's builders take them as
    keyword arguments), ROW_KINDS / `draw_row` the place a "spec decode" row kind is drawn, and the
    `absent` groups of the test's field map the fields that then become compared.
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
DEFAULT_OUT = REPO / "tests" / "data" / "vllm_builder_goldens.json"
DEFAULT_SEED = 23
DEFAULT_BATCHES = 500

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
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--batches", type=int, default=DEFAULT_BATCHES)
    ap.add_argument("--mode", default="none", choices=["none"], help="vLLM mamba cache mode (MODES)")
    ap.add_argument("--generate", action="store_true", help="(internal) run inside the scratch venv")
    args = ap.parse_args()
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

# Cache modes. Only "none" exists in this project today. "align" (prefix caching) adds an entry here
# -- its CacheConfig, and a block-table layout in `block_table_for` -- when the project's prefix
# caching lands; its goldens then go to a file of their own.
MODES = {"none": dict(enable_prefix_caching=False)}

_TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, tie_word_embeddings=False,
             torch_dtype="float32", max_position_embeddings=MAX_MODEL_LEN)
# name -> (vLLM builder, MambaAttentionBackendEnum member, config.json of a tiny model of the family,
#          state shapes for the MambaSpec (only their existence matters to the builders in "none" mode))
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
}
# Launch metadata of vLLM's Triton causal_conv1d (BLOCK_M tiling, 2048-long -1-filled pointers): stored
# as a shape summary, not values (this project's conv kernel has no such input; see the test's map).
SUMMARISED = ("nums_dict", "batch_ptr", "token_chunk_offset_ptr")
# Fields vLLM copies from CommonAttentionMetadata: stored as "=<field>" when equal to it (they are).
PASSTHROUGH = {"seq_lens": "seq_lens", "non_spec_query_start_loc": "query_start_loc"}
ROW_CODES = {"decode": "d", "prompt_tail_1": "t", "prompt_1": "p", "first_chunk": "f", "continue_chunk": "c",
             "padding": "x"}

# Row kinds: (weight, query length, tokens already in the state, is_prefilling)
ROW_KINDS = ("decode", "prompt_tail_1", "prompt_1", "first_chunk", "continue_chunk")
ROW_WEIGHTS = (0.35, 0.12, 0.08, 0.20, 0.25)
# A "spec_decode" row kind (query 1 + k, num_decode_draft_tokens_cpu = k, num_accepted_tokens) joins
# ROW_KINDS when the project's speculative decoding lands; `build_kwargs` passes those to build().


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


def block_table_for(batch: dict, mode: str):
    """[B, 1] int32: "none" mode keeps one state block per request (column 0 = its state slot)."""
    import torch
    if mode != "none":
        raise NotImplementedError(f"mode {mode!r}: its block-table layout is not written yet")
    return torch.tensor(batch["slots"], dtype=torch.int32).view(-1, 1)


def common_metadata(batch: dict, mode: str):
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
        block_table_tensor=block_table_for(batch, mode), slot_mapping=torch.full((t,), -1, dtype=torch.int64),
        is_prefilling=torch.tensor(batch["prefilling"], dtype=torch.bool), seq_lens_cpu_upper_bound=seq_lens.clone())


def build_kwargs(batch: dict) -> dict:
    """Extra keyword arguments of builder.build(): the speculative-decoding inputs
    (`num_accepted_tokens`, `num_decode_draft_tokens_cpu`) go here once the project has them."""
    return {}


def make_builder(name: str, mode: str, workdir: Path):
    import importlib

    import torch
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec
    cls_path, backend, hf_config, shapes = BUILDERS[name]
    folder = workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**_TINY, **hf_config}))
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32",
                                 max_model_len=MAX_MODEL_LEN),
        cache_config=CacheConfig(**MODES[mode]))
    cache = vllm_config.cache_config
    assert cache.mamba_cache_mode == mode, (name, cache.mamba_cache_mode)
    spec = MambaSpec(block_size=cache.mamba_block_size, shapes=shapes, dtypes=(torch.float32,) * len(shapes),
                     mamba_type=MambaAttentionBackendEnum[backend], mamba_cache_mode=cache.mamba_cache_mode)
    module, cls_name = cls_path.rsplit(".", 1)
    builder = getattr(importlib.import_module(module), cls_name)(spec, [f"{name}.layer"], vllm_config,
                                                                 torch.device("cpu"))
    info = dict(vllm_class=cls_path, architecture=hf_config["architectures"][0],
                chunk_size=hf_config.get("chunk_size"), mamba_cache_mode=cache.mamba_cache_mode,
                mamba_block_size=cache.mamba_block_size,
                cudagraph_mode=str(vllm_config.compilation_config.cudagraph_mode),
                use_v2_model_runner=bool(vllm_config.use_v2_model_runner))
    if hasattr(builder, "gdn_prefill_backend"):
        info["gdn_prefill_backend"] = builder.gdn_prefill_backend
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
    raise TypeError(f"{field}: unexpected {type(value).__name__} in mode 'none' (checkpoint or spec metadata?)")


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
    batches = [draw_batch(rng) for _ in range(args.batches)]
    workdir = Path(tempfile.mkdtemp(prefix="vllm-ref-configs-"))
    builders, outputs = {}, {}
    for name in BUILDERS:
        builder, info = make_builder(name, args.mode, workdir)
        records, dtypes = [], {}
        for b in batches:
            common = common_metadata(b, args.mode)
            md = builder.build(common_prefix_len=0, common_attn_metadata=common, **build_kwargs(b))
            rec = {}
            for f, v in vars(md).items():
                rec[f] = encode(f, v, common)
                if dtype_of(v):
                    dtypes.setdefault(f, set()).add(dtype_of(v))
            records.append(rec)
        info["fields"] = list(records[0])
        info["dtypes"] = {f: "/".join(sorted(d)) for f, d in dtypes.items()}
        builders[name] = info
        outputs[name] = columns(records)
        print(f"  {name}: {len(records)} batches ({time.time() - t0:.0f} s)", flush=True)
    dedupe(outputs)
    inputs = {k: [b[k] for b in batches] for k in ("kind", "q", "computed", "prefilling", "slots")}
    inputs["rows"] = ["".join(ROW_CODES[k] for k in b["row_kinds"]) for b in batches]
    doc = {
        "about": "Inputs and outputs of vLLM's Mamba-family metadata builders, for "
                 "tests/test_vllm_builder_goldens.py. Regenerate: python3 scripts/vllm_reference.py",
        "vllm_version": vllm.__version__, "torch_version": torch.__version__, "seed": args.seed,
        "mode": args.mode, "num_batches": len(batches), "max_model_len": MAX_MODEL_LEN,
        "input_format": "per batch: q = query lengths, computed = tokens already in the state, prefilling = "
                        "is_prefilling (0/1), slots = block_table_tensor[:, 0] (the state slot; block table "
                        "[B, 1]); seq_lens = seq_lens_cpu_upper_bound = computed + q; query_start_loc = "
                        "[0, cumsum(q)]; num_actual_tokens = sum(q); int32 CPU tensors; rows = the kind of "
                        "each row: " + ", ".join(f"{c}={k}" for k, c in ROW_CODES.items()),
        "output_format": "per builder and field, the list over batches, or {'const': v} (equal in every "
                         "batch) or {'same_as': 'builder.field'} (equal to that column); tensors as nested "
                         "lists (bool as 0/1; dtypes under builders), None as null, '=<field>' = equal to "
                         "that CommonAttentionMetadata field; " + ", ".join(SUMMARISED)
                         + ": true = present (values not recorded)",
        "coverage": coverage(batches),
        "builders": builders,
        "inputs": inputs,
        "outputs": outputs,
    }
    dump(doc, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1024:.0f} KiB): {len(batches)} batches x {len(builders)} builders, "
          f"vllm {vllm.__version__}, seed {args.seed}, mode {args.mode!r} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
