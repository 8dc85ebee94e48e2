"""RunnerConfig: the engine limits, validated once when the LLM is built."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch


@dataclass
class RunnerConfig:
    device: torch.device
    dtype: torch.dtype
    max_num_seqs: int               # rows in the persistent request table (vLLM max_num_reqs)
    max_num_batched_tokens: int     # token budget of one step
    block_size: int                 # tokens per KV block
    max_model_len: int              # prompt + output tokens of one request
    num_kv_blocks: int | None       # None: enough for max_num_seqs full-length requests
    seed: int
    backend: str = "torch"          # "torch" or "triton" (resolved: see resolve_backend)
    cudagraph_mode: str = "none"    # "full_decode", "padded_eager" or "none" (runner/cudagraph.py)
    enable_prefix_caching: bool = False   # reuse computed prefixes (kv_cache_manager.py); Mamba: "align"
    num_state_pages: int | None = None    # Mamba state pages; None: see state_pages
    # recurrent layers with prefix caching: "align" (a checkpoint where a chunk ends on a block
    # boundary) or "all" (also at every block boundary inside a prefill chunk); "none" without caching
    mamba_cache_mode: str = "none"
    # speculative decoding: drafts verified per decode row (0: off); see SpeculativeConfig
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks!r}: must be an int >= 2 "
                             "(block 0 is the reserved null block)")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r}: must be True or False")
        if self.num_state_pages is not None and (not isinstance(self.num_state_pages, int)
                                                 or self.num_state_pages < self.min_state_pages):
            per = (f"{self.min_state_pages // self.max_num_seqs} per running request with prefix caching"
                   if self.enable_prefix_caching else f"{self.state_columns} per running request")
            raise ValueError(f"num_state_pages={self.num_state_pages!r}: must be an int >= "
                             f"{self.min_state_pages} ({per}, max_num_seqs={self.max_num_seqs})")
        want = ("align", "all") if self.enable_prefix_caching else ("none",)
        if self.mamba_cache_mode not in want:
            raise ValueError(f"mamba_cache_mode={self.mamba_cache_mode!r} with enable_prefix_caching="
                             f"{self.enable_prefix_caching}: use {' or '.join(map(repr, want))}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens!r}: must be an int >= 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_num_seqs={self.max_num_seqs} so every running request can decode")

    @property
    def prefill_checkpoints(self) -> bool:
        """Cache mode "all": prefills save the states at the block boundaries inside their chunks."""
        return self.mamba_cache_mode == "all"

    @property
    def max_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def num_full_kv_blocks(self) -> int:
        """Block ids of a full-attention group, the null id included."""
        return self.num_kv_blocks or self.max_num_seqs * self.max_blocks_per_req + 1

    def num_window_blocks(self, sliding_window: int) -> int:
        """Block ids of a sliding-window group, the null id included. After each step a request holds
        the blocks of its last W - 1 tokens and its partial block (out-of-window ones are released),
        and a step adds the blocks of its new tokens: per running request cdiv(W - 1, bs) + 2, plus
        the step's budget in blocks; never more than a full-attention group has."""
        bs = self.block_size
        need = self.max_num_seqs * (-(-(sliding_window - 1) // bs) + 2) + -(-self.max_num_batched_tokens // bs) + 1
        return min(need, self.num_full_kv_blocks)

    @property
    def state_columns(self) -> int:
        """State pages a request holds without prefix caching: its running state, and with
        speculative decoding one per draft (the state after each verified position, vLLM's
        `1 + num_speculative_tokens` columns)."""
        return 1 + self.num_speculative_tokens

    @property
    def min_state_pages(self) -> int:
        return min_state_pages(self.max_num_seqs, self.num_speculative_tokens, self.enable_prefix_caching)

    @property
    def state_pages(self) -> int:
        """The state pool's size (`num_state_pages`, else `default_state_pages`)."""
        if self.num_state_pages is not None:
            return self.num_state_pages
        return default_state_pages(self.max_num_seqs, self.num_speculative_tokens, self.enable_prefix_caching)


def min_state_pages(max_num_seqs: int, num_speculative_tokens: int, enable_prefix_caching: bool) -> int:
    """The fewest state pages an engine runs with: a request holds its running state page (its 1 + k
    columns with speculative decoding), and with prefix caching for one step also the page it copies
    from (a checkpoint, or a prefix hit)."""
    return max_num_seqs * (1 + num_speculative_tokens + (1 if enable_prefix_caching else 0))


def default_state_pages(max_num_seqs: int, num_speculative_tokens: int, enable_prefix_caching: bool) -> int:
    """The recurrent state pool's size by default, besides the null page 0 (the one formula the config
    and the scheduler share): one page per request (1 + k with speculative decoding), or with prefix
    caching 3 + k per request (the running page, its k speculative pages, the page it copies from and
    the checkpoint a verify step may reach); those not held are the checkpoints kept for later hits."""
    return max_num_seqs * (1 + num_speculative_tokens + (2 if enable_prefix_caching else 0))


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`LLM(speculative_config={...})`, with vLLM's key names (`vllm/config/speculative.py`).

    method                  "ngram": prompt lookup, the continuation of the longest earlier match of
                            the context's last n tokens (n in [prompt_lookup_min, prompt_lookup_max]);
                            "draft_model": a smaller model with the same vocabulary (`model`) proposes
                            k tokens greedily
    num_speculative_tokens  k >= 1 drafts per decode row; each verify step runs 1 + d tokens (d <= k)
    prompt_lookup_min/max   both unset: 5 and 5; one set: the other takes its value (as vLLM)
    """
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None        # draft_model: a preset, demo model or HF folder


def resolve_speculative_config(spec: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """Check `LLM(speculative_config=...)`; None stays None (speculative decoding off)."""
    if spec is None or isinstance(spec, SpeculativeConfig):
        return spec
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config={spec!r}: use a dict such as "
                         "{'method': 'ngram', 'num_speculative_tokens': 3}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; this toolkit reads {sorted(known)}")
    method = spec.get("method")
    if method not in SPEC_METHODS:
        raise ValueError(f"speculative_config method={method!r}: use one of {SPEC_METHODS}")
    model = spec.get("model")
    if method == "draft_model" and (not isinstance(model, str) or not model):
        raise ValueError("speculative_config method='draft_model' needs 'model': a preset, demo model or "
                         "HF folder with the target's vocabulary")
    if method == "ngram" and model is not None:
        raise ValueError("speculative_config 'model' is for method='draft_model'; n-gram drafts need no model")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config num_speculative_tokens={k!r}: must be an int >= 1")
    lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"speculative_config {name}={value!r}: must be an int >= 1")
    if lo > hi:
        raise ValueError(f"speculative_config prompt_lookup_min={lo} > prompt_lookup_max={hi}")
    return SpeculativeConfig(method, k, lo, hi, model)


def resolve_mamba_cache_mode(mode: str | None, enable_prefix_caching: bool) -> str:
    """None: "align" with prefix caching (vLLM's MRV2 mode), else "none"."""
    if mode is None:
        return "align" if enable_prefix_caching else "none"
    if mode not in ("none", "align", "all"):
        raise ValueError(f"mamba_cache_mode={mode!r}: use None, 'align' or 'all'")
    return mode


def resolve_max_model_len(max_model_len: int | None, hf_config) -> int:
    """None: the model's max_position_embeddings, at most 2048; a larger value than the model's
    limit is refused."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if max_model_len is None:
        return min(limit or 2048, 2048)
    if limit is not None and max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={limit}")
    return max_model_len


def resolve_device_dtype(device: str | torch.device, dtype: str | torch.dtype
                         ) -> tuple[torch.device, torch.dtype]:
    """"auto": CUDA + bfloat16 when a GPU is there, else CPU + float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: the toolkit runs on 'cpu' or 'cuda'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA GPU")
    if dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if dtype not in names:
            raise ValueError(f"dtype={dtype!r}: use 'auto' or one of {sorted(names)}")
        dtype = names[dtype]
    return device, dtype


BACKENDS = ("auto", "torch", "triton")


def triton_installed() -> bool:
    """Whether triton can be imported, found without importing it: Triton reads TRITON_INTERPRET
    when it is imported (see toolkit.layers.ops.triton_ops)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except ImportError:
        return False


def resolve_backend(backend: str, device: torch.device) -> str:
    """The ops the model runs (toolkit/layers/ops.py): "torch", the reference ops, on every platform,
    or "triton", the kernels in toolkit.kernels. "auto" is Triton on CUDA (where triton is
    installed) and torch on the CPU. "triton" on the CPU runs the kernels under the Triton
    interpreter: slow, meant for tests."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {BACKENDS}")
    if backend == "torch":
        return "torch"
    if not triton_installed():
        if backend == "auto":
            return "torch"
        raise ValueError("backend='triton' but triton is not installed (no wheels for macOS and "
                         "Windows); use backend='auto' or 'torch'")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return "triton"
