"""KV-cache groups and their tensors (vLLM `KVCacheConfig` + `initialize_kv_cache`, simplified).

Layers are grouped by spec kind: one group of full-attention layers (paged K/V, `block_size` tokens
per block), one per sliding window (the same pages, released once out of every query's window) and
one group of Mamba layers (one state page per request). Unlike vLLM we do not
unify page sizes across groups: each group has its own tensors and its own id space, and id 0
of each is the null block/page. A Mamba group's block-table row has one column: the state page
(with speculative decoding 1 + k: the state after each position of a verify step, vLLM's
`state_indices_tensor_d` columns). With prefix caching ("align") the row is position-indexed, one
column per block, plus k columns: a verify step's spec columns follow the running column.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from toolkit.config import RunnerConfig
from toolkit.errors import NotSupportedYetError
from toolkit.kv_cache_manager import CacheGroupKind
from toolkit.kv_cache_spec import AttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


@dataclass
class KVCacheGroup:
    group_id: int
    kind: str                 # "attention" or "mamba"
    spec: KVCacheSpec         # shared by every layer of the group
    layer_names: list[str]
    block_size: int           # tokens per block; a Mamba group: max_model_len ("none"), block_size ("align")
    num_blocks: int           # ids in the group, including the null id 0
    width: int                # block-table columns per request

    @property
    def sliding_window(self) -> int | None:
        """W of a sliding-window group (its blocks are released once out of every query's window)."""
        return getattr(self.spec, "sliding_window", None)


def make_kv_cache_groups(specs: dict[str, KVCacheSpec], cfg: RunnerConfig,
                         release_windows: bool = True) -> list[KVCacheGroup]:
    """Groups in this order: full attention, sliding-window attention (one group per window, its own
    pool sized for windows: `RunnerConfig.num_window_blocks`), Mamba. `release_windows=False` (a draft
    model, whose layers use the target's full-attention block ids): sliding-window layers join the
    full-attention group."""
    def windowed(s: KVCacheSpec) -> bool:
        return isinstance(s, SlidingWindowSpec) and release_windows

    full = {n: s for n, s in specs.items() if isinstance(s, AttentionSpec) and not windowed(s)}
    windows = {n: s for n, s in specs.items() if windowed(s)}
    mamba = {n: s for n, s in specs.items() if isinstance(s, MambaSpec)}
    groups: list[KVCacheGroup] = []
    if full:
        # every full-attention layer shares one spec (a window-free copy of a sliding layer's, for a draft)
        distinct = {AttentionSpec(s.num_kv_heads, s.head_dim, s.dtype, s.kv_parts) for s in full.values()}
        if len(distinct) != 1:
            raise ValueError(f"attention layers must share one cache spec, got {distinct}")
        groups.append(KVCacheGroup(len(groups), "attention", next(iter(distinct)), list(full), cfg.block_size,
                                   cfg.num_full_kv_blocks, cfg.max_blocks_per_req))
    for spec in sorted(set(windows.values()), key=lambda s: s.sliding_window):
        members = [n for n, s in windows.items() if s == spec]
        groups.append(KVCacheGroup(len(groups), "attention", spec, members, cfg.block_size,
                                   cfg.num_window_blocks(spec.sliding_window), cfg.max_blocks_per_req))
    if mamba:
        distinct = set(mamba.values())
        if len(distinct) != 1:
            raise ValueError(f"mamba layers must share one cache spec, got {distinct}")
        spec = next(iter(distinct))
        if cfg.enable_prefix_caching:      # "align": a position-indexed row, a page per checkpoint
            check_spec_with_caching(cfg)     # and k speculative columns after the running one
            groups.append(KVCacheGroup(len(groups), "mamba", spec, list(mamba), cfg.block_size,
                                       cfg.state_pages + 1, cfg.max_blocks_per_req + cfg.num_speculative_tokens))
        else:       # "none": one running state per request (1 + k columns with speculative decoding)
            groups.append(KVCacheGroup(len(groups), "mamba", spec, list(mamba), cfg.max_model_len,
                                       cfg.state_pages + 1, cfg.state_columns))
    return groups


def scheduler_groups(groups: list[KVCacheGroup]) -> tuple[list[CacheGroupKind], int]:
    """What the scheduler's KVCacheManager takes of the runner's groups: each group's kind, block size
    and sliding window (with its own pool's size), and the full-attention pool's size (0 without one)."""
    kinds = [CacheGroupKind(g.kind, g.block_size, g.sliding_window, g.num_blocks if g.sliding_window else 0)
             for g in groups]
    full = next((g.num_blocks for g in groups if g.kind == "attention" and g.sliding_window is None), 0)
    return kinds, full


def check_spec_with_caching(cfg: RunnerConfig) -> None:
    """Speculative decoding on recurrent layers with prefix caching: a verify row of 1 + k tokens
    may cross at most one block boundary (its checkpoint is copied out of the state column that
    reached it), and cache mode "all" has no verify path (vLLM 0.33 has no "all" either)."""
    k = cfg.num_speculative_tokens
    if not k:
        return
    if cfg.prefill_checkpoints:
        raise NotSupportedYetError("speculative decoding with mamba_cache_mode='all' is not built: use "
                                   "mamba_cache_mode='align' (the default with prefix caching)")
    if k >= cfg.block_size:
        raise ValueError(f"num_speculative_tokens={k} with prefix caching on a model with recurrent layers "
                         f"needs block_size > {k} (block_size={cfg.block_size}): a verify row of 1 + k tokens "
                         "may cross at most one block boundary")


def check_prefill_checkpoints(model: nn.Module, block_size: int) -> None:
    """Cache mode "all": every recurrent layer must be able to save its state at each block
    boundary inside a prefill chunk (its `prefill_checkpoint_alignment` divides the block size)."""
    for name, layer in model.cache_layers().items():
        if not hasattr(layer, "prefill_checkpoint_alignment"):
            continue                                   # attention
        step = layer.prefill_checkpoint_alignment()
        if step is None or block_size % step:
            why = ("its prefill saves no state from inside a chunk yet" if step is None else
                   f"it can save states every {step} tokens, which does not divide block_size={block_size}")
            raise ValueError(f"mamba_cache_mode='all' needs a checkpoint at every block boundary, but layer "
                             f"{name} ({type(layer).__name__}) cannot: {why}. Use mamba_cache_mode='align'.")


def allocate_kv_caches(groups: list[KVCacheGroup], device: torch.device
                       ) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
    """Zero-initialised cache tensors per layer: attention [N, kv_parts (2: K and V; 1: an MLA latent),
    block_size, kv_heads, head_dim];
    Mamba a tuple with one [num_slots, *shape] tensor per state (conv, ssm, ...)."""
    caches: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    for g in groups:
        for name in g.layer_names:
            if isinstance(g.spec, AttentionSpec):
                caches[name] = torch.zeros(g.num_blocks, g.spec.kv_parts, g.block_size, g.spec.num_kv_heads,
                                           g.spec.head_dim, dtype=g.spec.dtype, device=device)
            else:
                caches[name] = tuple(torch.zeros(g.num_blocks, *shape, dtype=dtype, device=device)
                                     for shape, dtype in zip(g.spec.shapes, g.spec.dtypes))
    return caches


def cache_bytes(caches: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]) -> int:
    total = 0
    for value in caches.values():
        for t in (value if isinstance(value, tuple) else (value,)):
            total += t.numel() * t.element_size()
    return total
